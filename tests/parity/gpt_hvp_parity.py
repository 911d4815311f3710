#!/usr/bin/env python3
"""Checks remat's second order against PyTorch's: the reference GPT (torch_gpt.py) in float64, dropout
off, loads the weights remat wrote, and torch.autograd.functional.hvp computes the loss, and H·v along
remat's direction; torch.autograd.grad the gradient. remat's H·v comes twice, by double backward and
by forward-over-reverse (remat::hvp). Fails (exit 1) when the loss, any gradient or any H·v tensor
has relative error ||remat - torch|| / ||torch|| above 1e-10.

usage: gpt_hvp_parity.py DIR LAYERS WIDTH HEADS CONTEXT BATCH VOCAB"""
import math
import sys

import torch
from torch.nn.utils.stateless import functional_call

from safetensors_io import read_safetensors
from torch_gpt import GPT

LIMIT = 1e-10


def main():
    d = sys.argv[1]
    layers, width, heads, context, batch, vocab = (int(a) for a in sys.argv[2:8])
    torch.set_num_threads(2)
    model = GPT(layers, width, heads, context, vocab)
    model.load_state_dict(read_safetensors(f"{d}/weights.safetensors"), strict=True)
    model = model.double()
    ref = read_safetensors(f"{d}/remat.safetensors")
    idx, targets = ref["batch.idx"], ref["batch.targets"]
    names = [name for name, _ in model.named_parameters()]
    params = tuple(p.detach() for p in model.parameters())
    v = tuple(ref["direction." + name] for name in names)

    def loss_of(*ps):
        return functional_call(model, dict(zip(names, ps)), (idx, targets))

    loss, hv = torch.autograd.functional.hvp(loss_of, params, v)
    leaves = tuple(p.clone().requires_grad_() for p in params)
    g = torch.autograd.grad(loss_of(*leaves), leaves)

    def rel(a, b):
        return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()

    rows = [("loss", rel(ref["loss"], loss))]
    for name, gi, hi in zip(names, g, hv):
        for kind, ours, theirs in (("grad", ref["grad." + name], gi), ("hvp", ref["hvp." + name], hi),
                                   ("hvp (forward-over-reverse)", ref["hvp_forward." + name], hi)):
            if ours.shape != theirs.shape:
                print(f"FAIL {kind} {name}: remat shape {tuple(ours.shape)} vs torch {tuple(theirs.shape)}")
                return 1
            rows.append((f"{kind} {name}", rel(ours, theirs)))
    worst = max(r[1] for r in rows)
    print(f"HVP parity, float64, L={layers} C={width} H={heads} T={context} B={batch} V={vocab}: "
          f"torch loss {loss.item():.12f}, remat {ref['loss'].item():.12f}")
    for name, err in sorted(rows, key=lambda r: -r[1])[:6]:
        print(f"  {name:50s} rel err {err:.2e}")
    worst_hvp = max(r[1] for r in rows if r[0].startswith("hvp"))
    print(f"  ... {len(rows)} tensors compared; worst {worst:.2e}, worst H·v {worst_hvp:.2e} (limit {LIMIT:g})")
    if worst > LIMIT or not math.isfinite(worst):
        print("FAIL: remat and PyTorch disagree")
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())

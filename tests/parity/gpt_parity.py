#!/usr/bin/env python3
"""Checks remat's GPT against the same GPT in PyTorch: loads the weights remat wrote, runs the same
batch, and compares the loss and every parameter gradient (float32, dropout off). Fails loudly
(exit 1) when any tensor's relative error ||g_remat - g_torch|| / ||g_torch|| exceeds 1e-4.

usage: gpt_parity.py DIR LAYERS WIDTH HEADS CONTEXT BATCH VOCAB"""
import math
import sys

import torch

from safetensors_io import read_safetensors
from torch_gpt import GPT


def main():
    d = sys.argv[1]
    layers, width, heads, context, batch, vocab = (int(a) for a in sys.argv[2:8])
    torch.set_num_threads(2)
    model = GPT(layers, width, heads, context, vocab)
    weights = read_safetensors(f"{d}/weights.safetensors")
    missing, unexpected = model.load_state_dict(weights, strict=True)
    ref = read_safetensors(f"{d}/remat.safetensors")
    loss = model(ref["batch.idx"], ref["batch.targets"])
    loss.backward()

    rows, worst = [], 0.0
    loss_err = abs(loss.item() - ref["loss"].item()) / abs(loss.item())
    rows.append(("loss", loss_err, abs(loss.item() - ref["loss"].item())))
    for name, p in model.named_parameters():
        g_remat, g_torch = ref["grad." + name], p.grad
        if g_remat.shape != g_torch.shape:
            print(f"FAIL {name}: remat gradient shape {tuple(g_remat.shape)} vs torch {tuple(g_torch.shape)}")
            return 1
        rel = ((g_remat - g_torch).norm() / g_torch.norm().clamp_min(1e-30)).item()
        rows.append((name, rel, (g_remat - g_torch).abs().max().item()))
    worst = max(r[1] for r in rows)
    print(f"parity L={layers} C={width} H={heads} T={context} B={batch} V={vocab}: "
          f"torch loss {loss.item():.6f}, remat loss {ref['loss'].item():.6f}")
    for name, rel, mx in sorted(rows, key=lambda r: -r[1])[:5]:
        print(f"  {name:45s} rel err {rel:.2e}  max abs err {mx:.2e}")
    print(f"  ... {len(rows)} tensors compared, worst relative error {worst:.2e} (limit 1e-4)")
    if worst > 1e-4 or not math.isfinite(worst):
        print("FAIL: remat and PyTorch disagree")
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())

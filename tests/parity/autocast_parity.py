#!/usr/bin/env python3
"""Checks remat::autocast against torch.autocast('cpu', dtype=torch.bfloat16) on the same GPT: loads
the weights remat wrote, runs the batch in PyTorch in float32 and with the forward under autocast
(backward outside it, dropout off), and compares the loss and every parameter gradient by relative
error ||a - b|| / ||b|| per tensor:

  remat fp32     vs torch fp32      float32 parity, limit 1e-4 (as parity.gpt_*)
  remat autocast vs remat fp32      remat's own bfloat16 error   (reported)
  torch autocast vs torch fp32      PyTorch's own bfloat16 error (reported)
  remat autocast vs torch autocast  the check, limit TOL below

The tolerance. bfloat16 keeps 8 significant bits, so rounding a float32 to it errs by at most
u = 2^-8 relative (about u / sqrt(3) RMS). Under autocast every matrix product multiplies rounded
operands with float32 sums. The residual stream stays float32 and each block only adds to it, so a
gradient's error is set by the roundings on its local path, not by the depth: dW = dY^T X rounds dY
and X, and dY comes out of the next product's rounded operands — m ~ 6 roundings (PyTorch also
rounds each product's output and runs softmax, GELU and layer norm on bfloat16 inputs in bfloat16;
remat keeps those in float32). Independent errors add in quadrature: a run errs by about
u sqrt(m / 3) = sqrt(2) u in norm, and two runs that round differently differ by about
sqrt(2) sqrt(2) u = 2 u. TOL is twice that, 4 u = 2^-6 ~ 0.0156, for every tensor at every depth
(measured: the worst tensor's error grows from ~1.5 u at L = 2 to ~1.6 u at L = 8; a first guess
that errors compound with the K = 3 (6 L + 1) products of the whole path, u sqrt(2 K), was 20-50
times the measured error and failed the next check). The check also requires PyTorch's own
bfloat16 error (torch autocast vs torch fp32) to be at least TOL / 10, so the tolerance is of the
order of the error autocast itself makes and not a bound that would pass anything, and remat's
autocast to differ from its float32 run by more than 1e-4 (bfloat16 was in force).

usage: autocast_parity.py DIR LAYERS WIDTH HEADS CONTEXT BATCH VOCAB"""
import math
import sys

import torch

from safetensors_io import read_safetensors
from torch_gpt import GPT


def run(model, idx, targets, mixed):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
        loss = model(idx, targets)
    loss.backward()
    return loss.detach().float().reshape(()), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def compare(title, a, b, limit=None):
    """Relative errors of run a against run b, each (loss, grads); prints the worst tensors."""
    (la, ga), (lb, gb) = a, b
    rows = [("loss", abs(la.item() - lb.item()) / abs(lb.item()))]
    for name in gb:
        if ga[name].shape != gb[name].shape:
            raise SystemExit(f"FAIL {name}: gradient shapes {tuple(ga[name].shape)} vs {tuple(gb[name].shape)}")
        rows.append((name, rel(ga[name], gb[name])))
    worst = max(r[1] for r in rows)
    grads_worst = max(r[1] for r in rows[1:])
    bound = f" (limit {limit:.3g})" if limit is not None else ""
    print(f"  {title}: loss rel err {rows[0][1]:.2e}, worst gradient rel err {grads_worst:.2e}, "
          f"worst of {len(rows)} {worst:.2e}{bound}")
    for name, e in sorted(rows, key=lambda r: -r[1])[:3]:
        print(f"      {name:40s} {e:.2e}")
    return worst


def main():
    d = sys.argv[1]
    layers, width, heads, context, batch, vocab = (int(a) for a in sys.argv[2:8])
    torch.set_num_threads(2)
    model = GPT(layers, width, heads, context, vocab)
    model.load_state_dict(read_safetensors(f"{d}/weights.safetensors"), strict=True)
    ref = read_safetensors(f"{d}/remat.safetensors")
    idx, targets = ref["batch.idx"], ref["batch.targets"]

    remat = {r: (ref[f"{r}.loss"].float().reshape(()),
                 {n: ref[f"{r}.grad.{n}"] for n, _ in model.named_parameters()}) for r in ("fp32", "autocast")}
    torch_fp32 = run(model, idx, targets, False)
    torch_ac = run(model, idx, targets, True)

    u = 2.0 ** -8
    tol = 4 * u
    print(f"autocast parity L={layers} C={width} H={heads} T={context} B={batch} V={vocab}: "
          f"losses torch fp32 {torch_fp32[0].item():.6f}, torch autocast {torch_ac[0].item():.6f}, "
          f"remat fp32 {remat['fp32'][0].item():.6f}, remat autocast {remat['autocast'][0].item():.6f}")
    print(f"  TOL = 4 u = {tol:.3g} (u = 2^-8, bfloat16's relative rounding error)")
    fp32 = compare("remat fp32     vs torch fp32    ", remat["fp32"], torch_fp32, 1e-4)
    remat_own = compare("remat autocast vs remat fp32    ", remat["autocast"], remat["fp32"])
    torch_own = compare("torch autocast vs torch fp32    ", torch_ac, torch_fp32)
    parity = compare("remat autocast vs torch autocast", remat["autocast"], torch_ac, tol)
    failures = []
    if not fp32 <= 1e-4:
        failures.append(f"float32 runs disagree ({fp32:.2e} > 1e-4): the autocast comparison means nothing")
    if not remat_own > 1e-4:
        failures.append(f"remat's autocast run is within {remat_own:.2e} of its float32 run: bfloat16 was not in force")
    if not torch_own >= tol / 10:
        failures.append(f"PyTorch's own bfloat16 error {torch_own:.2e} is below TOL / 10: the tolerance is too loose")
    if not (parity <= tol and math.isfinite(parity)):
        failures.append(f"remat autocast and torch autocast disagree: {parity:.2e} > {tol:.3g}")
    print(f"  worst: parity {parity:.2e} vs TOL {tol:.3g} ({parity / tol:.2f} of it); PyTorch's own bf16 error "
          f"{torch_own:.2e}, remat's {remat_own:.2e}")
    for f in failures:
        print("FAIL:", f)
    if failures:
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Checks remat's BF16 safetensors against PyTorch: opens DIR/remat_bf16.safetensors (written by
`bf16_parity write`), requires its BF16 tensors to load as torch.bfloat16 with the shape written,
remat's bfloat16 of the float32 tensor "x" to have the bits of PyTorch's x.to(torch.bfloat16) for
every non-NaN element (and a NaN of the same sign for a NaN; PyTorch's own NaN bits differ between
its scalar and vector paths), and the 65536 patterns of "all" to widen to float32 exactly. Then
writes PyTorch's bfloat16 of x to DIR/torch_bf16.safetensors for `bf16_parity check`. Reads the
file by parsing the header itself, and through the safetensors package as well when installed.

usage: bf16_parity.py DIR"""
import struct
import sys

import torch

from safetensors_io import read_safetensors, write_safetensors


def bits(t):
    """The bfloat16 bit patterns as non-negative integers."""
    return t.view(torch.int16).to(torch.int32) & 0xFFFF


def main():
    d = sys.argv[1]
    path = f"{d}/remat_bf16.safetensors"
    f = read_safetensors(path)
    failures = []
    try:
        from safetensors.torch import load_file
        for name, t in load_file(path).items():
            if t.dtype != f[name].dtype or not torch.equal(t.view(torch.uint8), f[name].view(torch.uint8)):
                failures.append(f"the safetensors package reads '{name}' differently")
        reader = "the header parsed here and the safetensors package"
    except ImportError:
        reader = "the header parsed here (no safetensors package)"

    x, h, every = f["x"], f["h"], f["all"]
    if h.dtype != torch.bfloat16 or every.dtype != torch.bfloat16:
        failures.append(f"BF16 tensors load as {h.dtype} and {every.dtype}, not torch.bfloat16")
    if h.shape != x.shape or every.shape != (256, 256):
        failures.append(f"shapes {tuple(h.shape)} and {tuple(every.shape)}; expected {tuple(x.shape)} and (256, 256)")
    theirs = x.to(torch.bfloat16)
    nan = torch.isnan(x)
    differ = (bits(h) != bits(theirs)) & ~nan
    if differ.any():
        i = int(differ.nonzero()[0])
        xi = struct.unpack("<I", struct.pack("<f", x[i].item()))[0]
        failures.append(f"{int(differ.sum())} elements differ from PyTorch's rounding, the first {i}: float bits "
                        f"{xi:#010x}, PyTorch {int(bits(theirs)[i]):#06x}, remat {int(bits(h)[i]):#06x}")
    sign = lambda t: torch.signbit(t.float())
    if not torch.isnan(h[nan].float()).all() or not torch.equal(sign(h[nan]), sign(x[nan])):
        failures.append("a NaN did not stay a NaN of its sign")
    if not torch.equal(h[~nan].float(), theirs[~nan].float()):
        failures.append("the values widened to float32 differ from PyTorch's")
    patterns = torch.arange(65536, dtype=torch.int32)
    if not torch.equal(bits(every).flatten(), patterns):
        failures.append("the 65536 bfloat16 patterns did not load as written")
    widened = every.flatten().float().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    if not torch.equal(widened, patterns.to(torch.int64) << 16):
        failures.append("bfloat16 -> float32 in PyTorch is not the shift remat's to<float> is")

    write_safetensors(f"{d}/torch_bf16.safetensors", {"h": theirs})
    print(f"PyTorch {torch.__version__} opens remat's BF16 file through {reader}: {x.numel()} floats "
          f"({int(nan.sum())} NaN) and 65536 patterns compared")
    for msg in failures:
        print(f"FAIL: {msg}")
    if failures:
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())

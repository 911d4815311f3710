#!/usr/bin/env python3
"""The PyTorch peer of bench_gpt_step: the same GPT (tests/parity/torch_gpt.py, shared with the parity
test: pre-LN blocks, explicit softmax attention, dropout where remat has it), the same step (forward,
backward, SGD) and the same modes, timed per step, with the peak of bytes saved for backward counted exactly through saved-tensor hooks (each storage once while any graph holds it).
--precision bf16 runs each step's forward under torch.autocast("cpu", dtype=torch.bfloat16) and its
backward outside it (PyTorch's documented pattern; autocast's default weight-cast cache on), the
peer of bench_gpt_step --precision bf16; the weights, gradients and SGD stay float32.
Prints one JSON line, with the core OpenBLAS chose (its kernels; a generic one, Prescott, is several
times slower). Run by run.py in the OpenBLAS environment its probe found fastest (peer_blas_env)."""
import argparse
import ctypes
import json
import os
import sys
import time
import weakref

import torch

# The reference GPT is shared with the parity test, so the peer computes what remat computes.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "parity"))
from torch_gpt import GPT  # noqa: E402


def blas_core():
    """The core whose kernels the system BLAS runs (OpenBLAS's name for it), or "unknown" when the
    BLAS torch loaded is not OpenBLAS."""
    try:
        blas = ctypes.CDLL("libblas.so.3")  # the instance torch loaded: dlopen returns the same one
        blas.openblas_get_corename.restype = ctypes.c_char_p
        return blas.openblas_get_corename().decode()
    except (OSError, AttributeError):
        return "unknown"


class SavedBytes:
    """Live and peak bytes of storages held by autograd graphs, each storage counted once."""

    def __init__(self):
        self.refs, self.live, self.peak = {}, 0, 0

    def pack(self, t):
        s = t.storage()
        key, nbytes = s.data_ptr(), s.size() * t.element_size()
        if self.refs.get(key, 0) == 0:
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        self.refs[key] = self.refs.get(key, 0) + 1
        holder = _Holder()
        weakref.finalize(holder, self._drop, key, nbytes)
        return (holder, t)

    def _drop(self, key, nbytes):
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.live -= nbytes

    @staticmethod
    def unpack(packed):
        return packed[1]


class _Holder:
    pass


def main():
    p = argparse.ArgumentParser()
    for k, v in dict(layers=8, width=256, heads=4, context=128, batch=8, vocab=256, steps=5, warmup=1).items():
        p.add_argument(f"--{k}", type=int, default=v)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--mode", default="none", choices=["none", "blocks", "sqrt"])
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    a = p.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = GPT(a.layers, a.width, a.heads, a.context, a.vocab, a.dropout, a.mode)
    sgd = torch.optim.SGD(model.parameters(), lr=1e-3)
    idx = torch.randint(0, a.vocab, (a.batch, a.context))
    targets = torch.randint(0, a.vocab, (a.batch, a.context))
    ms, peak = [], 0
    for s in range(a.warmup + a.steps):
        counter = SavedBytes()
        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.precision == "bf16"):
                loss = model(idx, targets)
            loss.backward()  # outside autocast, as PyTorch documents
        sgd.step()
        sgd.zero_grad(set_to_none=True)
        t = (time.perf_counter() - t0) * 1e3
        del loss
        if s >= a.warmup:
            ms.append(round(t, 3))
        peak = max(peak, counter.peak)
    print(json.dumps({"impl": "torch", "precision": a.precision, "mode": a.mode, "ms": ms, "saved_peak": peak,
                      "threads": torch.get_num_threads(), "torch": torch.__version__, "blas_core": blas_core()}))


if __name__ == "__main__":
    main()

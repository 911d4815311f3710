#!/usr/bin/env python3
"""The PyTorch peer of bench_gpt_step: the same GPT (pre-LN blocks, explicit softmax attention,
dropout on the embeddings, attention probabilities, attention output and MLP output), the same
step (forward, backward, SGD) and the same modes, timed per step, with the peak of bytes saved for
backward counted exactly through saved-tensor hooks (each storage once while any graph holds it).
Prints one JSON line. Run by run.py with OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE unset for it alone."""
import argparse
import json
import math
import time
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, checkpoint_sequential


class Attention(nn.Module):
    def __init__(self, c, h, p):
        super().__init__()
        self.n_head, self.c_attn, self.c_proj = h, nn.Linear(c, 3 * c), nn.Linear(c, c)
        self.attn_dropout, self.resid_dropout = nn.Dropout(p), nn.Dropout(p)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
        att = self.attn_dropout(F.softmax(att.masked_fill(mask, float("-inf")), dim=-1))
        return self.resid_dropout(self.c_proj((att @ v).transpose(1, 2).contiguous().view(B, T, C)))


class Block(nn.Module):
    def __init__(self, c, h, p):
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(c), Attention(c, h, p), nn.LayerNorm(c)
        self.mlp = nn.Sequential(nn.Linear(c, 4 * c), nn.GELU(), nn.Linear(4 * c, c), nn.Dropout(p))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(a.vocab, a.width), nn.Embedding(a.context, a.width)
        self.drop = nn.Dropout(a.dropout)
        self.h = nn.Sequential(*[Block(a.width, a.heads, a.dropout) for _ in range(a.layers)])
        self.ln_f, self.lm_head = nn.LayerNorm(a.width), nn.Linear(a.width, a.vocab, bias=False)
        self.mode = a.mode

    def forward(self, idx, targets):
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(idx.size(1))))
        if self.mode == "blocks":
            for b in self.h:
                x = checkpoint(b, x)
        elif self.mode == "sqrt":
            x = checkpoint_sequential(self.h, math.ceil(math.sqrt(len(self.h))), x)
        else:
            x = self.h(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


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
    a = p.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = GPT(a)
    sgd = torch.optim.SGD(model.parameters(), lr=1e-3)
    idx = torch.randint(0, a.vocab, (a.batch, a.context))
    targets = torch.randint(0, a.vocab, (a.batch, a.context))
    ms, peak = [], 0
    for s in range(a.warmup + a.steps):
        counter = SavedBytes()
        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
            loss = model(idx, targets)
            loss.backward()
        sgd.step()
        sgd.zero_grad(set_to_none=True)
        t = (time.perf_counter() - t0) * 1e3
        del loss
        if s >= a.warmup:
            ms.append(round(t, 3))
        peak = max(peak, counter.peak)
    print(json.dumps({"impl": "torch", "mode": a.mode, "ms": ms, "saved_peak": peak, "threads": torch.get_num_threads(),
                      "torch": torch.__version__}))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Checks remat's GPT against the same GPT in PyTorch: loads the weights remat wrote, runs the same
batch, and compares the loss and every parameter gradient (float32, dropout off). Fails loudly
(exit 1) when any tensor's relative error ||g_remat - g_torch|| / ||g_torch|| exceeds 1e-4.

usage: gpt_parity.py DIR LAYERS WIDTH HEADS CONTEXT BATCH VOCAB"""
import json
import math
import struct
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

DTYPES = {"F32": torch.float32, "F64": torch.float64, "I64": torch.int64}


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        buf = bytearray(data[base + begin:base + end])
        t = torch.frombuffer(buf, dtype=DTYPES[info["dtype"]]) if buf else torch.empty(0, dtype=DTYPES[info["dtype"]])
        out[name] = t.reshape(info["shape"]).clone()
    return out


class Attention(nn.Module):
    def __init__(self, c, h):
        super().__init__()
        self.n_head = h
        self.c_attn = nn.Linear(c, 3 * c)
        self.c_proj = nn.Linear(c, c)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
        att = F.softmax(att.masked_fill(mask, float("-inf")), dim=-1)
        return self.c_proj((att @ v).transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c_fc = nn.Linear(c, 4 * c)
        self.c_proj = nn.Linear(4 * c, c)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, c, h):
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(c), Attention(c, h), nn.LayerNorm(c), MLP(c)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, layers, c, h, context, vocab):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, c), wpe=nn.Embedding(context, c),
            h=nn.ModuleList(Block(c, h) for _ in range(layers)), ln_f=nn.LayerNorm(c)))
        self.lm_head = nn.Linear(c, vocab, bias=False)

    def forward(self, idx, targets):
        t = idx.size(1)
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(t))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-100)


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

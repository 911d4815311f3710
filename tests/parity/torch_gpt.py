"""The PyTorch reference GPT, shared by the parity test (tests/parity/gpt_parity.py) and the
benchmark peer (benchmarks/gpt_step_torch.py): remat's nn::GPT written in PyTorch with the same
parameter names (nanoGPT's), pre-LN blocks, explicit softmax attention, and dropout where remat
has it (embeddings, attention probabilities, attention output, MLP output). `mode` checkpoints
the blocks with torch.utils.checkpoint: "none", "blocks" (each block) or "sqrt" (ceil(sqrt(L))
blocks a segment)."""
import math

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


class MLP(nn.Module):
    def __init__(self, c, p):
        super().__init__()
        self.c_fc, self.c_proj, self.dropout = nn.Linear(c, 4 * c), nn.Linear(4 * c, c), nn.Dropout(p)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, c, h, p):
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(c), Attention(c, h, p), nn.LayerNorm(c), MLP(c, p)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, layers, width, heads, context, vocab, dropout=0.0, mode="none"):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, width), wpe=nn.Embedding(context, width), drop=nn.Dropout(dropout),
            h=nn.Sequential(*[Block(width, heads, dropout) for _ in range(layers)]), ln_f=nn.LayerNorm(width)))
        self.lm_head = nn.Linear(width, vocab, bias=False)
        if mode not in ("none", "blocks", "sqrt"):
            raise ValueError(f"mode must be none, blocks or sqrt, got {mode!r}")
        self.mode = mode

    def forward(self, idx, targets):
        t = self.transformer
        x = t.drop(t.wte(idx) + t.wpe(torch.arange(idx.size(1))))
        if self.mode == "blocks":
            for block in t.h:
                x = checkpoint(block, x)
        elif self.mode == "sqrt":
            x = checkpoint_sequential(t.h, math.ceil(math.sqrt(len(t.h))), x)
        else:
            x = t.h(x)
        logits = self.lm_head(t.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-100)

"""A plain-torch Llama built from config.json: the test's stand-in for an engine's model.

Rotary embeddings are computed in forward, so the module has no non-persistent buffers. With
`tp > 1` it is one rank of a tensor-parallel model in the hf layout (heads, MLP and vocabulary
split; KV heads replicated when there are fewer than ranks), reduced with torch.distributed.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def reduce(x, tp: int):
    if tp > 1:
        dist.all_reduce(x)
    return x


class Attention(nn.Module):
    def __init__(self, c: dict, tp: int = 1):
        super().__init__()
        self.tp, self.hd = tp, c["head_dim"]
        self.heads, self.kv = c["num_attention_heads"] // tp, max(c["num_key_value_heads"] // tp, 1)
        h = c["hidden_size"]
        self.q_proj = nn.Linear(h, self.heads * self.hd, bias=False)
        self.k_proj = nn.Linear(h, self.kv * self.hd, bias=False)
        self.v_proj = nn.Linear(h, self.kv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.heads * self.hd, h, bias=False)
        self.theta = c["rope_theta"]

    def rope(self, x):
        t = x.shape[2]
        inv = 1.0 / self.theta ** (torch.arange(0, self.hd, 2, dtype=torch.float32, device=x.device) / self.hd)
        ang = torch.outer(torch.arange(t, dtype=torch.float32, device=x.device), inv)
        cos, sin = torch.cat([ang.cos()] * 2, -1).to(x.dtype), torch.cat([ang.sin()] * 2, -1).to(x.dtype)
        x1, x2 = x[..., : self.hd // 2], x[..., self.hd // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv, self.hd).transpose(1, 2)
        q, k = self.rope(q), self.rope(k)
        rep = self.heads // self.kv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return reduce(self.o_proj(y.transpose(1, 2).reshape(b, t, -1)), self.tp)


class MLP(nn.Module):
    def __init__(self, c: dict, tp: int = 1):
        super().__init__()
        self.tp = tp
        h, i = c["hidden_size"], c["intermediate_size"] // tp
        self.gate_proj, self.up_proj = nn.Linear(h, i, bias=False), nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return reduce(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)), self.tp)


class Layer(nn.Module):
    def __init__(self, c: dict, tp: int = 1):
        super().__init__()
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.self_attn, self.mlp = Attention(c, tp), MLP(c, tp)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, c: dict, tp: int = 1):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"] // tp, c["hidden_size"])
        self.layers = nn.ModuleList(Layer(c, tp) for _ in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])


class TinyLlama(nn.Module):
    def __init__(self, c: dict, tp: int = 1, rank: int = 0):
        super().__init__()
        self.tp, self.rank = tp, rank
        self.model = Body(c, tp)
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"] // tp, bias=False)
        if c.get("tie_word_embeddings"):
            self.lm_head.weight = self.model.embed_tokens.weight

    def embed(self, ids):
        if self.tp == 1:
            return self.model.embed_tokens(ids)
        n = self.model.embed_tokens.num_embeddings          # this rank's slice of the vocabulary
        local = ids - self.rank * n
        inside = (local >= 0) & (local < n)
        x = self.model.embed_tokens(local.clamp(0, n - 1)) * inside.unsqueeze(-1)
        return reduce(x, self.tp)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.model.layers:
            x = layer(x)
        logits = self.lm_head(self.model.norm(x))
        if self.tp > 1:
            parts = [torch.empty_like(logits) for _ in range(self.tp)]
            dist.all_gather(parts, logits)
            logits = torch.cat(parts, -1)
        return logits


def config(folder: Path) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())

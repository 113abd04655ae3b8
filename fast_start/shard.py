"""Tensor-parallel sharding: a rule table plus one pure function (an engine's tables merge the cuts).

Column-parallel weights (q, k, v, gate, up, experts' w1/w3) are cut along dim 0 (output
features), row-parallel ones (o, down, experts' w2) along dim 1 (input features); embeddings and
lm_head are vocab-parallel (dim 0); norms and routers are replicated. Column biases are cut like
their weight; row biases are replicated (added once after the all-reduce). The `hf` layout splits
the vocabulary evenly; `vllm` splits it as if padded to a multiple of 64, as vLLM does.

With grouped-query attention and more ranks than KV heads, each KV head is replicated to the
`world / kv_heads` consecutive ranks that need it.

Scales follow their weight: a per-tensor scale (computed on the full tensor) is replicated, a
per-channel scale [out, 1] is cut with the weight's dim 0, a block scale grid is cut by block
rows or columns, and a shard boundary that falls inside a 128-block is an error.
A tensor no rule covers is an error: nothing is replicated by default.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from .headers import ModelDims, padded, tp_sizes, tp_unfit
from .errors import ShardError
from .quant import BLOCK

COLUMN, ROW, VOCAB, KV, REPLICATE = "column", "row", "vocab", "kv", "replicate"
SPLIT_DIM = {COLUMN: 0, ROW: 1, VOCAB: 0, KV: 0}

RULES = tuple((re.compile(p), kind) for p, kind in (
    (r"^model\.embed_tokens\.weight$", VOCAB),
    (r"^lm_head\.weight$", VOCAB),
    (r"\.self_attn\.q_proj\.(weight|bias)$", COLUMN),
    (r"\.self_attn\.[kv]_proj\.(weight|bias)$", KV),
    (r"\.self_attn\.o_proj\.weight$", ROW),
    (r"\.mlp\.(experts\.\d+\.)?(gate|up)_proj\.weight$", COLUMN),
    (r"\.mlp\.(experts\.\d+\.)?down_proj\.weight$", ROW),
    (r"\.block_sparse_moe\.experts\.\d+\.w[13]\.weight$", COLUMN),
    (r"\.block_sparse_moe\.experts\.\d+\.w2\.weight$", ROW),
    (r"\.(o_proj|down_proj|w2)\.bias$", REPLICATE),
    (r"(^model\.norm|_layernorm|\.q_norm|\.k_norm)\.weight$", REPLICATE),
    (r"\.(mlp|block_sparse_moe)\.gate\.weight$", REPLICATE),      # MoE router
    (r"_proj\.input_scale$|\.w[123]\.input_scale$", REPLICATE),   # static activation scales
))
# Checkpoint tensors that engines recompute rather than load.
SKIP = re.compile(r"\.rotary_emb\.inv_freq$")
SCALE = re.compile(r"^(.*\.weight)(_scale|_scale_inv)$")


@dataclass(frozen=True)
class TP:
    """This rank's place in a tensor-parallel group."""
    rank: int
    size: int
    num_kv_heads: int
    head_dim: int
    vocab_padding: int = 0      # vocab-parallel tensors are split as if padded to this multiple


@dataclass(frozen=True)
class Cut:
    dim: int
    start: int
    length: int


def rule(name: str) -> str:
    for pattern, kind in RULES:
        if pattern.search(name):
            return kind
    raise ShardError(f"no sharding rule covers tensor {name!r}",
                     "fast-start will not guess; add a rule to shard.RULES for this tensor")


def cut_for(name: str, shape: tuple[int, ...], tp: TP) -> Cut | None:
    """Which part of a full tensor of `shape` this rank holds; None means all of it."""
    kind = rule(name)
    if kind == REPLICATE or tp.size == 1:
        return None
    dim = SPLIT_DIM[kind]
    full = shape[dim]
    if kind == VOCAB and tp.vocab_padding:
        # Split the padded vocabulary evenly; this rank holds the real rows of its part (the
        # layout pads the rest with zeros), possibly none.
        per = padded(full, tp.vocab_padding) // tp.size
        start = min(tp.rank * per, full)
        return Cut(dim, start, min(start + per, full) - start)
    if kind == KV and tp.num_kv_heads < tp.size:
        head = tp.rank // (tp.size // tp.num_kv_heads)   # consecutive ranks share one KV head
        return Cut(dim, head * tp.head_dim, tp.head_dim)
    if full % tp.size:
        raise ShardError(f"tensor {name!r} has {full} rows on dim {dim}, not divisible by TP size {tp.size}",
                         f"use a TP size that divides {full}")
    per = full // tp.size
    return Cut(dim, tp.rank * per, per)


def shard(name: str, tensor: torch.Tensor, tp: TP, weight_shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """This rank's part of `tensor`, a view made with `narrow`.

    A scale (`X.weight_scale`, `X.weight_scale_inv`) is cut to follow its weight, whose full
    shape `weight_shape` must then be given.
    """
    m = SCALE.match(name)
    if m is None:
        cut = cut_for(name, tuple(tensor.shape), tp)
    else:
        assert weight_shape is not None, f"shard({name}) needs its weight's shape"
        cut = _scale_cut(name, m.group(1), m.group(2), tensor, weight_shape, tp)
    return tensor if cut is None else tensor.narrow(cut.dim, cut.start, cut.length)


def _scale_cut(name: str, weight: str, suffix: str, scale: torch.Tensor,
               weight_shape: tuple[int, ...], tp: TP) -> Cut | None:
    cut = cut_for(weight, weight_shape, tp)
    if cut is None or scale.numel() == 1:
        return None                      # replicated weight, or one scale for the whole tensor
    if suffix == "_scale":               # per output channel: [out, 1]
        return cut if cut.dim == 0 else None
    end = cut.start + cut.length
    if cut.start % BLOCK or (cut.length % BLOCK and end != weight_shape[cut.dim]):
        raise ShardError(
            f"TP rank {tp.rank}/{tp.size} of {weight!r} covers rows {cut.start}..{end} of dim {cut.dim},"
            f" which cuts a {BLOCK}x{BLOCK} quantization block of {name!r}",
            "use a TP size whose shards are multiples of 128, or per-tensor/per-channel fp8")
    return Cut(cut.dim, cut.start // BLOCK, -(-cut.length // BLOCK))


def check_tp(dims: ModelDims, size: int, rank: int, vocab_padding: int = 0) -> TP:
    """Validate a TP size and rank against the model's dimensions, before any data is read."""
    if size < 1 or not 0 <= rank < size:
        raise ShardError(f"rank {rank} is outside a tensor-parallel group of size {size}",
                         f"use a rank from 0 to {size - 1}" if size >= 1 else "use a TP size of 1 or more")
    bad = tp_unfit(dims, size, vocab_padding)
    if bad:
        raise ShardError(f"TP size {size} does not divide {', '.join(bad)} of {dims.architecture}",
                         f"use one of the TP sizes {tp_sizes(dims, vocab_padding)}")
    return TP(rank, size, dims.num_kv_heads, dims.head_dim, vocab_padding)

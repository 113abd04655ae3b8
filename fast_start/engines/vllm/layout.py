"""vLLM's as-loaded layout built by fast-start's own tables (where the fill worker's environment
has no vLLM): each rank gets the tensors that vLLM's model holds once its weight loaders have
run, so vLLM can map them as its parameters without a copy:

- q/k/v projections become one `qkv_proj` ([q rows; k rows; v rows] of this rank), gate/up one
  `gate_up_proj` ([gate; up]), as vLLM's `packed_modules_mapping`;
- MoE experts become two 3-D tensors per layer: `experts.routed_experts.w13_weight`
  [experts, 2·I/tp, hidden] (each expert's [gate; up]) and `experts.routed_experts.w2_weight`
  [experts, hidden, I/tp];
- vocab-parallel embedding and lm_head are padded as vLLM's `VocabParallelEmbedding` pads them:
  the vocabulary is rounded up to a multiple of 64, split evenly, and the rows past the real
  vocabulary are zero;
- a tied lm_head is not a tensor of its own (vLLM's lm_head shares the embedding).

This is the stage *before* vLLM's `process_weights_after_loading`, which the engine still runs
at start: it leaves unquantized tensors as loaded on CUDA, and repacks linear weights for
oneDNN on CPU (a copy in the engine; embeddings and norms stay mapped).
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from ...headers import ModelDims, padded

# vLLM's DEFAULT_VOCAB_PADDING_SIZE: vocab-parallel tensors hold a multiple of 64 rows in all.
VOCAB_PADDING = 64

CAT, EXPERTS = "cat", "experts"
# (checkpoint name pattern, vLLM name, how parts combine, the parts in order). A pattern's group
# `s` names the part and `e` the expert; `p` and `t` are carried into the vLLM name.
MERGES = tuple((re.compile(p), target, how, parts) for p, target, how, parts in (
    (r"^(?P<p>.*)\.self_attn\.(?P<s>[qkv])_proj\.(?P<t>weight|bias)$", "{p}.self_attn.qkv_proj.{t}", CAT,
     ("q", "k", "v")),
    (r"^(?P<p>.*)\.mlp\.(?P<s>gate|up)_proj\.weight$", "{p}.mlp.gate_up_proj.weight", CAT, ("gate", "up")),
    (r"^(?P<p>.*)\.mlp\.experts\.(?P<e>\d+)\.(?P<s>gate|up)_proj\.weight$",
     "{p}.mlp.experts.routed_experts.w13_weight", EXPERTS, ("gate", "up")),
    (r"^(?P<p>.*)\.mlp\.experts\.(?P<e>\d+)\.(?P<s>down)_proj\.weight$",
     "{p}.mlp.experts.routed_experts.w2_weight", EXPERTS, ("down",)),
    (r"^(?P<p>.*)\.block_sparse_moe\.experts\.(?P<e>\d+)\.(?P<s>w[13])\.weight$",
     "{p}.block_sparse_moe.experts.routed_experts.w13_weight", EXPERTS, ("w1", "w3")),
    (r"^(?P<p>.*)\.block_sparse_moe\.experts\.(?P<e>\d+)\.(?P<s>w2)\.weight$",
     "{p}.block_sparse_moe.experts.routed_experts.w2_weight", EXPERTS, ("w2",)),
))
VOCAB_PADDED = re.compile(r"^(model\.embed_tokens|lm_head)\.weight$")


def arrange(dims: ModelDims, tp_size: int, tensors: Iterable[tuple[str, torch.Tensor]]
            ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint-named stream of (name, rank tensor) turned into vLLM's tensors, in stream
    order.

    A merged tensor is yielded once its last part has arrived, so only the parts of merges in
    progress are held (one layer's q/k/v, or one layer's experts).
    """
    pending: dict[str, dict] = {}
    for name, t in tensors:
        if VOCAB_PADDED.match(name):
            if not (name == "lm_head.weight" and dims.tie_word_embeddings):
                yield name, _pad_rows(t, _rows_per_rank(dims.vocab_size, tp_size))
            continue
        merge = next(((m, target, how, parts) for pattern, target, how, parts in MERGES
                      if (m := pattern.match(name))), None)
        if merge is None:
            yield name, t
            continue
        m, target, how, parts = merge
        key = target.format(**m.groupdict())
        slots = pending.setdefault(key, {})
        slots[(int(m["e"]) if how == EXPERTS else 0, parts.index(m["s"]))] = t
        if len(slots) == len(parts) * (dims.num_experts if how == EXPERTS else 1):
            del pending[key]
            yield key, _combine(slots, how, len(parts))
    if pending:     # a checkpoint that validated has every part; this is an internal invariant
        raise AssertionError(f"merges left incomplete: {sorted(pending)}")


def _combine(slots: dict[tuple[int, int], torch.Tensor], how: str, nparts: int) -> torch.Tensor:
    if how == CAT:
        return torch.cat([slots[0, i] for i in range(nparts)])
    experts = len(slots) // nparts
    return torch.stack([torch.cat([slots[e, i] for i in range(nparts)]) for e in range(experts)])


def _rows_per_rank(vocab: int, tp_size: int) -> int:
    return padded(vocab, VOCAB_PADDING) // tp_size


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    pad = torch.zeros((rows - t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    return torch.cat([t, pad])

"""Quantization functions and the tensor-parallel rule table."""
from __future__ import annotations

import pytest
import torch

import fast_start
from devtools import synth
from fast_start import fp8, quant, shard
from fast_start.checkpoint import open_checkpoint
from fast_start.errors import QuantizationError, ShardError
from fast_start.materialize import materialize
from fast_start.client import from_arenas

W = torch.randn(300, 200, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)


@pytest.mark.parametrize("fn,scale_shape", [(fp8.to_fp8, ()), (fp8.to_fp8_channel, (300, 1)),
                                            (fp8.to_fp8_block, (3, 2))])
def test_fp8_methods_dequantize_close_to_input(fn, scale_shape):
    q, s = fn(W)
    assert q.dtype == torch.float8_e4m3fn and q.shape == W.shape and s.dtype == torch.float32
    assert tuple(s.shape) == scale_shape
    if fn is fp8.to_fp8_block:
        s = s.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
    deq = q.float() * s
    assert torch.isfinite(deq).all()
    assert (deq - W.float()).abs().max() <= W.float().abs().max() * 0.07   # e4m3: 3 mantissa bits


def test_fp8_saturates_instead_of_producing_nan():
    q = fp8._saturate(torch.tensor([1e6, -1e6, 3.0]))
    assert q.float().tolist() == [448.0, -448.0, 3.0]


def test_all_zero_tensor_gets_a_finite_scale():
    q, s = fp8.to_fp8(torch.zeros(4, 4))
    assert torch.isfinite(s) and (q.float() == 0).all()


def test_quantization_is_deterministic():
    a, b = fp8.to_fp8_block(W), fp8.to_fp8_block(W.clone())
    assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("name,quantized", [
    ("model.layers.0.self_attn.q_proj.weight", True), ("model.layers.3.mlp.down_proj.weight", True),
    ("model.layers.1.block_sparse_moe.experts.7.w2.weight", True),
    ("model.layers.1.mlp.experts.2.gate_proj.weight", True),
    ("model.embed_tokens.weight", False), ("lm_head.weight", False), ("model.norm.weight", False),
    ("model.layers.0.self_attn.q_proj.bias", False), ("model.layers.0.mlp.gate.weight", False),
    ("model.layers.0.block_sparse_moe.gate.weight", False), ("model.layers.0.input_layernorm.weight", False),
])
def test_quantize_rule_table(name, quantized):
    assert quant.is_quantized(name) is quantized


def test_unknown_and_unverified_methods_are_named():
    with pytest.raises(QuantizationError, match="unknown quantization 'int3'.*fp8-block"):
        quant.method("int3")
    with pytest.raises(QuantizationError, match="'nvfp4-checkpoint' is not verified"):
        quant.require_verified(quant.method("nvfp4-checkpoint"))


@pytest.mark.parametrize("name,kind", [
    ("model.layers.0.self_attn.q_proj.weight", shard.COLUMN), ("model.layers.0.self_attn.k_proj.bias", shard.KV),
    ("model.layers.0.self_attn.o_proj.weight", shard.ROW), ("model.layers.0.mlp.down_proj.weight", shard.ROW),
    ("model.layers.0.mlp.experts.3.up_proj.weight", shard.COLUMN),
    ("model.layers.0.block_sparse_moe.experts.3.w1.weight", shard.COLUMN),
    ("model.layers.0.block_sparse_moe.experts.3.w2.weight", shard.ROW),
    ("model.embed_tokens.weight", shard.VOCAB), ("lm_head.weight", shard.VOCAB),
    ("model.layers.0.mlp.gate.weight", shard.REPLICATE), ("model.layers.0.self_attn.o_proj.bias", shard.REPLICATE),
    ("model.layers.0.self_attn.q_norm.weight", shard.REPLICATE),
])
def test_sharding_rule_table(name, kind):
    assert shard.rule(name) == kind


def test_rowwise_shard_splits_input_dim():
    tp = shard.TP(rank=1, size=2, num_kv_heads=2, head_dim=4)
    w = torch.arange(24.).view(4, 6)
    assert torch.equal(shard.shard("model.layers.0.self_attn.o_proj.weight", w, tp), w[:, 3:])
    assert torch.equal(shard.shard("model.layers.0.self_attn.q_proj.weight", w, tp), w[2:])


def test_gqa_with_more_ranks_than_kv_heads_replicates_heads():
    w = torch.arange(16.).view(8, 2)     # 2 KV heads of head_dim 4
    got = [shard.shard("model.layers.0.self_attn.v_proj.weight", w, shard.TP(r, 4, 2, 4)) for r in range(4)]
    assert torch.equal(got[0], w[:4]) and torch.equal(got[1], w[:4])
    assert torch.equal(got[2], w[4:]) and torch.equal(got[3], w[4:])


def test_scales_follow_their_weight():
    tp = shard.TP(1, 2, 8, 128)
    weight = (512, 256)
    chan = torch.arange(512.).view(512, 1)
    assert torch.equal(shard.shard("m.layers.0.mlp.up_proj.weight_scale", chan, tp, weight), chan[256:])
    assert torch.equal(shard.shard("m.layers.0.mlp.down_proj.weight_scale", chan[:256], tp, (256, 512)), chan[:256])
    grid = torch.arange(8.).view(4, 2)
    assert torch.equal(shard.shard("m.layers.0.mlp.up_proj.weight_scale_inv", grid, tp, weight), grid[2:])
    assert torch.equal(shard.shard("m.layers.0.mlp.down_proj.weight_scale_inv", grid.T.contiguous(), tp,
                                   (256, 512)), grid.T[:, 2:])
    one = torch.tensor(0.5)
    assert shard.shard("m.layers.0.mlp.up_proj.weight_scale", one, tp, weight) is one


def test_shard_boundary_inside_a_block_is_an_error(small):
    spec = fast_start.WeightSpec(str(small), tensor_parallel_size=2, quantization="fp8-block")
    with pytest.raises(ShardError, match="cuts a 128x128 quantization block"):
        fast_start.fetch(spec)


def test_tp_size_that_does_not_divide_heads_names_valid_sizes(small):
    with pytest.raises(ShardError, match=r"TP size 3 does not divide num_attention_heads \(8\).*\[1, 2, 4, 8\]"):
        fast_start.fetch(fast_start.WeightSpec(str(small), tensor_parallel_size=3))


def test_tp_size_that_does_not_divide_intermediate_size(tmp_path):
    folder = synth.write_checkpoint(tmp_path / "m", synth.Shape(num_layers=1, intermediate_size=518))
    with pytest.raises(ShardError, match=r"intermediate_size \(518\).*\[1, 2\]"):
        fast_start.fetch(fast_start.WeightSpec(str(folder), tensor_parallel_size=4))


def test_rank_outside_group_is_an_error(small):
    with pytest.raises(ShardError, match="rank 2 is outside"):
        fast_start.fetch(fast_start.WeightSpec(str(small), tensor_parallel_size=2, rank=2))


FAMILIES = {
    "Qwen2ForCausalLM": synth.Shape(architecture="Qwen2ForCausalLM", num_layers=1),
    "Qwen3ForCausalLM": synth.Shape(architecture="Qwen3ForCausalLM", num_layers=1, tie_word_embeddings=True),
    "MistralForCausalLM": synth.Shape(architecture="MistralForCausalLM", num_layers=1),
    "Qwen3MoeForCausalLM": synth.Shape(architecture="Qwen3MoeForCausalLM", num_layers=2, num_experts=4,
                                       moe_intermediate_size=256),
    "MixtralForCausalLM": synth.Shape(architecture="MixtralForCausalLM", num_layers=1, num_experts=4),
}


@pytest.mark.parametrize("arch", FAMILIES)
@pytest.mark.parametrize("method", ["none", "fp8-channel"])
def test_every_family_shards_and_caches_identically(tmp_path, arch, method):
    folder = synth.write_checkpoint(tmp_path / arch, FAMILIES[arch], files=2)
    full = {}
    for r in range(2):
        spec = fast_start.WeightSpec(str(folder), tensor_parallel_size=2, rank=r, quantization=method)
        disk = fast_start.fetch(spec)
        manifest, fds = materialize(spec)
        cache = from_arenas(manifest, fds)
        for name, t in disk.tensors.items():
            assert torch.equal(t.reshape(-1).view(torch.uint8), cache[name].reshape(-1).view(torch.uint8)), name
            full.setdefault(name, []).append(t)
    ckpt = open_checkpoint(folder)
    for name, (a, b) in full.items():
        if name in ckpt.tensors and shard.rule(name) in (shard.COLUMN, shard.ROW, shard.VOCAB, shard.KV):
            dim = shard.SPLIT_DIM[shard.rule(name)]
            assert a.shape[dim] * 2 == ckpt.tensors[name].shape[dim], name
        elif name in ckpt.tensors:
            assert torch.equal(a, b), name           # replicated

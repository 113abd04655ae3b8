"""The `vllm` layout, checked against the `hf` layout's tensors (which test_pipeline checks
against independent slicing): merges are concatenations of this rank's parts, vocab-parallel
tensors are padded to vLLM's 64-row multiple and split evenly, zeros past the vocabulary."""
from __future__ import annotations

import pytest
import torch
from conftest import LLAMA

from devtools import synth
from fast_start.checkpoint import open_checkpoint
from fast_start.client import from_arenas
from fast_start.errors import QuantizationError, ShardError
from fast_start.fingerprint import WeightSpec, fingerprint
from fast_start.materialize import load_from_disk, materialize, plan

# vocab 1000 pads to 1024: at TP 4 each rank holds 256 rows, the last one 232 real rows + 24 zeros.
SHAPES = {
    "llama": synth.Shape(**{**LLAMA.__dict__, "vocab_size": 1000}),
    "qwen3-tied": synth.Shape(**{**LLAMA.__dict__, "architecture": "Qwen3ForCausalLM", "vocab_size": 1000,
                                 "tie_word_embeddings": True}),
    "qwen3-moe": synth.Shape(**{**LLAMA.__dict__, "architecture": "Qwen3MoeForCausalLM", "vocab_size": 1000,
                                "num_experts": 4, "moe_intermediate_size": 256}),
    "mixtral": synth.Shape(**{**LLAMA.__dict__, "architecture": "MixtralForCausalLM", "vocab_size": 1000,
                              "num_experts": 4}),
}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def model(request, tmp_path_factory):
    return synth.write_checkpoint(tmp_path_factory.mktemp(request.param), SHAPES[request.param], files=2)


def tensors(path, tp, rank, layout):
    return load_from_disk(WeightSpec(str(path), tp, rank, layout=layout))[0]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vllm_layout_merges_this_ranks_parts_in_vllms_order(model, tp):
    dims = open_checkpoint(model).dims
    for rank in range(tp):
        hf, vl = tensors(model, tp, rank, "hf"), tensors(model, tp, rank, "vllm")
        for layer in range(dims.num_layers):
            p = f"model.layers.{layer}"
            attn = [hf[f"{p}.self_attn.{x}_proj.weight"] for x in "qkv"]
            assert torch.equal(vl[f"{p}.self_attn.qkv_proj.weight"], torch.cat(attn))
            assert torch.equal(vl[f"{p}.self_attn.o_proj.weight"], hf[f"{p}.self_attn.o_proj.weight"])
            if dims.num_experts == 0:
                gate_up = torch.cat([hf[f"{p}.mlp.gate_proj.weight"], hf[f"{p}.mlp.up_proj.weight"]])
                assert torch.equal(vl[f"{p}.mlp.gate_up_proj.weight"], gate_up)
                continue
            moe, (w1, w3, w2) = ((f"{p}.block_sparse_moe", ("w1", "w3", "w2")) if "mixtral" in str(model)
                                 else (f"{p}.mlp", ("gate_proj", "up_proj", "down_proj")))
            w13 = torch.stack([torch.cat([hf[f"{moe}.experts.{e}.{w1}.weight"], hf[f"{moe}.experts.{e}.{w3}.weight"]])
                               for e in range(dims.num_experts)])
            down = torch.stack([hf[f"{moe}.experts.{e}.{w2}.weight"] for e in range(dims.num_experts)])
            assert torch.equal(vl[f"{moe}.experts.routed_experts.w13_weight"], w13)
            assert torch.equal(vl[f"{moe}.experts.routed_experts.w2_weight"], down)
            assert torch.equal(vl[f"{moe}.gate.weight"], hf[f"{moe}.gate.weight"])


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vllm_vocab_is_padded_to_64_and_split_evenly(model, tp):
    dims = open_checkpoint(model).dims
    full = tensors(model, 1, 0, "hf")
    names = ["model.embed_tokens.weight"] + ([] if dims.tie_word_embeddings else ["lm_head.weight"])
    for name in names:
        parts = [tensors(model, tp, r, "vllm")[name] for r in range(tp)]
        assert {p.shape[0] for p in parts} == {1024 // tp}
        joined = torch.cat(parts)
        assert torch.equal(joined[:1000], full[name])
        assert not joined[1000:].any()
    if dims.tie_word_embeddings:
        assert "lm_head.weight" not in tensors(model, tp, 0, "vllm")


def test_vllm_layout_cache_equals_disk_and_plan(model, tmp_path):
    spec = WeightSpec(str(model), 2, 1, layout="vllm")
    disk = tensors(model, 2, 1, "vllm")
    manifest, fds = materialize(spec)
    cached = from_arenas(manifest, fds)
    assert manifest.aliases == {} and manifest.fingerprint.layout == "vllm/2"
    assert [(n, tuple(t.shape)) for n, t in disk.items()] == [(n, s) for n, _, s in plan(open_checkpoint(model), spec)]
    assert all(torch.equal(cached[n], t) for n, t in disk.items()) and set(cached) == set(disk)


def test_rank_past_the_real_vocabulary_holds_only_zeros(tmp_path):
    # vocab 40 pads to 64; at TP 8 ranks 5..7 cover rows 40..63, past the real vocabulary.
    shape = synth.Shape(hidden_size=256, num_heads=8, num_kv_heads=8, head_dim=32, intermediate_size=256,
                        vocab_size=40, num_layers=1)
    path = synth.write_checkpoint(tmp_path / "m", shape)
    parts = [tensors(path, 8, r, "vllm")["model.embed_tokens.weight"] for r in range(8)]
    assert [p.shape[0] for p in parts] == [8] * 8
    assert not torch.cat(parts[5:]).any() and torch.cat(parts[:5])[:40].any()


def test_vllm_layout_refuses_quantization_and_hf_refuses_indivisible_vocab(model):
    with pytest.raises(QuantizationError, match="own tables caches unquantized weights only"):
        plan(open_checkpoint(model), WeightSpec(str(model), layout="vllm", quantization="fp8"))
    with pytest.raises(ShardError, match=r"vocab_size \(1000\)"):
        plan(open_checkpoint(model), WeightSpec(str(model), 16, 0))
    assert fingerprint(WeightSpec(str(model), layout="vllm")) != fingerprint(WeightSpec(str(model)))

"""Cache (arena) and disk paths give bit-identical tensors; shards reassemble the full tensors."""
from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

import fast_start
from fast_start import fp8
from fast_start.client import from_arenas
from fast_start.materialize import materialize

METHODS = ["none", "fp8", "fp8-channel", "fp8-block"]
TP_RANKS = [(tp, r) for tp in (1, 2, 4) for r in range(tp)]
QUANTIZERS = {"fp8": fp8.to_fp8, "fp8-channel": fp8.to_fp8_channel, "fp8-block": fp8.to_fp8_block}


def full_tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, f)))
    return out


def expected_full(folder, method: str, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    """The whole (quantized) model, computed here without the pipeline."""
    out = {}
    for name, t in full_tensors(folder).items():
        linear = name.endswith("_proj.weight")
        if method in QUANTIZERS and linear:
            q, s = QUANTIZERS[method](t)
            out[name] = q
            out[name + ("_scale_inv" if method == "fp8-block" else "_scale")] = s
        elif t.dtype == torch.float8_e4m3fn or name.endswith(("_scale", "_scale_inv")):
            out[name] = t
        else:
            out[name] = t.to(dtype)
    return out


def split_dim(name: str, t: torch.Tensor) -> int | None:
    """An independent statement of the hf TP layout: which dim a full tensor is cut along."""
    base = name.removesuffix("_scale_inv").removesuffix("_scale")
    if name != base and t.numel() == 1:
        return None
    if any(k in base for k in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")):
        return 0
    if any(k in base for k in ("o_proj", "down_proj")):
        return None if name.endswith("_scale") and base != name else 1
    return None


def expected_shard(name: str, full: torch.Tensor, tp: int, rank: int, kv_heads: int) -> torch.Tensor:
    dim = split_dim(name, full)
    if dim is None or tp == 1:
        return full
    if ("k_proj" in name or "v_proj" in name) and kv_heads < tp:
        head = rank * kv_heads // tp
        return full.chunk(kv_heads, dim)[head]
    return full.chunk(tp, dim)[rank]


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_identical(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(raw(a[k]), raw(b[k])), k


@pytest.mark.parametrize("fixture", ["llama", "llama_tied"])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("tp,rank", TP_RANKS)
def test_arena_and_disk_paths_are_bit_identical(request, fixture, method, tp, rank):
    folder = request.getfixturevalue(fixture)
    spec = fast_start.WeightSpec(str(folder), tensor_parallel_size=tp, rank=rank, quantization=method)
    manifest, fds = materialize(spec)
    try:
        cache = from_arenas(manifest, fds)
    finally:
        for fd in fds:
            os.close(fd)
    disk = fast_start.fetch(spec)
    assert disk.source == "disk" and cache.source == "cache"
    assert cache.fingerprint == disk.fingerprint
    assert_identical(dict(cache.tensors), dict(disk.tensors))
    for e in manifest.tensors:
        assert len(e.checksum) == 32


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_rank_shards_match_independent_slicing_of_full_tensors(llama, method, tp):
    full = expected_full(llama, method)
    ranks = [dict(fast_start.fetch(fast_start.WeightSpec(str(llama), tensor_parallel_size=tp, rank=r,
                                                         quantization=method)).tensors) for r in range(tp)]
    assert set(ranks[0]) == set(full)
    for name, t in full.items():
        for r in range(tp):
            want = expected_shard(name, t, tp, r, kv_heads=2)
            assert torch.equal(raw(ranks[r][name]), raw(want)), (name, r)
        dim = split_dim(name, t)
        replicated_kv = ("k_proj" in name or "v_proj" in name) and tp > 2   # 2 KV heads over 4 ranks
        if dim is not None and not replicated_kv:
            whole = torch.cat([ranks[r][name] for r in range(tp)], dim)
            assert torch.equal(raw(whole), raw(t)), name


@pytest.mark.parametrize("tp,rank", TP_RANKS)
def test_prequantized_checkpoint_passes_through_with_scales(llama_fp8, tp, rank):
    spec = fast_start.WeightSpec(str(llama_fp8), tensor_parallel_size=tp, rank=rank, quantization="fp8-checkpoint")
    manifest, fds = materialize(spec)
    cache = from_arenas(manifest, fds)
    for fd in fds:
        os.close(fd)
    disk = fast_start.fetch(spec)
    assert_identical(dict(cache.tensors), dict(disk.tensors))
    full = expected_full(llama_fp8, "fp8-checkpoint")
    assert set(disk.tensors) == set(full)
    for name, t in full.items():
        want = expected_shard(name, t, tp, rank, kv_heads=2)
        assert torch.equal(raw(disk[name]), raw(want)), name


def test_tied_embeddings_are_an_alias_in_cache_and_disk(llama_tied):
    spec = fast_start.WeightSpec(str(llama_tied), tensor_parallel_size=2, rank=1)
    manifest, fds = materialize(spec)
    cache = from_arenas(manifest, fds, mode="copy")
    for fd in fds:
        os.close(fd)
    disk = fast_start.fetch(spec)
    assert "lm_head.weight" not in disk.tensors
    assert manifest.aliases == disk.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    assert cache["lm_head.weight"] is cache["model.embed_tokens.weight"]
    assert torch.equal(disk["lm_head.weight"], cache["lm_head.weight"])


def test_output_is_deterministic_across_runs(llama):
    spec = fast_start.WeightSpec(str(llama), tensor_parallel_size=2, rank=0, quantization="fp8-block")
    a, fa = materialize(spec)
    b, fb = materialize(spec)
    for fd in fa + fb:
        os.close(fd)
    assert [e.checksum for e in a.tensors] == [e.checksum for e in b.tensors]


def test_several_arenas_when_a_limit_is_set(llama):
    spec = fast_start.WeightSpec(str(llama))
    manifest, fds = materialize(spec, chunk=1 << 21)
    assert len(manifest.arenas) > 1 and len(fds) == len(manifest.arenas)
    cache = from_arenas(manifest, fds)
    for fd in fds:
        os.close(fd)
    assert_identical(dict(cache.tensors), dict(fast_start.fetch(spec).tensors))


def test_unverified_quantization_is_refused_before_reading(llama_fp8):
    spec = fast_start.WeightSpec(str(llama_fp8), quantization="nvfp4-checkpoint")
    with pytest.raises(fast_start.FastStartError, match="not verified for sharing"):
        fast_start.fetch(spec)


def test_quantizing_an_fp8_checkpoint_again_is_refused(llama_fp8):
    with pytest.raises(fast_start.FastStartError, match="fp8-checkpoint"):
        fast_start.fetch(fast_start.WeightSpec(str(llama_fp8), quantization="fp8"))


def test_fp8_checkpoint_method_on_a_bf16_checkpoint_is_refused(llama):
    with pytest.raises(fast_start.FastStartError, match="holds no FP8 weights"):
        fast_start.fetch(fast_start.WeightSpec(str(llama), quantization="fp8-checkpoint"))


def test_dtype_is_applied_to_unquantized_tensors(llama):
    w = fast_start.fetch(fast_start.WeightSpec(str(llama), dtype="float16", quantization="fp8"))
    assert w["model.norm.weight"].dtype == torch.float16
    assert w["model.layers.0.mlp.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert w["model.layers.0.mlp.up_proj.weight_scale"].dtype == torch.float32


def test_unknown_mode_is_refused(llama):
    with pytest.raises(fast_start.FastStartError, match="zero_copy"):
        fast_start.fetch(fast_start.WeightSpec(str(llama)), mode="mmap")


@pytest.mark.parametrize("quantization,dtype", [("none", "bfloat16"), ("none", "float32"), ("fp8", "bfloat16")])
def test_the_pipeline_holds_nothing_of_a_tensor_once_the_next_is_asked_for(llama, quantization, dtype):
    """A fill lets go of each tensor before it asks for the next: then it holds one tensor at a
    time beside its arenas (on a GPU, where the caching allocator keeps what was held the most)."""
    import weakref
    from fast_start.checkpoint import open_checkpoint, tensor_reader
    from fast_start.materialize import derive
    spec = fast_start.WeightSpec(str(llama), 2, 1, dtype=dtype, quantization=quantization, engine_version="test")
    ckpt, seen = open_checkpoint(spec.path), []
    with tensor_reader(ckpt) as read:
        for name, t in derive(ckpt, spec, read):
            seen.append((name, weakref.ref(t)))
            del t
            alive = [n for n, ref in seen[:-1] if ref() is not None]
            assert not alive, f"{alive} still held when {name} came"
    assert len(seen) > 10

"""The fingerprint: independent of where the checkpoint lies, sensitive to everything that matters."""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from fast_start.checkpoint import open_checkpoint
from fast_start.fingerprint import Fingerprint, WeightSpec, fingerprint


def test_same_checkpoint_elsewhere_has_the_same_fingerprint(llama, tmp_path):
    copy = shutil.copytree(llama, tmp_path / "elsewhere")
    a = fingerprint(WeightSpec(str(llama)), open_checkpoint(llama))
    b = fingerprint(WeightSpec(str(copy)), open_checkpoint(copy))
    assert a == b and a.digest() == b.digest()


def test_diff_names_the_fields_that_differ(llama):
    ckpt = open_checkpoint(llama)
    base = WeightSpec(str(llama), tensor_parallel_size=2, rank=0)
    a = fingerprint(base, ckpt)
    b = fingerprint(base._replace(engine_version="0.31.0", rank=1, quantization="fp8"), ckpt)
    assert set(a.diff(b)) == {"engine_version", "rank", "quantization", "quantization_config"}
    assert a.digest() != b.digest()


def test_changed_header_changes_the_checkpoint_hash(small):
    before = fingerprint(WeightSpec(str(small)), open_checkpoint(small))
    tensors = load_file(small / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones_like(tensors["model.norm.weight"], dtype=torch.float32)
    save_file(tensors, small / "model.safetensors")
    after = fingerprint(WeightSpec(str(small)), open_checkpoint(small))
    assert after.diff(before) == ("checkpoint",)


def test_round_trips_through_a_dict(llama):
    fp = fingerprint(WeightSpec(str(llama)), open_checkpoint(llama))
    assert Fingerprint.from_dict(fp.to_dict()) == fp


def test_the_checkpoint_hash_covers_every_safetensors_file_without_reading_the_index(llama, tmp_path):
    """An engine's fingerprint hashes the header of every *.safetensors file and never parses the
    index (megabytes for an MoE); for a complete download that is the index's shards, so it equals
    the fill's and the hash of the shards the index names."""
    import hashlib
    import json

    from fast_start import watch
    from fast_start.errors import CheckpointError
    from fast_start.headers import INDEX, raw_header
    folder = shutil.copytree(llama, tmp_path / "m")
    ckpt = open_checkpoint(folder)
    engine = fingerprint(WeightSpec(str(folder)))
    assert engine == fingerprint(WeightSpec(str(folder)), ckpt)
    named = sorted(set(json.loads((folder / INDEX).read_text())["weight_map"].values()))
    assert len(named) == 3
    h = hashlib.sha256()
    for name in named:
        raw = raw_header(folder / name)
        h.update(f"{name}\0{len(raw)}\0".encode())
        h.update(raw)
    assert engine.checkpoint == h.hexdigest()

    (folder / INDEX).write_text("not json")         # the engine's check does not read it ...
    assert fingerprint(WeightSpec(str(folder))) == engine
    with pytest.raises(CheckpointError, match=INDEX):   # ... the fill, which loads by it, refuses it
        open_checkpoint(folder)

    shutil.copy(folder / named[0], folder / "adapter.safetensors")   # a stray file: stricter, not looser
    assert fingerprint(WeightSpec(str(folder))).diff(engine) == ("checkpoint",)
    assert "adapter.safetensors" in watch.identity(folder)


def test_an_engine_takes_each_shards_identity_from_the_open_that_read_its_header(small):
    """fetch opens each shard once: the identity its header read records is the one `watch.identity`
    takes, which the engine sent before the read (`client._Headers` compares the two)."""
    from fast_start import watch
    seen: dict = {}
    fp = fingerprint(WeightSpec(str(small)), identities=seen)
    assert fp == fingerprint(WeightSpec(str(small)))
    shards = sorted(p.name for p in small.glob("*.safetensors"))
    assert sorted(seen) == shards
    assert seen == {n: watch.identity(small)[n] for n in shards}


@pytest.mark.parametrize("layout,quantization", [("hf", "none"), ("hf", "fp8"), ("vllm", "none"), ("vllm", "fp8")])
def test_a_requested_fingerprint_leaves_empty_only_what_the_files_say(small, layout, quantization):
    """What an engine sends before it reads its checkpoint equals its whole fingerprint in every
    field but those FROM_FILES, which are empty (the quantization too where vLLM's layout takes it
    from config.json); a partial diff ignores just those."""
    from fast_start.fingerprint import FROM_FILES, requested
    spec = WeightSpec(str(small), layout=layout, quantization=quantization, engine_version="x")
    whole, asked = fingerprint(spec), requested(spec)
    assert set(whole.diff(asked)) <= set(FROM_FILES)
    assert all(getattr(asked, f) == "" for f in whole.diff(asked))
    assert (asked.quantization == "") == (layout == "vllm" and quantization == "none")
    assert whole.diff(asked, partial=True) == ()
    assert whole.diff(asked._replace(rank=1), partial=True) == ("rank",)
    assert whole.diff(whole._replace(checkpoint=""), partial=False) == ("checkpoint",)

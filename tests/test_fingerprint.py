"""The fingerprint: independent of where the checkpoint lies, sensitive to everything that matters."""
from __future__ import annotations

import shutil

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

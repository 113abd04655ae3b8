"""Checkpoint discovery and validation: every malformed file gets its own specific error."""
from __future__ import annotations

import json
import shutil
import struct
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fast_start
from devtools import synth
from fast_start.checkpoint import INDEX, open_checkpoint, required_tensors
from fast_start.errors import CheckpointError, FastStartError


def split(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write(path: Path, header: bytes | dict, data: bytes, length: int | None = None) -> None:
    hb = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(hb) if length is None else length) + hb + data)


def ordered(header: dict) -> list[str]:
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


def test_single_file_checkpoint_is_described(small):
    ckpt = open_checkpoint(small)
    assert ckpt.files == ("model.safetensors",)
    assert set(ckpt.tensors) == set(required_tensors(ckpt.dims))
    assert ckpt.dims.architecture == "LlamaForCausalLM" and ckpt.dims.num_kv_heads == 2
    raw = ckpt.headers["model.safetensors"]
    assert struct.unpack("<Q", raw[:8])[0] == len(raw) - 8


def test_indexed_checkpoint_lists_its_shards(llama):
    ckpt = open_checkpoint(llama)
    assert len(ckpt.files) == 3 and list(ckpt.files) == sorted(ckpt.files)
    index = json.loads((llama / INDEX).read_text())["weight_map"]
    assert {n: i.file for n, i in ckpt.tensors.items()} == index


@pytest.mark.parametrize("case,expected", [
    ("too_long_header", "more than the format's 100000000-byte limit"),
    ("header_past_end", "but the file has only"),
    ("truncated", "the file is truncated"),
    ("overlapping", "overlaps the tensor before it"),
    ("gapped", "gap of 16 bytes before tensor"),
    ("bad_dtype", "unknown dtype (`F13`"),
    ("shape_size_mismatch", "has shape [1000, 256] (512000 bytes) but a range of"),
    ("duplicate_name", "names tensor 'model.norm.weight' twice"),
    ("trailing_bytes", "7 trailing bytes after the last tensor"),
    ("non_json_header", "not a valid safetensors JSON object"),
    ("too_short", "too few for a safetensors header"),
])
def test_malformed_file_gives_its_specific_error(small, case, expected):
    path = small / "model.safetensors"
    header, data = split(path)
    names = ordered(header)
    if case == "too_long_header":
        write(path, header, data, length=10**12)
    elif case == "header_past_end":
        write(path, header, data, length=len(json.dumps(header)) + len(data) + 100)
    elif case == "truncated":
        path.write_bytes(path.read_bytes()[:-10])
    elif case in ("overlapping", "gapped"):
        second = header[names[1]]
        shift = -16 if case == "overlapping" else 16
        second["data_offsets"] = [o + shift for o in second["data_offsets"]]
        for later in names[2:]:
            header[later]["data_offsets"] = [o + shift for o in header[later]["data_offsets"]]
        write(path, header, data + b"\0" * 16 if case == "gapped" else data[:-16])
    elif case == "bad_dtype":
        header[names[0]]["dtype"] = "F13"
        write(path, header, data)
    elif case == "shape_size_mismatch":
        header[names[0]]["shape"] = [1000, 256]
        write(path, header, data)
    elif case == "duplicate_name":
        text = json.dumps(header)
        dup = json.dumps({"model.norm.weight": header["model.norm.weight"]})[1:-1]
        write(path, (text[:-1] + ", " + dup + "}").encode(), data)
    elif case == "trailing_bytes":
        write(path, header, data + b"x" * 7)
    elif case == "non_json_header":
        write(path, b"{this is not json" + b" " * 40, data)
    elif case == "too_short":
        path.write_bytes(b"\x01\x02\x03")
    with pytest.raises(CheckpointError) as err:
        open_checkpoint(small)
    assert expected in str(err.value) and "model.safetensors" in str(err.value)
    assert err.value.fix


def test_exponent_only_scales_are_served_as_stored(tmp_path):
    """An MX checkpoint's float8_e8m0fnu tensors come back in their own dtype, under a scale's name
    or not (here the final norm's), while the weights take the model's dtype."""
    import torch
    from safetensors.torch import load_file, save_file
    folder = synth.write_checkpoint(tmp_path / "mx", synth.Shape(hidden_size=64, num_layers=1, num_heads=2,
                                    num_kv_heads=1, head_dim=32, intermediate_size=128, vocab_size=100), seed=1)
    tensors = load_file(folder / "model.safetensors")
    scales = torch.tensor([2.0 ** k for k in range(-32, 32)]).to(torch.float8_e8m0fnu)
    tensors["model.layers.0.mlp.down_proj.weight_scale"] = scales.reshape(16, 4)
    tensors["model.norm.weight"] = scales.clone()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    w = fast_start.fetch(fast_start.WeightSpec(str(folder), dtype="float32"), socket_dir=str(tmp_path / "none"))
    for name in ("model.layers.0.mlp.down_proj.weight_scale", "model.norm.weight"):
        assert w[name].dtype == torch.float8_e8m0fnu
        assert torch.equal(w[name].view(torch.uint8).flatten(), scales.view(torch.uint8))
    assert w["model.layers.0.mlp.down_proj.weight"].dtype == torch.float32


def test_missing_shard_named_by_index(llama, tmp_path):
    folder = shutil.copytree(llama, tmp_path / "m")
    victim = sorted(folder.glob("*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"names shard {victim.name}, which is missing"):
        open_checkpoint(folder)


def test_index_that_disagrees_with_files(llama, tmp_path):
    folder = shutil.copytree(llama, tmp_path / "m")
    index = json.loads((folder / INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    name = next(n for n, f in index["weight_map"].items() if f == files[0])
    index["weight_map"][name] = files[1]
    (folder / INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"places tensor '{name}' in {files[1]}, but it is in {files[0]}"):
        open_checkpoint(folder)


def test_tensor_missing_from_index(llama, tmp_path):
    folder = shutil.copytree(llama, tmp_path / "m")
    index = json.loads((folder / INDEX).read_text())
    index["weight_map"].pop("model.norm.weight")
    (folder / INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="'model.norm.weight' .* is not in"):
        open_checkpoint(folder)


def test_tensor_in_two_files(small):
    header, data = split(small / "model.safetensors")
    name = ordered(header)[0]
    info = header[name]
    start, stop = info["data_offsets"]
    write(small / "extra.safetensors", {name: {**info, "data_offsets": [0, stop - start]}}, data[start:stop])
    with pytest.raises(CheckpointError, match=f"'{name}' is in both"):
        open_checkpoint(small)


def test_missing_required_tensor(tmp_path):
    folder = synth.write_checkpoint(tmp_path / "m", synth.Shape(num_layers=1))
    from safetensors.torch import load_file, save_file
    tensors = load_file(folder / "model.safetensors")
    tensors.pop("model.layers.0.mlp.up_proj.weight")
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match="lacks tensor 'model.layers.0.mlp.up_proj.weight'"):
        open_checkpoint(folder)


def test_unknown_architecture_and_missing_config(small):
    cfg = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(CheckpointError, match="'GPT2LMHeadModel' is not supported"):
        open_checkpoint(small)
    (small / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json is missing"):
        open_checkpoint(small)


def test_folder_without_safetensors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(synth.Shape().config()))
    with pytest.raises(CheckpointError, match="no \\*.safetensors files"):
        open_checkpoint(tmp_path)


def test_uncovered_tensor_is_an_error_not_replicated(small):
    from safetensors.torch import load_file, save_file
    tensors = load_file(small / "model.safetensors")
    tensors["model.layers.0.mystery.weight"] = tensors["model.norm.weight"].clone()
    save_file(tensors, small / "model.safetensors")
    with pytest.raises(FastStartError, match="no sharding rule covers tensor 'model.layers.0.mystery.weight'"):
        fast_start.fetch(fast_start.WeightSpec(str(small)))


_VALID = None


def _valid_bytes() -> tuple[bytes, str]:
    global _VALID
    if _VALID is None:
        with tempfile.TemporaryDirectory() as d:
            folder = synth.write_checkpoint(Path(d), synth.Shape(num_layers=1, hidden_size=64, head_dim=16,
                                                                 num_heads=4, num_kv_heads=2,
                                                                 intermediate_size=64, vocab_size=64))
            _VALID = ((folder / "model.safetensors").read_bytes(), (folder / "config.json").read_text())
    return _VALID


mutation = st.one_of(
    st.tuples(st.just("byte"), st.integers(0, 10_000), st.integers(0, 255)),
    st.tuples(st.just("truncate"), st.integers(0, 10_000), st.just(0)),
    st.tuples(st.just("length"), st.integers(0, 2**64 - 1), st.just(0)),
    st.tuples(st.just("insert"), st.integers(0, 10_000), st.integers(0, 255)),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(mutation, min_size=1, max_size=4))
def test_random_header_mutations_raise_only_our_error(mutations):
    data, config = _valid_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    buf = bytearray(data)
    for kind, pos, value in sorted(mutations, key=lambda m: m[0] == "truncate"):   # truncations last
        at = 8 + pos % n                      # a position inside the original header
        if kind == "byte":
            buf[at] = value
        elif kind == "insert":
            buf[at:at] = bytes([value])
        elif kind == "length":
            buf[:8] = struct.pack("<Q", pos)
        else:
            del buf[pos % max(len(buf), 1):]
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "model.safetensors").write_bytes(bytes(buf))
        (Path(d) / "config.json").write_text(config)
        try:
            fast_start.fetch(fast_start.WeightSpec(d, dtype="float32"))
        except FastStartError:
            pass

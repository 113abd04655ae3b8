"""Find, validate and read the safetensors shards of a model folder.

The `safetensors` library validates each file's header (length, UTF-8, JSON, dtypes, offsets,
sizes) and we rely on it for that; where its message lumps several faults together (a truncated
file and trailing bytes, overlapping and gapped ranges) we look at the header again to name the
one that happened. What it does not check is done here: duplicate names inside a header, the
index and the files agreeing, no tensor in two files, and every tensor the architecture needs
being present. Tensors are read through `safe_open` (memory-mapped), never whole files.

The raw header bytes of each file (8-byte length + JSON) are kept: they feed the fingerprint.
"""
from __future__ import annotations

import json
import os
import struct
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import SafetensorError, safe_open

from .errors import CheckpointError

INDEX = "model.safetensors.index.json"
MAX_HEADER = 100_000_000  # the safetensors format's own limit

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}

# Tensors each architecture needs, per decoder layer. "{e}" expands over experts.
PARTS = {
    "attn": ("input_layernorm.weight", "post_attention_layernorm.weight",
             "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
             "self_attn.o_proj.weight"),
    "qkv_bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "qk_norm": ("self_attn.q_norm.weight", "self_attn.k_norm.weight"),
    "mlp": ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"),
    "qwen_moe": ("mlp.gate.weight", "mlp.experts.{e}.gate_proj.weight",
                 "mlp.experts.{e}.up_proj.weight", "mlp.experts.{e}.down_proj.weight"),
    "mixtral_moe": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.w1.weight",
                    "block_sparse_moe.experts.{e}.w2.weight", "block_sparse_moe.experts.{e}.w3.weight"),
}
# architecture -> (parts of every layer, part of a sparse layer or None, its dense part)
ARCHITECTURES = {
    "LlamaForCausalLM": (("attn",), None, "mlp"),
    "MistralForCausalLM": (("attn",), None, "mlp"),
    "Qwen2ForCausalLM": (("attn", "qkv_bias"), None, "mlp"),
    "Qwen3ForCausalLM": (("attn", "qk_norm"), None, "mlp"),
    "Qwen3MoeForCausalLM": (("attn", "qk_norm"), "qwen_moe", "mlp"),
    "MixtralForCausalLM": (("attn",), "mixtral_moe", "mlp"),
}


@dataclass(frozen=True)
class ModelDims:
    """What `config.json` says about the model's shape."""
    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    num_experts: int = 0
    moe_intermediate_size: int = 0
    sparse_layers: tuple[int, ...] = ()
    quantization_config: dict | None = None


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: str          # file name inside the folder
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Checkpoint:
    folder: Path
    files: tuple[str, ...]              # sorted file names
    headers: dict[str, bytes]           # file name -> raw header (8-byte length + JSON)
    tensors: dict[str, TensorInfo]      # in file order, then offset order
    dims: ModelDims


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Validate a model folder and describe it. Reads headers and config.json, no tensor data."""
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"model path {folder} is not a folder",
                              "point it at the folder holding *.safetensors and config.json")
    dims = read_config(folder)
    files = shard_files(folder)
    headers, tensors = {}, {}
    for name in files:
        raw, header = _validated_header(folder / name)
        headers[name] = raw
        for tname, info in header.items():
            if tname in tensors:
                raise CheckpointError(
                    f"tensor {tname!r} is in both {tensors[tname].file} and {name} in {folder}",
                    "remove the duplicate so each tensor is stored in exactly one file")
            tensors[tname] = TensorInfo(tname, name, _dtype(folder / name, tname, info["dtype"]),
                                        tuple(info["shape"]))
    _check_index(folder, files, tensors)
    _check_required(folder, dims, tensors)
    return Checkpoint(folder, files, headers, tensors, dims)


def read_config(folder: Path) -> ModelDims:
    path = folder / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing", "copy the model's config.json next to its weights") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is not readable JSON: {e}", "restore the model's config.json") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path} is not a JSON object", "restore the model's config.json")
    archs = cfg.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else None
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{path}: architecture {arch!r} is not supported",
                              f"use one of {', '.join(ARCHITECTURES)}")

    def key(k: str, default=None) -> int:
        v = cfg.get(k)
        v = default if v is None else v   # HF writes null for "derive it"
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise CheckpointError(f"{path}: {k} = {v!r} is not a non-negative integer",
                                  f"set {k} in config.json as the model defines it")
        return v

    heads, layers = key("num_attention_heads"), key("num_hidden_layers")
    if heads == 0:
        raise CheckpointError(f"{path}: num_attention_heads is 0", "restore the model's config.json")
    experts = key("num_experts", 0) if arch == "Qwen3MoeForCausalLM" else key("num_local_experts", 0)
    moe_part = ARCHITECTURES[arch][1]
    step = key("decoder_sparse_step", 1) or 1
    dense_only = set(cfg.get("mlp_only_layers") or ())
    sparse = tuple(i for i in range(layers) if moe_part and experts and i not in dense_only and (i + 1) % step == 0)
    intermediate = key("intermediate_size", 0 if sparse and arch == "Qwen3MoeForCausalLM" else None)
    return ModelDims(
        architecture=arch, num_layers=layers, hidden_size=key("hidden_size"), num_heads=heads,
        num_kv_heads=key("num_key_value_heads", heads),
        head_dim=key("head_dim", key("hidden_size") // heads if heads else 0),
        intermediate_size=intermediate, vocab_size=key("vocab_size"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        num_experts=experts,
        moe_intermediate_size=key("moe_intermediate_size", intermediate) if arch == "Qwen3MoeForCausalLM" else intermediate,
        sparse_layers=sparse, quantization_config=cfg.get("quantization_config"))


def required_tensors(dims: ModelDims) -> list[str]:
    """Names of the weights the architecture needs (scales of pre-quantized weights not included)."""
    common, moe_part, dense_part = ARCHITECTURES[dims.architecture]
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not dims.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(dims.num_layers):
        parts = common + ((moe_part,) if i in dims.sparse_layers else (dense_part,))
        for part in parts:
            for t in PARTS[part]:
                experts = range(dims.num_experts) if "{e}" in t else (None,)
                names += [f"model.layers.{i}." + t.format(e=e) for e in experts]
    return names


def raw_header(path: Path) -> bytes:
    """The 8-byte little-endian length and the JSON header, as stored."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
            return head + f.read(min(n, MAX_HEADER))
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}",
                              "make the checkpoint readable by this process's user (uid "
                              f"{os.geteuid()})") from None


@contextmanager
def tensor_reader(ckpt: Checkpoint) -> Iterator[Callable[[str], torch.Tensor]]:
    """Yields `read(name, cut=None) -> Tensor` over memory-mapped files open for the block.

    With a cut (anything with `dim`, `start`, `length`) only that slice is read from disk.
    """
    with ExitStack() as stack:
        handles = {}

        def read(name: str, cut=None) -> torch.Tensor:
            info = ckpt.tensors[name]
            if info.file not in handles:
                path = ckpt.folder / info.file
                try:
                    handles[info.file] = stack.enter_context(safe_open(str(path), framework="pt"))
                except (SafetensorError, OSError) as e:
                    raise CheckpointError(f"cannot open {path}: {e}",
                                          "check that the file is readable and unchanged since start") from None
            try:
                if cut is None:
                    return handles[info.file].get_tensor(name)
                index = (slice(None),) * cut.dim + (slice(cut.start, cut.start + cut.length),)
                return handles[info.file].get_slice(name)[index]
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"cannot read tensor {name!r} from {ckpt.folder / info.file}: {e}",
                                      "check that the file is readable and unchanged since start") from None
        yield read


def shard_files(folder: Path) -> tuple[str, ...]:
    """The safetensors files of a model folder: those the index names, else every *.safetensors."""
    index = folder / INDEX
    try:
        indexed = index.exists()
    except OSError as e:
        raise CheckpointError(f"cannot read {folder}: {e.strerror or e}", "make the checkpoint readable by this "
                              f"process's user (uid {os.geteuid()})") from None
    if indexed:
        files = sorted(set(_read_index(index).values()))
        for name in files:
            if not (folder / name).is_file():
                raise CheckpointError(f"{index} names shard {name}, which is missing from {folder}",
                                      "download the missing shard or restore the index")
        return tuple(files)
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {folder}",
                              "point the model path at a folder holding safetensors weights")
    return tuple(files)


def _read_index(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise CheckpointError(f"{index} is not a readable index: {e}", "restore the model's index file") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index} has no weight_map of tensor name -> file name",
                              "restore the model's index file")
    for v in set(weight_map.values()):
        if "/" in v or v in ("", ".", ".."):
            raise CheckpointError(f"{index} names {v!r}, which is not a file inside the model folder",
                                  "the index may only name files next to it")
    return weight_map


def _check_index(folder: Path, files: tuple[str, ...], tensors: dict[str, TensorInfo]) -> None:
    index = folder / INDEX
    if not index.exists():
        return
    weight_map = _read_index(index)
    for name, file in weight_map.items():
        if name not in tensors:
            raise CheckpointError(f"{index} places tensor {name!r} in {file}, but no file holds it",
                                  "restore the shard or regenerate the index")
        if tensors[name].file != file:
            raise CheckpointError(f"{index} places tensor {name!r} in {file}, but it is in {tensors[name].file}",
                                  "regenerate the index from the files")
    extra = [n for n in tensors if n not in weight_map]
    if extra:
        raise CheckpointError(f"tensor {extra[0]!r} in {tensors[extra[0]].file} is not in {index}"
                              f" ({len(extra)} such tensors)", "regenerate the index from the files")


def _check_required(folder: Path, dims: ModelDims, tensors: dict[str, TensorInfo]) -> None:
    missing = [n for n in required_tensors(dims) if n not in tensors]
    if missing:
        raise CheckpointError(
            f"{folder} lacks tensor {missing[0]!r} that {dims.architecture} needs"
            f" ({len(missing)} missing in all)",
            "check that every shard was downloaded and that config.json belongs to these weights")


def _dtype(path: Path, name: str, code: str) -> torch.dtype:
    if code not in DTYPES:
        raise CheckpointError(f"tensor {name!r} in {path} has dtype {code}, which fast-start does not handle",
                              f"convert it to one of {', '.join(DTYPES)}")
    return DTYPES[code]


def _validated_header(path: Path) -> tuple[bytes, dict]:
    """Let safetensors validate the file, then parse the header ourselves (duplicates, diagnosis)."""
    try:
        with open(path, "rb"):
            pass          # a plain open first: safetensors reports EACCES as "No such file or directory"
        with safe_open(str(path), framework="pt"):
            pass
    except SafetensorError as e:
        raise CheckpointError(f"{path}: {_explain(path, str(e))}",
                              "re-download or re-export this file") from None
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}", "check the file's permissions") from None
    raw = raw_header(path)
    header = json.loads(raw[8:], object_pairs_hook=_no_duplicates(path))
    header.pop("__metadata__", None)
    return raw, header


def _no_duplicates(path: Path):
    def hook(pairs):
        seen = set()
        for k, _ in pairs:
            if k in seen:
                raise CheckpointError(f"{path}: the header names tensor {k!r} twice",
                                      "re-export the file; each name may appear once")
            seen.add(k)
        return dict(pairs)
    return hook


def _explain(path: Path, msg: str) -> str:
    """Turn a safetensors message into the specific fault, looking at the header where it helps."""
    size = path.stat().st_size
    head = raw_header(path)
    n = struct.unpack("<Q", head[:8])[0] if len(head) >= 8 else 0
    if "header too small" in msg:
        return f"the file has {size} bytes, too few for a safetensors header"
    if "header too large" in msg:
        return f"the header length field says {n} bytes, more than the format's {MAX_HEADER}-byte limit"
    if 8 + n > size:
        return f"the header length field says {n} bytes but the file has only {size} bytes"
    if "invalid UTF-8" in msg:
        return "the header is not UTF-8 text"
    if "unknown variant" in msg:
        return f"a tensor has an unknown dtype ({msg.split('unknown variant')[1].split(',')[0].strip()})"
    if "invalid JSON" in msg:
        return f"the header is not a valid safetensors JSON object ({msg.split('header:', 1)[-1].strip()})"
    try:
        header = json.loads(head[8:])
        header.pop("__metadata__", None)
        ranges = sorted((v["data_offsets"][0], v["data_offsets"][1], k) for k, v in header.items())
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return msg
    if "invalid offset" in msg:
        end = 0
        for begin, stop, name in ranges:
            if begin < end:
                return f"tensor {name!r} overlaps the tensor before it (starts at {begin}, previous ends at {end})"
            if begin > end:
                return f"there is a gap of {begin - end} bytes before tensor {name!r}"
            end = stop
    if "invalid shape" in msg:
        for _, _, name in ranges:
            info = header[name]
            if info["dtype"] in DTYPES:
                want = DTYPES[info["dtype"]].itemsize
                for d in info["shape"]:
                    want *= d
                got = info["data_offsets"][1] - info["data_offsets"][0]
                if want != got:
                    return f"tensor {name!r} has shape {info['shape']} ({want} bytes) but a range of {got} bytes"
    if "incomplete metadata" in msg and ranges:
        data_end = 8 + n + max(stop for _, stop, _ in ranges)
        if size < data_end:
            return f"the file is truncated: {size} bytes, the header needs {data_end}"
        if size > data_end:
            return f"the file has {size - data_end} trailing bytes after the last tensor"
    return msg

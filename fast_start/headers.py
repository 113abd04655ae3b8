"""A model folder as the control plane sees it: safetensors files, raw headers, config.json.

Everything here reads with the standard library only (no torch, no safetensors): the daemon and
the CLI compute fingerprints from it. Validating the files and reading tensors is
`checkpoint.py`'s, in the fill worker and the engine.
"""
from __future__ import annotations

import json
import os
import stat
import struct
from pathlib import Path
from typing import NamedTuple

from . import dtypes
from .errors import CheckpointError

INDEX = "model.safetensors.index.json"
MAX_HEADER = 100_000_000  # the safetensors format's own limit

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


class ModelDims(NamedTuple):
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


def open_file(path: Path) -> int:
    """An fd to read checkpoint file `path`, opened without blocking: a FIFO or device planted
    where a file belongs fails at once instead of stalling the reader (a worker, check-config).
    Refused unless a regular file; a symlink to one is fine (snapshots link into a blob store)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"{path} is not a regular file", "put the model's own file there")
    return fd


def read_file(path: Path) -> bytes:
    with os.fdopen(open_file(path), "rb") as f:
        return f.read()


def _config_json(folder: Path) -> tuple[Path, dict, str | None]:
    path = folder / "config.json"
    try:
        cfg = json.loads(read_file(path))
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing", "copy the model's config.json next to its weights") from None
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}", "make the checkpoint readable by this "
                              f"process's user (uid {os.geteuid()})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is not readable JSON: {e}", "restore the model's config.json") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path} is not a JSON object", "restore the model's config.json")
    archs = cfg.get("architectures") or []
    return path, cfg, archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None


def read_identity(folder: Path) -> tuple[str, dict | None]:
    """(architecture, quantization_config) of any model folder: what a fill by vLLM is keyed on
    (vLLM builds the architecture; fast-start's tables need not know it)."""
    path, cfg, arch = _config_json(folder)
    if arch is None:
        raise CheckpointError(f"{path} names no architecture", "restore the model's config.json")
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    return arch, cfg.get("quantization_config") or text.get("quantization_config")


def tensor_bytes(folder: Path) -> list[tuple[str, str, int]]:
    """(name, safetensors dtype code, bytes) of every tensor in the folder's shards, from headers."""
    out = []
    for name in shard_files(folder):
        header = json.loads(raw_header(folder / name)[8:])
        out += [(k, v["dtype"], v["data_offsets"][1] - v["data_offsets"][0])
                for k, v in header.items() if k != "__metadata__"]
    return out


def rank_bytes(folder: Path, dtype: str, ranks: int) -> int:
    """A rank's bytes from the headers alone: the checkpoint's, with wider floats cast to `dtype`,
    split over `ranks` (an estimate before the model is built: replicated tensors add some)."""
    size = dtypes.BY_NAME[dtype].itemsize
    total = 0
    for _, code, nbytes in tensor_bytes(folder):
        d = dtypes.BY_CODE.get(code)
        floating = d is not None and d.name.startswith(("float", "bfloat")) and d.itemsize > 1
        total += nbytes // d.itemsize * size if floating else nbytes
    return total // ranks


def read_config(folder: Path) -> ModelDims:
    path, cfg, arch = _config_json(folder)
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


def raw_header(path: Path, identities: dict[str, list[int]] | None = None) -> bytes:
    """The 8-byte little-endian length and the JSON header, as stored. With `identities`, the
    file's identity (`file_identity`) is recorded there under its name, from the same open."""
    try:
        fd = open_file(path)
        try:
            head = os.pread(fd, 8, 0)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
            raw = head + os.pread(fd, min(n, MAX_HEADER), 8) if n else head
            if identities is not None:
                identities[Path(path).name] = file_identity(os.fstat(fd))
            return raw
        finally:
            os.close(fd)
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}",
                              "make the checkpoint readable by this process's user (uid "
                              f"{os.geteuid()})") from None


def size_fault(path: Path, raw: bytes) -> str | None:
    """What is wrong with a safetensors file's size against its own header `raw` (as stored:
    truncated, or bytes after the last tensor), or None; a stat is all it reads. A header that
    cannot be parsed is left to the full validation (`checkpoint.py`)."""
    try:
        header = json.loads(raw[8:])
        ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
        need = len(raw) + max(ends, default=0)
        size = os.stat(path).st_size
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, OSError):
        return None
    if not all(isinstance(e, int) for e in ends) or size == need:
        return None
    if size < need:
        return f"{path} is truncated: {size} bytes, its header needs {need}"
    return f"{path} has {size - need} bytes after its last tensor"


def file_identity(st: os.stat_result) -> list[int]:
    """What the cache records of a checkpoint file (`watch.py`): device, inode, size, mtime."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]


def weight_files(folder: Path) -> tuple[str, ...]:
    """Every *.safetensors file in a model folder, sorted: the files a fingerprint hashes and whose
    identity a cache records. The index's shards in any complete download, found without parsing
    the index (an MoE's runs to megabytes: milliseconds of every engine start); a stray file
    next to them (an adapter, a consolidated copy) only makes the check stricter."""
    try:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    except OSError as e:
        raise CheckpointError(f"cannot read {folder}: {e.strerror or e}", "make the checkpoint readable by this "
                              f"process's user (uid {os.geteuid()})") from None
    if not names:
        raise CheckpointError(f"no *.safetensors files in {folder}",
                              "point the model path at a folder holding safetensors weights")
    return tuple(names)


def shard_files(folder: Path) -> tuple[str, ...]:
    """The safetensors files of a model folder: those the index names, else every *.safetensors."""
    index = folder / INDEX
    try:
        indexed = index.exists()
    except OSError as e:
        raise CheckpointError(f"cannot read {folder}: {e.strerror or e}", "make the checkpoint readable by this "
                              f"process's user (uid {os.geteuid()})") from None
    if indexed:
        files = sorted(index_files(index))
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


_INDEXES: dict[Path, tuple[tuple[int, ...], dict[str, str], frozenset[str]]] = {}   # path -> stat, map, files


def read_index(index: Path) -> dict[str, str]:
    """An index's weight_map (tensor name -> file), checked."""
    return _index(index)[0]


def index_files(index: Path) -> frozenset[str]:
    """The files an index names, checked."""
    return _index(index)[1]


def _index(index: Path) -> tuple[dict[str, str], frozenset[str]]:
    """Parsed once per version of the file: an MoE index runs to megabytes, and a fetch reads it
    for the fingerprint and again for the files' identities."""
    try:
        st = os.stat(index)
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if index in _INDEXES and _INDEXES[index][0] == key:
            return _INDEXES[index][1:]
        weight_map = json.loads(read_file(index)).get("weight_map")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise CheckpointError(f"{index} is not a readable index: {e}", "restore the model's index file") from None
    try:        # the distinct values, at C speed (an MoE index names ~10,000 tensors in a handful of files)
        files = frozenset(weight_map.values()) if isinstance(weight_map, dict) else None
    except TypeError:           # an unhashable value: a list or an object
        files = None
    if files is None or not all(isinstance(v, str) for v in files):
        raise CheckpointError(f"{index} has no weight_map of tensor name -> file name",
                              "restore the model's index file")
    for v in files:
        if "/" in v or v in ("", ".", ".."):
            raise CheckpointError(f"{index} names {v!r}, which is not a file inside the model folder",
                                  "the index may only name files next to it")
    _INDEXES[index] = (key, weight_map, files)
    return weight_map, files


def padded(n: int, multiple: int) -> int:
    """`n` rounded up to a multiple of `multiple` (0: unchanged)."""
    return -(-n // multiple) * multiple if multiple else n


def tp_unfit(d: ModelDims, t: int, vocab_padding: int = 0) -> list[str]:
    """What a TP size `t` does not divide in a model (empty: it fits); `shard.check_tp` and the
    CLI's checks, without torch."""
    return [what for what, ok in _tp_constraints(d, t, vocab_padding) if not ok]


def tp_sizes(d: ModelDims, vocab_padding: int = 0) -> list[int]:
    """Every TP size that fits the model."""
    return [t for t in range(1, d.num_heads + 1) if not tp_unfit(d, t, vocab_padding)]


def _tp_constraints(d: ModelDims, t: int, vocab_padding: int) -> list[tuple[str, bool]]:
    kv_ok = d.num_kv_heads % t == 0 or t % d.num_kv_heads == 0
    vocab = padded(d.vocab_size, vocab_padding)
    out = [(f"num_attention_heads ({d.num_heads})", d.num_heads % t == 0),
           (f"num_key_value_heads ({d.num_kv_heads})", kv_ok),
           (f"vocab_size ({d.vocab_size}{f', padded to {vocab}' if vocab_padding else ''})", vocab % t == 0)]
    if len(d.sparse_layers) < d.num_layers:
        out.append((f"intermediate_size ({d.intermediate_size})", d.intermediate_size % t == 0))
    if d.sparse_layers:
        out.append((f"moe_intermediate_size ({d.moe_intermediate_size})", d.moe_intermediate_size % t == 0))
    return out

"""Find, validate and read the safetensors shards of a model folder.

The `safetensors` library validates each file's header (length, UTF-8, JSON, dtypes, offsets,
sizes) and we rely on it for that; where its message lumps several faults together (a truncated
file and trailing bytes, overlapping and gapped ranges) we look at the header again to name the
one that happened. What it does not check is done here: duplicate names inside a header, the
index and the files agreeing, no tensor in two files, and every tensor the architecture needs
being present. Tensors are read through `safe_open` (memory-mapped), never whole files.

The raw header bytes of each file (8-byte length + JSON) are kept: they feed the fingerprint.
Finding the files, reading raw headers and config.json is `headers.py`'s (no torch).
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

from . import dtypes
from .errors import CheckpointError
from .headers import (INDEX, MAX_HEADER, ModelDims, open_file, read_index, raw_header, read_config, required_tensors,
                      shard_files)

DTYPES = {d.code: dtypes.torch_dtype(d.name) for d in dtypes.TABLE if hasattr(torch, d.name)}

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


def _check_index(folder: Path, files: tuple[str, ...], tensors: dict[str, TensorInfo]) -> None:
    index = folder / INDEX
    if not index.exists():
        return
    weight_map = read_index(index)
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
        os.close(open_file(path))    # first: safetensors reports EACCES as "No such file or directory",
        # and would block on a FIFO
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

"""The fingerprint that guards the cache: any differing field means a miss.

`checkpoint` hashes every shard's raw safetensors header (file names sorted, the folder's path
left out). Headers carry every tensor's name, dtype, shape and byte range; a checkpoint whose
data changed without its header changing is caught by the file identities the daemon compares
at every acquire (`watch.py`), not here. The GPU is matched separately, by UUID. Read without
torch: the daemon and the CLI compute fingerprints.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from typing import TYPE_CHECKING, NamedTuple

from . import engines, quant
from .headers import raw_header, read_config, weight_files

if TYPE_CHECKING:
    from .checkpoint import Checkpoint

# Bump when the bytes fast-start produces for the same inputs change (rules, packing, formats).
LAYOUT_VERSION = 2


def layouts() -> tuple[str, ...]:
    """"hf" (the checkpoint's names) and each engine's (`engines`)."""
    return ("hf", *engines.names())


class WeightSpec(NamedTuple):
    """Which weights an engine wants: the checkpoint and how to derive this rank's tensors."""
    path: str
    """The checkpoint's folder."""
    tensor_parallel_size: int = 1
    """The engine's TP size."""
    rank: int = 0
    """This rank: the global rank, pp_rank × tensor_parallel_size + tp_rank."""
    dtype: str = "bfloat16"
    """The engine's dtype."""
    quantization: str = "none"
    """The engine's quantization ("none": the checkpoint's own, or none)."""
    layout: str = "hf"
    """The cached tensors' layout: "hf" (the checkpoint's names), or the engine's that fills them."""
    revision: str = "main"
    """The checkpoint's revision."""
    engine_version: str = ""
    """The engine's version (its bytes may change with it)."""
    pipeline_parallel_size: int = 1
    """The engine's PP size."""
    engine_options: str = ""
    """An engine's: what else steers its bytes (`Engine.options`)."""
    data_parallel_size: int = 1
    """An engine's DP size: its MoE layers shard across every DP rank's TP ranks."""
    data_parallel_rank: int = 0
    """This engine's DP rank."""
    expert_parallel: str = ""
    """An engine's expert placement (`Engine.expert_parallel`); "" = none."""


class Fingerprint(NamedTuple):
    checkpoint: str
    architecture: str
    tensor_parallel_size: int
    rank: int
    dtype: str
    quantization: str
    quantization_config: str
    revision: str
    engine_version: str
    layout: str          # "<layout>/<LAYOUT_VERSION>", e.g. "hf/2"
    pipeline_parallel_size: int
    engine_options: str
    data_parallel_size: int
    data_parallel_rank: int
    expert_parallel: str

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self._asdict(), sort_keys=True).encode()).hexdigest()

    def diff(self, other: "Fingerprint", partial: bool = False) -> tuple[str, ...]:
        """Names of the fields that differ. `partial`: `other` is a `requested` fingerprint, whose
        empty FROM_FILES fields differ from nothing."""
        return tuple(name for name, a, b in zip(self._fields, self, other)
                     if a != b and not (partial and b == "" and name in FROM_FILES))

    def to_dict(self) -> dict:
        return self._asdict()

    def spec(self, path: str) -> WeightSpec:
        """The WeightSpec of this fingerprint's fields, for the checkpoint at `path`."""
        fields = {k: getattr(self, k) for k in WeightSpec._fields if k in self._fields}
        return WeightSpec(path=path, **{**fields, "layout": self.layout.split("/")[0]})

    @classmethod
    def from_dict(cls, d: dict) -> "Fingerprint":
        names = set(cls._fields)
        if not isinstance(d, dict) or set(d) != names:
            raise ValueError(f"a fingerprint has exactly the fields {sorted(names)}")
        return cls(**d)


# What only the checkpoint's files say (its headers, config.json). An engine asks a daemon before
# it reads them: it sends these empty (`requested`), the daemon matches the other fields and the
# files' identities (`watch.py`), and the engine checks the whole fingerprint in the reply.
FROM_FILES = ("checkpoint", "architecture", "quantization", "quantization_config")


def requested(spec: WeightSpec) -> Fingerprint:
    """`spec`'s fingerprint as far as it is known before a file is read: FROM_FILES empty, except
    a quantization the spec names (an engine may take "none" from the checkpoint's config)."""
    engine = engines.get(spec.layout)
    quantization = engine.requested_quantization(spec.quantization) if engine else spec.quantization
    return _of(spec, "", "", quantization, "")


def checkpoint_hash(folder: Path, known: dict[str, bytes] | None = None,
                    identities: dict[str, list[int]] | None = None) -> str:
    """Hash of the raw header of every *.safetensors file in `folder` (`weight_files`), by file
    name (the folder's path is left out). `known`: headers already read, by file name (a fill's).
    `identities`: where to record the identity of each file read (`headers.raw_header`).

    The index is not hashed: which tensor lies in which file is what the headers say. Its
    identity, like every file's, is the cache's other check (`watch.identity`)."""
    h = hashlib.sha256()
    for name in weight_files(folder):
        raw = known.get(name) if known else None
        raw = raw if raw is not None else raw_header(folder / name, identities)
        h.update(f"{name}\0{len(raw)}\0".encode())
        h.update(raw)
    return h.hexdigest()


def fingerprint(spec: WeightSpec, ckpt: "Checkpoint | None" = None,
                identities: dict[str, list[int]] | None = None) -> Fingerprint:
    """The fingerprint of `spec`'s weights.

    Without `ckpt` only config.json and the raw headers are read, not validated: that is all a
    cache lookup needs, since a daemon holding the same header hash validated those very files.
    `identities` collects the identity of each shard as read (an engine compares them with the
    identities it sent: a shard replaced meanwhile is a miss).
    """
    folder = Path(spec.path)
    # First: it names an unreadable folder.
    checkpoint = checkpoint_hash(folder, ckpt.headers if ckpt else None, identities)
    engine = engines.get(spec.layout)
    if engine is not None:
        architecture, quantization, config = engine.identity(folder, spec.quantization)
    else:
        dims = ckpt.dims if ckpt else read_config(folder)
        architecture, quantization = dims.architecture, spec.quantization
        config = quant.config_hash(quant.method(quantization), dims.quantization_config)
    return _of(spec, checkpoint, architecture, quantization, config)


def _of(spec: WeightSpec, checkpoint: str, architecture: str, quantization: str, config: str) -> Fingerprint:
    """The fingerprint of `spec` with the fields FROM_FILES given (empty in a `requested` one)."""
    return Fingerprint(
        checkpoint=checkpoint, architecture=architecture,
        tensor_parallel_size=spec.tensor_parallel_size, rank=spec.rank, dtype=spec.dtype,
        quantization=quantization, quantization_config=config,
        revision=spec.revision, engine_version=spec.engine_version,
        layout=f"{spec.layout}/{LAYOUT_VERSION}", pipeline_parallel_size=spec.pipeline_parallel_size,
        engine_options=spec.engine_options, data_parallel_size=spec.data_parallel_size,
        data_parallel_rank=spec.data_parallel_rank, expert_parallel=spec.expert_parallel)

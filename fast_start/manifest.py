"""The manifest: everything a client needs to turn arena file descriptors into tensors.

JSON on the wire: the fingerprint, the arenas (size, device), the tensors (name, dtype, shape,
arena, offset, nbytes, checksum; a `stride` where the tensor is a view, e.g. vLLM's transposed
FP8 weights, whose entries may then share bytes), tied-weight aliases (name -> name of the tensor
it shares) and, for a model an engine filled, what its plugin needs to install it (`engine`:
the engine's record, e.g. `engines/vllm/record.py`).
`Manifest.from_json` checks everything a client relies on before it builds a single view, so a
manifest from a buggy or hostile peer cannot make a client read outside an arena. Plain Python:
the daemon parses and stores manifests without torch; the checksums are `arena.checksum`'s.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from . import dtypes
from .errors import ArenaError
from .fingerprint import Fingerprint

ALIGN = 256
CHUNK = 512 << 20   # an arena's most bytes (a larger tensor gets one of its own): what a copy holds twice
MAX_ARENAS = 128    # of one rank: its fds travel in one message; systemd's fd store holds every model's


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    arena: int
    offset: int
    nbytes: int
    checksum: str = ""
    stride: tuple[int, ...] = ()     # empty: contiguous


@dataclass(frozen=True)
class ArenaEntry:
    size: int
    device: str        # "cpu", or the GPU's UUID for CUDA arenas


@dataclass(frozen=True)
class Manifest:
    fingerprint: Fingerprint
    arenas: tuple[ArenaEntry, ...]
    tensors: tuple[TensorEntry, ...]
    aliases: dict[str, str]
    engine: dict = field(default_factory=dict)   # an engine's record of its fill ({} for fast-start's own)

    def to_dict(self) -> dict:
        """The JSON object `from_dict` reads back."""
        return {"fingerprint": self.fingerprint.to_dict(), "arenas": [asdict(a) for a in self.arenas],
                "tensors": [asdict(t) for t in self.tensors], "aliases": dict(self.aliases), "engine": self.engine}

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict(), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> "Manifest":
        try:
            d = json.loads(data)
        except ValueError as e:
            raise ArenaError(f"manifest is not JSON: {e}", "refill the cache (fast-start evict, then restart)") from None
        return cls.from_dict(d)

    @classmethod
    def from_dict(cls, d: dict) -> "Manifest":
        """Build and validate a manifest from its JSON object."""
        try:
            m = cls(Fingerprint.from_dict(d["fingerprint"]),
                    tuple(ArenaEntry(**a) for a in d["arenas"]),
                    tuple(TensorEntry(**{**t, "shape": tuple(t["shape"]), "stride": tuple(t.get("stride", ()))})
                          for t in d["tensors"]),
                    dict(d["aliases"]), dict(d.get("engine", {})))
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise ArenaError(f"manifest is malformed: {e}", "refill the cache (fast-start evict, then restart)") from None
        m.validate()
        return m

    def validate(self) -> None:
        """Every tensor lies inside its arena, aligned, with nbytes matching dtype and shape."""
        names = set()
        for t in self.tensors:
            if t.name in names or not 0 <= t.arena < len(self.arenas):
                raise ArenaError(f"manifest entry {t.name!r} is duplicated or names no arena", "refill the cache")
            if t.dtype not in dtypes.BY_NAME:
                raise ArenaError(f"manifest entry {t.name!r} has dtype {t.dtype}, which this fast-start does not know "
                                 f"(it knows {', '.join(dtypes.BY_NAME)})",
                                 "upgrade fast-start to one that knows it, or serve this model from disk")
            names.add(t.name)
            if any(not isinstance(s, int) or s < 0 for s in t.shape) or nbytes(t.dtype, t.shape) != t.nbytes:
                raise ArenaError(f"manifest entry {t.name!r}: shape {t.shape} does not match {t.nbytes} bytes",
                                 "refill the cache")
            if t.offset < 0 or t.offset % (ALIGN if not t.stride else dtypes.BY_NAME[t.dtype].itemsize) or \
                    t.offset + span(t) > self.arenas[t.arena].size:
                raise ArenaError(f"manifest entry {t.name!r} lies outside arena {t.arena} or is misaligned",
                                 "refill the cache")
        for alias, target in self.aliases.items():
            if target not in names or alias in names:
                raise ArenaError(f"manifest alias {alias!r} -> {target!r} is invalid", "refill the cache")


def span(t: TensorEntry) -> int:
    """Bytes from a tensor's first element to the end of its last (its nbytes when contiguous)."""
    if not t.stride:
        return t.nbytes
    if len(t.stride) != len(t.shape) or any(not isinstance(s, int) or s < 0 for s in t.stride):
        raise ArenaError(f"manifest entry {t.name!r}: stride {t.stride} does not fit shape {t.shape}", "refill the cache")
    if 0 in t.shape:
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride))) * dtypes.BY_NAME[t.dtype].itemsize


def nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    n = dtypes.BY_NAME[dtype].itemsize
    for s in shape:
        n *= s
    return n


def place(sizes: list[int], chunk: int | None = None) -> tuple[list[tuple[int, int]], list[int]]:
    """(arena, offset) of each of `sizes` bytes, one after another, 256-byte aligned, and each
    arena's size: a new arena starts where the next would pass `chunk` bytes (one larger than
    `chunk` gets an arena of its own). Where that makes more than MAX_ARENAS arenas, `chunk` is
    doubled until it does not (an engine receives all of a rank's fds in one message)."""
    while True:
        where, arenas, cursor = [], [0], 0
        for size in sizes:
            if chunk and cursor and cursor + size > chunk:
                arenas[-1], cursor = cursor, 0
                arenas.append(0)
            where.append((len(arenas) - 1, cursor))
            cursor += -(-size // ALIGN) * ALIGN
        arenas[-1] = max(cursor, ALIGN)
        if len(arenas) <= MAX_ARENAS:
            return where, arenas
        chunk *= 2


def pack(outputs: list[tuple[str, str, tuple[int, ...]]], chunk: int | None = None
         ) -> tuple[list[TensorEntry], list[int]]:
    """Place tensors in arenas of at most `chunk` bytes (`place`).

    Tensors of one dtype and shape are placed together (in their given order), so that an engine
    builds them as one view (`arena.from_table`).
    """
    ordered = sorted(outputs, key=lambda o: (o[1], o[2]))
    sizes = [nbytes(dtype, shape) for _, dtype, shape in ordered]
    where, arenas = place(sizes, chunk)
    entries = [TensorEntry(name, dtype, tuple(shape), arena, offset, size)
               for (name, dtype, shape), (arena, offset), size in zip(ordered, where, sizes)]
    return entries, arenas

"""The manifest: everything a client needs to turn arena file descriptors into tensors.

JSON on the wire: the fingerprint, the arenas (size, device), the tensors (name, dtype, shape,
arena, offset, nbytes, checksum) and tied-weight aliases (name -> name of the tensor it shares).
`Manifest.from_json` checks everything a client relies on before it builds a single view, so a
manifest from a buggy or hostile peer cannot make a client read outside an arena.

Checksums are computed with integer torch ops (see `checksum`), so the CPU and a GPU give the
same value and a GPU can checksum an arena without copying it to the host.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch

from .errors import ArenaError
from .fingerprint import Fingerprint

ALIGN = 256
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}
_CHUNK = 1 << 28   # bytes per checksum step (a multiple of _BLOCK)
_BLOCK = 4096


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    arena: int
    offset: int
    nbytes: int
    checksum: str = ""


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

    def to_dict(self) -> dict:
        """The JSON object `from_dict` reads back."""
        return {"fingerprint": self.fingerprint.to_dict(), "arenas": [asdict(a) for a in self.arenas],
                "tensors": [asdict(t) for t in self.tensors], "aliases": dict(self.aliases)}

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
                    tuple(TensorEntry(**{**t, "shape": tuple(t["shape"])}) for t in d["tensors"]),
                    dict(d["aliases"]))
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise ArenaError(f"manifest is malformed: {e}", "refill the cache (fast-start evict, then restart)") from None
        m.validate()
        return m

    def validate(self) -> None:
        """Every tensor lies inside its arena, aligned, with nbytes matching dtype and shape."""
        names = set()
        for t in self.tensors:
            if t.name in names or t.dtype not in DTYPES or not 0 <= t.arena < len(self.arenas):
                raise ArenaError(f"manifest entry {t.name!r} is duplicated, has an unknown dtype or arena",
                                 "refill the cache")
            names.add(t.name)
            if any(not isinstance(s, int) or s < 0 for s in t.shape) or nbytes(DTYPES[t.dtype], t.shape) != t.nbytes:
                raise ArenaError(f"manifest entry {t.name!r}: shape {t.shape} does not match {t.nbytes} bytes",
                                 "refill the cache")
            if t.offset % ALIGN or t.offset < 0 or t.offset + t.nbytes > self.arenas[t.arena].size:
                raise ArenaError(f"manifest entry {t.name!r} lies outside arena {t.arena} or is misaligned",
                                 "refill the cache")
        for alias, target in self.aliases.items():
            if target not in names or alias in names:
                raise ArenaError(f"manifest alias {alias!r} -> {target!r} is invalid", "refill the cache")


def nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    n = dtype.itemsize
    for s in shape:
        n *= s
    return n


def pack(outputs: list[tuple[str, torch.dtype, tuple[int, ...]]], arena_limit: int | None = None
         ) -> tuple[list[TensorEntry], list[int]]:
    """Place tensors one after another, 256-byte aligned; start a new arena past `arena_limit` bytes."""
    entries, sizes, cursor = [], [0], 0
    for name, dtype, shape in outputs:
        size = nbytes(dtype, shape)
        if arena_limit and cursor and cursor + size > arena_limit:
            sizes[-1], cursor = cursor, 0
            sizes.append(0)
        entries.append(TensorEntry(name, str(dtype).removeprefix("torch."), tuple(shape), len(sizes) - 1, cursor, size))
        cursor += -(-size // ALIGN) * ALIGN
    sizes[-1] = max(cursor, ALIGN)
    return entries, sizes


def checksum(t: torch.Tensor) -> str:
    """Device-independent checksum of a contiguous tensor's bytes.

    The bytes, zero-padded, are read as int64 words in blocks of 4 KiB; the result is the sum of
    all words and the sum of block sums weighted by block position (both mod 2**64). Integer
    sums wrap the same way on every device and in any order, so CPU and GPU agree, and one pass
    runs at memory speed. It detects corruption (stray writes, torn copies), not tampering.
    """
    b = t.detach().reshape(-1).view(torch.uint8)
    if b.data_ptr() % 8:
        b = b.clone()   # int64 views need 8-byte alignment
    s1 = s2 = 0
    for start in range(0, b.numel(), _CHUNK):
        c = b[start:start + _CHUNK]
        if c.numel() % _BLOCK:
            c = torch.cat([c, c.new_zeros(_BLOCK - c.numel() % _BLOCK)])
        blocks = c.view(torch.int64).view(-1, _BLOCK // 8).sum(1)
        first = start // _BLOCK + 1
        pos = torch.arange(first, first + blocks.numel(), dtype=torch.int64, device=blocks.device)
        s1 += int(blocks.sum())
        s2 += int((blocks * pos).sum())
    return f"{s1 % 2**64:016x}{s2 % 2**64:016x}"

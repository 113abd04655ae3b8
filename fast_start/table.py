"""The tensor table: a manifest's tensors as one fixed-width binary block, sent with each acquire.

Tensors lie in the arenas in runs: consecutive tensors of one dtype, shape and stride at a
constant step (fills place tensors of a shape together, so the 9,435 tensors of an MoE rank in
the `hf` layout are five runs). The table has one row per run, and an engine turns each row into
its tensors with one view and one `unbind` (`arena.from_table`): no Python object, check or
call per tensor. The daemon builds it once per cached model, from the manifest. Little-endian:

- header (28 bytes): magic `FST2`, then u32 each: tensors `n`, runs `r`, dimensions `d` (the
  largest rank), bytes of names `m`, CRC-32 of everything after the header, and 0;
- `r` rows of `7 + 2d` int64: count, step (bytes from one tensor to the next), offset of the
  first, nbytes, arena, dtype (index into `dtypes.TABLE`), rank, shape (`d` entries,
  zero-padded), stride in elements (`d` entries; the contiguous strides where the manifest gives
  none);
- the names of all tensors in run order, UTF-8, joined by NUL (`m` bytes).

Stdlib only: the daemon encodes without torch.
"""
from __future__ import annotations

import struct
import sys
import zlib
from array import array
from typing import TYPE_CHECKING

from . import dtypes
from .errors import ArenaError

if TYPE_CHECKING:
    from .manifest import Manifest

MAGIC = b"FST2"
HEADER = struct.Struct("<4sIIIIII")
FIXED = 7           # int64 columns before shape and stride
CODES = {d.name: i for i, d in enumerate(dtypes.TABLE)}
ITEMSIZES = tuple(d.itemsize for d in dtypes.TABLE)


def encode(manifest: "Manifest") -> bytes:
    """The table of `manifest`'s tensors: runs in the order they lie in the arenas."""
    entries = sorted(manifest.tensors, key=lambda t: (t.arena, t.offset))
    d = max((len(t.shape) for t in entries), default=0)
    runs: list[list] = []           # [count, step, offset, key]
    for t in entries:
        stride = t.stride or contiguous_stride(t.shape)
        pad = (0,) * (d - len(t.shape))
        key = (t.nbytes, t.arena, CODES[t.dtype], len(t.shape), *t.shape, *pad, *stride, *pad)
        last = runs[-1] if runs else None
        if last is not None and last[3] == key:
            step = t.offset - last[2] - (last[0] - 1) * last[1]
            if step > 0 and step % ITEMSIZES[key[2]] == 0 and (last[0] == 1 or step == last[1]):
                last[0] += 1
                last[1] = step
                continue
        runs.append([1, 0, t.offset, key])
    rows = array("q")
    for count, step, offset, key in runs:
        rows.extend((count, step, offset, *key))
    if sys.byteorder != "little":
        rows.byteswap()
    names = "\0".join(t.name for t in entries).encode()
    if names.count(b"\0") != max(len(entries) - 1, 0):
        raise ArenaError("a tensor name contains a NUL byte", "rename the tensor in the checkpoint")
    body = rows.tobytes() + names
    return HEADER.pack(MAGIC, len(entries), len(runs), d, len(names), zlib.crc32(body), 0) + body


def parse(data: bytes | bytearray) -> tuple[int, array, list[str]]:
    """(dimensions, the run rows as one flat array of ints, names) of a table whose header and
    checksum hold; the rows themselves are the reader's to check (`arena.from_table`)."""
    if len(data) < HEADER.size:
        raise ArenaError(f"tensor table of {len(data)} bytes is shorter than its header", "ask the daemon again")
    magic, n, r, d, m, crc, _ = HEADER.unpack_from(data)
    view = memoryview(data)[HEADER.size:]
    size = r * (FIXED + 2 * d) * 8
    if magic != MAGIC or len(view) != size + m or zlib.crc32(view) != crc:
        raise ArenaError("tensor table is damaged (magic, size or checksum)",
                         "ask the daemon again; if it persists, evict and refill the model")
    rows = array("q")
    rows.frombytes(view[:size])
    if sys.byteorder != "little":
        rows.byteswap()
    try:
        names = bytes(view[size:]).decode().split("\0") if n else []
    except UnicodeDecodeError:
        names = []
    counts = rows[::FIXED + 2 * d]
    if len(names) != n or sum(counts) != n or min(counts, default=1) < 1:
        raise ArenaError(f"tensor table has {len(names)} names for {n} tensors in runs of {list(counts[:8])}",
                         "evict and refill the model")
    return d, rows, names


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= size
    return tuple(stride[::-1])

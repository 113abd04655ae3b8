"""Arenas: the memory one model shard's tensors are packed into, held and shared as file descriptors.

On the CPU an arena is a `memfd`: written once with `pwrite`, then sealed (no write, grow or
shrink, and no further seals), so no process holding the fd, the daemon included, can change
the bytes a client has mapped. A client maps it read-only (`zero_copy`: writes through such a
tensor fault) and builds dtype views at the manifest's offsets. The mapping lives as long as the
last tensor that uses it. The fd is the capability: whoever holds it can read the weights, so
fds only travel over an authenticated Unix socket (`SCM_RIGHTS`).

The CUDA arena (`vmm.py`: VMM allocations exported as POSIX fds) has the same interface: a
writer with `size`, `device`, `write(offset, tensor)`, `finish() -> fd` and `abort()`, and a
read-only map of an fd as a flat uint8 tensor.
"""
from __future__ import annotations

import gc
import mmap
import os
import types
import warnings
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from . import cudadrv, dtypes, files, table
from .errors import ArenaError

if TYPE_CHECKING:
    from .manifest import Manifest

_WRITE_STEP = 1 << 26
_CHUNK = 1 << 28   # bytes per checksum step (a multiple of _BLOCK)
_BLOCK = 4096
# Every read-only map of this process, by address, while a tensor uses it: what `detach.py` makes
# the engine's own (an Imported object on a GPU, the mmap object on the CPU).
maps: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


class MemfdWriter:
    """Fills a new memfd of `size` bytes; `finish()` seals it and hands over the fd."""
    device = "cpu"

    def __init__(self, size: int, name: str):
        self.fd = files.memfd(f"fast-start:{name}")
        try:
            os.ftruncate(self.fd, size)
        except OSError as e:
            os.close(self.fd)
            raise ArenaError(f"cannot size a {size}-byte arena for {name}: {e}",
                             "free memory or lower the model's footprint") from None
        self.size, self.name = size, name

    def write(self, offset: int, tensor: torch.Tensor) -> None:
        assert tensor.is_contiguous() and offset + tensor.nbytes <= self.size
        data = memoryview(tensor.detach().cpu().reshape(-1).view(torch.uint8).numpy())
        done = 0
        while done < len(data):
            done += os.pwrite(self.fd, data[done:done + _WRITE_STEP], offset + done)

    def typed(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        """No place to write in: a memfd is written with `pwrite` (`write`)."""
        return None

    def finish(self) -> int:
        try:
            files.seal(self.fd)
        except OSError as e:
            raise ArenaError(f"cannot seal the arena of {self.name}: {e.strerror or e}",
                             "another process maps it writable, or the kernel held its pages: fill it "
                             "again (fast-start fill)") from None
        fd, self.fd = self.fd, -1
        return fd

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def create(size: int, device: str, name: str):
    """A writer for a new arena of at least `size` bytes on "cpu" or "cuda:N"."""
    if device == "cpu":
        return MemfdWriter(size, name)
    if device.startswith("cuda"):
        from . import vmm
        return vmm.VmmWriter(size, torch.device(device).index or 0, name)
    raise ArenaError(f"arena device {device!r} is unknown", 'use "cpu" or "cuda:N"')


class Written:
    """The arenas one rank is written into (`materialize`, an engine's export), as a context: each
    made in turn (`open`), written at offsets with the bytes done told to `progress(done, total)`,
    sealed in order (`seal`: `fds`); on an error every arena made, sealed or not, is discarded."""

    def __init__(self, label: str, device: str, total: int, progress=None):
        self.label, self.device, self.total, self.progress = label, device, total, progress
        self.made: list = []            # every writer, in order
        self.fds: list[int] = []        # the first len(fds) sealed
        self.done = 0

    def __enter__(self) -> "Written":
        return self

    def __exit__(self, kind, value, trace) -> None:
        if kind is not None:
            for fd in self.fds:
                os.close(fd)
            for w in self.made[len(self.fds):]:
                w.abort()

    def open(self, size: int):
        """A new arena of `size` bytes (its writer: `typed`, `view` where the device has them)."""
        self.made.append(create(size, self.device, f"{self.label}-{len(self.made)}"))
        return self.made[-1]

    def write(self, arena: int, offset: int, tensor: torch.Tensor) -> None:
        self.made[arena].write(offset, tensor)
        self.done += tensor.nbytes
        if self.progress:
            self.progress(self.done, self.total)

    def seal(self) -> None:
        """Seal every arena made and not sealed yet, in order."""
        for w in self.made[len(self.fds):]:
            self.fds.append(w.finish())


def map_readonly(fd: int, size: int, arena_device: str, device: torch.device) -> torch.Tensor:
    """Map an arena fd read-only as a flat uint8 tensor on `device`; the fd may be closed afterwards.

    `arena_device` is where the arena lives ("cpu" or a GPU UUID); it must be `device` itself.
    """
    if arena_device == "cpu" and device.type == "cpu":
        return _map_memfd(fd, size)
    if device.type == "cuda":
        ordinal = device.index if device.index is not None else torch.cuda.current_device()
        if cudadrv.device_uuid(ordinal) == arena_device:
            # torch keeps a reference to the Imported object for as long as any view of the tensor lives.
            imported = Imported(fd, size, ordinal, readonly=True)
            maps[imported.ptr] = imported
            return torch.as_tensor(imported, device=f"cuda:{ordinal}")
    raise ArenaError(f"arena on {arena_device} cannot be mapped on {device}",
                     "fetch on the device the daemon serves")


class Imported:
    """An arena fd imported and mapped on a GPU by an engine (`cudadrv`: no cuda-bindings import
    on the engine's start); unmapped when garbage-collected, i.e. when its last tensor view dies.

    Everything runs on the caller's thread: the engine's process is left with no thread of ours.
    A forked child inherits the object but not the mapping's CUDA state, so only the process that
    mapped it unmaps it.
    """

    def __init__(self, fd: int, size: int, ordinal: int, readonly: bool):
        self.size, self.ordinal, self.pid = size, ordinal, os.getpid()
        self.ptr = cudadrv.map_fd(fd, size, ordinal)
        try:
            cudadrv.set_access(self.ptr, size, ordinal, readonly)
        except BaseException:
            cudadrv.unmap(self.ptr, size)
            self.ptr = None
            raise
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (self.ptr, False),
                                         "version": 3}

    def __del__(self):
        if not getattr(self, "ptr", None) or self.pid != os.getpid() or not cudadrv.loaded():
            return
        try:
            torch.cuda.synchronize(self.ordinal)    # no kernel may still read what we unmap
            cudadrv.unmap(self.ptr, self.size)
        except Exception:       # noqa: BLE001 - at interpreter exit torch may be gone; the process's end unmaps
            pass
        self.ptr = None


def warm_ups(device: torch.device) -> Iterator[None]:
    """What a process's first views of arenas on `device` would do, one step per `next()`, for a
    fetch to run while the daemon answers: make a tensor from an array interface, a dtype view, a
    strided view and an `unbind` of a tiny tensor (torch's first call of each costs a fraction of
    a millisecond). A fetch stops when the reply arrives. Nothing it makes is kept."""
    try:
        probe = torch.empty(16, dtype=torch.uint8, device=device)
        yield
        if device.type == "cuda":
            probe = torch.as_tensor(types.SimpleNamespace(__cuda_array_interface__=probe.__cuda_array_interface__),
                                    device=device)
            yield
        probe = probe.view(torch.bfloat16)
        yield
        with torch.inference_mode():        # no step ends inside it: the caller's mode is never changed
            probe.as_strided((2, 2), (2, 1), 0).unbind(0)
    except Exception:       # a warm-up only: whatever failed here, the map itself does again and reports
        return


def _map_memfd(fd: int, size: int) -> torch.Tensor:
    if not files.sealed(fd):
        raise ArenaError("arena memfd is not sealed against writes", "refill the cache from a trusted daemon")
    if os.fstat(fd).st_size != size:
        raise ArenaError(f"arena has {os.fstat(fd).st_size} bytes, the manifest says {size}", "refill the cache")
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    with warnings.catch_warnings():
        # torch warns that the buffer is not writable: that is the point of a read-only map.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(mm, dtype=torch.uint8)
    maps[flat.data_ptr()] = mm
    return flat


def tensors(manifest: Manifest, fds: list[int], mode: str, device: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor of a manifest from its arena fds (which the caller keeps and may close)."""
    maps = map_arenas(fds, [(a.size, a.device) for a in manifest.arenas], mode, device)
    return from_table(table.encode(manifest), maps)


def map_arenas(fds: list[int], arenas: list[tuple[int, str]], mode: str, device: torch.device,
               close: bool = False) -> list[torch.Tensor]:
    """Each arena (size, device) from its fd as a flat uint8 tensor on `device`.

    `zero_copy`: read-only maps. `copy`: one device copy of each arena into memory the caller
    owns (one large copy runs at full bandwidth; per-tensor clones would not), each map dropped
    as soon as its copy is done, before the next arena is mapped. With `close`, each fd is
    closed (and its place in `fds` set to -1) as soon as its arena is mapped or copied: a copy
    then never holds more than one arena twice, where the daemon has let go of its fds.
    """
    if len(fds) != len(arenas):
        raise ArenaError(f"got {len(fds)} arena fds for {len(arenas)} arenas",
                         "ask the daemon again; the reply was incomplete")
    out = []
    for i, (size, where) in enumerate(arenas):
        flat = map_readonly(fds[i], size, where, device)
        if mode == "copy":
            # The map dies here: a GPU map is unmapped once the device is done with the copy
            # (`Imported.__del__`), before the next arena is mapped.
            flat = flat.clone()
        out.append(flat)
        if close:
            os.close(fds[i])
            fds[i] = -1
    return out


def from_table(data: bytes | bytearray, maps: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every tensor of a tensor table (`table.py`) as a view into the mapped arenas `maps`.

    One view per run (its tensors along a leading dimension), split with `unbind`. Each run is
    checked exactly (arena, dtype, shape against nbytes, alignment, its last element inside its
    arena) before its view is made, so a damaged or hostile table cannot make a view reach
    outside an arena.
    """
    d, rows, names = table.parse(data)
    width = table.FIXED + 2 * d
    typed: dict[tuple[int, int], torch.Tensor] = {}
    runs: list[tuple] = []          # (typed view, count, shape, stride, step, offset), in elements
    first = 0                       # the run's first tensor, in `names`
    for at in range(0, len(rows), width):
        count, step, offset, nbytes, arena, code, ndim = rows[at:at + table.FIXED]
        shape, stride = rows[at + table.FIXED:at + table.FIXED + ndim].tolist(), \
            rows[at + table.FIXED + d:at + table.FIXED + d + ndim].tolist()
        if not 0 <= code < len(table.ITEMSIZES):
            raise ArenaError(f"tensor table entry {names[first]!r} has an unknown dtype",
                             "use a fast-start client of the daemon's version")
        itemsize = table.ITEMSIZES[code]
        _check_run(names[first], offset, nbytes, arena, ndim, shape, stride, count, step, itemsize, d, maps)
        if (arena, code) not in typed:
            flat = maps[arena]
            typed[arena, code] = flat[:flat.numel() // itemsize * itemsize].view(
                dtypes.torch_dtype(dtypes.TABLE[code].name))
        runs.append((typed[arena, code], count, shape, stride, step // itemsize, offset // itemsize))
        first += count
    collecting = gc.isenabled()
    gc.disable()        # thousands of new tensors would start a full collection of the engine's heap
    try:
        out = dict(zip(names, _views(runs)))
    finally:
        if collecting:
            gc.enable()
    if len(out) != len(names):
        raise ArenaError("tensor table names a tensor twice", "evict and refill the model")
    return out


def _views(runs: list[tuple]) -> list[torch.Tensor]:
    tensors: list[torch.Tensor] = []
    # Strided views made in inference mode skip autograd's view tracking (about half of their
    # cost); of a normal tensor they are normal tensors, which may become Parameters or (in
    # copy mode) be written in place. The dtype views are made outside it (`from_table`): one
    # made in it would be an inference tensor, and so would every view of it.
    with torch.inference_mode():
        for view, count, shape, stride, step, offset in runs:
            if count == 1:
                tensors.append(view.as_strided(shape, stride, offset))
            else:
                tensors.extend(view.as_strided((count, *shape), (step, *stride), offset).unbind(0))
    return tensors


def _check_run(name: str, offset: int, nbytes: int, arena: int, ndim: int, shape: list[int], stride: list[int],
               count: int, step: int, itemsize: int, d: int, maps: list[torch.Tensor]) -> None:
    """Exact checks of one run (Python integers: no overflow); ArenaError naming its first tensor."""
    size = 1
    for s in shape:
        size *= s
    ok = 0 <= arena < len(maps) and 0 <= ndim <= d and min(shape + stride, default=0) >= 0 and count >= 1 \
        and size * itemsize == nbytes and offset >= 0 and offset % itemsize == 0 \
        and (count == 1 or (step > 0 and step % itemsize == 0))
    if ok:
        span = 0 if 0 in shape else (1 + sum((n - 1) * s for n, s in zip(shape, stride))) * itemsize
        ok = offset + (count - 1) * step + span <= maps[arena].numel()
    if not ok:
        raise ArenaError(f"tensor table entry {name!r} (and {count - 1} like it) does not fit its arena",
                         "evict and refill the model; use a fast-start client of the daemon's version")


def checksum(t: torch.Tensor) -> str:
    """Device-independent checksum of a tensor's bytes in row-major order (a view: of its copy).

    The bytes, zero-padded, are read as int64 words in blocks of 4 KiB; the result is the sum of
    all words and the sum of block sums weighted by block position (both mod 2**64). Integer
    sums wrap the same way on every device and in any order, so CPU and GPU agree, and one pass
    runs at memory speed. It detects corruption (stray writes, torn copies), not tampering.
    """
    b = t.detach().contiguous().reshape(-1).view(torch.uint8)
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

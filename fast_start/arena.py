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

import fcntl
import mmap
import os
import warnings

import torch

from . import dtypes
from .errors import ArenaError
from .manifest import Manifest, TensorEntry

_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL
_WRITE_STEP = 1 << 26
_CHUNK = 1 << 28   # bytes per checksum step (a multiple of _BLOCK)
_BLOCK = 4096


class MemfdWriter:
    """Fills a new memfd of `size` bytes; `finish()` seals it and hands over the fd."""
    device = "cpu"

    def __init__(self, size: int, name: str):
        self.fd = os.memfd_create(f"fast-start:{name}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
        except OSError as e:
            os.close(self.fd)
            raise ArenaError(f"cannot size a {size}-byte arena for {name}: {e}",
                             "free memory or lower the model's footprint") from None
        self.size = size

    def write(self, offset: int, tensor: torch.Tensor) -> None:
        assert tensor.is_contiguous() and offset + tensor.nbytes <= self.size
        data = memoryview(tensor.detach().cpu().reshape(-1).view(torch.uint8).numpy())
        done = 0
        while done < len(data):
            done += os.pwrite(self.fd, data[done:done + _WRITE_STEP], offset + done)

    def finish(self) -> int:
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)
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


def map_readonly(fd: int, size: int, arena_device: str, device: torch.device) -> torch.Tensor:
    """Map an arena fd read-only as a flat uint8 tensor on `device`; the fd may be closed afterwards.

    `arena_device` is where the arena lives ("cpu" or a GPU UUID); it must be `device` itself.
    """
    if arena_device == "cpu" and device.type == "cpu":
        return _map_memfd(fd, size)
    if device.type == "cuda":
        from . import vmm
        ordinal = device.index if device.index is not None else torch.cuda.current_device()
        if vmm.device_uuid(ordinal) == arena_device:
            return vmm.map_fd(fd, size, ordinal, readonly=True)
    raise ArenaError(f"arena on {arena_device} cannot be mapped on {device}",
                     "fetch on the device the daemon serves")


def _map_memfd(fd: int, size: int) -> torch.Tensor:
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    if seals & _SEALS != _SEALS:
        raise ArenaError("arena memfd is not sealed against writes", "refill the cache from a trusted daemon")
    if os.fstat(fd).st_size != size:
        raise ArenaError(f"arena has {os.fstat(fd).st_size} bytes, the manifest says {size}", "refill the cache")
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    with warnings.catch_warnings():
        # torch warns that the buffer is not writable: that is the point of a read-only map.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mm, dtype=torch.uint8)


def tensors(manifest: Manifest, fds: list[int], mode: str, device: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor of a manifest from its arena fds (which the caller keeps and may close).

    `zero_copy`: read-only views of the arenas. `copy`: one device copy of each arena into memory
    the caller owns (one large copy runs at full bandwidth; per-tensor clones would not), the
    mappings dropped as soon as the copy is done.
    """
    if len(fds) != len(manifest.arenas):
        raise ArenaError(f"got {len(fds)} arena fds for {len(manifest.arenas)} arenas",
                         "ask the daemon again; the reply was incomplete")
    maps = [map_readonly(fd, a.size, a.device, device) for fd, a in zip(fds, manifest.arenas, strict=True)]
    if mode == "copy":
        maps = [m.clone() for m in maps]
    out = {}
    for i, arena in enumerate(maps):
        out.update(views(arena, [e for e in manifest.tensors if e.arena == i]))
    return out


def views(arena: torch.Tensor, entries: list[TensorEntry]) -> dict[str, torch.Tensor]:
    """The tensors `entries` describe, as views into one mapped arena.

    One typed view of the whole arena per dtype, then one `as_strided` per tensor: a model has
    hundreds of tensors and this runs on every engine start.
    """
    typed: dict[str, torch.Tensor] = {}
    out = {}
    for e in entries:
        dtype = dtypes.torch_dtype(e.dtype)
        if e.dtype not in typed:
            usable = arena.numel() // dtype.itemsize * dtype.itemsize
            typed[e.dtype] = arena[:usable].view(dtype)
        stride = e.stride or contiguous_stride(e.shape)
        out[e.name] = typed[e.dtype].as_strided(e.shape, stride, e.offset // dtype.itemsize)
    return out


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= size
    return tuple(stride[::-1])


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

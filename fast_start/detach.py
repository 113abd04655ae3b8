"""A zero_copy engine's read-only maps made its own writable memory, at the same addresses.

An engine feature that writes its weights in place (vLLM's `reload_weights`) would fault on the
daemon's read-only maps, and must never write the cache. `detach` copies each map that one of
the given tensors lies in into memory the process owns and puts that memory where the map was:
every view, and every pointer a CUDA graph captured, stays valid and now reads and writes the
engine's own copy. It costs the maps' size in the engine's memory; a GPU without room for it
says so, and nothing changes. On the CPU the copy is an anonymous mapping moved over the map
(`mremap`); on a GPU a new allocation mapped in its place (`cudadrv.own`).
"""
from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Iterable

import torch

from . import arena, cudadrv
from .errors import ArenaError

_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2
_libc = None


def detach(tensors: Iterable[torch.Tensor]) -> int:
    """Make every read-only arena map any of `tensors` lies in this process's own; the bytes made so."""
    spans = list(arena.maps.items())
    hit: dict[int, object] = {}
    for t in tensors:
        p = t.data_ptr()
        for address, holder in spans:
            if address <= p < address + _size(holder):
                hit[address] = holder
    for address, holder in sorted(hit.items()):
        if isinstance(holder, arena.Imported):
            with torch.cuda.device(holder.ordinal):
                torch.cuda.synchronize()        # nothing may read the range while it is swapped
                cudadrv.own(address, holder.size, holder.ordinal)
        else:
            _own_host(address, len(holder))
        del arena.maps[address]
    return sum(_size(h) for h in hit.values())


def _size(holder) -> int:
    return holder.size if isinstance(holder, arena.Imported) else len(holder)


def _own_host(address: int, size: int) -> None:
    """An anonymous private mapping with the map's bytes, moved over it: the old map is gone, its
    mmap object unmaps the new one when the last view of it dies."""
    libc = _c()
    tmp = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if tmp in (None, ctypes.c_void_p(-1).value):
        raise ArenaError(f"cannot map {size / 2**30:.2f} GiB for a copy of the weights mapped from the daemon "
                         f"({os.strerror(ctypes.get_errno())})", "free host memory, or load the engine with mode copy")
    ctypes.memmove(tmp, address, size)
    if libc.mremap(tmp, size, size, _MREMAP_MAYMOVE | _MREMAP_FIXED, address) != address:
        err = ctypes.get_errno()
        libc.munmap(tmp, size)
        raise ArenaError(f"cannot move a copy over the map at {address:#x}: {os.strerror(err)}",
                         "load the engine with mode copy")


def _c():
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.mremap.restype = ctypes.c_void_p
        libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc = libc
    return _libc

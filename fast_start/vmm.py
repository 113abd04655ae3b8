"""CUDA arenas: VMM allocations shared as POSIX file descriptors (extra `cuda` = cuda-bindings).

The fill worker (which has a CUDA context) creates each arena with `cuMemCreate` at the
recommended granularity, maps it read-write, fills it, exports it with
`cuMemExportToShareableHandle` and drops its own handle and mapping: from then on only the fd
keeps the memory alive. The daemon holds fds and never creates a context (asking for the GPU's
UUID needs `cuInit` only). A client imports the fd, reserves an address range, maps it and
sets the access read-only for `zero_copy`, so a stray write fails loudly (illegal address)
instead of corrupting the cache; the tensor wrapping the mapping unmaps it when the last view
of it is gone. The client imports and maps through `arena.Imported` and `cudadrv` (ctypes): an
engine's start never imports cuda-bindings.
"""
from __future__ import annotations

import math

import torch

from . import gpus
from .errors import ArenaError
from .gpus import check as _check
from .gpus import device_uuid, driver


def _prop(ordinal: int):
    drv = driver()
    p = drv.CUmemAllocationProp()
    p.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    p.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    p.location.id = ordinal
    p.requestedHandleTypes = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    return p


def _access(ordinal: int, readonly: bool):
    drv = driver()
    a = drv.CUmemAccessDesc()
    a.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    a.location.id = ordinal
    a.flags = (drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ if readonly
               else drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
    return a


def granularity(ordinal: int) -> int:
    drv = driver()
    flag = drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    return int(_check(drv.cuMemGetAllocationGranularity(_prop(ordinal), flag), "cuMemGetAllocationGranularity"))


class Mapping:
    """A mapped VMM range; unmapped when garbage-collected (i.e. when its last tensor view dies)."""

    def __init__(self, handle, size: int, ordinal: int, readonly: bool):
        drv = driver()
        self.size, self.ordinal = size, ordinal
        self.ptr = _check(drv.cuMemAddressReserve(size, 0, 0, 0), "cuMemAddressReserve")
        try:
            _check(drv.cuMemMap(self.ptr, size, 0, handle, 0), "cuMemMap")
            _check(drv.cuMemSetAccess(self.ptr, size, [_access(ordinal, readonly)], 1), "cuMemSetAccess")
        except ArenaError:
            drv.cuMemAddressFree(self.ptr, size)
            raise
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (int(self.ptr), False),
                                         "version": 3}

    def tensor(self) -> torch.Tensor:
        # torch keeps a reference to this object for as long as any view of the tensor lives.
        return torch.as_tensor(self, device=f"cuda:{self.ordinal}")

    def __del__(self):
        drv = gpus.loaded()
        if drv is None or not getattr(self, "ptr", None):
            return
        torch.cuda.synchronize(self.ordinal)    # no kernel may still read what we unmap
        drv.cuMemUnmap(self.ptr, self.size)
        drv.cuMemAddressFree(self.ptr, self.size)
        self.ptr = None


class VmmWriter:
    """Creates one VMM allocation on GPU `ordinal`, fills it, and hands it over as an fd."""

    def __init__(self, size: int, ordinal: int, name: str):
        drv = driver()
        gran = granularity(ordinal)
        self.size = -(-size // gran) * gran
        self.ordinal, self.name = ordinal, name
        self.device = device_uuid(ordinal)
        self.handle = _check(drv.cuMemCreate(self.size, _prop(ordinal), 0), f"cuMemCreate({self.size}) for {name}")
        self.mapping = Mapping(self.handle, self.size, ordinal, readonly=False)
        self.view = self.mapping.tensor()

    def write(self, offset: int, tensor: torch.Tensor) -> None:
        assert tensor.is_contiguous() and offset + tensor.nbytes <= self.size
        dst = self.view[offset:offset + tensor.nbytes]
        if dst.data_ptr() != tensor.data_ptr():       # not staged in place (`typed`)
            dst.copy_(tensor.reshape(-1).view(torch.uint8), non_blocking=True)

    def typed(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The arena's bytes at `offset` as a tensor of `shape` and `dtype`, to be written in place."""
        n = math.prod(shape) * dtype.itemsize
        assert offset % dtype.itemsize == 0 and offset + n <= self.size
        return self.view[offset:offset + n].view(dtype).view(shape)

    def finish(self) -> int:
        drv = driver()
        torch.cuda.synchronize(self.ordinal)
        fd = int(_check(drv.cuMemExportToShareableHandle(
            self.handle, drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
            "cuMemExportToShareableHandle"))
        self.abort()
        return fd

    def abort(self) -> None:
        """Drop our mapping and handle; an exported fd (if any) keeps the memory alive."""
        if self.handle is None:
            return
        self.view = None
        self.mapping = None             # unmaps
        driver().cuMemRelease(self.handle)
        self.handle = None

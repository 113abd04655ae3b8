"""The engine's few CUDA driver calls, through ctypes: name the GPU, import and map an arena fd,
make a mapped range the process's own (`own`), and reserve an address range whose memory comes
and goes (`reserve`, `create`, `map_handle`: a standby's KV cache, `plugins/vllm/standby_kv.py`).

The engine side runs these on every start. `cuda-bindings` (which the daemon and the fill worker
use, `gpus.py` and `vmm.py`) takes longer to import than a whole fetch may (BENCHMARKS.md);
`libcuda.so.1` is already loaded by the engine's torch, and these few calls have plain C
signatures. Every call's result is checked; an error names the call and its code.
"""
from __future__ import annotations

import ctypes

from .errors import ArenaError
from .gpus import uuid_text

_HANDLE_FD = 1              # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
_LOCATION_DEVICE = 1        # CU_MEM_LOCATION_TYPE_DEVICE
_READ, _READ_WRITE = 1, 3   # CU_MEM_ACCESS_FLAGS_PROT_READ, _READWRITE

_u64, _size, _int = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int


class _AccessDesc(ctypes.Structure):       # CUmemAccessDesc: a CUmemLocation, then the flags
    _fields_ = [("type", _int), ("id", _int), ("flags", _int)]


class _AllocProp(ctypes.Structure):        # CUmemAllocationProp: pinned device memory, no handle type
    _fields_ = [("type", _int), ("handle_types", _int), ("location_type", _int), ("location_id", _int),
                ("win32_metadata", ctypes.c_void_p), ("compression", ctypes.c_ubyte),
                ("rdma", ctypes.c_ubyte), ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


_SIGNATURES = {
    "cuInit": [ctypes.c_uint],
    "cuDeviceGet": [ctypes.POINTER(_int), _int],
    "cuDeviceGetCount": [ctypes.POINTER(_int)],
    "cuDeviceGetUuid_v2": [ctypes.POINTER(ctypes.c_char), _int],
    "cuDeviceTotalMem_v2": [ctypes.POINTER(_size), _int],
    "cuMemImportFromShareableHandle": [ctypes.POINTER(_u64), ctypes.c_void_p, _int],
    "cuMemAddressReserve": [ctypes.POINTER(_u64), _size, _size, _u64, _u64],
    "cuMemMap": [_u64, _size, _size, _u64, _u64],
    "cuMemSetAccess": [_u64, _size, ctypes.POINTER(_AccessDesc), _size],
    "cuMemRelease": [_u64],
    "cuMemUnmap": [_u64, _size],
    "cuMemAddressFree": [_u64, _size],
    "cuMemCreate": [ctypes.POINTER(_u64), _size, ctypes.POINTER(_AllocProp), ctypes.c_ulonglong],
    "cuMemcpyDtoD_v2": [_u64, _u64, _size],
    "cuCtxSynchronize": [],
    "cuMemGetAllocationGranularity": [ctypes.POINTER(_size), ctypes.POINTER(_AllocProp), _int],
    "cuMemsetD8_v2": [_u64, ctypes.c_ubyte, _size],
}
_OUT_OF_MEMORY = 2          # CUDA_ERROR_OUT_OF_MEMORY
_INVALID_DEVICE = 101       # CUDA_ERROR_INVALID_DEVICE
_lib = None
_uuids: dict[int, str] = {}


def _driver():
    global _lib
    if _lib is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise ArenaError(f"cannot load the CUDA driver (libcuda.so.1): {e}", "install the NVIDIA driver") from None
        for name, args in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, _int
        _check(lib.cuInit(0), "cuInit")
        _lib = lib
    return _lib


def _check(code: int, what: str) -> None:
    if code:
        raise ArenaError(f"{what} failed: CUDA driver error {code}", "check the GPU, its driver and free memory")


def _device(ordinal: int) -> int:
    """The driver's handle of GPU `ordinal`; one the driver does not see is named with those it does."""
    lib, dev, count = _driver(), _int(), _int()
    code = lib.cuDeviceGet(ctypes.byref(dev), ordinal)
    if code == _INVALID_DEVICE:
        _check(lib.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount")
        seen = f"GPUs 0 to {count.value - 1}" if count.value > 1 else "GPU 0" if count.value else "no GPU"
        raise ArenaError(f"there is no GPU {ordinal} here: the CUDA driver sees {seen}",
                         "name a GPU this machine has in the model's gpus (CUDA_VISIBLE_DEVICES renumbers them)")
    _check(code, f"cuDeviceGet({ordinal})")
    return dev.value


def device_uuid(ordinal: int) -> str:
    """The GPU's UUID ("GPU-xxxxxxxx-…") for a CUDA ordinal, as `gpus.device_uuid` names it (asked
    once per ordinal: a process's ordinals do not change)."""
    if ordinal not in _uuids:
        raw = (ctypes.c_char * 16)()
        _check(_driver().cuDeviceGetUuid_v2(raw, _device(ordinal)), "cuDeviceGetUuid_v2")
        _uuids[ordinal] = uuid_text(bytes(raw))
    return _uuids[ordinal]


def total_memory(ordinal: int) -> int:
    """The GPU's memory in bytes, for a CUDA ordinal."""
    size = _size()
    _check(_driver().cuDeviceTotalMem_v2(ctypes.byref(size), _device(ordinal)), "cuDeviceTotalMem_v2")
    return size.value


def map_fd(fd: int, size: int, ordinal: int) -> int:
    """Import an arena fd and map all `size` bytes of it on GPU `ordinal`; the address. No access
    is set yet (`set_access`): the range can be named but not read. The fd may be closed
    afterwards: the mapping holds the memory until `unmap`."""
    lib, handle, ptr = _driver(), _u64(), _u64()
    _check(lib.cuMemImportFromShareableHandle(ctypes.byref(handle), ctypes.c_void_p(fd), _HANDLE_FD),
           "cuMemImportFromShareableHandle")
    try:
        _check(lib.cuMemAddressReserve(ctypes.byref(ptr), size, 0, 0, 0), "cuMemAddressReserve")
        try:
            _check(lib.cuMemMap(ptr, size, 0, handle, 0), "cuMemMap")
        except ArenaError:
            lib.cuMemAddressFree(ptr, size)
            raise
    finally:
        lib.cuMemRelease(handle)            # the mapping holds the memory from here on
    return ptr.value


def set_access(ptr: int, size: int, ordinal: int, readonly: bool) -> None:
    """Let GPU `ordinal` read (and unless `readonly`, write) a mapped range. Its time grows with the
    size, the rest of a map's does not; ctypes lets other Python threads run meanwhile."""
    access = _AccessDesc(_LOCATION_DEVICE, ordinal, _READ if readonly else _READ_WRITE)
    _check(_driver().cuMemSetAccess(ptr, size, ctypes.byref(access), 1), "cuMemSetAccess")


def unmap(ptr: int, size: int) -> None:
    lib = _driver()
    _check(lib.cuMemUnmap(ptr, size), "cuMemUnmap")
    _check(lib.cuMemAddressFree(ptr, size), "cuMemAddressFree")


def _pinned(ordinal: int) -> _AllocProp:
    return _AllocProp(1, 0, _LOCATION_DEVICE, ordinal)     # CU_MEM_ALLOCATION_TYPE_PINNED


def granularity(ordinal: int) -> int:
    """The size every `create`, `map_handle` and `reserve` on GPU `ordinal` is a multiple of."""
    size = _size()
    _check(_driver().cuMemGetAllocationGranularity(ctypes.byref(size), ctypes.byref(_pinned(ordinal)), 0),
           "cuMemGetAllocationGranularity")
    return size.value


def reserve(size: int) -> int:
    """An address range of `size` bytes with nothing mapped; it lasts as long as the process."""
    ptr = _u64()
    _check(_driver().cuMemAddressReserve(ctypes.byref(ptr), size, 0, 0, 0), "cuMemAddressReserve")
    return ptr.value


def create(size: int, ordinal: int, what: str) -> int:
    """A handle to `size` new bytes of GPU `ordinal`; ArenaError naming `what` when it has no room."""
    handle = _u64()
    code = _driver().cuMemCreate(ctypes.byref(handle), size, ctypes.byref(_pinned(ordinal)), 0)
    if code == _OUT_OF_MEMORY:
        raise ArenaError(f"GPU {ordinal} has no room for {what} ({size / 2**30:.2f} GiB)",
                         "end what else holds the GPU's memory, or lower gpu_memory_utilization")
    _check(code, "cuMemCreate")
    return handle.value


def map_handle(ptr: int, size: int, handle: int, ordinal: int) -> None:
    """Map `size` bytes of `handle`'s memory (from its start) at `ptr`, readable and writable."""
    _check(_driver().cuMemMap(ptr, size, 0, handle, 0), "cuMemMap")
    set_access(ptr, size, ordinal, readonly=False)


def release(handle: int) -> None:
    """Drop the handle: its memory lives on in its mappings, and goes with the last of them."""
    _check(_driver().cuMemRelease(handle), "cuMemRelease")


def unmap_only(ptr: int, size: int) -> None:
    """Unmap one mapping, keeping its address range reserved."""
    _check(_driver().cuMemUnmap(ptr, size), "cuMemUnmap")


def zero(ptr: int, size: int) -> None:
    lib = _driver()
    _check(lib.cuMemsetD8_v2(ptr, 0, size), "cuMemsetD8")
    _check(lib.cuCtxSynchronize(), "cuCtxSynchronize")


def own(ptr: int, size: int, ordinal: int) -> None:
    """Make the range mapped at `ptr` this process's own writable memory with the same bytes, at
    the same address (every pointer into it, a CUDA graph's too, stays valid): a new allocation
    is filled from the range through a second mapping, then mapped in its place. The caller's
    context must be current and nothing may be running that reads the range. ArenaError naming
    the shortfall when the GPU has no room for `size` more bytes; the range is unchanged then."""
    lib, handle, tmp = _driver(), _u64(), _u64()
    code = lib.cuMemCreate(ctypes.byref(handle), size, ctypes.byref(_pinned(ordinal)), 0)
    if code == _OUT_OF_MEMORY:
        raise ArenaError(f"GPU {ordinal} has no room for a {size / 2**30:.2f} GiB copy of the weights mapped from "
                         "the daemon", "load the engine with mode copy, or leave that much of the GPU free")
    _check(code, "cuMemCreate")
    try:
        _check(lib.cuMemAddressReserve(ctypes.byref(tmp), size, 0, 0, 0), "cuMemAddressReserve")
        try:
            _check(lib.cuMemMap(tmp, size, 0, handle, 0), "cuMemMap")
            try:
                set_access(tmp.value, size, ordinal, readonly=False)
                _check(lib.cuMemcpyDtoD_v2(tmp, ptr, size), "cuMemcpyDtoD")
                _check(lib.cuCtxSynchronize(), "cuCtxSynchronize")
            finally:
                lib.cuMemUnmap(tmp, size)
        finally:
            lib.cuMemAddressFree(tmp, size)
        _check(lib.cuMemUnmap(ptr, size), "cuMemUnmap")
        _check(lib.cuMemMap(ptr, size, 0, handle, 0), "cuMemMap")
        set_access(ptr, size, ordinal, readonly=False)
    finally:
        lib.cuMemRelease(handle)            # the mapping at `ptr` holds it from here on


def loaded() -> bool:
    return _lib is not None

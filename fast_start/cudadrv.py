"""The engine's few CUDA driver calls, through ctypes: name the GPU, import and map an arena fd.

The engine side runs these on every start. `cuda-bindings` (which the daemon and the fill worker
use, `gpus.py` and `vmm.py`) takes 36 ms to import on the H200 machine, more than the whole
fetch may; `libcuda.so.1` is already loaded by the engine's torch, and these nine calls have
plain C signatures. Every call's result is checked; an error names the call and its code.
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


_SIGNATURES = {
    "cuInit": [ctypes.c_uint],
    "cuDeviceGet": [ctypes.POINTER(_int), _int],
    "cuDeviceGetUuid_v2": [ctypes.POINTER(ctypes.c_char), _int],
    "cuMemImportFromShareableHandle": [ctypes.POINTER(_u64), ctypes.c_void_p, _int],
    "cuMemAddressReserve": [ctypes.POINTER(_u64), _size, _size, _u64, _u64],
    "cuMemMap": [_u64, _size, _size, _u64, _u64],
    "cuMemSetAccess": [_u64, _size, ctypes.POINTER(_AccessDesc), _size],
    "cuMemRelease": [_u64],
    "cuMemUnmap": [_u64, _size],
    "cuMemAddressFree": [_u64, _size],
}
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


def device_uuid(ordinal: int) -> str:
    """The GPU's UUID ("GPU-xxxxxxxx-…") for a CUDA ordinal, as `gpus.device_uuid` names it (asked
    once per ordinal: a process's ordinals do not change)."""
    if ordinal not in _uuids:
        lib, dev, raw = _driver(), _int(), (ctypes.c_char * 16)()
        _check(lib.cuDeviceGet(ctypes.byref(dev), ordinal), f"cuDeviceGet({ordinal})")
        _check(lib.cuDeviceGetUuid_v2(raw, dev), "cuDeviceGetUuid_v2")
        _uuids[ordinal] = uuid_text(bytes(raw))
    return _uuids[ordinal]


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
    size (0.2 ms for 4 GiB, 0.8 ms for 32 GiB on an H200), the rest of a map's does not; ctypes
    lets other Python threads run meanwhile."""
    access = _AccessDesc(_LOCATION_DEVICE, ordinal, _READ if readonly else _READ_WRITE)
    _check(_driver().cuMemSetAccess(ptr, size, ctypes.byref(access), 1), "cuMemSetAccess")


def unmap(ptr: int, size: int) -> None:
    lib = _driver()
    _check(lib.cuMemUnmap(ptr, size), "cuMemUnmap")
    _check(lib.cuMemAddressFree(ptr, size), "cuMemAddressFree")


def loaded() -> bool:
    return _lib is not None

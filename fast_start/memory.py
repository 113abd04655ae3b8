"""Device memory as the daemon sees it, without a CUDA context: what is free for a fill or a copy.

A GPU's free and total memory come from NVML (`libnvidia-ml.so.1`, which the driver installs;
asked by UUID, as the daemon names its GPU), the whole device's, every process's use counted; the
CPU's from /proc/meminfo (`MemAvailable`), where memfd arenas live. `None` where it cannot be
told (no NVML): the checks that use it are then skipped, with one warning.
"""
from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass

from .errors import NoRoom

log = logging.getLogger("fast_start.daemon")

GIB = 2**30
_nvml = None
_warned: set[str] = set()


@dataclass(frozen=True)
class Memory:
    total: int
    free: int


class _Info(ctypes.Structure):          # nvmlMemory_t
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def _library():
    global _nvml
    if _nvml is None:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        if lib.nvmlInit_v2():
            raise OSError("nvmlInit_v2 failed")
        _nvml = lib
    return _nvml


def of(device: str) -> Memory | None:
    """`device` ("cpu", or a GPU's UUID) now; None where it cannot be told."""
    if device == "cpu":
        return _host()
    try:
        lib, handle, info = _library(), ctypes.c_void_p(), _Info()
        if lib.nvmlDeviceGetHandleByUUID(device.encode(), ctypes.byref(handle)) or \
                lib.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(info)):
            raise OSError(f"NVML cannot read {device}'s memory")
    except (OSError, AttributeError) as e:
        if device not in _warned:
            _warned.add(device)
            log.warning("cannot tell %s's free memory (%s): fills and copies are not checked against it", device, e)
        return None
    return Memory(info.total, info.free)


class _Process(ctypes.Structure):       # nvmlProcessInfo_v2_t
    _fields_ = [("pid", ctypes.c_uint), ("used", ctypes.c_ulonglong), ("gpu_instance", ctypes.c_uint),
                ("compute_instance", ctypes.c_uint)]


_MOST_PROCESSES = 256
_NOT_AVAILABLE = 2**64 - 1              # NVML_VALUE_NOT_AVAILABLE


def by_process(device: str) -> dict[int, int]:
    """The GPU memory each process with a CUDA context on `device` (a GPU's UUID) uses, by pid as
    NVML tells them; empty where it cannot be told (the CPU, no NVML, another pid namespace's pids
    do not match ours)."""
    if device == "cpu":
        return {}
    try:
        lib, handle = _library(), ctypes.c_void_p()
        count, found = ctypes.c_uint(_MOST_PROCESSES), (_Process * _MOST_PROCESSES)()
        if lib.nvmlDeviceGetHandleByUUID(device.encode(), ctypes.byref(handle)) or \
                lib.nvmlDeviceGetComputeRunningProcesses_v2(handle, ctypes.byref(count), found):
            return {}
    except (OSError, AttributeError):
        return {}
    return {p.pid: p.used for p in found[:count.value] if p.used != _NOT_AVAILABLE}


def _host() -> Memory | None:
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return Memory(int(fields["MemTotal"].split()[0]) * 1024, int(fields["MemAvailable"].split()[0]) * 1024)
    except (OSError, KeyError, ValueError):
        return None


def fill_need(nbytes: int, device: str) -> int:
    """What filling a model of `nbytes` takes at its peak: the model and one arena chunk (vLLM's
    fill), the fill worker's CUDA context, processing's temporaries; 10 %, at least 2 GiB on a GPU."""
    return nbytes + max(nbytes // 10, 0 if device == "cpu" else 2 * GIB)


def room_for(name: str, nbytes: int, device: str, gpu: int, keep_free: int) -> NoRoom | None:
    """The shortfall (NoRoom, not raised) where `device`'s free memory, less `keep_free`, cannot
    hold the fill of `name` (`nbytes` of weights) at its peak (`fill_need`); None where it can or
    free memory cannot be told."""
    now = of(device)
    if now is None:
        return None
    need, room = fill_need(nbytes, device), now.free - keep_free
    if need <= room:
        return None
    return NoRoom(f"{name} needs {gib(need)} of {where(device, gpu)} to fill ({gib(nbytes)} of weights); "
                  f"{gib(now.free)} is free and keep_free leaves {gib(keep_free)} of it to engines: "
                  f"{gib(need - room)} short", "free that much (stop an engine or evict a model), or lower "
                  "keep_free; the daemon tries again meanwhile", need - room)


def where(device: str, gpu: int) -> str:
    """How messages name the memory of a daemon's device ("cpu" or "cuda", or a GPU's UUID)."""
    return "host memory" if device == "cpu" else f"GPU {gpu}"


def gib(n: int) -> str:
    """Bytes for people, in the unit that suits them ("17.26 GiB", "2.15 MiB"; negative: "-0.50 GiB")."""
    from .config import format_bytes
    return format_bytes(n) if n >= 0 else "-" + format_bytes(-n)


def device_total(device: str, gpu: int) -> int:
    """Total memory of the daemon's device ("cpu": the host's; else GPU `gpu`, asked of the driver)."""
    if device == "cpu":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    from .cudadrv import total_memory
    return total_memory(gpu)


def keep_free(daemon, gpu: int) -> int:
    """`[daemon] keep_free` in bytes (a share of the device's memory where it is one)."""
    from .config import parse_bytes
    text = daemon.keep_free
    return parse_bytes(text, device_total(daemon.device, gpu) if text.strip().endswith("%") else None)

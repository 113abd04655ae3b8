"""GPUs through the CUDA driver API (`cuda-bindings`, extra `cuda`), without a context or torch.

The daemon names the GPU it serves by UUID and sizes its budget from the GPU's memory; neither
needs more than `cuInit`, so the serving process never holds a CUDA context.
"""
from __future__ import annotations

from .errors import ArenaError

_drv = None


def driver():
    """cuda.bindings.driver, initialised once; an ArenaError when it is not installed."""
    global _drv
    if _drv is None:
        try:
            from cuda.bindings import driver as drv
        except ImportError:
            raise ArenaError("CUDA arenas need cuda-bindings in the fill worker's environment",
                             "pip install cuda-bindings there (fast-start's [cuda] extra)") from None
        check(drv.cuInit(0), "cuInit")
        _drv = drv
    return _drv


def loaded():
    """The driver module if `driver()` has run (for finalizers that must not initialise it)."""
    return _drv


def check(result, what: str):
    err = result[0] if isinstance(result, tuple) else result
    if int(err) != 0:
        raise ArenaError(f"{what} failed: {err}", "check the GPU, its driver and free memory")
    if isinstance(result, tuple):
        return result[1] if len(result) == 2 else result[1:]
    return None


def device_uuid(ordinal: int) -> str:
    """The GPU's UUID ("GPU-xxxxxxxx-…") for a CUDA ordinal, without creating a context."""
    drv = driver()
    dev = check(drv.cuDeviceGet(ordinal), f"cuDeviceGet({ordinal})")
    get = getattr(drv, "cuDeviceGetUuid_v2", None) or drv.cuDeviceGetUuid
    return uuid_text(bytes(check(get(dev), "cuDeviceGetUuid").bytes))


def uuid_text(raw: bytes) -> str:
    """A GPU's 16 UUID bytes as nvidia-smi writes them: "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"."""
    b = raw.hex()
    return f"GPU-{b[:8]}-{b[8:12]}-{b[12:16]}-{b[16:20]}-{b[20:]}"

"""A standby's KV cache: its addresses from the start, memory of its own only while it serves.

A standby (`fast_start.standby`) starts while the serving engine holds the GPU: there is no room
for a second KV cache beside the first, and a standby needs none until it serves. Under the
standby's supervisor (which sets `STARTS_AS` in each engine it forks) the workers' KV cache
buffers are made here instead of by torch, each as vLLM sizes and shares them: an address range
reserved for the process's life, backed by memory of its own while the engine serves, and
otherwise by one small block mapped over the whole range again and again. An engine forked as
the standby starts on the small block: its warm-up and CUDA graph capture write there, and no
request ever reads it. Waking backs every range with zeroed memory of its own (vLLM's KV cache
starts zeroed), sleeping goes back to the block and returns the memory to the GPU. The addresses
never change, so the graphs captured at start stay valid. vLLM's start-up check is made for the
engine that will serve: a standby's is left to its wake (`unchecked`), when the serving engine
is gone.
"""
from __future__ import annotations

import copy
import logging
import os
import time
import types

import torch

from ... import cudadrv
from ...standby import STANDBY, STARTS_AS

log = logging.getLogger("vllm.fast_start")      # vLLM's processes print its loggers' records

BLOCK = 64 << 20                        # the small block a light range maps again and again

_ranges: list["Range"] = []
_blocks: dict[int, int] = {}            # GPU ordinal -> the small block's handle
_placing = False                        # whether this vLLM's KV cache allocation is placed here


def standby() -> bool:
    """Whether this engine was forked as the standby and its KV cache starts light (this vLLM's
    allocation is one `wrap_allocation` places)."""
    return _placing and os.environ.get(STARTS_AS) == STANDBY


class Range:
    """One KV cache buffer of `size` bytes at a fixed address on GPU `ordinal`, light or backed."""

    def __init__(self, size: int, ordinal: int, light: bool):
        grain = cudadrv.granularity(ordinal)
        self.size, self.ordinal = -(-size // grain) * grain, ordinal
        # The driver maps whole allocations (on an H100, laying the block over a range whose last
        # piece took part of it failed: CUDA_ERROR_NOT_SUPPORTED): the range spans whole blocks,
        # of which a backed range maps its first `size` bytes.
        self.ptr = cudadrv.reserve(-(-self.size // BLOCK) * BLOCK)
        self.mapped: list[tuple[int, int]] = []     # (address, bytes) of each mapping
        self.backed = False
        self.lighten() if light else self.back()
        interface = {"shape": (size,), "typestr": "|i1", "data": (self.ptr, False), "version": 3}
        self.tensor = torch.as_tensor(types.SimpleNamespace(__cuda_array_interface__=interface),
                                      device=torch.device("cuda", ordinal))

    def back(self) -> None:
        """Memory of its own, zeroed; the range as it was where the GPU has no room (ArenaError).
        A map that fails after the unmap leaves the range unmapped: `back` or `lighten` maps it again."""
        if self.backed:
            return
        handle = cudadrv.create(self.size, self.ordinal, "the engine's KV cache")
        try:
            self._unmap()
            cudadrv.map_handle(self.ptr, self.size, handle, self.ordinal)
        finally:
            cudadrv.release(handle)
        self.mapped, self.backed = [(self.ptr, self.size)], True
        cudadrv.zero(self.ptr, self.size)

    def lighten(self) -> None:
        """The small block over the whole range: its own memory, if any, goes back to the GPU."""
        if self.mapped and not self.backed:
            return
        block = _block(self.ordinal)
        self._unmap()
        for offset in range(0, self.size, BLOCK):
            cudadrv.map_handle(self.ptr + offset, BLOCK, block, self.ordinal)
            self.mapped.append((self.ptr + offset, BLOCK))
        self.backed = False

    def _unmap(self) -> None:
        while self.mapped:
            cudadrv.unmap_only(*self.mapped.pop())


def _block(ordinal: int) -> int:
    if ordinal not in _blocks:
        _blocks[ordinal] = cudadrv.create(BLOCK, ordinal, "a standby's placeholder block")
    return _blocks[ordinal]


def placed(sized: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """vLLM's KV buffers, which it sized (on `meta`) and shared out by layer, on ranges of their own:
    light where this engine is the standby, else backed."""
    ordinal = device.index if device.index is not None else torch.cuda.current_device()
    made: dict[int, torch.Tensor] = {}
    for tensor in sized.values():
        if id(tensor) not in made:
            r = Range(tensor.numel() * tensor.element_size(), ordinal, light=standby())
            _ranges.append(r)
            made[id(tensor)] = r.tensor.view(tensor.dtype).view(tensor.shape)
    log.info("fast-start: the KV cache's %.2f GiB lie at addresses of their own, %s", held() / 2**30,
             "light until this standby wakes" if standby() else "backed")
    return {name: made[id(tensor)] for name, tensor in sized.items()}


def wake() -> None:
    if not all(r.backed for r in _ranges):
        started = time.monotonic()
        torch.cuda.synchronize()        # nothing may still run on what is unmapped
        for r in _ranges:
            r.back()
        log.info("fast-start: the KV cache's %.2f GiB backed in %.3f s", held() / 2**30, time.monotonic() - started)


def sleep() -> None:
    if any(r.backed for r in _ranges):
        torch.cuda.synchronize()        # the last step may still run on the KV cache
        for r in _ranges:
            r.lighten()
        torch.cuda.empty_cache()
        log.info("fast-start: the KV cache's %.2f GiB returned to the GPU", held() / 2**30)


def held() -> int:
    """The bytes of this process's KV cache ranges (its memory while backed)."""
    return sum(r.size for r in _ranges)


def unchecked(check, snapshot, cache_config, *args, **kwargs) -> int:
    """vLLM's start-up memory request for a standby, its check made as if the GPU were free: the
    serving engine holds it now, and the KV cache gets memory only when the standby wakes, after
    that engine is gone (a shortfall then fails the wake, naming it)."""
    counted = copy.copy(snapshot)
    counted.free_memory = snapshot.total_memory
    log.info("fast-start: a standby's KV cache gets its memory as it wakes: vLLM's start-up check is left to "
             "then (%.2f GiB free now)", snapshot.free_memory / 2**30)
    return check(counted, cache_config, *args, **kwargs)


def pooled(worker) -> bool:
    """Whether vLLM's own sleep has something to do: its memory pool is in use (enable_sleep_mode)
    or the KV cache is vLLM's (this process has no ranges: outside the standby's supervisor, or off
    a GPU)."""
    return not _ranges or bool(getattr(worker.vllm_config.model_config, "enable_sleep_mode", False))


def ours(device: torch.device) -> bool:
    return device.type == "cuda" and STARTS_AS in os.environ


def wrap_allocation() -> None:
    """vLLM's KV cache allocation, sized by vLLM on `meta` and placed here, only under the standby's
    supervisor and on a GPU (`ours`): vLLM 0.26's model runners, which size the raw buffers before
    they view them. A vLLM that views them as it allocates (0.32) keeps its own: its standby holds a
    KV cache of its own (`standby()` is False)."""
    global _placing
    import importlib
    try:
        runner = importlib.import_module("vllm.v1.worker.gpu_model_runner").GPUModelRunner
        v2 = importlib.import_module("vllm.v1.worker.gpu.attn_utils")
    except ImportError:
        return
    allocate_v1 = getattr(runner, "_allocate_kv_cache_tensors", None)
    allocate_v2 = getattr(v2, "_allocate_kv_cache", None)
    if allocate_v1 is None or allocate_v2 is None:
        return

    def v1(self, kv_cache_config):
        if not ours(self.device):
            return allocate_v1(self, kv_cache_config)
        device, self.device = self.device, torch.device("meta")
        try:
            sized = allocate_v1(self, kv_cache_config)
        finally:
            self.device = device
        return placed(sized, device)

    def v2_(kv_cache_config, shared_layers, device):
        if not ours(torch.device(device)):
            return allocate_v2(kv_cache_config, shared_layers, device)
        return placed(allocate_v2(kv_cache_config, shared_layers, torch.device("meta")), torch.device(device))

    runner._allocate_kv_cache_tensors, v2._allocate_kv_cache = v1, v2_
    _placing = True

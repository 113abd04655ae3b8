"""Host → GPU copies of checkpoint tensors through pinned staging buffers.

A tensor read from the checkpoint is a view of the file's page cache (pageable memory). Copying
it to the GPU directly makes the driver stage it through a small pinned buffer, one chunk after
another, on one CPU thread. Here two large pinned buffers alternate: torch's multi-threaded CPU
copy fills one (page cache → pinned) while the DMA engine drains the other (pinned → GPU), so
reading the disk's data and moving it overlap.
"""
from __future__ import annotations

from typing import Callable

import torch

CHUNK = 256 << 20


class PinnedStager:
    def __init__(self, device: torch.device, chunk: int = CHUNK):
        self.device, self.chunk = device, chunk
        self.buffers = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.done: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        src = t.contiguous().reshape(-1).view(torch.uint8)
        out = torch.empty(t.shape, dtype=t.dtype, device=self.device)
        dst = out.reshape(-1).view(torch.uint8)
        for start in range(0, src.numel(), self.chunk):
            n = min(self.chunk, src.numel() - start)
            k, self.turn = self.turn, 1 - self.turn
            if self.done[k] is not None:
                self.done[k].synchronize()          # its previous DMA has finished reading it
            self.buffers[k][:n].copy_(src[start:start + n])
            dst[start:start + n].copy_(self.buffers[k][:n], non_blocking=True)
            self.done[k] = torch.cuda.Event()
            self.done[k].record()
        return out


def to_device(device: str | torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function moving CPU tensors to `device`: staged through pinned memory for CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return lambda t: t.to(device)
    return PinnedStager(device)

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

    def __call__(self, t: torch.Tensor, dtype: torch.dtype | None = None, out: torch.Tensor | None = None
                 ) -> torch.Tensor:
        """`t` on the GPU as `dtype` (its own by default), in `out` where given (a contiguous
        tensor of its shape and that dtype: a fill stages straight into its arena), else in a
        new tensor. A cast is made on the CPU as the bytes are staged: the GPU never holds a
        tensor in two dtypes at once."""
        dtype = dtype or t.dtype
        src = t.contiguous().reshape(-1)
        if out is None:
            out = torch.empty(t.shape, dtype=dtype, device=self.device)
        dst, per = out.reshape(-1), self.chunk // out.element_size()
        for start in range(0, src.numel(), per):
            n = min(per, src.numel() - start)
            k, self.turn = self.turn, 1 - self.turn
            if self.done[k] is not None:
                self.done[k].synchronize()          # its previous DMA has finished reading it
            staged = self.buffers[k][:n * out.element_size()].view(dtype)
            staged.copy_(src[start:start + n])
            dst[start:start + n].copy_(staged, non_blocking=True)
            self.done[k] = torch.cuda.Event()
            self.done[k].record()
        return out


ToDevice = Callable[..., torch.Tensor]


def to_device(device: str | torch.device) -> ToDevice:
    """A function `(t, dtype=None, out=None)` moving a CPU tensor to `device` as `dtype`: staged
    through pinned memory for CUDA (into `out` where given), `Tensor.to` elsewhere."""
    device = torch.device(device)
    if device.type != "cuda":
        return lambda t, dtype=None, out=None: t.to(device=device, dtype=dtype or t.dtype)
    return PinnedStager(device)

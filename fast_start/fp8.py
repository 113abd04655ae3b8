"""FP8 quantization: pure functions from a weight to (e4m3 weight, float32 scale).

Every function turns one linear weight (shape [out, in]) into an FP8 weight and a float32 scale
with `w ≈ q.float() * scale` (the scale is the *dequantization* multiplier). All arithmetic is
float32 with IEEE rounding, so the same input gives the same bytes on the CPU and on a GPU.
Which method uses which function is `quant.METHODS`.
"""
from __future__ import annotations

import torch

from .quant import BLOCK

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0   # largest finite e4m3fn value


def _saturate(x: torch.Tensor) -> torch.Tensor:
    # Saturate, don't wrap: e4m3fn has no infinity, so an out-of-range value would become NaN.
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def _scale_of(amax: torch.Tensor) -> torch.Tensor:
    # An all-zero tensor gets scale 1/448 instead of 0 so that dequantization stays finite.
    # Multiply by a reciprocal held in a tensor: CUDA divides by a Python scalar as a multiply by
    # its reciprocal and the CPU does not, so `/ 448.0` would differ by an ulp between devices.
    inv = torch.tensor(1.0 / FP8_MAX, dtype=torch.float32, device=amax.device)
    return amax.float().clamp(min=1e-12) * inv


def to_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor e4m3: one float32 scale (shape []) from the whole tensor's absolute maximum."""
    w = w.float()
    scale = _scale_of(w.abs().amax())
    return _saturate(w / scale), scale


def to_fp8_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output channel: scale [out, 1], one per row."""
    w = w.float()
    scale = _scale_of(w.abs().amax(dim=1, keepdim=True))
    return _saturate(w / scale), scale


def to_fp8_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """128×128 blocks: scale grid [⌈out/128⌉, ⌈in/128⌉]; ragged edge blocks are padded with zeros."""
    out, inp = w.shape
    rows, cols = -(-out // BLOCK), -(-inp // BLOCK)
    padded = torch.nn.functional.pad(w.float(), (0, cols * BLOCK - inp, 0, rows * BLOCK - out))
    blocks = padded.view(rows, BLOCK, cols, BLOCK)
    scale = _scale_of(blocks.abs().amax(dim=(1, 3)))                          # [rows, cols]
    q = _saturate(blocks / scale[:, None, :, None]).view(rows * BLOCK, cols * BLOCK)
    return q[:out, :inp].contiguous(), scale


def quantize(method, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`method`'s function on `w`; on `meta` only the output shapes and dtypes (no slow meta
    decompositions)."""
    if w.is_meta:
        return (torch.empty(w.shape, dtype=FP8, device="meta"),
                torch.empty(method.scale_shape(tuple(w.shape)), dtype=torch.float32, device="meta"))
    return globals()[method.kernel](w)

"""Quantization methods: a table of pure functions.

Every method turns one linear weight `X.weight` (shape [out, in]) into an FP8 weight and a float32
scale with `w ≈ q.float() * scale` (the scale is the *dequantization* multiplier):

| method           | outputs                                                     |
|------------------|-------------------------------------------------------------|
| `none`           | `X.weight` cast to the configured dtype                     |
| `fp8`            | `X.weight` e4m3 [out, in], `X.weight_scale` f32 [] (whole tensor) |
| `fp8-channel`    | `X.weight` e4m3 [out, in], `X.weight_scale` f32 [out, 1]    |
| `fp8-block`      | `X.weight` e4m3 [out, in], `X.weight_scale_inv` f32 [⌈out/128⌉, ⌈in/128⌉] |
| `fp8-checkpoint` | the checkpoint's own e4m3 weights and scales, passed through |

`weight_scale_inv` is the name FP8 block checkpoints use for the same multiplier, so a
pre-quantized block checkpoint and `fp8-block` produce the same names. Which tensors are
quantized is `QUANTIZE_RULES`; everything else (embeddings, lm_head, norms, biases, router
gates) is cast to the configured dtype. All arithmetic is float32 with IEEE rounding, so the same
input gives the same bytes on the CPU and on a GPU.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Callable

import torch

from .errors import QuantizationError

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0   # largest finite e4m3fn value
BLOCK = 128
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# First match wins. Linear layers are quantized; the rest keeps the model dtype.
QUANTIZE_RULES = (
    (re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$"), True),
    (re.compile(r"\.experts\.\d+\.w[123]\.weight$"), True),
    (re.compile(r""), False),   # embeddings, lm_head, norms, biases, router gates
)
# Names a pre-quantized checkpoint stores next to its FP8 weights.
SCALE_SUFFIXES = ("_scale", "_scale_inv")


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


def _tensor_scale(shape: tuple[int, ...]) -> tuple[int, ...]:
    return ()


def _channel_scale(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (shape[0], 1)


def _block_scale(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (-(-shape[0] // BLOCK), -(-shape[1] // BLOCK))


@dataclass(frozen=True)
class Method:
    name: str
    quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None
    scale_suffix: str              # appended to "X.weight" for the scale's name
    verified_for_sharing: bool     # cache and disk checked bit-identical for every TP rank
    prequantized: bool = False     # the checkpoint already holds quantized weights
    params: dict = field(default_factory=dict)   # what the quantization-config hash covers
    scale_shape: Callable[[tuple[int, ...]], tuple[int, ...]] | None = None

    def apply(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`quantize(w)`; on `meta` only the output shapes and dtypes (no slow meta decompositions)."""
        if w.is_meta:
            return (torch.empty(w.shape, dtype=FP8, device="meta"),
                    torch.empty(self.scale_shape(tuple(w.shape)), dtype=torch.float32, device="meta"))
        return self.quantize(w)


METHODS = {m.name: m for m in (
    Method("none", None, "", True),
    Method("fp8", to_fp8, "_scale", True, params={"format": "e4m3fn", "scale": "tensor"},
           scale_shape=_tensor_scale),
    Method("fp8-channel", to_fp8_channel, "_scale", True, params={"format": "e4m3fn", "scale": "channel"},
           scale_shape=_channel_scale),
    Method("fp8-block", to_fp8_block, "_scale_inv", True,
           params={"format": "e4m3fn", "scale": "block", "block": [BLOCK, BLOCK]}, scale_shape=_block_scale),
    Method("fp8-checkpoint", None, "", True, prequantized=True),
    # Packed 4-bit weights with two scale levels; shard rules for its packing are not verified yet.
    Method("nvfp4-checkpoint", None, "", False, prequantized=True),
)}


def method(name: str) -> Method:
    if name not in METHODS:
        raise QuantizationError(f"unknown quantization {name!r}", f"use one of {', '.join(METHODS)}")
    return METHODS[name]


def dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise QuantizationError(f"unknown dtype {name!r}", f"use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def require_verified(m: Method) -> None:
    if not m.verified_for_sharing:
        verified = [n for n, x in METHODS.items() if x.verified_for_sharing]
        raise QuantizationError(f"quantization {m.name!r} is not verified for sharing across engines",
                                f"use one of {', '.join(verified)}")


def is_quantized(name: str) -> bool:
    return next(q for pattern, q in QUANTIZE_RULES if pattern.search(name))


def config_hash(m: Method, checkpoint_config: dict | None) -> str:
    """Hash of everything that decides the quantized bytes besides the weights themselves."""
    conf = {"method": m.name, **m.params}
    if m.prequantized:
        conf["checkpoint"] = checkpoint_config
    return hashlib.sha256(json.dumps(conf, sort_keys=True).encode()).hexdigest()[:16]

"""Quantization methods: a table, read without torch (the config and the fingerprint use it).

Every method turns one linear weight `X.weight` (shape [out, in]) into an FP8 weight and a float32
scale with `w ≈ q.float() * scale` (the scale is the *dequantization* multiplier); the functions
that do it are in `fp8.py`, named by each row's `kernel`:

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
gates) is cast to the configured dtype.
"""
from __future__ import annotations

import hashlib
import json
import re
from typing import Callable, NamedTuple

from . import dtypes
from .errors import QuantizationError

BLOCK = 128

# First match wins. Linear layers are quantized; the rest keeps the model dtype. (Patterns, not
# compiled ones: an engine imports this module on every start and never quantizes.)
QUANTIZE_RULES = (
    (r"\.(q|k|v|o|gate|up|down)_proj\.weight$", True),
    (r"\.experts\.\d+\.w[123]\.weight$", True),
    (r"", False),   # embeddings, lm_head, norms, biases, router gates
)
# Names a pre-quantized checkpoint stores next to its FP8 weights.
SCALE_SUFFIXES = ("_scale", "_scale_inv")


def _tensor_scale(shape: tuple[int, ...]) -> tuple[int, ...]:
    return ()


def _channel_scale(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (shape[0], 1)


def _block_scale(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (-(-shape[0] // BLOCK), -(-shape[1] // BLOCK))


class Method(NamedTuple):
    name: str
    kernel: str | None             # the function in fp8.py that quantizes a weight, if any
    scale_suffix: str              # appended to "X.weight" for the scale's name
    verified_for_sharing: bool     # cache and disk checked bit-identical for every TP rank
    prequantized: bool = False     # the checkpoint already holds quantized weights
    params: dict = {}              # what the quantization-config hash covers (never mutated)
    scale_shape: Callable[[tuple[int, ...]], tuple[int, ...]] | None = None

    @property
    def quantize(self) -> bool:
        return self.kernel is not None


METHODS = {m.name: m for m in (
    Method("none", None, "", True),
    Method("fp8", "to_fp8", "_scale", True, params={"format": "e4m3fn", "scale": "tensor"},
           scale_shape=_tensor_scale),
    Method("fp8-channel", "to_fp8_channel", "_scale", True, params={"format": "e4m3fn", "scale": "channel"},
           scale_shape=_channel_scale),
    Method("fp8-block", "to_fp8_block", "_scale_inv", True,
           params={"format": "e4m3fn", "scale": "block", "block": [BLOCK, BLOCK]}, scale_shape=_block_scale),
    Method("fp8-checkpoint", None, "", True, prequantized=True),
    # Packed 4-bit weights with two scale levels; shard rules for its packing are not verified yet.
    Method("nvfp4-checkpoint", None, "", False, prequantized=True),
)}


def method(name: str) -> Method:
    if name not in METHODS:
        raise QuantizationError(f"unknown quantization {name!r}", f"use one of {', '.join(METHODS)}")
    return METHODS[name]


def check_dtype(name: str) -> str:
    """`name` if a model may be cast to it."""
    if name not in dtypes.MODEL:
        raise QuantizationError(f"unknown dtype {name!r}", f"use one of {', '.join(dtypes.MODEL)}")
    return name


def require_verified(m: Method) -> None:
    if not m.verified_for_sharing:
        verified = [n for n, x in METHODS.items() if x.verified_for_sharing]
        raise QuantizationError(f"quantization {m.name!r} is not verified for sharing across engines",
                                f"use one of {', '.join(verified)}")


def is_quantized(name: str) -> bool:
    return next(q for pattern, q in QUANTIZE_RULES if re.search(pattern, name))


def config_hash(m: Method, checkpoint_config: dict | None) -> str:
    """Hash of everything that decides the quantized bytes besides the weights themselves."""
    conf = {"method": m.name, **m.params}
    if m.prequantized:
        conf["checkpoint"] = checkpoint_config
    return hash_of(conf)


def hash_of(conf: dict) -> str:
    return hashlib.sha256(json.dumps(conf, sort_keys=True).encode()).hexdigest()[:16]

"""Tensor dtypes: one table for every place that names one.

A row gives torch's name (what manifests and the config's `dtype` say), the safetensors code,
the size of one element and whether a model may be cast to it. The control plane reads the
table without torch; `torch_dtype` turns a name into torch's object where tensors are made.
"""
from __future__ import annotations

from typing import NamedTuple


class DType(NamedTuple):
    name: str            # torch's attribute name: "bfloat16"
    code: str            # the safetensors header's: "BF16"
    itemsize: int
    model: bool = False  # a dtype a model's weights may be cast to (`dtype` in the config)


TABLE = (
    DType("float64", "F64", 8), DType("float32", "F32", 4, True), DType("float16", "F16", 2, True),
    DType("bfloat16", "BF16", 2, True), DType("float8_e4m3fn", "F8_E4M3", 1), DType("float8_e5m2", "F8_E5M2", 1),
    DType("int64", "I64", 8), DType("int32", "I32", 4), DType("int16", "I16", 2), DType("int8", "I8", 1),
    DType("uint8", "U8", 1), DType("bool", "BOOL", 1),
    # Appended, never inserted: a cache's tables name a dtype by its place here.
    DType("float8_e8m0fnu", "F8_E8M0", 1),     # MXFP4's block scales, as vLLM's Marlin holds them
)
BY_NAME = {d.name: d for d in TABLE}
BY_CODE = {d.code: d for d in TABLE}
MODEL = tuple(d.name for d in TABLE if d.model)
FP8 = "float8_e4m3fn"


def torch_dtype(name: str):
    """torch's dtype object for a name of the table."""
    import torch
    return getattr(torch, BY_NAME[name].name)


def name_of(dtype) -> str:
    """The table's name of a torch dtype."""
    return str(dtype).removeprefix("torch.")

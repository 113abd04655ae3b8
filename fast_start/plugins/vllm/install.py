"""Installing cached tensors into vLLM's weightless model, and bringing it to vLLM's runtime state.

`prepare` is the plugin's step 3 (`loader.py`): it compares the engine's kernel plan (and, for
stage "processed", its kernel libraries and GPU) with the fill's, then for stage "loaded" points
the parameters at the cache (`install`), gives a model built on meta what the fill recorded by
value and mends vLLM's reload record (`complete`), and runs vLLM's processing; for stage
"processed" it installs every parameter and buffer of the fill's processed model
(`install_processed`), runs vLLM's pre-processed pass (layers it cannot
finish, FP4 kernels among them, are finished by `vllm_preprocessed`), mends the gaps that pass
leaves (`mend_gaps`) and compares the attribute signature with the fill's. Either way
a model built on meta that still holds anything on meta is refused (`check_complete`). Each
refusal is a CacheMiss naming what differs; the loader then drops the model.
"""
from __future__ import annotations

import contextlib

import torch
from vllm.model_executor.model_loader import utils as vllm_utils
from vllm.utils.torch_utils import set_default_torch_dtype

from . import preprocessed as vllm_preprocessed, state as vllm_state
from ...client import Weights, fit_error
from ...errors import CacheMiss
from ...engines.vllm.record import FillRecord


def prepare(model: torch.nn.Module, weights: Weights, record: FillRecord, model_config, device: torch.device) -> None:
    """Install `weights` into the weightless `model` and bring it to vLLM's runtime state; raises
    CacheMiss where the fill's kernels or resulting state (`record`) differ from this engine's."""
    if record.kernels is not None:
        differs = vllm_state.environment_differences(record.kernels, vllm_state.kernel_environment(device))
        if differs:
            raise CacheMiss("this engine's kernel libraries or GPU differ from the fill's: " + "; ".join(differs),
                            "fill from the engine's environment (the model's python), on this GPU")
    differs = vllm_state.differences(record.plan, vllm_state.kernel_plan(model))
    if differs:
        raise CacheMiss("this engine chose other kernels than the fill: " + "; ".join(differs),
                        "fill with the engine's settings ([model.vllm], the worker's python, the GPU)")
    modules = dict(model.named_modules())     # one walk for the installs: neither changes the tree
    if record.stage == "loaded":
        install(modules, weights, record)
        complete(modules, record, device)
        with set_default_torch_dtype(model_config.dtype):
            vllm_utils.process_weights_after_loading(model, model_config, device)
        check_complete(model, record)
        return
    install_processed(model, weights, record)
    complete(modules, record, device)
    recorded = vllm_state.per_module(record.signature)
    hook = vllm_preprocessed.has_hook()
    told = _mark_processed_online_layers(model, recorded) if hook else []
    try:
        changed = vllm_preprocessed.take_over(model, hook)
        try:
            with set_default_torch_dtype(model_config.dtype), _pre_processed(hook):
                vllm_utils.process_weights_after_loading(model, model_config, device)
        finally:
            vllm_preprocessed.restore(changed)
    except RuntimeError as e:       # a quant method without a pre-processed pass
        raise CacheMiss(f"vLLM cannot install processed weights here: {e}", "serve it without fast-start") from None
    finally:
        for method in told:
            del method.supports_pre_processed_weights
    mend_gaps(model, recorded)
    check_complete(model, record)
    differs = vllm_state.differences(record.signature, vllm_state.signature(model))
    if differs:
        raise CacheMiss("vLLM's pre-processed pass left other state than the fill's processing: " + "; ".join(differs),
                        "report this with your vLLM version; the default loader is used meanwhile")


def _pre_processed(hook: bool):
    """vLLM's pre-processed pass where it has one; without it every layer is finished by
    `vllm_preprocessed.take_over`."""
    if not hook:
        return contextlib.nullcontext()
    from vllm.model_executor.utils import weights_already_processed
    return weights_already_processed()


def install_processed(model: torch.nn.Module, weights: Weights, record: FillRecord) -> None:
    """Every parameter and buffer of the fill's processed model, by name: parameters become
    Parameters over the cached tensors (keeping the attributes vLLM set on the constructed ones,
    tied names one object), those processing dropped are dropped, buffers are copied."""
    buffers, removed = set(record.buffers), set(record.removed)
    own = dict(model.named_parameters(remove_duplicate=False))
    missing = [n for n in own if n not in weights.tensors and n not in weights.aliases and n not in removed]
    modules = dict(model.named_modules())
    unplaced = [n for n in weights.tensors if n.rpartition(".")[0] not in modules]
    # Another name of a cached tensor, under a module processing attaches (vLLM 0.26's MoE runner
    # holds the router as `experts.gate`): the finisher attaches it again, over the installed one.
    cached = [*weights.tensors, *(n for n in weights.aliases if n.rpartition(".")[0] in modules)]
    if missing or unplaced:
        raise fit_error(missing, unplaced, [], "fill with the engine's vLLM, model, TP/PP size and dtype")
    made: dict[int, torch.nn.Parameter] = {}
    replaced: dict[int, torch.nn.Parameter] = {}
    for name in cached:
        owner, _, leaf = name.rpartition(".")
        module, tensor = modules[owner], weights[name]
        if name in buffers:
            module._parameters.pop(leaf, None)
            module._buffers[leaf] = tensor.clone()
            continue
        param = made.get(id(tensor))
        old = own.get(name)
        if param is None:
            param = made[id(tensor)] = torch.nn.Parameter(tensor, requires_grad=False)
            if old is not None:
                param.__dict__.update({k: v for k, v in old.__dict__.items() if k not in param.__dict__})
        if old is not None:
            replaced[id(old)] = param
        if leaf in module._parameters:
            del module._parameters[leaf]
        elif leaf in module.__dict__:
            delattr(module, leaf)
        module._buffers.pop(leaf, None)     # a buffer processing turned into a parameter (KV-cache scales)
        module._parameters[leaf] = param
    for name in removed:
        owner, _, leaf = name.rpartition(".")
        if hasattr(modules[owner], leaf):
            delattr(modules[owner], leaf)
    _repoint(modules.values(), replaced)


def _repoint(modules, replaced: dict[int, torch.nn.Parameter]) -> None:
    """Objects a layer holds (an attention layer's `impl`) keep the parameters they were built
    with: gpt-oss's attention hands its `sinks` parameter to the backend's impl. Where install
    replaced such a parameter (`replaced`: by the old one's id), the reference follows it; the
    default loader, which copies into the parameter, needs no such step."""
    if not replaced:
        return
    for module in modules:
        for held in list(vars(module).values()):
            if isinstance(held, (torch.nn.Module, torch.Tensor)) or not hasattr(held, "__dict__"):
                continue
            for key, value in list(vars(held).items()):
                if isinstance(value, torch.Tensor) and id(value) in replaced:
                    setattr(held, key, replaced[id(value)])


_ONLINE_DONE = "_already_called_process_weights_after_loading"


def _mark_processed_online_layers(model: torch.nn.Module, recorded: dict[str, dict]) -> list:
    """Online quantization methods have no pre-processed pass, but guard against running twice:
    a layer the fill recorded as processed is marked so (with the attributes its processing set
    to None), and its method lets vLLM's pass through. Returns the methods told (the caller
    removes the instance flag again)."""
    told = []
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is None or getattr(method, "supports_pre_processed_weights", True) or name not in recorded:
            continue
        if recorded[name].get(_ONLINE_DONE) == "True":
            setattr(module, _ONLINE_DONE, True)
            for key, value in recorded[name].items():     # what its processing reset (input_scale = None)
                if value == "None" and "." not in key and not hasattr(module, key):
                    setattr(module, key, None)
            method.supports_pre_processed_weights = True
            told.append(method)
    return told


def mend_gaps(model: torch.nn.Module, recorded: dict[str, dict]) -> None:
    """State vLLM's processing sets and its pre-processed pass (vLLM 0.30–0.33) does not:

    - `deep_gemm_warmup_provider`: the DeepGEMM kernel object, which the JIT warm-up reads (else
      kernels compile on live requests);
    - `logical_output_size` of the per-tensor FP8 CUTLASS kernel (else the first forward asserts);
    - `is_w4a16_nvfp4`, which ModelOpt's FP4 linear method (vLLM 0.32) sets after the point
      where its pre-processed pass returns (its GEMM reads it).

    Each is taken from the fill's signature, and only where the engine's own kernel is the one
    the fill recorded.
    """
    for name, module in model.named_modules():
        state = recorded.get(name, {})
        want = state.get("deep_gemm_warmup_provider")
        if want and not hasattr(module, "deep_gemm_warmup_provider"):
            kernel = _find_kernel(getattr(module, "quant_method", None), want)
            if kernel is not None:
                module.deep_gemm_warmup_provider = kernel
        flag = state.get("is_w4a16_nvfp4")
        if flag in ("True", "False") and not hasattr(module, "is_w4a16_nvfp4"):
            module.is_w4a16_nvfp4 = flag == "True"
        size = state.get("quant_method.fp8_linear.logical_output_size")
        kernel = getattr(getattr(module, "quant_method", None), "fp8_linear", None)
        if size not in (None, "None") and kernel is not None and getattr(kernel, "logical_output_size", 0) is None:
            kernel.logical_output_size = int(size)


def _find_kernel(method, described: str):
    """The object under `method` (two levels down) that `vllm_state.describe` names `described`."""
    if method is None:
        return None
    level = [method]
    for _ in range(3):
        for obj in level:
            if vllm_state.describe(obj) == described:
                return obj
        level = [v for obj in level for v in vars(obj).values() if hasattr(v, "__dict__")
                 and not isinstance(v, (torch.nn.Module, torch.Tensor))]
    return None


def install(modules: dict[str, torch.nn.Module], weights: Weights, record: FillRecord) -> None:
    """Point every parameter of a model (`modules`: its named modules) at its tensor in `weights`
    and copy the cached buffers in; raises LoadError if any does not fit.

    A parameter built on the device keeps its object (`param.data = tensor`), with the attributes
    vLLM's weight loaders and reload path rely on; one built on meta (which cannot take a device
    tensor as its data) is replaced by a Parameter of its class with its attributes, as vLLM's own
    meta round trip does. Tied parameters are one object and get one tensor.
    """
    params, own_buffers = _named(modules, "_parameters"), _named(modules, "_buffers")
    tensors, aliases = weights.tensors, weights.aliases
    cached = {n: tensors.get(aliases.get(n, n)) for n in [*params, *own_buffers]}
    buffers = set(record.buffers) & tensors.keys() & own_buffers.keys()
    wrong = [f"{n}: got {t.dtype} {tuple(t.shape)}, vLLM has {p.dtype} {tuple(p.shape)}"
             for n, p in [*params.items(), *own_buffers.items()]
             if (t := cached[n]) is not None and (t.shape != p.shape or t.dtype != p.dtype)]
    missing = [n for n in params if cached[n] is None]
    unexpected = [n for n in tensors if n not in params and n not in buffers]
    if missing or unexpected or wrong:
        raise fit_error(missing, unexpected, wrong, "build vLLM for the same model, TP size and dtype as the "
                        "daemon's [[model]] (engine = \"vllm\")")
    replaced: dict[int, torch.nn.Parameter] = {}
    for name, param in params.items():
        if not param.is_meta:
            param.data = cached[name]
            continue
        new = torch.nn.Parameter(cached[name], requires_grad=param.requires_grad)
        new.__class__, new.__dict__ = param.__class__, dict(param.__dict__)
        replaced[id(param)] = new
    for module in modules.values():
        for key, param in module._parameters.items():
            if param is not None and id(param) in replaced:
                module._parameters[key] = replaced[id(param)]
    _repoint(modules.values(), replaced)
    for name in buffers:
        owner, _, leaf = name.rpartition(".")
        modules[owner]._buffers[leaf] = cached[name].clone()


def _named(modules: dict[str, torch.nn.Module], table: str) -> dict[str, torch.Tensor]:
    """Every module's parameters or buffers (`table`) by dotted name, as `named_parameters` and
    `named_buffers` give them: a tensor held under several names by its first."""
    out, seen = {}, set()
    for prefix, module in modules.items():
        for key, t in getattr(module, table).items():
            if t is None or id(t) in seen:
                continue
            seen.add(id(t))
            out[f"{prefix}.{key}" if prefix else key] = t
    return out


def complete(modules: dict[str, torch.nn.Module], record: FillRecord, device: torch.device) -> None:
    """What a model built on meta (`modules`: its named modules) lacks besides its parameters and
    buffers: the attributes the fill recorded by value, and what vLLM recorded of it for
    `reload_weights` (`_mend_reload_record`). A no-op for a model built on the device."""
    if record.attrs is None:
        return
    for name in record.attrs:
        if name.rpartition(".")[0] not in modules:
            raise CacheMiss(f"the fill recorded attribute {name} of a module this engine's model lacks",
                            "fill with the engine's vLLM, model, TP/PP size and dtype")
    try:
        values = vllm_state.made(record.attrs, device)
    except vllm_state.RecordError as e:
        raise CacheMiss(f"the fill's record of attribute {e.name} is unusable ({e.cause})",
                        "evict the model (fast-start evict) so that it is filled again") from None
    for name, value in values.items():
        owner, _, key = name.rpartition(".")
        setattr(modules[owner], key, value)
    _mend_reload_record(modules.values(), device)


def _mend_reload_record(modules, device: torch.device) -> None:
    """vLLM records each layer's device and tensors (as meta tensors) as it builds a model, for
    `reload_weights`. Built on meta, the device recorded is meta, and each non-persistent buffer
    was left out as an alias of a parameter (every meta tensor's storage has address 0): the
    device becomes the engine's and such buffers are recorded again, now that they are real."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        from vllm.model_executor.model_loader.reload.meta import capture_layer_to_meta
    except ImportError:       # a vLLM without layerwise reload
        return
    for module in modules:
        info = LAYERWISE_INFO.get(module)
        if info is None:
            continue
        info.restore_device = device
        if module._non_persistent_buffers_set:
            info.restore_metadata = (info.restore_metadata[0], capture_layer_to_meta(module)[1])


def check_complete(model: torch.nn.Module, record: FillRecord) -> None:
    """Raises CacheMiss where a model built on meta still holds a tensor or device on meta."""
    if record.attrs is None:
        return
    left = [vllm_state.dotted(module, key) for module, key, _, value in vllm_state.held(model)
            if vllm_state.is_meta(value)]
    if left:
        raise CacheMiss(f"the model built on meta still holds {len(left)} value(s) on meta after installing "
                        f"the cache: {', '.join(left[:3])}", "report this with your vLLM version; the default "
                        "loader is used meanwhile")

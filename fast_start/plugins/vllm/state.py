"""What a vLLM model holds besides its tensors: the kernel plan and the attribute signature.

Both the fill worker (which runs vLLM's own loader and processing for one rank) and the engine's
plugin (which installs those tensors into a weightless model) describe their model the same way,
and the plugin refuses the cache where the two differ:

- the **kernel plan** is every quantized module's quant method (and compressed-tensors' scheme),
  the kernel objects it chose at construction and the flags that chose them (`fp8_linear`,
  `use_marlin`, `block_quant`, the MoE backend...). Kernels are picked before any weight
  exists, so the engine compares its plan with the fill's before it touches the cache: another
  GPU generation, another backend variable or another library version shows up here. The kernel libraries' versions and the GPU's
  properties processing may read (`kernel_environment`) are compared first.
- the **attribute signature** is every module's Python-side state after processing (attribute
  names, types, small values, tensor dtypes and shapes), quant methods and kernels included. The
  engine takes it after vLLM's pre-processed pass: state that pass does not rebuild shows up here.

Both are stored grouped (`{"table": [description, ...], "modules": {name: index}}`), since most
layers of a model describe alike.

`held` lists every tensor a model holds (parameters, buffers, tensor attributes, tensors inside
containers and kernel objects): the engine builds on the `meta` device where the fill found that
all a meta build leaves without a value is in the cache (parameters, buffers) or recorded by
value (`small_attrs`: scalar scales, empty placeholders).
"""
from __future__ import annotations

import enum
import json
import re

import torch

_MODULE_KEYS = frozenset(vars(torch.nn.Module()))       # torch's own bookkeeping on every module
_NESTED = re.compile(r"(Kernel|Method|Experts)$")     # objects whose own state is recorded too
_SCALARS = (bool, int, float, str, type(None))
_SCHEME = "scheme"      # compressed-tensors keeps each layer's scheme, and its kernel, on the layer
ATTR_LIMIT = 256      # elements of a tensor attribute recorded by value


def describe(value) -> str:
    """A value as the signature records it: small values exactly, objects (configs too) by type."""
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, _SCALARS):
        text = repr(value)
        return text if len(text) <= 96 else f"str of {len(value)}"
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, torch.Tensor):
        return f"tensor {str(value.dtype).removeprefix('torch.')} {tuple(value.shape)} {value.device.type}"
    if isinstance(value, (tuple, list)) and len(value) <= 16 and all(isinstance(v, _SCALARS) for v in value):
        return repr(tuple(value))
    return f"<{type(value).__qualname__}>"


def _state(obj, prefix: str, out: dict, depth: int) -> None:
    for key, value in vars(obj).items():
        if key in _MODULE_KEYS:
            continue
        out[prefix + key] = describe(value)
        if (depth and not isinstance(value, torch.nn.Module) and hasattr(value, "__dict__")
                and (_NESTED.search(type(value).__name__) or key == _SCHEME)):      # vLLM's, or a plugin's
            _state(value, f"{prefix}{key}.", out, depth - 1)


def _grouped(per_module: dict[str, dict]) -> dict:
    table, index, modules = [], {}, {}
    for name, state in per_module.items():
        text = json.dumps(state, sort_keys=True, separators=(",", ":"))
        if text not in index:
            index[text] = len(table)
            table.append(text)
        modules[name] = index[text]
    return {"table": table, "modules": modules}


def kernel_plan(model: torch.nn.Module) -> dict:
    """Each quantized module's quant method and kernels, as chosen at construction."""
    per_module = {}
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            state = {"quant_method": describe(method)}
            _state(method, "quant_method.", state, 2)
            scheme = vars(module).get(_SCHEME)
            if scheme is not None:
                state[_SCHEME] = describe(scheme)
                _state(scheme, _SCHEME + ".", state, 2)
            per_module[name] = state
    return _grouped(per_module)


# Packages of kernels whose version may change how vLLM lays out processed weights (vLLM itself
# is the fingerprint's `engine_version`).
KERNEL_LIBRARIES = ("flashinfer-python", "flashinfer-cubin", "flashinfer-jit-cache", "humming-kernels",
                    "deep-gemm", "nvidia-cutlass-dsl")


def kernel_environment(device: torch.device) -> dict[str, str]:
    """The kernel libraries installed here (by distribution name, with their versions) and what
    processing may read from the GPU: its name, compute capability and SM count (Marlin sizes
    its workspace by the SMs)."""
    from importlib import metadata
    out = {}
    for dist in KERNEL_LIBRARIES:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        out["gpu"] = f"{p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs"
    return out


def environment_differences(cached: dict[str, str], own: dict[str, str]) -> list[str]:
    """"name cached -> own" for each kernel library or GPU property that differs."""
    return [f"{k} {cached.get(k, 'none')} -> {own.get(k, 'none')}" for k in sorted(set(cached) | set(own))
            if cached.get(k) != own.get(k)]


def signature(model: torch.nn.Module) -> dict:
    """Every module's Python-side state (its quant method and kernels included)."""
    per_module = {}
    for name, module in model.named_modules():
        state = {"class": describe(module)}
        _state(module, "", state, 2)
        own = repr(name)      # a layer's own name (prefix, layer_name) would make every layer unique
        per_module[name] = {k: "<own name>" if v == own else v for k, v in state.items()}
    return _grouped(per_module)


def per_module(grouped: dict) -> dict[str, dict]:
    """A grouped description as module name -> state, each distinct state decoded once."""
    table = [json.loads(text) for text in grouped["table"]]
    return {name: table[i] for name, i in grouped["modules"].items()}


def differences(cached: dict, own: dict, limit: int = 3) -> list[str]:
    """What differs between two grouped descriptions, as "module: key cached -> own" lines."""
    out = []
    mine, theirs = own["modules"], cached["modules"]
    for name in [*theirs, *(n for n in mine if n not in theirs)]:
        if name not in mine or name not in theirs:
            out.append(f"{name or '<model>'}: {'only in the cache' if name in theirs else 'not in the cache'}")
        elif mine[name] is not None and own["table"][mine[name]] != cached["table"][theirs[name]]:
            a, b = json.loads(cached["table"][theirs[name]]), json.loads(own["table"][mine[name]])
            keys = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
            out.append(f"{name or '<model>'}: " + ", ".join(f"{k} {a.get(k, 'unset')} -> {b.get(k, 'unset')}"
                                                            for k in keys[:4]))
        if len(out) >= limit:
            break
    return out


def held(model: torch.nn.Module):
    """(module name, key, kind, value) for each tensor or torch.device a module holds; kind is
    "param", "buffer", "attr" (directly in the module's attributes) or "nested" (in a list,
    tuple or dict there, or in a quant method's or kernel's own attributes)."""
    for name, module in model.named_modules():
        for key, t in module._parameters.items():
            if t is not None:
                yield name, key, "param", t
        for key, t in module._buffers.items():
            if t is not None:
                yield name, key, "buffer", t
        for key, value in vars(module).items():
            if key in _MODULE_KEYS:
                continue
            kind = _kind(type(value))
            if kind == _HELD:
                yield name, key, "attr", value
            elif kind == _SEARCHED:
                for inner in _inner(value, 2):
                    yield name, key, "nested", inner


# What `held` does with a value, by its type (a model holds a few thousand values of a few dozen).
_SKIPPED, _HELD, _SEARCHED = 0, 1, 2
_KINDS: dict[type, int] = {}


def _kind(cls: type) -> int:
    kind = _KINDS.get(cls)
    if kind is None:
        if issubclass(cls, _SCALARS):
            kind = _SKIPPED
        elif issubclass(cls, (torch.Tensor, torch.device)):
            kind = _HELD
        elif issubclass(cls, (list, tuple, dict)) or (
                not issubclass(cls, torch.nn.Module) and cls.__dictoffset__ and _NESTED.search(cls.__name__)):
            kind = _SEARCHED
        else:
            kind = _SKIPPED
        _KINDS[cls] = kind
    return kind


def _inner(value, depth: int):
    kind = _kind(type(value))
    if kind == _HELD:
        yield value
    elif depth and kind == _SEARCHED:
        for v in (value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple))
                  else vars(value).values()):
            yield from _inner(v, depth - 1)


def is_meta(value) -> bool:
    return value.is_meta if isinstance(value, torch.Tensor) else value.type == "meta"


def dotted(module: str, key: str) -> str:
    return f"{module}.{key}" if module else key


def small_attrs(model: torch.nn.Module) -> dict[str, list]:
    """Each module's tensor attributes of at most ATTR_LIMIT elements by value, as
    `[dtype, shape, device type, values]`, and its torch.device attributes as `["device", type]`."""
    out = {}
    for name, key, kind, value in held(model):
        if kind != "attr":
            continue
        if isinstance(value, torch.device):
            out[dotted(name, key)] = ["device", value.type]
        elif value.numel() <= ATTR_LIMIT:
            out[dotted(name, key)] = [str(value.dtype).removeprefix("torch."), list(value.shape), value.device.type,
                                      value.detach().cpu().reshape(-1).tolist()]
    return out


class RecordError(Exception):
    """A value `small_attrs` recorded that cannot be made again: `name` is its attribute."""

    def __init__(self, name: str, cause: Exception):
        super().__init__(f"{name}: {cause}")
        self.name, self.cause = name, cause


def made(records: dict[str, list], device: torch.device) -> dict[str, object]:
    """The values `small_attrs` recorded, by name; those that were on an accelerator are on
    `device`, moved there in one copy per dtype (a copy each would wait for the device each time:
    a model records a few for every layer). Raises RecordError naming an unusable record."""
    out: dict[str, object] = {}
    moving: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for name, record in records.items():
        try:
            if record[0] == "device":
                out[name] = torch.device("cpu") if record[1] == "cpu" else device
                continue
            dtype, shape, where, values = record
            if not isinstance(getattr(torch, dtype, None), torch.dtype):
                raise ValueError(f"unknown dtype {dtype!r}")
            tensor = torch.tensor(values, dtype=getattr(torch, dtype), device="cpu").reshape(shape)
        except (ValueError, TypeError, IndexError, KeyError, RuntimeError) as e:
            raise RecordError(name, e) from None
        out[name] = tensor
        if where != "cpu":
            moving.setdefault(tensor.dtype, []).append((name, tensor))
    for group in moving.values():
        flat = torch.cat([t.reshape(-1) for _, t in group]).to(device)
        for (name, t), part in zip(group, flat.split([t.numel() for _, t in group])):
            out[name] = part.view(t.shape)
    return out


def registrations(vllm_config) -> tuple:
    """What vLLM registers process-wide as it builds a model: its named layers, its MoE layers
    and the rotary embeddings it caches by their settings (one object shared by every layer)."""
    c = vllm_config.compilation_config
    return dict(c.static_forward_context), list(getattr(c, "static_all_moe_layers", [])), dict(_rope_cache())


def restore_registrations(vllm_config, before: tuple) -> None:
    """Back to what `registrations` returned: a model built since (and turned down) is forgotten,
    so that the next build registers its layers afresh."""
    c = vllm_config.compilation_config
    c.static_forward_context.clear()
    c.static_forward_context.update(before[0])
    if hasattr(c, "static_all_moe_layers"):
        c.static_all_moe_layers[:] = before[1]
    rope = _rope_cache()
    rope.clear()
    rope.update(before[2])


def _rope_cache() -> dict:
    from vllm.model_executor.layers import rotary_embedding
    return getattr(rotary_embedding, "_ROPE_DICT", {})

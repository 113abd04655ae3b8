"""vLLM's attention backend: chosen once by the fill, named again by the engine.

Without `--attention-backend`, a vLLM process's first attention layer tries every backend its
platform lists for the layer's inputs, importing each (flex attention, turboquant, their triton
kernels: a third or more of a build on meta, BENCHMARKS.md), and takes the first valid one. That choice is a function of the selector's
arguments (head size, dtypes, KV-cache dtype, block size, MLA, sinks, ...), the GPU's compute
capability, vLLM itself (which the fingerprint pins) and the backends' libraries the interpreter
has (the fill runs the engine's interpreter; where it does not, a backend the engine's lacks is
refused by vLLM here and it chooses itself). So the fill notes, for each selection its
build made, those inputs and vLLM's choice (`recording`), and the engine's build names the noted
backend where a selection's inputs are the same (`choosing`), as `--attention-backend` would:
vLLM validates it and imports it alone. A selection with other inputs, one whose backend the
user named (`--attention-backend`, per-kind overrides), or a noted backend that vLLM refuses
here goes vLLM's own way.
"""
from __future__ import annotations

import contextlib
import inspect
import json
from collections.abc import Iterator


@contextlib.contextmanager
def recording(out: list[dict]) -> Iterator[None]:
    """While inside, each selection vLLM makes itself is noted in `out` as {"inputs", "backend"}
    (once per distinct inputs)."""
    def wrap(original, signature):
        def record(*args, **kwargs):
            backend = original(*args, **kwargs)
            entry = _noted(signature, args, kwargs, backend)
            if entry is not None and entry not in out:
                out.append(entry)
            return backend
        return record

    with _selection_wrapped(wrap):
        yield


@contextlib.contextmanager
def choosing(noted: list[dict] | None) -> Iterator[None]:
    """While inside, a selection whose inputs the fill noted names the backend vLLM chose there."""
    if not isinstance(noted, list) or not noted:
        yield
        return
    chosen = {e["inputs"]: e["backend"] for e in noted       # a malformed note names nothing
              if isinstance(e, dict) and isinstance(e.get("inputs"), str) and isinstance(e.get("backend"), str)}

    def wrap(original, signature):
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
        named: dict = {}        # each layer of a model asks with the same arguments: described once

        def choose(*args, **kwargs):
            key = (args, tuple(sorted(kwargs.items())))     # hashable where vLLM's own cache can key on them
            try:
                if key not in named:
                    named[key] = _named(signature, args, kwargs, chosen, AttentionBackendEnum)
                call = named[key]
            except TypeError:       # unhashable: vLLM's cache refuses the call itself
                call = None
            if call is not None:
                try:
                    return original(*call[0], **call[1])
                except Exception:      # noqa: BLE001 - vLLM refuses it here: its own choice decides
                    pass
            return original(*args, **kwargs)
        return choose

    with _selection_wrapped(wrap):
        yield


@contextlib.contextmanager
def _selection_wrapped(wrap) -> Iterator[None]:
    """While inside, vLLM's cached backend selection is `wrap(original, its signature)`."""
    selector = _selector()
    if selector is None:
        yield
        return
    original = selector._cached_get_attn_backend
    selector._cached_get_attn_backend = wrap(original, inspect.signature(original))
    try:
        yield
    finally:
        selector._cached_get_attn_backend = original


def _named(signature: inspect.Signature, args, kwargs, chosen: dict[str, str], enum) -> tuple | None:
    """This call's (args, kwargs) with the fill's backend named; None where the call
    names one itself, the fill noted other inputs or a backend this vLLM does not know, or the
    call cannot be described (vLLM's own choice)."""
    try:
        described = _described(signature, args, kwargs)
    except Exception:      # noqa: BLE001 - a call this module cannot describe: vLLM's own choice
        return None
    if described is None or chosen.get(described[1]) not in enum.__members__:
        return None
    bound = described[0]
    bound.arguments["backend"] = enum[chosen[described[1]]]
    return bound.args, bound.kwargs


def _selector():
    try:
        from vllm.v1.attention import selector
    except ImportError:
        return None
    return selector if hasattr(selector, "_cached_get_attn_backend") else None


def _noted(signature: inspect.Signature, args, kwargs, backend) -> dict | None:
    """The note of one selection vLLM made itself; None where the caller named the backend, or
    where the inputs cannot be described (the fill goes on without the note)."""
    try:
        described = _described(signature, args, kwargs)
        return None if described is None else {"inputs": described[1], "backend": backend.get_name()}
    except Exception:      # noqa: BLE001 - a note is an optimisation, never a reason for a fill to fail
        return None


def _described(signature: inspect.Signature, args, kwargs) -> tuple[inspect.BoundArguments, str] | None:
    """A selection's bound arguments and its inputs (`_inputs`); None where the caller named the
    backend. Raises where the call does not fit the signature."""
    bound = signature.bind(*args, **kwargs)
    if bound.arguments.get("backend") is not None:
        return None
    return bound, _inputs(bound)


def _inputs(bound: inspect.BoundArguments) -> str:
    """A selection's arguments but the backend, and the GPU's capability, as one string."""
    from vllm.platforms import current_platform

    bound.apply_defaults()
    out = {"capability": repr(current_platform.get_device_capability())}
    for key, value in bound.arguments.items():
        if key != "backend":
            out[key] = ({k: repr(v) for k, v in value._asdict().items()} if hasattr(value, "_asdict")
                        else repr(value))
    return json.dumps(out, sort_keys=True)

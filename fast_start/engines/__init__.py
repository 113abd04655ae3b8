"""Engines: the inference engines that fill a model themselves, by name.

A model whose `engine` names one is filled by that engine where the fill worker's
environment has it installed (vLLM builds, loads and processes the rank); otherwise
fast-start's own tables build the layout (`materialize.py`). The control plane (the config,
the daemon, the CLI) asks an engine through `Engine` for what it decides there: its settings
(`[model.<name>]`) and rules, its fingerprint fields, the version installed in a worker's
environment. This package is that description alone; the code that runs inside an engine's
processes and in its fill (vLLM's: `plugins/vllm/`) imports it, never the other way round.
Only the fill (`Engine.filler`) and the tables touch torch, imported where they run.

`model` below is a `config.ModelConfig`, `spec` a `fingerprint.WeightSpec` (this package sits
below both: they ask it).

Read without torch.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..headers import ModelDims
from .vllm import ENGINE as _VLLM

if TYPE_CHECKING:
    import torch


# [[model]] keys that only an engine fills (fast-start's own tables shard by TP alone), each with
# the value that means "off".
ENGINE_KEYS = {"pipeline_parallel_size": 1, "data_parallel_size": 1, "enable_expert_parallel": False,
               "expert_placement_strategy": "linear"}


class Model(Protocol):
    """What an engine reads of a [[model]] (`config.ModelConfig` is one)."""
    name: str
    quantization: str
    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int
    enable_expert_parallel: bool
    expert_placement_strategy: str
    settings: Any                   # the engine's own `settings` record: the engine knows its type


class Spec(Protocol):
    """What an engine reads of a rank's `fingerprint.WeightSpec`."""
    path: str
    dtype: str
    quantization: str
    tensor_parallel_size: int
    pipeline_parallel_size: int


class Tables(Protocol):
    """fast-start's own tables for an engine's as-loaded layout (`Engine.tables`)."""
    VOCAB_PADDING: int              # the multiple vocab-parallel tensors are padded to

    def arrange(self, dims: ModelDims, tp_size: int, tensors: Iterable[tuple[str, torch.Tensor]]
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """The rank's tensors, named and laid out as the engine holds them."""


class Engine(Protocol):
    name: str                       # a model's `engine` (and the fingerprint's `layout`), its manifests' "engine"
    title: str                      # its name as people write it ("vLLM")
    distributions: tuple[str, ...]  # the packages that install it (its version: the first found)
    module: str                     # what an environment imports to run it
    # The function that fills a rank into arenas itself, as "module:function": imported in the
    # fill worker alone (it may import torch and the engine), called as `function(spec, device,
    # progress, chunk)`, returning the manifest and the arenas' fds.
    filler: str
    # The engine's own settings, a [[model]]'s `[model.<name>]` table: a frozen dataclass whose
    # fields (annotated str, int, bool or tuple[str, ...]) all have defaults; a model's is
    # `model.settings`. `moved`: keys older configs wrote in the [[model]] itself, by the field
    # each now is (read there still, with a deprecation warning).
    settings: type
    moved: dict[str, str]

    def check(self, model: Model) -> Iterator[tuple[str, str, str]]:
        """(key, what is wrong, the fix) for each of this engine's rules `model` breaks."""

    def options(self, model: Model) -> str:
        """The fingerprint's `engine_options`: what else steers the bytes this engine makes."""

    def expert_parallel(self, model: Model) -> str:
        """The fingerprint's `expert_parallel`: the expert placement, "" where none."""

    def requested_quantization(self, configured: str) -> str:
        """The fingerprint's `quantization` as known before the checkpoint is read ("": it is
        the checkpoint's)."""

    def identity(self, folder: Path, configured: str) -> tuple[str, str, str]:
        """The fingerprint's architecture, quantization and quantization_config, from the
        checkpoint's config.json."""

    def estimate(self, spec: Spec) -> int:
        """A rank's bytes from the checkpoint's headers, before the engine builds it."""

    def tables(self) -> Tables | None:
        """fast-start's own tables for this engine's as-loaded layout, used where the fill worker's
        environment lacks the engine (a module will do); None where there are none."""


GROUP = "fast_start.engines"     # the entry-point group another package registers its engine under
REGISTRY: dict[str, Engine] = {e.name: e for e in (_VLLM,)}
log = logging.getLogger("fast_start.engines")


def get(name: str) -> Engine | None:
    """The engine `name` (a model's `engine`, a fingerprint's `layout`, a manifest's "engine")
    names, or None ("hf": the checkpoint's own layout). A name not built in is looked for among
    the installed packages' `fast_start.engines` entry points, each time it is asked for."""
    if name in REGISTRY or name == "hf":
        return REGISTRY.get(name)
    _discover()
    return REGISTRY.get(name)


def names() -> tuple[str, ...]:
    """Every engine's name, those installed packages register included."""
    _discover()
    return tuple(REGISTRY)


def _discover() -> None:
    from importlib import metadata
    for point in metadata.entry_points(group=GROUP):
        if point.name in REGISTRY:
            continue
        try:
            engine = point.load()
        except Exception as e:      # another package's: it costs its own models, not the others'
            log.warning("the engine %r (%s) cannot be loaded: %s: %s", point.name, point.value, type(e).__name__, e)
            continue
        if engine.name != point.name or engine.name == "hf":
            log.warning("the engine registered as %r names itself %r: ignored", point.name, engine.name)
            continue
        REGISTRY[engine.name] = engine
        installed.cache_clear()


@functools.cache
def installed() -> dict[str, str]:
    """Versions of the known engines installed in this environment, from package metadata (no
    import)."""
    from importlib import metadata
    _discover()
    found = {}
    for engine in REGISTRY.values():
        for dist in engine.distributions:
            try:
                found[engine.name] = metadata.version(dist)
                break
            except metadata.PackageNotFoundError:
                continue
    return found

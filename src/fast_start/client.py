"""The engine side: `fetch` a rank's weights and `load_into` a module built on `meta`.

`fetch` returns the same tensors whether they come from a daemon's arenas or from disk: both run
`materialize.derive`. In `zero_copy` mode arena tensors are read-only views of shared memory
(writing through one faults); in `copy` mode they are cloned into memory the engine owns and the
mappings are dropped.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Iterator

import torch

from . import arena as arenas
from .errors import FastStartError, LoadError
from .fingerprint import Fingerprint, WeightSpec
from .manifest import Manifest
from .materialize import load_from_disk

MODES = ("zero_copy", "copy")


class Weights(Mapping):
    """name -> tensor for one rank. Tied names (`aliases`) resolve to the tensor they share.

    `source` is "cache" or "disk"; `fingerprint` is what the tensors were derived from.
    """

    def __init__(self, tensors: dict[str, torch.Tensor], aliases: dict[str, str], source: str,
                 fingerprint: Fingerprint):
        self.tensors, self.aliases = tensors, aliases
        self.source, self.fingerprint = source, fingerprint

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[self.aliases.get(name, name)]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def __repr__(self) -> str:
        return f"Weights({len(self)} tensors, source={self.source!r}, rank={self.fingerprint.rank})"


def fetch(spec: WeightSpec, device: str | torch.device = "cpu", mode: str = "zero_copy",
          fallback: bool = True) -> Weights:
    """This rank's weights on `device`: from the cache where a daemon holds them, else from disk."""
    if mode not in MODES:
        raise FastStartError(f"fetch mode {mode!r} is unknown", f"use one of {', '.join(MODES)}")
    tensors, aliases, fp = load_from_disk(spec, device)
    return Weights(tensors, aliases, "disk", fp)


def from_arenas(manifest: Manifest, fds: list[int], mode: str = "zero_copy") -> Weights:
    """Build weights from arena fds (the caller keeps ownership of the fds and may close them)."""
    if len(fds) != len(manifest.arenas):
        raise FastStartError(f"got {len(fds)} arena fds for {len(manifest.arenas)} arenas",
                             "ask the daemon again; the reply was incomplete")
    maps = [arenas.map_readonly(fd, a.size, a.device) for fd, a in zip(fds, manifest.arenas)]
    tensors = {e.name: arenas.view(maps[e.arena], e) for e in manifest.tensors}
    if mode == "copy":
        tensors = {n: t.clone() for n, t in tensors.items()}   # the maps go with the last view
    return Weights(tensors, dict(manifest.aliases), "cache", manifest.fingerprint)


def load_into(module: torch.nn.Module, weights: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    """Replace a `meta` module's parameters and persistent buffers with `weights`, keeping ties.

    Tied parameters (one object under several names) get one tensor under all their names.
    Raises `LoadError` naming missing, unexpected and wrong-shaped or wrong-dtype tensors;
    nothing is replaced unless everything fits. Non-persistent buffers (rotary caches) are the
    caller's to recompute.
    """
    groups: dict[int, list[str]] = {}
    state = module.state_dict(keep_vars=True)
    for name, t in state.items():
        groups.setdefault(id(t), []).append(name)
    chosen, missing, wrong, used = {}, [], [], set()
    for names in groups.values():
        found = next((n for n in names if n in weights), None)
        if found is None:
            missing += names
            continue
        used.update(n for n in names if n in weights)
        src, want = weights[found], state[names[0]]
        if src.shape != want.shape or src.dtype != want.dtype:
            wrong.append(f"{found}: got {src.dtype} {tuple(src.shape)}, module has {want.dtype} {tuple(want.shape)}")
        chosen[tuple(names)] = src
    unexpected = [n for n in weights if n not in used]
    if missing or unexpected or wrong:
        raise LoadError("weights do not fit the module: " + "; ".join(
            f"{label} {items[:5]}{' …' if len(items) > 5 else ''}"
            for label, items in (("missing", missing), ("unexpected", unexpected), ("mismatched", wrong)) if items),
            "build the module for the same architecture, TP rank, dtype and quantization as the weights")
    for names, src in chosen.items():
        value = src if not isinstance(state[names[0]], torch.nn.Parameter) else torch.nn.Parameter(src, requires_grad=False)
        for name in names:
            owner, _, attr = name.rpartition(".")
            sub = module.get_submodule(owner)
            table = sub._parameters if attr in sub._parameters else sub._buffers
            table[attr] = value
    return module

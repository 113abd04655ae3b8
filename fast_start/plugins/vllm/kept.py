"""What vLLM rebuilds at every start, kept by the daemon with the model's cache (`fast_start.artifacts`).

vLLM keeps its torch.compile cache under `VLLM_CACHE_ROOT` (and, from the compile on, Inductor's
and Triton's caches inside it), below `$HOME` by default. Where the engine can write there, it
stays vLLM's folder (`own_cache`): a warm one starts exactly as without fast-start, and one
emptied (a container, a reboot) gets what it lacks from the set the daemon kept for this
engine's key (`hand_over`), before vLLM compiles. Where it cannot (a sandboxed engine), the
loader points all three caches (Triton's and Inductor's are under `$HOME` and `/tmp` before the
compile) at the engine user's folder for this key in the temp dir, filled from the set: the
engine then starts from kept artifacts although its `$HOME` is neither writable nor kept. Either
folder is the same path at every start (vLLM's cache names files by absolute path). Once the
engine has compiled and warmed up (`Worker.compile_or_warm_up_model`, wrapped by `register`),
the set is sent back if the engine added to it (`keep_new`): in vLLM's own folder, the folders
of this engine's compile and any file new since its start. (vLLM's CPU build compiles through
torch's Inductor, whose cache is `/tmp/torchinductor_<user>` unless `TORCHINDUCTOR_CACHE_DIR`
puts it inside vLLM's folder: only then is it kept.) One folder per daemon and key: a TP
rank's worker is its own process and talks to its own GPU's daemon.

The key is what vLLM names its compile cache after, less the traced code, which only another
vLLM changes: its config hash (`compute_hash`), its compile-relevant environment
(`envs.compile_factors`), and vLLM's and torch's versions; and the folder's path. The settings
sent with it spell out the engine options that most often differ (`SETTINGS`), so that a miss
names them.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch
import vllm

from ... import artifacts
from ...errors import FastStartError

log = logging.getLogger("vllm.fast_start")

# variable -> its folder inside ours. vLLM points Inductor's and Triton's at its compile cache
# where its own backend compiles; where torch.compile's does (VLLM_USE_AOT_COMPILE=0) they stay here.
POINTED = {"VLLM_CACHE_ROOT": "vllm", "TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}
SETTINGS = {        # vLLM config section -> the fields a miss names where they differ
    "model_config": ("model", "dtype", "quantization", "max_model_len", "enforce_eager", "revision"),
    "cache_config": ("block_size", "cache_dtype"),
    "parallel_config": ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
                        "enable_expert_parallel"),
    "scheduler_config": ("max_num_seqs", "max_num_batched_tokens"),
    "compilation_config": ("mode", "backend", "cudagraph_mode", "cudagraph_capture_sizes", "compile_sizes",
                           "custom_ops", "splitting_ops", "use_inductor_graph_partition", "pass_config"),
}
_folder: artifacts.Folder | None = None


def identity(vllm_config) -> tuple[str, dict[str, str]]:
    """(key, settings) of this engine's artifacts."""
    from vllm import envs
    settings = {"vllm": vllm.__version__, "torch": torch.__version__, "vLLM's config hash": vllm_config.compute_hash()}
    for section, names in SETTINGS.items():
        config = getattr(vllm_config, section, None)
        for name in names:
            if hasattr(config, name):
                settings[f"{section.removesuffix('_config')}.{name}"] = str(getattr(config, name))
    factors = {f"env {k}": str(v) for k, v in sorted(envs.compile_factors().items())}
    keyed = [settings["vllm"], settings["torch"], settings["vLLM's config hash"], factors]
    return hashlib.sha256(json.dumps(keyed).encode()).hexdigest(), {**settings, **factors}


def own_cache() -> Path | None:
    """vLLM's cache folder (`VLLM_CACHE_ROOT`) if this engine can write in it, else None."""
    from vllm import envs
    root = Path(envs.VLLM_CACHE_ROOT)
    try:
        root.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=root).close()
    except OSError:
        return None
    return root


def hand_over(weights, vllm_config) -> None:
    """Give this process's vLLM caches what they lack of the daemon's set for its key, in vLLM's
    own folder or one in the temp dir (once: a speculative draft's load finds it done)."""
    global _folder
    if _folder is not None or weights.socket is None or weights.model is None:
        return
    try:
        key, settings = identity(vllm_config)
    except AttributeError as e:     # a vLLM without compute_hash or compile_factors: nothing to key by
        log.info("fast-start: vLLM keeps its own caches: this vLLM does not name its compile factors (%s)", e)
        return
    try:
        _folder = artifacts.hand_over(weights.socket, weights.model, key, settings, own_cache())
    except artifacts.Unkept as e:
        log.info("fast-start: vLLM keeps its own caches: %s", e.what)
        return
    if not _folder.own:
        for variable, name in POINTED.items():
            os.environ[variable] = str(_folder.path / name)
    said(_folder)


def said(folder: artifacts.Folder) -> None:
    """The engine's log line for how its folder was filled."""
    where = f"its own cache folder {folder.path}" if folder.own else f"fast-start's folder {folder.path}"
    if folder.outcome == "hit":
        log.info("fast-start: vLLM starts from the artifacts the daemon kept for these settings (%d files, "
                 "%.1f MiB, in %s)", len(folder.listing), sum(folder.listing.values()) / 2**20, where)
    elif folder.outcome.startswith("refused"):
        log.warning("fast-start: the artifacts the daemon kept are %s; vLLM uses %s as it finds it",
                    folder.outcome, where)
    else:
        log.info("fast-start: no artifacts kept for these settings (%s); vLLM uses %s as it finds it, and the "
                 "daemon keeps what it uses", folder.outcome.removeprefix("miss: "), where)


def keep_new(compilation_config=None) -> None:
    """Send the daemon the set if the engine added to it since `hand_over` (nothing if it started
    from the kept set without adding to it). This engine's compile folders (`compilation_config`'s,
    Inductor's and Triton's as vLLM set them) are kept where they are in vLLM's own folder."""
    if _folder is None:
        return
    hit = _folder.outcome == "hit"
    ours = [getattr(compilation_config, name, "") for name in ("cache_dir", "local_cache_dir")]
    ours += [os.environ.get(variable, "") for variable in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")]
    try:
        new = _folder.keep(tuple(str(p) for p in ours if p))
    except (FastStartError, OSError) as e:
        log.warning("fast-start: could not keep this engine's artifacts: %s", getattr(e, "what", e))
        return
    size, made = sum(_folder.listing.values()) / 2**20, _folder.made(new)
    if made and hit:
        log.warning("fast-start: vLLM added to the kept artifacts although they were made for these settings (it "
                    "rebuilt %d files: %s); the daemon keeps the new set (%.1f MiB)", len(made), _some(made), size)
    elif new and hit:
        log.info("fast-start: the daemon adds to the kept artifacts %d files an earlier engine made after they "
                 "were kept (compiled while it served: %s); %.1f MiB", len(new), _some(new), size)
    elif new:
        log.info("fast-start: the daemon keeps this engine's artifacts (%d files, %.1f MiB) for its next start",
                 len(new), size)


def _some(names: list[str]) -> str:
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def wrap_warm_up(worker) -> None:
    """The worker class's `compile_or_warm_up_model`, followed by `keep_new`."""
    worker.compile_or_warm_up_model = _then_keep(worker.compile_or_warm_up_model)


def _then_keep(warm_up):
    def warmed(self, *args, **kwargs):
        result = warm_up(self, *args, **kwargs)
        keep_new(getattr(getattr(self, "vllm_config", None), "compilation_config", None))
        return result
    return warmed

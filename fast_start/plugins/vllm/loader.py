"""vLLM: `--load-format fast_start` maps a rank's weights from the fast-start daemon.

`register` is the `vllm.general_plugins` entry point; vLLM calls it in every engine process
(more than once is harmless). The daemon's fill worker ran this engine's vLLM for the rank
(`fill.py`); the loader:

0. freezes the startup heap for Python's garbage collector, as vLLM does once the engine is up
   (vLLM's three collections around the load otherwise scan it: about a second);
1. asks the daemon for this rank's tensors (`fetch`, fingerprint from vLLM's own view: the
   checkpoint's headers, architecture, TP and PP size, global rank, dtype, quantization,
   revision, `vllm.__version__`, the KV-cache dtype and the kernel-selecting variables);
2. on a hit, builds vLLM's model without weight memory (naming the attention backends vLLM
   chose in the fill, where the selection's inputs are the same: `vllm_attention`) and compares
   its kernel plan with the fill's: on `meta` where the fill found that the cache completes such
   a model (its manifest then records the small attributes a meta build leaves without a value);
   otherwise on the target device with every parameter's storage released as it is registered
   (vLLM computes its buffers for real);
3. installs the cached tensors (`install.prepare`): for stage "processed" (vLLM's state after
   `process_weights_after_loading`), every parameter and buffer, dropping what processing
   dropped, then runs vLLM's pre-processed pass (`weights_already_processed()`), mends the gaps
   that pass leaves (`mend_gaps`) and compares the attribute signature with the fill's; for stage
   "loaded", the parameters are pointed at the cache, the buffers copied from it, and processing
   runs as usual. A model built on meta gets the recorded attributes and its reload record
   mended (`complete`), and is refused if anything is still on meta (`check_complete`);
4. on any miss (no daemon, a differing fingerprint, kernel plan or signature) releases the lease,
   logs one line naming the reason and loads with vLLM's default loader, or raises with
   `fallback: false`. A model is never half loaded: the default loader builds a new one.

5. on a hit, points vLLM's compile and kernel caches at a folder filled from the artifacts the
   daemon kept for this engine's settings, and keeps them once the engine has warmed up (`kept.py`).

Options come from `--model-loader-extra-config`: `mode` (zero_copy | copy), `fallback`
(default true), `socket_dir`, `connect_timeout_s`, `artifacts` (default true).

A zero_copy engine's weights are the daemon's, mapped read-only; the engine's features that write
weights are handled before they can fault: sleep mode (which frees and restores the engine's own
weight memory), weight transfer (`weight_transfer_config`: a trainer's updates written into the
weights) and expert load balancing are refused at start, a level-2 sleep (which discards the
weights; a standby's engine sleeps without sleep mode, `standby_kv.py`) as it is asked for, each
naming the fix (mode copy); `reload_weights` first makes the maps the engine's own memory at the
same addresses (`detach.py`), then reloads as vLLM does.
"""
from __future__ import annotations

import copy
import dataclasses
import gc
import itertools
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import vllm
from torch.nn.modules.module import register_module_parameter_registration_hook
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader import utils as vllm_utils
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.utils.torch_utils import set_default_torch_dtype

from . import attention as vllm_attention, compat, kept, roles, standby_kv, state as vllm_state
from ...engines.vllm import ENGINE, Settings as VllmSettings, rules as vllm_rules
from .install import prepare
from ...engines.vllm.record import FillRecord
from ...client import cached, fetch, release
from ...config import ModelConfig
from ...errors import CacheMiss, FastStartError, QuantizationError
from ...fingerprint import WeightSpec
from ...protocol import Mode
from ...dtypes import MODEL, torch_dtype

# Under "vllm" so that vLLM's log handler prints our lines with its own.
log = logging.getLogger("vllm.fast_start")

LOAD_FORMAT = "fast_start"
_registered = False


def register() -> None:
    """The `vllm.general_plugins` entry point: registers load format `fast_start`."""
    global _registered
    if not _registered:
        register_model_loader(LOAD_FORMAT)(FastStartLoader)
        counts_itself = not compat.current().COUNTS_MAPPED_WEIGHTS
        _wrap_runners(count=counts_itself)
        _wrap_startup_check(counts_itself)
        standby_kv.wrap_allocation()
        worker = _platform_worker()
        if worker is not None:
            kept.wrap_warm_up(worker)
            _wrap_sleep(worker)
        _registered = True


def _platform_worker():
    """vLLM's worker class of this platform; None in a build without it (only this platform's
    worker module is imported: the CPU one sets up shared memory as it loads)."""
    import importlib
    from vllm.platforms import current_platform
    module, name = (("vllm.v1.worker.cpu_worker", "CPUWorker") if current_platform.is_cpu()
                    else ("vllm.v1.worker.gpu_worker", "Worker"))
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


_excluded: dict = {}        # what the start-up check left out: {"bytes", "free", "requested"}
_starting: list = []        # the vLLM workers inside `init_device`, innermost last


def _wrap_startup_check(counts_itself: bool) -> None:
    """vLLM checks at start-up, before any loader runs, that the GPU's free memory holds
    `gpu_memory_utilization` of it (`request_memory`), counting the daemon's arenas as used; the
    snapshot it takes there is also what its profiler later measures the engine's own memory
    against. Two cases need the daemon's bytes for this rank counted otherwise:

    - A zero_copy engine maps them: they are its weights. vLLM 0.32 excludes them from the check
      itself (`get_external_weight_memory`); before 0.32 (`counts_itself`: `compat`'s
      `COUNTS_MAPPED_WEIGHTS` is False) they are counted as free for the check here, so an engine at 0.9 starts beside a cache of more than a tenth of the GPU. The KV
      cache is then sized as the default loader's on an empty GPU: the mapped bytes count as
      the model's memory (`_wrap_runners`). Should the load miss and fall back to disk, the
      check is made again without them (`_loading`).
    - A copy engine whose daemon drops its cache (`on_release = "drop"`) takes that memory over:
      the snapshot is taken as if the daemon did not hold those bytes (`_count_as_free`), on every
      version. Otherwise the check would count them as used, and the profiler, seeing another
      process's memory go away while the engine loads, would take it for memory the engine
      freed and size the KV cache larger by the model's bytes. Should the load miss, the daemon
      keeps them, the profiler sees them as the engine's, and the KV cache is smaller by them.
    """
    try:
        from vllm.v1.worker import gpu_worker
    except ImportError:
        return
    check, init_device = getattr(gpu_worker, "request_memory", None), gpu_worker.Worker.init_device
    if check is None:
        return

    def init(self, *args, **kwargs):
        _starting.append(self)
        try:
            return init_device(self, *args, **kwargs)
        finally:
            _starting.remove(self)

    def request(snapshot, cache_config, *args, **kwargs):
        return _request(check, counts_itself, snapshot, cache_config, *args, **kwargs)

    gpu_worker.Worker.init_device = init
    gpu_worker.request_memory = request


def _request(check, counts_itself: bool, snapshot, cache_config, *args, **kwargs) -> int:
    """vLLM's `request_memory` (`check`) for the worker starting now, the daemon's bytes for its
    rank counted as `_wrap_startup_check` says; a standby's is left to its wake (`standby_kv`)."""
    if standby_kv.standby():
        return standby_kv.unchecked(check, snapshot, cache_config, *args, **kwargs)
    how, held = _handover(_starting[-1].vllm_config, counts_itself) if _starting else ("", 0)
    if how == "drop":
        _count_as_free(snapshot, held)
        log.info("fast-start: the daemon hands the %.2f GiB it holds for this rank over to its copy "
                 "(on_release = \"drop\"): vLLM's memory accounting counts them as free at start-up", held / 2**30)
    elif how == "map" and counts_itself:
        counted = copy.copy(snapshot)
        counted.free_memory = snapshot.free_memory + held
        requested = check(counted, cache_config, *args, **kwargs)
        _excluded.update(bytes=held, free=snapshot.free_memory, requested=requested)
        log.info("fast-start: the %.2f GiB this rank maps from the daemon count as free in vLLM's start-up "
                 "memory check", held / 2**30)
        return requested
    try:
        return check(snapshot, cache_config, *args, **kwargs)
    except ValueError:
        if how == "keep":       # vLLM's own message names neither way out
            log.error("fast-start: the daemon keeps its %.2f GiB for this rank beside this engine's copy "
                      "(on_release = \"keep\"), and vLLM counts them as used (fix: load with mode zero_copy, "
                      "set on_release = \"drop\" in the daemon's config, or lower gpu_memory_utilization)",
                      held / 2**30)
        raise


def _handover(vllm_config, zero_copy: bool = True) -> tuple[str, int]:
    """What becomes of the bytes the daemon holds for exactly this rank: ("map", n) a zero_copy
    engine maps them; ("drop", n) a copy engine takes them over; ("keep", n) a copy engine copies
    them beside the cache; ("", 0) any other load, and a zero_copy one unless `zero_copy` (the
    daemon is not asked then)."""
    load = vllm_config.load_config
    if load.load_format != LOAD_FORMAT:
        return "", 0
    try:
        options = Options.parse(load.model_loader_extra_config)
        if options.mode == "zero_copy" and not zero_copy:
            return "", 0
        held, on_release = _held(vllm_config, options)
    except (FastStartError, ValueError):
        return "", 0
    if held and options.mode == "zero_copy":
        return "map", held
    if held:
        return ("drop" if on_release == "drop" else "keep"), held
    return "", 0


def _held(vllm_config, options: "Options") -> tuple[int, str]:
    """(bytes, on_release) the daemon holds for this rank's models: the target's (a miss raises)
    and a speculative draft's where it is cached too."""
    (target, parallel), *drafts = _models(vllm_config)
    device = _device(vllm_config)
    held, on_release = cached(weight_spec(target, vllm_config, parallel), device, options.socket_dir,
                              options.connect_timeout_s)
    for model_config, parallel in drafts:
        try:
            held += cached(weight_spec(model_config, vllm_config, parallel), device, options.socket_dir,
                           options.connect_timeout_s)[0]
        except FastStartError:
            pass
    return held, on_release


def _models(vllm_config):
    """(model config, parallel config) of each model this engine loads with its load format: the
    target, then a speculative draft model's (vLLM's draft loader takes the target's load config)."""
    out = [(vllm_config.model_config, vllm_config.parallel_config)]
    speculative = getattr(vllm_config, "speculative_config", None)
    draft = getattr(speculative, "draft_model_config", None)
    if draft is not None and draft is not vllm_config.model_config:
        out.append((draft, speculative.draft_parallel_config))
    return out


def _count_as_free(snapshot, held: int) -> None:
    """vLLM's start-up memory snapshot, in place, as it would read without the daemon's `held` bytes."""
    snapshot.free_memory += held
    snapshot.cuda_memory -= held
    snapshot.non_torch_memory -= held


def _wrap_runners(count: bool) -> None:
    """Both GPU model runners' `load_model`, when the load format is ours: the startup heap frozen
    for the GC before vLLM's DeviceMemoryProfiler collects it (0.3-0.5 s, inside vLLM's "Model
    loading took" window); and with `count` (vLLM before 0.32, which cannot be told about weights
    mapped from elsewhere: it gained `get_external_weight_memory` in 0.32 and would size the KV
    cache as if they were free) the mapped bytes counted as the model's memory, as the default
    loader's copy would be counted."""
    import importlib
    for module in ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner"):
        try:
            runner = importlib.import_module(module).GPUModelRunner
        except (ImportError, AttributeError):      # a build without that runner
            continue
        runner.load_model = _loading(runner.load_model, count)
        if hasattr(runner, "reload_weights"):
            runner.reload_weights = _detaching(runner.reload_weights)


def _loading(load_model, count: bool):
    def load(self, *args, **kwargs):
        ours = getattr(getattr(self, "load_config", None), "load_format", None) == LOAD_FORMAT
        if ours:
            gc.freeze()     # see FastStartLoader._load_model
        result = load_model(self, *args, **kwargs)
        if _excluded and getattr(self.get_model(), "fast_start_source", "disk") != "cache" \
                and _excluded["free"] < _excluded["requested"]:
            raise ValueError(f"fast-start: vLLM's start-up memory check counted the {_excluded['bytes'] / 2**30:.2f} "
                             "GiB the daemon holds for this rank as free, but the load missed and read the disk "
                             f"(see the line above): {_excluded['free'] / 2**30:.2f} GiB was free, "
                             f"{_excluded['requested'] / 2**30:.2f} GiB requested; fix the miss, or lower "
                             "gpu_memory_utilization")
        drafter = getattr(getattr(self, "drafter", None), "model", None)     # a speculative engine's draft
        mapped = sum(getattr(m, "fast_start_mapped_bytes", 0) for m in (self.get_model(), drafter)) \
            if ours and count else 0
        if mapped:
            self.model_memory_usage += mapped
            log.info("fast-start: %.2f GiB mapped from the daemon counted as the model's memory", mapped / 2**30)
        return result
    return load


def _detaching(reload_weights):
    def reload(self, *args, **kwargs):
        model = self.get_model()
        mapped = getattr(model, "fast_start_mapped_bytes", 0)
        if mapped:
            from ...detach import detach
            log.warning("fast-start: reload_weights writes the weights in place: the %.2f GiB this engine maps "
                        "read-only from the daemon are copied into its own memory first (mode copy avoids this)",
                        mapped / 2**30)
            detach(itertools.chain(model.parameters(), model.buffers()))
            model.fast_start_mapped_bytes = 0
        return reload_weights(self, *args, **kwargs)
    return reload


def _wrap_sleep(worker) -> None:
    """The worker's sleep and wake_up as a standby uses them. Sleep: refused at level 2 where the
    weights are mapped from the daemon; vLLM's own where it has something to do
    (`standby_kv.pooled`); the KV cache's ranges lightened; the daemon told "standby". Wake: the
    daemon told "waking"; the ranges backed before vLLM's own wake; then "serving"."""
    sleep, wake_up = worker.sleep, worker.wake_up

    def sleeping(self, level: int = 1, *args, **kwargs):
        if level >= 2 and getattr(self.model_runner.get_model(), "fast_start_mapped_bytes", 0):
            raise ValueError("fast-start: a level-2 sleep discards the weights and wakes by reloading them, and a "
                             "zero_copy engine's weights are the daemon's, mapped read-only: nothing was discarded "
                             "(wake_up resumes the engine); sleep at level 1, which releases the KV cache only, "
                             "or load with --model-loader-extra-config '{\"mode\": \"copy\"}'")
        result = sleep(self, level, *args, **kwargs) if standby_kv.pooled(self) else None
        standby_kv.sleep()
        roles.tell("standby")
        return result

    def waking(self, *args, **kwargs):
        roles.tell("waking")
        standby_kv.wake()
        result = wake_up(self, *args, **kwargs) if standby_kv.pooled(self) else None
        roles.tell("serving")
        return result

    worker.sleep, worker.wake_up = sleeping, waking


def refusal(vllm_config, mode: str) -> str | None:
    """Why an engine feature that writes weights cannot run on weights mapped from the daemon."""
    if mode != "zero_copy":
        return None
    fix = "load with --model-loader-extra-config '{\"mode\": \"copy\"}'"
    if getattr(vllm_config.model_config, "enable_sleep_mode", False):
        return (f"fast-start: enable_sleep_mode frees and restores the engine's own weight memory, and a zero_copy "
                f"engine's weights are the daemon's, mapped read-only; {fix}")
    if getattr(vllm_config.parallel_config, "enable_eplb", False):
        return (f"fast-start: enable_eplb moves experts between ranks as the engine runs, writing their weights "
                f"in place, and a zero_copy engine's weights are the daemon's, mapped read-only; {fix} (it loads "
                "from disk: expert load balancing's layouts are not cached)")
    if getattr(vllm_config, "weight_transfer_config", None) is not None:
        return (f"fast-start: weight_transfer_config writes a trainer's weights into the engine's, and a zero_copy "
                f"engine's weights are the daemon's, mapped read-only; {fix}")
    return None


# Each option's JSON types and how an error message names them.
OPTION_TYPES = {"mode": ((str,), "a string"), "fallback": ((bool,), "true or false"),
                "socket_dir": ((str,), "a string"), "connect_timeout_s": ((int, float), "a number"),
                "artifacts": ((bool,), "true or false")}


@dataclass(frozen=True)
class Options:
    mode: Mode = Mode.ZERO_COPY
    fallback: bool = True
    socket_dir: str | None = None
    connect_timeout_s: float = 5.0
    artifacts: bool = True          # vLLM's compile and kernel caches kept by the daemon (`kept.py`)

    @classmethod
    def parse(cls, extra: object) -> Options:
        """`--model-loader-extra-config` as Options; a wrong key or type names it and the fix."""
        if not isinstance(extra, dict):
            raise ValueError(f"--model-loader-extra-config for load format {LOAD_FORMAT} must be a JSON object")
        for key, value in extra.items():
            if key not in OPTION_TYPES:
                raise ValueError(f"--model-loader-extra-config key {key!r} is unknown to load format "
                                 f"{LOAD_FORMAT}; use {', '.join(OPTION_TYPES)}")
            types, kind = OPTION_TYPES[key]
            if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
                raise ValueError(f"--model-loader-extra-config key {key!r} is {value!r}; it must be {kind}")
        options = cls(**{**extra, "mode": Mode.of(extra.get("mode", cls.mode), "--model-loader-extra-config mode")})
        if options.connect_timeout_s <= 0:
            raise ValueError("--model-loader-extra-config connect_timeout_s must be above 0")
        return options


class FastStartLoader(BaseModelLoader):
    def __init__(self, load_config):
        super().__init__(load_config)
        self.options = Options.parse(load_config.model_loader_extra_config)

    def default_loader(self) -> DefaultModelLoader:
        """vLLM's own loader, for the same checkpoint, without our options."""
        return DefaultModelLoader(dataclasses.replace(self.load_config, load_format="auto",
                                                      model_loader_extra_config={}))

    def download_model(self, model_config) -> None:
        self.default_loader().download_model(model_config)

    def load_weights(self, model: torch.nn.Module, model_config) -> None:
        # In-place reloads read the checkpoint as vLLM does (a zero_copy model's maps were made
        # the engine's own first: `_detaching`).
        self.default_loader().load_weights(model, model_config)

    def get_all_weights(self, model_config, model: torch.nn.Module):
        """The checkpoint's tensors, as vLLM's `reload_weights` asks a loader for them."""
        return self.default_loader().get_all_weights(model_config, model)

    def get_external_weight_memory(self, vllm_config) -> int:
        """Bytes a zero-copy engine will map from the daemon: vLLM counts them as used."""
        if self.options.mode != "zero_copy":
            return 0
        try:
            return _held(vllm_config, self.options)[0]
        except FastStartError:
            return 0

    def load_model(self, vllm_config, model_config, prefix: str = "") -> torch.nn.Module:
        # The build makes tens of thousands of objects and no garbage: with the collector on, its
        # collections of them cost about a tenth of the build.
        enabled = gc.isenabled()
        gc.disable()
        try:
            return self._load_model(vllm_config, model_config, prefix)
        finally:
            if enabled:
                gc.enable()

    def _load_model(self, vllm_config, model_config, prefix: str) -> torch.nn.Module:
        o = self.options
        refused = refusal(vllm_config, o.mode)
        if refused:
            raise ValueError(refused)
        # vLLM times this call inside DeviceMemoryProfiler, whose gc.collect() calls scan the whole
        # startup heap: 0.3-0.5 s each with vLLM imported (623k objects), three of them. vLLM
        # freezes that heap itself once the engine is up (freeze_gc_heap); freezing it here, as
        # the load starts, is the same freeze seconds earlier: the collections after the load
        # scan only what the load made (1.5 ms). vLLM's shutdown unfreezes it as before. The
        # runners' wrapper (`_wrap_runners`) froze it already, before the profiler's first
        # collection; this is for a runner it does not know.
        gc.freeze()
        device = _device(vllm_config)
        weights, registered = None, vllm_state.registrations(vllm_config)
        clock, cpu_start = [time.perf_counter()], time.thread_time()
        try:
            spec = weight_spec(model_config, vllm_config)
            weights = fetch(spec, device, o.mode, fallback=False, socket_dir=o.socket_dir,
                            connect_timeout=o.connect_timeout_s)
            clock.append(time.perf_counter())
            record = FillRecord.from_dict(weights.engine)
            on_meta = record.attrs is not None
            with vllm_attention.choosing(record.attention):
                model = build(vllm_config, model_config, prefix, device, on_meta)
            clock.append(time.perf_counter())
            prepare(model, weights, record, model_config, device)
            clock.append(time.perf_counter())
        except FastStartError as miss:
            if weights is not None:
                model = None        # drop the half-installed model (and its mappings) before the disk load
                release(weights, o.connect_timeout_s)
                vllm_state.restore_registrations(vllm_config, registered)
            if not o.fallback:
                raise
            fields = getattr(miss, "fields", ())
            log.warning("fast-start: cache miss for %s (%s%s); loading with vLLM's default loader",
                        model_config.model, miss.what, f"; differing fields: {', '.join(fields)}" if fields else "")
            return self.default_loader().load_model(vllm_config, model_config, prefix)
        nbytes = sum(t.nbytes for t in weights.tensors.values())
        _log_load(spec, weights, nbytes, record, o.mode, clock, 1e3 * (time.thread_time() - cpu_start), on_meta)
        model.fast_start_source = weights.source
        roles.holding(weights)
        if o.artifacts:
            kept.hand_over(weights, vllm_config)
        if o.mode == "zero_copy":       # read by _count_mapped_weights on vLLM < 0.32
            model.fast_start_mapped_bytes = nbytes
        return model.eval()


def _log_load(spec: WeightSpec, weights, nbytes: int, record: FillRecord, mode: str, clock: list[float],
              cpu: float, on_meta: bool) -> None:
    """The load's line: what came from the cache and each step's time (`clock`: its start, then the
    end of the fetch, of the build, of the install). The CPU time says whether a slow load computed
    slowly or waited (for the GPU, the daemon, the CPU itself where the machine is oversubscribed)."""
    fetched, built, prepared = (1e3 * (b - a) for a, b in zip(clock, clock[1:]))
    rank = f"rank {spec.rank} of {spec.tensor_parallel_size * spec.pipeline_parallel_size}"
    if spec.data_parallel_size > 1:
        rank += f" (DP rank {spec.data_parallel_rank} of {spec.data_parallel_size})"
    log.info("fast-start: %d tensors (%.1f MiB, %s) for %s from the cache (%s): fetch %.1f ms, "
             "model built on %s %.1f ms, installed %.1f ms (this thread's CPU time: %.1f of %.1f ms)",
             len(weights), nbytes / 2**20, record.stage, rank, mode, fetched,
             "meta" if on_meta else "the device", built, prepared, cpu, fetched + built + prepared)


def weight_spec(model_config, vllm_config, parallel=None) -> WeightSpec:
    """What this engine process needs, in fast-start's terms; raises CacheMiss where it cannot say.
    `parallel`: the model's parallel config where it is not the engine's (a speculative draft's)."""
    from vllm.distributed import get_dp_group, get_pp_group, get_tensor_model_parallel_rank, get_tp_group

    parallel = parallel or vllm_config.parallel_config
    if getattr(parallel, "enable_eplb", False):
        raise CacheMiss("expert load balancing (--enable-eplb) moves experts between ranks as the engine runs; "
                        "its layouts are not cached", "serve it without fast-start, or without --enable-eplb")
    chosen = vllm_rules.unmatched_choices(vllm_config, parallel)
    if chosen:
        raise CacheMiss(f"the engine chooses its kernels ({', '.join(chosen)}), which may lay out the processed "
                        "weights otherwise, and the fill does not (it takes vLLM's defaults)",
                        "serve it without those options to load from the cache")
    speculative = getattr(vllm_config, "speculative_config", None)
    if speculative is not None and model_config is speculative.draft_model_config:
        _check_draft(model_config, speculative.method)
    elif model_config.hf_overrides:
        raise CacheMiss("--hf-overrides change the model but not the checkpoint the fingerprint reads",
                        "serve it without --hf-overrides, or write the overrides into the checkpoint's config.json")
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    quantization = model_config.quantization or "none"
    try:
        vllm_rules.check(quantization, tp)
    except QuantizationError as e:
        raise CacheMiss(e.what, e.fix) from None
    dtype = next((name for name in MODEL if torch_dtype(name) == model_config.dtype), None)
    if dtype is None:
        raise CacheMiss(f"dtype {model_config.dtype} is not cached", f"use one of {', '.join(MODEL)}")
    if get_tp_group().world_size != tp:
        raise CacheMiss(f"this model's TP size {tp} is not the engine's ({get_tp_group().world_size}): a draft's "
                        "own TP size is not cached", "run the draft at the target's TP size")
    dp = parallel.data_parallel_size      # this engine as a [[model]] would say it; its slot, not a GPU, is its rank
    model = ModelConfig(name=model_config.model, path=_local_folder(model_config), gpus=(), tensor_parallel_size=tp,
                        dtype=dtype, quantization=quantization, engine=ENGINE.name,
                        revision=model_config.revision or "main", engine_version=vllm.__version__,
                        pipeline_parallel_size=pp, data_parallel_size=dp,
                        enable_expert_parallel=getattr(parallel, "enable_expert_parallel", False),
                        expert_placement_strategy=getattr(parallel, "expert_placement_strategy", "linear"),
                        settings=VllmSettings.of_engine(vllm_config, os.environ))
    dp_rank = get_dp_group().rank_in_group if dp > 1 else 0
    return model.slot_spec((dp_rank * pp + get_pp_group().rank_in_group) * tp + get_tensor_model_parallel_rank())


def _check_draft(model_config, method: str) -> None:
    """CacheMiss for a speculative draft that vLLM builds as something other than its checkpoint's
    model: MTP and EAGLE heads, whose config vLLM rewrites (architecture, model type) and whose
    weights it ties to the target's. A draft model of its own (`draft_model`) is that model, cached
    under its own checkpoint's fingerprint."""
    folder = Path(_local_folder(model_config))
    try:
        written = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        written = {}
    built = model_config.hf_config
    if written.get("architectures") != list(getattr(built, "architectures", None) or []) \
            or written.get("model_type") != getattr(built, "model_type", None):
        raise CacheMiss(f"the {method} draft is vLLM's {built.architectures} made of {folder} "
                        f"({written.get('architectures')}), which the cache does not hold",
                        "nothing to fix: the draft loads from disk, the target from the cache")


def _local_folder(model_config) -> str:
    """The checkpoint folder vLLM reads: a local path, or the model's snapshot in the local HF cache."""
    if Path(model_config.model).is_dir():
        return model_config.model
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(model_config.model, revision=model_config.revision, local_files_only=True)
    except (ImportError, OSError, ValueError) as e:     # not cached, or not a repo id: vLLM's loader decides
        raise CacheMiss(f"{model_config.model} is not a local folder nor in the local HF cache ({type(e).__name__})",
                        "download the model first (the daemon needs its path)") from None


def _device(vllm_config) -> torch.device:
    load_device = vllm_config.load_config.device or vllm_config.device_config.device
    return torch.device(load_device)


def build(vllm_config, model_config, prefix: str, device: torch.device, on_meta: bool) -> torch.nn.Module:
    """vLLM's model without weight memory: on `meta` where the fill found that the cache completes
    it (`prepare` then installs the cached buffers and the recorded attributes); otherwise on
    `device` with every parameter's storage released as it is registered (vLLM computes its
    buffers for real; the peak is one tensor)."""
    if on_meta:
        try:
            return _build_on_meta(vllm_config, model_config, prefix)
        except Exception as e:      # noqa: BLE001 - whatever it is, the default loader can still load
            raise CacheMiss(f"vLLM could not build the model on meta here as the fill did ({type(e).__name__}: {e})",
                            "report this with your vLLM version; the default loader is used meanwhile") from None
    handle = register_module_parameter_registration_hook(_release_storage)
    try:
        with set_default_torch_dtype(model_config.dtype), device:
            return vllm_utils.initialize_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
    finally:
        handle.remove()


def _build_on_meta(vllm_config, model_config, prefix: str) -> torch.nn.Module:
    """vLLM's build on meta, with vLLM's record of the model for `reload_weights` made once the meta
    device mode is left: inside it, torch's Python mode intercepts each of the record's few
    thousand tensor calls, which makes the record about twice as slow. The record is the same but
    for the device it notes, which `_mend_reload_record` sets to the engine's either way."""
    record = getattr(vllm_utils, "record_metadata_for_reloading", None)    # absent before vLLM's layerwise reload
    built: list[torch.nn.Module] = []
    if record is not None:
        vllm_utils.record_metadata_for_reloading = built.append
    try:
        with set_default_torch_dtype(model_config.dtype), torch.device("meta"):
            model = vllm_utils.initialize_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
    finally:
        if record is not None:
            vllm_utils.record_metadata_for_reloading = record
    for each in built:
        record(each)
    return model


def _release_storage(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
    if param is None or param.is_meta:
        return
    storage = param.untyped_storage()
    if param.storage_offset() == 0 and storage.nbytes() == param.nbytes and storage.resizable():
        storage.resize_(0)      # only a parameter that owns its whole storage; never someone's view

"""vLLM: `--load-format fast_start` maps a rank's weights from the fast-start daemon.

`register` is the `vllm.general_plugins` entry point; vLLM calls it in every engine process
(more than once is harmless). The loader:

1. asks the daemon for this rank's tensors in the `vllm` layout (`fetch`, fingerprint from
   vLLM's own view: the checkpoint's headers, architecture, TP size and rank, dtype,
   quantization, revision and `vllm.__version__`);
2. on a hit, builds vLLM's model on the target device with every parameter's storage released
   as it is registered (so no weight memory is allocated, while buffers vLLM computes at
   construction, rotary caches and attention scales, are computed for real), then points each
   parameter at its cache tensor, keeping vLLM's parameter objects and their weight loaders;
3. runs vLLM's `process_weights_after_loading`, as the default loader does;
4. on any miss, logs one line naming the reason and loads with vLLM's default loader, or
   raises with `fallback: false`.

Options come from `--model-loader-extra-config`: `mode` (zero_copy | copy), `fallback`
(default true), `socket_dir`, `connect_timeout_s`.
"""
from __future__ import annotations

import dataclasses
import logging
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

from .client import MODES, Weights, cached_bytes, fetch, fit_error
from .errors import CacheMiss, FastStartError
from .fingerprint import WeightSpec
from .dtypes import MODEL, torch_dtype

# Under "vllm" so that vLLM's log handler prints our lines with its own.
log = logging.getLogger("vllm.fast_start")

LOAD_FORMAT = "fast_start"
_registered = False


def register() -> None:
    """The `vllm.general_plugins` entry point: registers load format `fast_start`."""
    global _registered
    if not _registered:
        register_model_loader(LOAD_FORMAT)(FastStartLoader)
        _registered = True


# Each option's JSON types and how an error message names them.
OPTION_TYPES = {"mode": ((str,), "a string"), "fallback": ((bool,), "true or false"),
                "socket_dir": ((str,), "a string"), "connect_timeout_s": ((int, float), "a number")}


@dataclass(frozen=True)
class Options:
    mode: str = "zero_copy"
    fallback: bool = True
    socket_dir: str | None = None
    connect_timeout_s: float = 5.0

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
        options = cls(**extra)
        if options.mode not in MODES:
            raise ValueError(f"--model-loader-extra-config mode {options.mode!r} is unknown; "
                             f"use one of {', '.join(MODES)}")
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
        # In-place reloads (vLLM's reload_weights) read the checkpoint as vLLM does.
        self.default_loader().load_weights(model, model_config)

    def get_external_weight_memory(self, vllm_config) -> int:
        """Bytes a zero-copy engine will map from the daemon: vLLM counts them as used."""
        if self.options.mode != "zero_copy":
            return 0
        try:
            spec = weight_spec(vllm_config.model_config, vllm_config)
            device = _device(vllm_config)
            return cached_bytes(spec, device, self.options.socket_dir, self.options.connect_timeout_s)
        except FastStartError:
            return 0

    def load_model(self, vllm_config, model_config, prefix: str = "") -> torch.nn.Module:
        o = self.options
        device = _device(vllm_config)
        try:
            spec = weight_spec(model_config, vllm_config)
            weights = fetch(spec, device, o.mode, fallback=False, socket_dir=o.socket_dir,
                            connect_timeout=o.connect_timeout_s)
            model = build(vllm_config, model_config, prefix, device)
            install(model, weights)
        except FastStartError as miss:
            if not o.fallback:
                raise
            fields = getattr(miss, "fields", ())
            log.warning("fast-start: cache miss for %s (%s%s); loading with vLLM's default loader",
                        model_config.model, miss.what, f"; differing fields: {', '.join(fields)}" if fields else "")
            return self.default_loader().load_model(vllm_config, model_config, prefix)
        log.info("fast-start: %d tensors (%.1f MiB) for TP rank %d of %d from the cache (%s)", len(weights),
                 sum(t.nbytes for t in weights.tensors.values()) / 2**20, spec.rank, spec.tensor_parallel_size, o.mode)
        with set_default_torch_dtype(model_config.dtype):
            vllm_utils.process_weights_after_loading(model, model_config, device)
        model.fast_start_source = weights.source
        return model.eval()


def weight_spec(model_config, vllm_config) -> WeightSpec:
    """What this engine process needs, in fast-start's terms; raises CacheMiss where it cannot say."""
    from vllm.distributed import get_tensor_model_parallel_rank

    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise CacheMiss("pipeline parallelism is not cached", "use tensor parallelism only")
    if model_config.quantization:
        raise CacheMiss(f"vLLM quantization {model_config.quantization!r} is not cached by layout \"vllm\"",
                        "run the model unquantized, or without --load-format fast_start")
    dtype = next((name for name in MODEL if torch_dtype(name) == model_config.dtype), None)
    if dtype is None:
        raise CacheMiss(f"dtype {model_config.dtype} is not cached", f"use one of {', '.join(MODEL)}")
    return WeightSpec(_local_folder(model_config), parallel.tensor_parallel_size, get_tensor_model_parallel_rank(),
                      dtype, "none", "vllm", model_config.revision or "main", vllm.__version__)


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


def build(vllm_config, model_config, prefix: str, device: torch.device) -> torch.nn.Module:
    """vLLM's model on `device` with every parameter's storage released: shapes without memory.

    Building on `meta` instead would leave vLLM's computed buffers (rotary caches, attention
    scales, placeholders held as plain attributes) on meta; this way vLLM computes them itself.
    Each parameter's memory is freed as soon as it is registered, so the peak is one tensor.
    """
    handle = register_module_parameter_registration_hook(_release_storage)
    try:
        with set_default_torch_dtype(model_config.dtype), device:
            return vllm_utils.initialize_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
    finally:
        handle.remove()


def _release_storage(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
    if param is None or param.is_meta:
        return
    storage = param.untyped_storage()
    if param.storage_offset() == 0 and storage.nbytes() == param.nbytes and storage.resizable():
        storage.resize_(0)      # only a parameter that owns its whole storage; never someone's view


def install(model: torch.nn.Module, weights: Weights) -> None:
    """Point every parameter of `model` at its tensor in `weights`; raises LoadError if any does not fit.

    vLLM's parameter objects are kept (`param.data = tensor`), with the attributes its weight
    loaders and reload path rely on. Tied parameters are one object and get one tensor.
    """
    params = dict(model.named_parameters())
    wrong = [f"{n}: got {weights[n].dtype} {tuple(weights[n].shape)}, vLLM has {p.dtype} {tuple(p.shape)}"
             for n, p in params.items()
             if n in weights and (weights[n].shape != p.shape or weights[n].dtype != p.dtype)]
    missing = [n for n in params if n not in weights]
    unexpected = [n for n in weights if n not in params]
    if missing or unexpected or wrong:
        raise fit_error(missing, unexpected, wrong, "build vLLM for the same model, TP size and dtype as the "
                        "daemon's [[model]] (layout = \"vllm\")")
    for name, param in params.items():
        param.data = weights[name]

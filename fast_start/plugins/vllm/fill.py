"""The fill of an `engine = "vllm"` model: vLLM itself builds, loads and processes one rank.

Runs in the fill worker, with the engine's interpreter (`python` / `worker_python`), so the
bytes come from the engine's own vLLM, torch and kernels. For the rank the daemon serves it:

1. sets the kernel-selecting variables the fingerprint names (`engine_options`), builds vLLM's
   config from the model's settings, and stands in for the TP and PP groups with groups of one
   process that pose as rank r of n (any collective raises: a fill that needs peers fails loudly);
2. builds vLLM's model for that rank (any architecture vLLM supports) and records the kernel
   plan and the attention backends vLLM chose (`vllm_attention`), loads the checkpoint with
   vLLM's default loader, and
3. either runs `process_weights_after_loading` and exports every parameter and buffer
   (stage "processed"; the engine installs them under vLLM's `weights_already_processed()`, and
   finishes the layers vLLM's pass cannot itself: `vllm_preprocessed`), or
   exports the parameters as loaded (stage "loaded"; the engine runs the processing itself). The
   loaded stage serves the CPU build with unquantized models (its processing turns linear weights
   into oneDNN handles, which cannot be exported) and vLLM versions without the pre-processed
   hook; it is checked here: processing must not change a byte of what was exported, since an
   engine maps those bytes read-only.

Storages are written once each, whole: tensors that share one (a transposed view, tied weights)
share its bytes in the arena and keep their strides and offsets.
"""
from __future__ import annotations

import contextlib
import gc
import os
import tempfile
import time
import types
from collections.abc import Callable

import torch

from ... import arena as arenas
from . import attention as vllm_attention, preprocessed as vllm_preprocessed, state as vllm_state
from ...engines.vllm import ENGINE, rules as vllm_rules
from ...engines.vllm.record import FillRecord
from ...errors import FastStartError
from ...fingerprint import WeightSpec, fingerprint
from ...manifest import ALIGN, CHUNK, ArenaEntry, Manifest, TensorEntry, place
from ...dtypes import name_of

COLLECTIVES = ("all_reduce", "all_gather", "all_gatherv", "reduce_scatter", "reduce_scatterv", "gather",
               "broadcast", "broadcast_object", "broadcast_object_list", "broadcast_tensor_dict", "send_object",
               "recv_object", "send_tensor_dict", "recv_tensor_dict", "send", "recv", "barrier", "dispatch", "combine")


# FP4 methods: their loaded stage (the engine repacks) is not verified, only the processed one.
FP4 = ("compressed-tensors", "modelopt_fp4", "gpt_oss_mxfp4")


def stage_for(device: str, quantization: str, model: torch.nn.Module) -> str:
    """"processed" where the engine can install this model's processed weights: vLLM ≥ 0.30 (its
    pre-processed pass), or every quantized layer finished by `vllm_preprocessed` (FP4 kernels
    on any version); "loaded" otherwise, and for unquantized models on the CPU."""
    if device == "cpu" and quantization == "none":
        return "loaded"
    hook = vllm_preprocessed.has_hook()
    if quantization in FP4 and (layers := vllm_preprocessed.unfinished(model, hook)):
        others = vllm_preprocessed.finishing_backends(model, hook)
        raise FastStartError(f"neither vLLM {'' if hook else '(no pre-processed pass here) '}nor fast-start can "
                             f"finish {len(layers)} of this model's layers over processed weights "
                             f"({', '.join(layers[:3])}): every engine would miss",
                             f"{vllm_rules.backend_fix(others[0])} (a backend fast-start finishes), or serve it "
                             "without fast-start" if others
                             else "serve it without fast-start")
    if hook or vllm_preprocessed.processed_without_hook(model):
        return "processed"
    return "loaded"


def apply_env(env: dict[str, str]) -> None:
    """The kernel variables exactly as the fingerprint says (set ones set, the others unset)."""
    for name in vllm_rules.KERNEL_ENV:
        if name in env:
            os.environ[name] = env[name]
        else:
            os.environ.pop(name, None)


def engine_config(spec: WeightSpec, options: vllm_rules.Options):
    from vllm.engine.arg_utils import EngineArgs
    quantization = None if spec.quantization == "none" else spec.quantization
    args = EngineArgs(**options.engine_args(), model=spec.path, dtype=spec.dtype, quantization=quantization,
                      tensor_parallel_size=spec.tensor_parallel_size,
                      pipeline_parallel_size=spec.pipeline_parallel_size,
                      data_parallel_size=spec.data_parallel_size,
                      enable_expert_parallel=bool(spec.expert_parallel),
                      expert_placement_strategy=spec.expert_parallel or "linear",
                      enforce_eager=True,
                      skip_tokenizer_init=True, load_format="auto", use_tqdm_on_load=False)
    return args.create_engine_config()


@contextlib.contextmanager
def one_rank(spec: WeightSpec, parallel):
    """Process groups of one, posing as this rank of the TP, PP, DP and EP groups (vLLM's MoE
    layers read the DP rank to place experts); collectives raise. vLLM's own DP setup, which
    would wait for the other DP ranks, is skipped: `parallel` is the engine config's. Torn down
    afterwards: the worker fills the next model (dense or MoE, other sizes) afresh."""
    from vllm.distributed import parallel_state as ps
    store = tempfile.NamedTemporaryFile(prefix="fast-start-pg-", delete=False)
    store.close()
    os.unlink(store.name)
    configured, parallel.data_parallel_size = parallel.data_parallel_size, 1
    try:
        ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                        distributed_init_method=f"file://{store.name}")
        ps.ensure_model_parallel_initialized(1, 1)
    finally:
        parallel.data_parallel_size = configured
    pp_rank, tp_rank = divmod(spec.rank, spec.tensor_parallel_size)
    tp, dp = spec.tensor_parallel_size, spec.data_parallel_size
    ep = getattr(ps, "_EP", None)           # vLLM makes it for MoE models only
    for group, rank, size in ((ps.get_tp_group(), tp_rank, tp),
                              (ps.get_pp_group(), pp_rank, spec.pipeline_parallel_size),
                              (ps.get_dp_group(), spec.data_parallel_rank, dp),
                              (ep, spec.data_parallel_rank * tp + tp_rank, dp * tp)):
        if group is None:
            continue
        group.world_size, group.rank_in_group, group.ranks, group.rank = size, rank, list(range(size)), rank
        if size > 1:
            for op in COLLECTIVES:
                if hasattr(group, op):
                    setattr(group, op, _refuse(op, spec))
    if ep is not None and dp > 1:       # MoE layers across DP ranks size their dispatch by its all-to-all
        ep.device_communicator = _posed_communicator(spec, ep)
    try:
        yield
    finally:
        if ep is not None:
            ep.device_communicator = None
        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()


def _posed_communicator(spec: WeightSpec, ep_group):
    """A device communicator whose all-to-all manager has this rank's place in the EP group and
    refuses to communicate: what MoE layers read while they choose their kernels."""
    from vllm.distributed.device_communicators.base_device_communicator import All2AllManagerBase
    manager = object.__new__(All2AllManagerBase)
    manager.rank, manager.world_size = ep_group.rank_in_group, ep_group.world_size
    manager.dp_rank, manager.dp_world_size = spec.data_parallel_rank, spec.data_parallel_size
    manager.internode, manager.support_fault_tolerance = False, False
    for op in ("get_handle", "dispatch", "dispatch_router_logits", "combine", "set_num_sms", "max_sms_used"):
        setattr(manager, op, _refuse(op, spec))
    return types.SimpleNamespace(all2all_manager=manager)


def _refuse(op: str, spec: WeightSpec):
    def refuse(*args, **kwargs):
        raise FastStartError(f"vLLM asked for a {op} across ranks while filling rank {spec.rank}: this model's "
                             "loading needs the other ranks, which a one-rank fill cannot reach",
                             "serve it without fast-start (e.g. online quantization at TP > 1)")
    return refuse


def fill(spec: WeightSpec, device: str, progress: Callable[[int, int], None] | None = None,
         chunk: int = CHUNK) -> tuple[Manifest, list[int]]:
    """Build, load and (stage "processed") process this rank with vLLM; export into a sealed arena."""
    options = vllm_rules.Options.decoded(spec.engine_options)
    apply_env(options.env)
    # vLLM's records through the worker's handler (`journal.setup`), which gives the journal their
    # priority, not through vLLM's own, whose every line the journal would keep at info.
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    from vllm.plugins import load_general_plugins

    load_general_plugins()      # what the engine loads too: kernels and models registered by plugins
    want = fingerprint(spec)
    vllm_rules.check(want.quantization, spec.tensor_parallel_size)
    config = engine_config(spec, options)
    model_config, target = config.model_config, torch.device(device)
    got = model_config.quantization or "none"
    if got != want.quantization:
        raise FastStartError(f"vLLM reads {spec.path} as quantization {got!r}, the fingerprint says "
                             f"{want.quantization!r}", "set the model's quantization to what vLLM uses")
    try:
        return _fill(spec, want, config, device, progress, chunk)
    finally:      # the worker lives on: give vLLM's copy of the weights back to the device
        gc.collect()
        if target.type == "cuda":
            torch.cuda.empty_cache()


def _fill(spec: WeightSpec, want, config, device: str, progress, chunk: int) -> tuple[Manifest, list[int]]:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import utils as loader_utils
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.utils.torch_utils import set_default_torch_dtype

    model_config, target = config.model_config, torch.device(device)
    attention: list[dict] = []
    with set_current_vllm_config(config), one_rank(spec, config.parallel_config):
        with set_default_torch_dtype(model_config.dtype), target, vllm_attention.recording(attention):
            model = loader_utils.initialize_model(vllm_config=config, model_config=model_config)
        plan = vllm_state.kernel_plan(model)
        stage = stage_for(device, want.quantization, model)
        built = {n for n, _ in model.named_parameters()}
        loader = DefaultModelLoader(config.load_config)
        loader.counter_before_loading_weights = time.perf_counter()
        loader.load_weights(model, model_config)
        attrs = vllm_state.small_attrs(model)     # as the engine's model holds them before processing
        if stage == "processed":       # what the kernels made here is cached: their libraries and GPU too
            kernels = vllm_state.kernel_environment(target)
            with set_default_torch_dtype(model_config.dtype), vllm_preprocessed.deferred(model, target) as later:
                loader_utils.process_weights_after_loading(model, model_config, target)
                with vllm_preprocessed.kept(model):
                    plain: dict[int, torch.Tensor] = {}      # one per object: tied names stay one
                    named = [(n, plain.setdefault(id(t), t.detach()))
                             for n, t in [*_params(model), *model.named_buffers()]]
                    removed = tuple(sorted(built - {n for n, _ in model.named_parameters()}))
                    buffers = tuple(n for n, _ in model.named_buffers())
            later()      # as the engine will, over the tensors cached as they were
            record = FillRecord(ENGINE.name, stage, plan, attention, buffers, removed, vllm_state.signature(model),
                                kernels, _meta_build(config, {n for n, _ in named} | set(removed), attrs))
            manifest, fds = export(want, named, device, record, progress, chunk)
        else:
            params, buffers = list(_params(model)), list(model.named_buffers())
            record = FillRecord(ENGINE.name, stage, plan, attention, tuple(n for n, _ in buffers),
                                attrs=_meta_build(config, {n for n, _ in [*params, *buffers]}, attrs))
            hold = "repoint" if target.type == "cuda" else "keep"
            manifest, fds = export(want, [*params, *buffers], device, record, progress, chunk, hold,
                                   then=_processing(model, model_config, target, params))
    return manifest, fds


def _processing(model, model_config, target: torch.device, params) -> Callable[[list[TensorEntry]], None]:
    """vLLM's processing over the exported tensors (in the arena on a GPU, as an engine runs it),
    which must not change a byte of them: `export`'s `then` at the loaded stage."""
    from vllm.model_executor.model_loader import utils as loader_utils
    from vllm.utils.torch_utils import set_default_torch_dtype

    def process(entries: list[TensorEntry]) -> None:
        loaded = {name: t.detach() for name, t in _unique(params)}   # processing may re-point a Parameter
        with set_default_torch_dtype(model_config.dtype):
            loader_utils.process_weights_after_loading(model, model_config, target)
        changed = [e.name for e in entries if e.name in loaded and arenas.checksum(loaded[e.name]) != e.checksum]
        if changed:
            raise FastStartError(f"vLLM's processing rewrote {len(changed)} loaded tensors in place "
                                 f"({', '.join(changed[:3])}); an engine could not run it over read-only "
                                 "cache memory", "use vLLM 0.30 or later, whose pre-processed pass skips it")
    return process


def _meta_build(config, exported: set[str], attrs: dict[str, list]) -> dict | None:
    """Whether an engine can build this model on the `meta` device and complete it from the cache:
    builds it so here, with vLLM's registrations emptied meanwhile (as in a fresh engine process).
    Where every tensor the build leaves on meta is an exported parameter or buffer or a small
    attribute recorded by value, returns those attributes' values (the record's `attrs`);
    otherwise (vLLM cannot build it on meta, or leaves something else there) None: the engine
    builds on its device."""
    from vllm.model_executor.model_loader import utils as loader_utils
    from vllm.utils.torch_utils import set_default_torch_dtype

    before = vllm_state.registrations(config)
    vllm_state.restore_registrations(config, ({}, [], {}))
    try:
        with set_default_torch_dtype(config.model_config.dtype), torch.device("meta"):
            trial = loader_utils.initialize_model(vllm_config=config, model_config=config.model_config)
        need = {}
        for module, key, kind, value in vllm_state.held(trial):
            name = vllm_state.dotted(module, key)
            if not vllm_state.is_meta(value) or (kind in ("param", "buffer") and name in exported):
                continue
            if kind != "attr" or name not in attrs:
                return None
            need[name] = attrs[name]
        return need
    except Exception:      # noqa: BLE001 - vLLM cannot build this model on meta: the engine builds on its device
        return None
    finally:
        vllm_state.restore_registrations(config, before)


def _params(model: torch.nn.Module):
    return model.named_parameters(remove_duplicate=False)


def _unique(named) -> list[tuple[str, torch.Tensor]]:
    seen, out = set(), []
    for name, t in named:
        if id(t) not in seen:
            seen.add(id(t))
            out.append((name, t))
    return out


def _storage_key(t: torch.Tensor) -> tuple:
    """One key per distinct storage (empty storages have no address to share)."""
    s = t.untyped_storage()
    return (s.data_ptr(), s.nbytes()) if s.nbytes() else ("empty", id(t))


def export(want, named, device: str, record: FillRecord, progress=None, chunk: int = CHUNK, hold: str = "",
           then: Callable[[list[TensorEntry]], None] | None = None) -> tuple[Manifest, list[int]]:
    """Write each distinct storage behind `named` once into arenas of at most `chunk` bytes (a
    storage larger than that gets an arena of its own); entries keep strides. Names of one tensor
    object (tied weights) become aliases.

    Chunk by chunk, each storage written is given back: freed, and the device's cache returned
    to the driver before the next chunk is made, so the fill's peak is the model plus one chunk
    (`hold = ""`). `hold = "repoint"`: the tensors are pointed at their bytes in the arena
    instead (the loaded stage on a GPU: vLLM then processes the model in the arena, as an engine
    would); `hold = "keep"`: the storages are kept (the loaded stage on the CPU). `then` runs
    before the arenas are sealed; an error there discards them.
    """
    plan = _Plan(named, record, chunk)
    made, fds = _write(plan, f"vllm-{want.checkpoint[:12]}-r{want.rank}", device, progress, hold, then)
    manifest = Manifest(want, tuple(made), tuple(plan.entries), plan.aliases, record.to_dict())
    manifest.validate()
    return manifest, fds


class _Plan:
    """Where `export` writes each distinct storage: its chunk and offset, its tensors' entries."""

    def __init__(self, named, record: FillRecord, chunk: int):
        # Storages of one dtype, shape and stride together: an engine builds them as one view.
        unique = sorted(_unique(named), key=lambda nt: (str(nt[1].dtype), tuple(nt[1].shape), nt[1].stride()))
        first = {id(t): name for name, t in unique}
        self.aliases = {name: first[id(t)] for name, t in named if first[id(t)] != name}
        storages: dict[tuple, torch.UntypedStorage] = {}
        for _, t in unique:
            storages.setdefault(_storage_key(t), t.untyped_storage())
        # Buffers may outlive the model: vLLM shares one rotary embedding (and its cache) between
        # every model built with the same settings, so the next fill's model holds it too.
        buffers = set(record.buffers)
        self.shared = {t.untyped_storage().data_ptr() for name, t in named if name in buffers}
        where, self.sizes = place([s.nbytes() for s in storages.values()], chunk)
        bases = dict(zip(storages, where))              # storage -> (arena, offset)
        self.chunks: list[list[tuple[int, torch.UntypedStorage]]] = [[] for _ in self.sizes]
        for (arena, offset), s in zip(where, storages.values()):
            self.chunks[arena].append((offset, s))
        self.entries: list[TensorEntry] = []
        self.members: list[list[tuple[torch.Tensor, TensorEntry]]] = [[] for _ in self.chunks]
        for name, t in unique:
            arena, base = bases[_storage_key(t)]
            offset = base + t.storage_offset() * t.itemsize
            stride = () if t.is_contiguous() and offset % ALIGN == 0 else tuple(t.stride())
            entry = TensorEntry(name, name_of(t.dtype), tuple(t.shape), arena, offset, t.numel() * t.itemsize,
                                arenas.checksum(t), stride)
            self.entries.append(entry)
            self.members[arena].append((t, entry))


def _write(plan: _Plan, label: str, device: str, progress, hold: str, then) -> tuple[list[ArenaEntry], list[int]]:
    """`plan`'s chunks written into arenas, chunk by chunk (`export`): their entries and sealed fds."""
    with arenas.Written(label, device, sum(plan.sizes), progress) as out:
        for i, (group, size) in enumerate(zip(plan.chunks, plan.sizes)):
            writer = out.open(size)
            for base, s in group:
                if s.nbytes():
                    out.write(i, base, torch.empty(0, dtype=torch.uint8, device=s.device).set_(s))
            if hold == "repoint":
                for t, e in plan.members[i]:
                    t.data = _view(writer.view, e, t)
            if hold != "keep":
                _give_back(group, plan.shared, device)
            if not hold:
                out.seal()
        if then is not None:
            then(plan.entries)
        out.seal()
    return [ArenaEntry(w.size, w.device) for w in out.made], out.fds


def _give_back(group: list[tuple[int, torch.UntypedStorage]], shared: set[int], device: str) -> None:
    """Free a written chunk's storages (not those shared beyond the model) and return the device's
    cache to the driver before the next chunk is made."""
    for _, s in group:
        if s.resizable() and s.data_ptr() not in shared:
            s.resize_(0)
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def _view(flat: torch.Tensor, entry: TensorEntry, like: torch.Tensor) -> torch.Tensor:
    """`like`'s shape and strides over its bytes at `entry`'s offset in an arena's mapping."""
    return torch.empty(0, dtype=like.dtype, device=flat.device).set_(
        flat.untyped_storage(), entry.offset // like.itemsize, like.shape, like.stride())

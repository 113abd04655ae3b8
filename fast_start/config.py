"""The TOML config (`/etc/fast-start/fast-start.toml`) as one frozen dataclass tree.

Validated once, at daemon start, before any checkpoint is touched: unknown keys, wrong types and
impossible values each fail with one message naming the file, the key and the fix.
"""
from __future__ import annotations

import grp
import re
import sys
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path

from . import dtypes, engines, quant
from .errors import ConfigError
from .fingerprint import WeightSpec, layouts
from .transport import DEFAULT_SOCKET_DIR

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

DEFAULT_PATH = Path("/etc/fast-start/fast-start.toml")
AUTO = "auto"                     # engine_version: what the worker's environment has installed
ON_RELEASE = ("keep", "drop")     # "host" (demote to host RAM) is planned, not built
DEVICES = ("cuda", "cpu")
MIN_CHUNK, MAX_CHUNK = 64 << 10, 2 << 30


@dataclass(frozen=True)
class DaemonConfig:
    """The `[daemon]` table: one for every GPU's daemon of the host."""
    worker_python: str = ""
    """The fill worker's interpreter (the engine's, for a model an engine fills); "" = the daemon's own."""
    socket_dir: str = DEFAULT_SOCKET_DIR
    """Where each GPU's socket (`gpu<N>.sock`), lock and state file are."""
    device: str = "cuda"
    """Where the cache lives: "cuda" (GPU memory) or "cpu" (host memory, memfd arenas)."""
    on_release: str = "keep"
    """What a copy-mode engine's hand-over does: "keep" the model cached, or "drop" it."""
    memory_budget: str = "95%"
    """The most of the device the GPU's models may take (bytes, or a share of the device)."""
    allowed_uids: tuple[int, ...] = ()
    """Engines' users besides the daemon's own uid and root."""
    allowed_groups: tuple[str, ...] = ()
    """Groups whose members may connect as engines."""
    admin_groups: tuple[str, ...] = ()
    """Groups whose members may also evict and fill (as root and the daemon's user may)."""
    fill_bandwidth: str = "0"
    """Bytes per second a fill may read; "0" = unlimited."""
    arena_chunk: str = "512MiB"
    """An arena's most bytes: what a copy-mode engine holds twice."""
    keep_free: str = "1GiB"
    """Device memory that fills (and copies beside a kept cache) leave free for engines."""
    refill_on_change: bool = True
    """Refill a model whose checkpoint changed under it (else it waits for a restart)."""
    metrics_file: str = ""
    """A Prometheus textfile per GPU ("{gpu}" in the path); "" = none."""
    request_timeout_s: int = 10
    """How long an idle connection waits for a request, and the most a frame may take."""
    artifacts: str = "8GiB"
    """What one engine user may keep of its engine's artifacts per GPU; "0" = none."""

    @property
    def shared(self) -> bool:
        """Whether users other than the daemon's connect (the socket is then 0666, its folder 0755)."""
        return bool(self.allowed_uids or self.allowed_groups or self.admin_groups)

    def gids(self, key: str) -> frozenset[int]:
        """The group ids of `allowed_groups` or `admin_groups` (names checked when the config loaded)."""
        return frozenset(grp.getgrnam(g).gr_gid for g in getattr(self, key))


@dataclass(frozen=True)
class ModelConfig:
    """A `[[model]]` table: a checkpoint, the GPUs that serve it, and how each GPU's rank is made."""
    name: str
    """How the daemons, `status` and the engines' log lines name it."""
    path: str
    """The checkpoint's folder (*.safetensors, config.json), absolute."""
    gpus: tuple[int, ...]
    """The GPUs that serve it; GPU i serves slot gpus.index(i) + rank_offset of its replica."""
    tensor_parallel_size: int = 1
    """The engines' TP size."""
    rank_offset: int = 0
    """The first GPU's slot (multi-node TP: node k of n GPUs each sets k × n)."""
    dtype: str = "bfloat16"
    """The engines' dtype."""
    quantization: str = "none"
    """An engine's quantization name ("none": what the checkpoint says), or fast-start's own methods."""
    engine: str = ""
    """The engine that fills it itself ("vllm"); "": fast-start's own tables."""
    layout: str = "hf"
    """Its cached tensors' layout: "hf" (the checkpoint's), or its engine's (older configs named the engine here)."""
    revision: str = "main"
    """The checkpoint's revision, as the engines name it."""
    engine_version: str = ""
    """The engines' version; "auto": the version installed where the model's worker runs."""
    python: str = ""
    """This model's worker interpreter; "" = `worker_python`."""
    pipeline_parallel_size: int = 1
    """The engines' PP size; ranks are global: pp_rank × tensor_parallel_size + tp_rank."""
    data_parallel_size: int = 1
    """An engine's data-parallel size (its MoE layers shard over every DP rank's TP ranks)."""
    enable_expert_parallel: bool = False
    """An engine's expert parallelism."""
    expert_placement_strategy: str = "linear"
    """... and its placement of experts ("linear", "round_robin")."""
    replicas: int = 1
    """Independent engines of the model on the host, each on its share of `gpus`."""
    settings: object = field(default=None, metadata={"table": True})
    """The engine's own settings: its [model.<engine>] table, typed by the engine
    (`Engine.settings`); the engine's defaults where the table is left out; None for a model no
    engine fills."""

    def __post_init__(self):
        # An engine's model is cached in the engine's layout, which the fingerprint's `layout`
        # names. (A layout naming an engine, as configs said before `engine`, names it too.)
        if self.engine and self.layout == "hf":
            object.__setattr__(self, "layout", self.engine)
        if self.settings is None and self.filler is not None:
            object.__setattr__(self, "settings", self.filler.settings())

    @property
    def filler(self) -> engines.Engine | None:
        """The engine that fills this model where the worker's environment has it, or None:
        fast-start's own tables."""
        return engines.get(self.layout)

    @property
    def replica_gpus(self) -> int:
        """How many GPUs each replica (each engine of the model) has."""
        return len(self.gpus) // self.replicas

    def spec(self, gpu: int) -> WeightSpec:
        """The weights GPU `gpu` serves for this model: its slot's (its place in its replica's
        share of `gpus`, plus `rank_offset`)."""
        return self.slot_spec(self.gpus.index(gpu) % self.replica_gpus + self.rank_offset)

    def slot_spec(self, slot: int) -> WeightSpec:
        """The weights of a replica's slot `slot`: slots count DP rank by DP rank, each of tensor ×
        pipeline ranks. The one builder of a model's `WeightSpec`: the daemon's, and a running
        engine's, whose plugin describes the engine as a [[model]] and asks its slot's."""
        engine = self.filler
        dp_rank, rank = divmod(slot, self.tensor_parallel_size * self.pipeline_parallel_size)
        return WeightSpec(path=self.path, tensor_parallel_size=self.tensor_parallel_size, rank=rank,
                          dtype=self.dtype, quantization=self.quantization, layout=self.layout,
                          revision=self.revision, engine_version=self.engine_version,
                          pipeline_parallel_size=self.pipeline_parallel_size,
                          engine_options=engine.options(self) if engine else "",
                          data_parallel_size=self.data_parallel_size, data_parallel_rank=dp_rank,
                          expert_parallel=engine.expert_parallel(self) if engine else "")


@dataclass(frozen=True)
class Config:
    path: str
    daemon: DaemonConfig
    models: tuple[ModelConfig, ...]
    deprecated: tuple[str, ...] = ()        # what the file says the way an older version did, and the new way

    def models_on(self, gpu: int) -> tuple[ModelConfig, ...]:
        return tuple(m for m in self.models if gpu in m.gpus)

    def python(self, model: ModelConfig) -> str:
        """The interpreter that fills `model`: its own `python`, `worker_python`, or the daemon's."""
        return model.python or self.daemon.worker_python or sys.executable


def written_socket_dir(path: Path) -> str | None:
    """`[daemon] socket_dir` as written in a config that does not load (another key is wrong), or
    None where the file is no TOML or has no such string."""
    try:
        value = tomllib.loads(path.read_text()).get("daemon", {}).get("socket_dir")
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, AttributeError):
        return None
    return value if isinstance(value, str) and value else None


def load(path: str | Path = DEFAULT_PATH, check_paths: bool = True) -> Config:
    """Read and validate the config. `check_paths=False` skips the model folders: commands that
    only need the socket directory keep working while a model's storage is away (NFS down)."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist",
                          f"create it from the example (fast-start example-config > {path}), then edit it; "
                          "or pass --config") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config file {path}: {e}", "check its permissions") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML: {e}", "fix the syntax at that line") from None
    return parse(data, str(path), check_paths)


def parse(data: dict, path: str, check_paths: bool = True) -> Config:
    unknown = set(data) - {"daemon", "model"}
    if unknown:
        raise ConfigError(f"{path}: unknown section or key {sorted(unknown)[0]!r}",
                          "the config has a [daemon] table and [[model]] tables only")
    daemon = _table(DaemonConfig, data.get("daemon", {}), path, "[daemon]")
    models = data.get("model", [])
    if not isinstance(models, list):
        raise ConfigError(f"{path}: 'model' must be an array of tables", "write each model as [[model]]")
    deprecated = []
    parsed = tuple(_model(m, path, f"[[model]] #{i + 1}", deprecated) for i, m in enumerate(models))
    _check_daemon(daemon, path)
    names = set()
    for i, m in enumerate(parsed):
        where = f"{path}: [[model]] #{i + 1} ({m.name!r})"
        if m.name in names:
            raise ConfigError(f"{where}: name {m.name!r} is used twice", "give every model its own name")
        names.add(m.name)
        check_model(m, where, check_paths)
    return Config(path, daemon, parsed, tuple(deprecated))


def _model(raw, path: str, where: str, deprecated: list[str]) -> ModelConfig:
    """A [[model]] table: its own keys, and its engine's settings from its [model.<engine>] table
    (keys an older version read in the [[model]] itself are moved there, each with a note)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: {where} must be a table", "write it as [[model]]")
    tables = {k: v for k, v in raw.items() if isinstance(v, dict)}
    own = {k: v for k, v in raw.items() if k not in tables}
    known = _keys(ModelConfig)
    moved = {k: own.pop(k) for k in list(own) if k not in known and _owner(k) is not None}
    model = _table(ModelConfig, own, path, where)
    engine = model.filler
    if engine is None and (model.engine or model.layout != "hf"):
        return model        # an engine nobody registered: `check_model` names it with the known ones
    for name in tables:
        if engine is None or name != engine.name:
            raise ConfigError(f"{path}: {where} has a table [model.{name}], but "
                              + (f"engine {engine.name!r} fills the model" if engine else "no engine fills the model"),
                              f"name it [model.{engine.name}]" if engine else f"remove it, or set {_by_engine()}")
    named = f"{path}: {where} ({model.name!r})"
    if engine is None:
        for key, value in moved.items():
            _unused_setting(key, value, named, deprecated)
        return model
    settings = _moved_in(engine, dict(tables.get(engine.name, {})), moved, named, deprecated)
    return with_settings(model, settings, path, f"{where} [model.{engine.name}]")


def _moved_in(engine: engines.Engine, settings: dict, moved: dict, where: str, deprecated: list[str]) -> dict:
    """`settings` (an engine's table) with the keys an older version read in the [[model]] itself
    (`moved`) in the fields each now is, a note for each."""
    for key, value in moved.items():
        new = engine.moved.get(key)
        if new is None:
            raise ConfigError(f"{where} has unknown key {key!r}", f"remove it: {engine.title} has no such setting")
        if new in settings:
            raise ConfigError(f"{where} sets {key!r} and [model.{engine.name}] {new}",
                              f"keep [model.{engine.name}] {new} alone")
        settings[new] = value
        deprecated.append(f"{where}: key {key!r} is [model.{engine.name}] {new} now; move it there (it is read as "
                          "if it were)")
    return settings


def with_settings(model: ModelConfig, raw: dict, path: str, where: str) -> ModelConfig:
    """`model` with its engine's settings read from `raw` (the keys of its [model.<engine>] table)."""
    if model.filler is None:
        if raw:
            raise ConfigError(f"{path}: {where} sets {next(iter(raw))!r}, an engine's setting, for a model no engine "
                              "fills", f"remove it, or set {_by_engine()}")
        return model
    return replace(model, settings=_table(model.filler.settings, raw, path, where))


def _keys(cls) -> dict:
    """The keys a table of `cls` takes (its fields, less those its sub-tables fill)."""
    return {f.name: f for f in fields(cls) if not f.metadata.get("table")}


def _owner(key: str):
    """The engine whose setting `key` was in a [[model]] of an older version, or None."""
    return next((e for e in map(engines.get, engines.names()) if key in e.moved), None)


def _unused_setting(key: str, value, where: str, deprecated: list[str]) -> None:
    """An engine's setting as older configs wrote it, in a model no engine fills: its engine's
    default (the older example's value) is left with a note; any other value is refused."""
    owner = _owner(key)
    if (tuple(value) if isinstance(value, list) else value) != getattr(owner.settings(), owner.moved[key]):
        raise ConfigError(f"{where} key {key!r} is {value!r} for a model no engine fills",
                          f"remove it, or set {_by_engine()} and write it as [model.{owner.name}] {owner.moved[key]}")
    deprecated.append(f"{where}: key {key!r} is {owner.title}'s setting, and no engine fills this model; remove it")


def parse_bytes(text: str, total: int | None = None) -> int:
    """"120GiB", "500MB", "1048576", or (with `total`) "95%" -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(%|[KMGT]i?B|B)?\s*", text)
    if not m or (m.group(2) == "%" and total is None):
        raise ValueError(text)
    value, unit = float(m.group(1)), m.group(2) or "B"
    if unit == "%":
        return int(total * value / 100)
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}[unit]
    return int(value * scale)


def format_bytes(n: int) -> str:
    """Bytes for people: "512 B", "7.50 MiB", "16.00 GiB"."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _table(cls, raw, path: str, where: str):
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: {where} must be a table", f"write it as {where.split(' #')[0]}")
    known = _keys(cls)
    for key in raw:
        if key not in known:
            raise ConfigError(f"{path}: {where} has unknown key {key!r}",
                              f"remove it or use one of {', '.join(known)}")
    missing = [k for k, f in known.items() if k not in raw and f.default is MISSING]
    if missing:
        raise ConfigError(f"{path}: {where} lacks key {missing[0]!r}", f"add {missing[0]} = ...")
    values = {}
    for key, value in raw.items():
        values[key] = _typed(value, known[key].type, f"{path}: {where} key {key!r}")
    return cls(**values)


def _typed(value, annotation: str, where: str):
    """Check a TOML value against a field's annotation (kept as a string by `annotations`)."""
    if annotation == "str":
        ok = isinstance(value, str)
    elif annotation == "bool":
        ok = isinstance(value, bool)
    elif annotation == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif annotation.startswith("tuple[int"):
        ok = isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        value = tuple(value) if ok else value
    else:  # tuple[str, ...]
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
        value = tuple(value) if ok else value
    if not ok:
        kind = {"str": "a string", "int": "an integer", "bool": "true or false"}.get(
            annotation, "a list of " + annotation[6:9] + "s")
        raise ConfigError(f"{where} is {value!r}, not {kind}", f"write it as {kind}")
    return value


def _check_daemon(d: DaemonConfig, path: str) -> None:
    def bad(key, what, fix):
        raise ConfigError(f"{path}: [daemon] key {key!r} {what}", fix)
    if d.device not in DEVICES:
        bad("device", f"is {d.device!r}", f"use one of {', '.join(DEVICES)}")
    if d.on_release not in ON_RELEASE:
        bad("on_release", f"is {d.on_release!r}", f"use one of {', '.join(ON_RELEASE)}"
            + (" (the host-memory tier is not built yet)" if d.on_release == "host" else ""))
    if d.worker_python and not Path(d.worker_python).is_absolute():
        bad("worker_python", f"is {d.worker_python!r}, not an absolute path", "name the engine's interpreter, "
            "e.g. /opt/vllm/.venv/bin/python")
    if d.metrics_file and (not Path(d.metrics_file).is_absolute() or "{gpu}" not in d.metrics_file):
        bad("metrics_file", f"is {d.metrics_file!r}, not an absolute path naming {{gpu}}",
            'each GPU\'s daemon writes its own file: e.g. "/var/lib/prometheus/node-exporter/fast-start-gpu{gpu}.prom"')
    if not Path(d.socket_dir).is_absolute():
        bad("socket_dir", f"is {d.socket_dir!r}, not an absolute path", "use an absolute path such as /run/fast-start")
    if d.metrics_file and _within(Path(d.metrics_file).parent, Path(d.socket_dir)):
        # Its atomic write renames over whatever holds the name: a socket, the GPUs' state files.
        bad("metrics_file", f"is {d.metrics_file!r}, inside socket_dir {d.socket_dir!r}",
            "write it where node_exporter reads textfiles, e.g. /var/lib/prometheus/node-exporter")
    for key in ("allowed_groups", "admin_groups"):
        for name in getattr(d, key):
            try:
                grp.getgrnam(name)
            except KeyError:
                bad(key, f"names group {name!r}, which does not exist on this host",
                    f"create it (groupadd {name}) or remove it from {key}")
    if any(u < 0 for u in d.allowed_uids):
        bad("allowed_uids", f"is {list(d.allowed_uids)}", "list user ids (0 or more)")
    for key, total in (("memory_budget", 1), ("fill_bandwidth", None), ("arena_chunk", None), ("keep_free", 1),
                       ("artifacts", None)):
        try:
            parse_bytes(getattr(d, key), total)
        except ValueError:
            bad(key, f"is {getattr(d, key)!r}", 'write bytes ("120GiB", "500MB")' + (' or a share ("95%")' if total else ""))
    for key in ("memory_budget", "keep_free"):
        if getattr(d, key).strip().endswith("%") and parse_bytes(getattr(d, key), 100) > 100:
            bad(key, f"is {getattr(d, key)!r}, more than the whole device", "write a share up to 100%")
    if not 1 <= d.request_timeout_s <= 300:
        bad("request_timeout_s", f"is {d.request_timeout_s}", "write whole seconds from 1 to 300 (default 10)")
    if not MIN_CHUNK <= parse_bytes(d.arena_chunk) <= MAX_CHUNK:
        bad("arena_chunk", f"is {d.arena_chunk!r}", "write a size from 64KiB to 2GiB (default 512MiB)")


def _within(folder: Path, root: Path) -> bool:
    """Whether `folder` is `root` or inside it, as written or with symlinks resolved."""
    return any(f == r or r in f.parents for f, r in ((folder, root), (folder.resolve(), root.resolve())))


def _by_engine() -> str:
    """`engine = "<name>"` for each engine (looked up in installed packages too: errors only)."""
    return " or ".join(f"engine = \"{n}\"" for n in engines.names())


def check_model(m: ModelConfig, where: str, check_paths: bool, names: dict[str, str] | None = None) -> None:
    """The rules a [[model]] table obeys; `names` renames its keys in the errors (the CLI's
    `fingerprint` names its options)."""
    def bad(key, what, fix):
        raise ConfigError(f"{where} {_named(m, key, names)} {what}", fix)
    _check_gpus(m, bad)
    _check_engine(m, bad)
    _check_ranks(m, bad)
    _check_weights(m, bad)
    _check_paths(m, bad, check_paths)


def _named(m: ModelConfig, key: str, names: dict[str, str] | None) -> str:
    """`key` as the config writes it (an engine's setting: in its table), or as `names` renames it."""
    setting = m.settings is not None and key in _keys(type(m.settings))
    if names:
        return f"--setting {key}" if setting else names.get(key, f"key {key!r}")
    return f"[model.{m.filler.name}] key {key!r}" if setting else f"key {key!r}"


def _check_gpus(m: ModelConfig, bad) -> None:
    if not m.gpus:
        bad("gpus", "is empty", "list the GPU indices that serve this model, e.g. gpus = [0]")
    if len(set(m.gpus)) != len(m.gpus) or min(m.gpus) < 0:
        bad("gpus", f"{list(m.gpus)} lists a GPU twice or a negative index", "list each GPU once")
    for key in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        if getattr(m, key) < 1:
            bad(key, f"is {getattr(m, key)}", "use 1 or more")


def _check_engine(m: ModelConfig, bad) -> None:
    if m.engine and engines.get(m.engine) is None:
        bad("engine", f"is {m.engine!r}", f"use one of {', '.join(engines.names())}, or leave it out (fast-start's "
            "own tables fill the model)")
    if m.engine and m.layout != m.engine:
        bad("layout", f"is {m.layout!r} with engine {m.engine!r}", "leave layout out: an engine's model is cached "
            "in the engine's layout")
    if not m.engine and m.layout != "hf" and engines.get(m.layout) is None:
        bad("layout", f"is {m.layout!r}", f"use one of {', '.join(layouts())}; or name the engine that fills the "
            "model with engine = ...")
    for key, off in engines.ENGINE_KEYS.items():
        if getattr(m, key) != off and m.filler is None:
            value = getattr(m, key)
            bad(key, f"is {list(value) if isinstance(value, tuple) else value!r} for a model no engine fills",
                f"remove it, or set {_by_engine()}: pipeline stages, data and expert parallelism are an "
                "engine's settings")
    if m.engine_version == AUTO and m.filler is None:
        bad("engine_version", f"is \"auto\", which only an engine's model ({_by_engine()}) can resolve",
            "write the version your engine passes in its WeightSpec")


def _check_ranks(m: ModelConfig, bad) -> None:
    if m.replicas < 1 or len(m.gpus) % m.replicas:
        bad("replicas", f"is {m.replicas} with gpus = {list(m.gpus)}", "list as many GPUs for each replica: gpus "
            "holds replicas × the GPUs of one engine, replica by replica")
    ranks = m.tensor_parallel_size * m.pipeline_parallel_size * m.data_parallel_size
    per = m.replica_gpus
    each = f" for each of {m.replicas} replicas" if m.replicas > 1 else ""
    if m.rank_offset < 0 or m.rank_offset + per > ranks:
        if m.rank_offset == 0 and per % ranks == 0:
            n = len(m.gpus) // ranks
            bad("gpus", f"lists {per} GPUs{each}, more than the {ranks} rank(s) of one engine",
                f"for {n} engines of {ranks} GPU(s) each, set replicas = {n}; for one engine over them all, raise "
                "its tensor_parallel_size (or pipeline_parallel_size, data_parallel_size)")
        bad("rank_offset", f"{m.rank_offset} with {per} GPUs{each} serves ranks beyond {ranks - 1}",
            "serve at most data_parallel_size × pipeline_parallel_size × tensor_parallel_size ranks in each replica: "
            "fix gpus, replicas or rank_offset")


def _check_weights(m: ModelConfig, bad) -> None:
    if m.dtype not in dtypes.MODEL:
        bad("dtype", f"is {m.dtype!r}", f"use one of {', '.join(dtypes.MODEL)}")
    if m.filler is not None:
        for key, what, fix in m.filler.check(m):
            bad(key, what, fix)
    elif m.quantization not in quant.METHODS:
        bad("quantization", f"is {m.quantization!r}", f"use one of {', '.join(quant.METHODS)}")
    elif not quant.METHODS[m.quantization].verified_for_sharing:
        verified = [n for n, x in quant.METHODS.items() if x.verified_for_sharing]
        bad("quantization", f"{m.quantization!r} is not verified for sharing", f"use one of {', '.join(verified)}")


def _check_paths(m: ModelConfig, bad, check_paths: bool) -> None:
    if m.python and not Path(m.python).is_absolute():
        bad("python", f"is {m.python!r}, not an absolute path", "name the engine's interpreter, e.g. "
            "/opt/vllm/.venv/bin/python")
    folder = Path(m.path)
    if not folder.is_absolute():
        bad("path", f"{m.path!r} is not an absolute path", "write the model folder's absolute path")
    if check_paths and not (folder.is_dir() and any(folder.glob("*.safetensors"))):
        bad("path", f"{m.path!r} is not a folder holding *.safetensors files",
            "point it at the model's folder (with config.json and the safetensors shards)")

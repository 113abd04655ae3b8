"""The `fast-start` command line.

Exit codes are part of the interface (runbooks branch on them): 0 ok / match, 1 mismatch or
not ready, 2 usage (including a bad config), 3 no daemon reachable. `fails` below is the one
place where errors become one line and an exit code; no command prints a traceback. With
`--json` (before or after the command) the output and the errors are JSON: an error is
`{"error": ..., "fix": ..., "exit_code": N}` on stdout, with the same exit code.

The CLI imports no torch: it talks to daemons (`transport.py`) and reads headers; `verify --deep`,
which compares tensor bytes, hands that to a fill worker.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Optional, TypeVar

import typer
from rich.console import Console
from rich.table import Table

from . import __version__, files, journal, protocol, reports, trust, watch
from . import config as configs
from .config import ConfigError
from .errors import CheckpointError, FastStartError, NoDaemon, Refused, StartError
from .fingerprint import Fingerprint, WeightSpec, checkpoint_hash, fingerprint
from .headers import raw_header, size_fault, weight_files
from .transport import DEFAULT_SOCKET_DIR, connect, request, socket_path, state_path
from .trust import TrustError

app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, context_settings={"help_option_names": ["-h", "--help"]},
                  help="Keep inference engines' weights resident on each GPU between restarts.")
# No markup: paths, details and errors print as they are ("fast-start[cuda]" keeps its brackets);
# piped, no 80-column cut: a table is as wide as its longest path.
out = Console(markup=False, width=None if sys.stdout.isatty() else 1000)

CONFIG = typer.Option(configs.DEFAULT_PATH, "--config", help="config file (finds the socket directory)")
GPU = typer.Option(None, "--gpu", help="GPU index; all daemons in the socket directory when left out")
JSON = typer.Option(False, "--json", help="machine-readable output (errors too)")
R = TypeVar("R")
_json = [False]     # the global --json, given before the command


def _version(value: bool) -> None:
    if value:       # eager: before --json is parsed, wherever it stands
        print(json.dumps({"version": __version__}) if "--json" in sys.argv[1:] else f"fast-start {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="print the version and exit"),
          as_json: bool = JSON):
    _json[0] = as_json


def error(what: str, fix: str, code: int, as_json: bool) -> typer.Exit:
    """Report an error (one line on stderr, or a JSON object on stdout) and the Exit to raise."""
    if as_json:
        print(json.dumps({"error": what, "fix": fix, "exit_code": code}))
    else:
        print(journal.error_line(f"error: {what}" + (f" (fix: {fix})" if fix else "")), file=sys.stderr)   # one line
    return typer.Exit(code)


def fails(command):
    """Map errors to one line (or a JSON object) and the documented exit code; never a traceback."""
    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        as_json = kwargs.get("as_json", False) or _json[0]
        try:
            return command(*args, **kwargs)
        except FastStartError as e:
            code = 2 if isinstance(e, (ConfigError, StartError)) else 3 if isinstance(e, (NoDaemon, TrustError)) else 1
            raise error(e.what, e.fix, code, as_json) from None
        except BrokenPipeError:     # its reader went away (`status | head -3`): click ends it quietly
            raise
        except MemoryError:
            raise error("out of memory", "raise the process's memory limit, e.g. LimitAS= or ulimit -v", 1,
                        as_json) from None
        except OSError as e:
            raise error(f"{e.strerror or e}{f': {e.filename}' if e.filename else ''}", "", 1, as_json) from None
    return wrapper


def socket_dir(config: Path) -> str:
    """The config's socket_dir when --config is given, else $FAST_START_SOCKET_DIR, else that of
    /etc/fast-start/fast-start.toml, else /run/fast-start. A config being edited may not load: the
    daemons still answer, so its `socket_dir` is taken as written (else /run/fast-start), with a
    warning."""
    if config == configs.DEFAULT_PATH:
        if os.environ.get("FAST_START_SOCKET_DIR"):
            return os.environ["FAST_START_SOCKET_DIR"]
        if not config.exists():
            return DEFAULT_SOCKET_DIR
    try:
        return configs.load(config, check_paths=False).daemon.socket_dir
    except ConfigError as e:
        if not config.is_file():
            raise
        directory = configs.written_socket_dir(config) or DEFAULT_SOCKET_DIR
        print(f"warning: {e.what}; asking the daemons in {directory}", file=sys.stderr)
        return directory


def gpus(directory: str, gpu: int | None) -> list[int]:
    if gpu is not None:
        return [gpu]
    found = set()
    for p in Path(directory).glob("gpu*.*") if Path(directory).is_dir() else []:
        if p.suffix in (".sock", ".state") and p.stem[3:].isdigit():
            found.add(int(p.stem[3:]))
    if not found:
        raise NoDaemon(f"no fast-start daemon in {directory}", "start one: systemctl start fast-start@N")
    return sorted(found)


def ask(directory: str, gpu: int, msg, with_fds: bool = False):
    """One request to GPU `gpu`'s daemon; NoDaemon when it cannot be reached or refuses us."""
    path = socket_path(directory, gpu)
    try:
        conn = connect(path, timeout=10.0)
    except (OSError, TrustError) as e:
        raise NoDaemon(f"GPU {gpu}: no daemon reachable at {path} ({getattr(e, 'what', None) or e.strerror or e})",
                       f"start it: systemctl start fast-start@{gpu}") from None
    with conn:
        try:
            request(conn, protocol.Hello(protocol.VERSION))
        except FastStartError as e:
            raise Refused(f"GPU {gpu}: {e.what}", e.fix) from None
        except OSError as e:
            raise NoDaemon(f"GPU {gpu}: the daemon at {path} closed the connection ({e.strerror or e})",
                           f"see journalctl -u fast-start@{gpu}") from None
        return request(conn, msg, with_fds)


def emit(data, as_json: bool, human) -> None:
    if as_json or _json[0]:
        out.print_json(json.dumps(data))
    else:
        human(data)


@app.command("daemon")
@fails
def daemon_cmd(gpu: int = typer.Option(..., "--gpu", help="the GPU this daemon serves"), config: Path = CONFIG):
    """Run GPU N's daemon in the foreground (what fast-start@N.service runs)."""
    from . import daemon
    journal.setup(gpu)
    raise typer.Exit(daemon.run(str(config), gpu))


@app.command()
@fails
def status(gpu: Optional[int] = GPU, config: Path = CONFIG, as_json: bool = JSON,
           watch_s: Optional[float] = typer.Option(None, "--watch", help="show it again every this many seconds, "
                                                   "until interrupted (Ctrl-C)")):
    """State per GPU: loading (progress, time left), ready or failed; models, bytes, fingerprints,
    leases; memory; each daemon's version and uptime."""
    if watch_s is None:
        return _status_once(gpu, config, as_json)
    if as_json or _json[0] or not 0 < watch_s < 86400:
        raise ConfigError(f"--watch {watch_s:g} with --json" if 0 < watch_s < 86400 else f"--watch {watch_s:g}",
                          "watch a table every N > 0 seconds; for JSON, call status --json in a loop")
    try:
        while True:
            out.clear()
            out.print(time.strftime("%H:%M:%S"), f"fast-start status, every {watch_s:g} s (Ctrl-C ends it)",
                      highlight=False)
            try:
                _status_once(gpu, config, False)
            except typer.Exit:
                pass                        # not ready, or no daemon (said): watched until it is
            except FastStartError as e:
                out.print(f"error: {e.what}", highlight=False)
            time.sleep(watch_s)
    except KeyboardInterrupt:
        raise typer.Exit(0) from None


def _status_once(gpu: Optional[int], config: Path, as_json: bool) -> None:
    directory = socket_dir(config)
    states = []
    for g in gpus(directory, gpu):
        try:
            states.append(ask_report(directory, g, protocol.Status(), reports.Status))
        except Refused:
            raise
        except NoDaemon:
            state_file = state_path(directory, g)
            if not state_file.exists():
                if gpu is not None:
                    raise
                continue
            try:
                state = _state_of(files.read_json(state_file))
            except OSError as e:
                raise NoDaemon(f"GPU {g}: no daemon answers and {state_file} is unreadable ({e.strerror or e})",
                               "run as root or the daemon's user") from None
            except (ValueError, protocol.ProtocolError) as e:
                raise NoDaemon(f"GPU {g}: no daemon answers and {state_file} is damaged "
                               f"({getattr(e, 'what', None) or e})",
                               f"remove it, then systemctl restart fast-start@{g}") from None
            if not _alive(state.pid):
                state = state._replace(state="failed", error=state.error or f"daemon pid {state.pid} is not running")
            states.append(state)
    if not states:
        raise NoDaemon(f"no fast-start daemon reachable in {directory}", "start one: systemctl start fast-start@N")
    if gpu is None:
        states += [reports.DaemonState(g, "stopped", 0, error=f"not running, though the config names it: "
                                       f"systemctl start fast-start@{g}")
                   for g in sorted(_configured_gpus(config, directory) - {s.gpu for s in states})]
    emit([reports.body(s) for s in states], as_json, lambda _: _status_table(states))
    if any(s.state != "ready" for s in states):
        raise typer.Exit(1)


def _configured_gpus(config: Path, directory: str) -> set[int]:
    """The GPUs the config's models name, where it loads and its daemons use `directory`."""
    try:
        cfg = configs.load(config, check_paths=False)
    except ConfigError:
        return set()
    return {g for m in cfg.models for g in m.gpus} if cfg.daemon.socket_dir == directory else set()


def ask_report(directory: str, gpu: int, msg, kind: type[R]) -> R:
    """`ask`, its report's body read as the record `kind` (checked once, here)."""
    return reports.read(kind, ask(directory, gpu, msg).body, f"GPU {gpu}'s {msg.kind} report")


def each_report(config: Path, gpu: int | None, msg, kind: type[R]) -> list[R]:
    """`ask_report` of the daemon of GPU `gpu`, or of every daemon the config's socket_dir has."""
    directory = socket_dir(config)
    return [ask_report(directory, g, msg, kind) for g in gpus(directory, gpu)]


def _state_of(obj) -> reports.DaemonState:
    """A daemon's state file as `status` shows it; ProtocolError or ValueError naming what does
    not fit."""
    state = reports.read(reports.DaemonState, obj, "it")
    if state.pid <= 0:
        raise ValueError(f"its pid is {state.pid}")
    return state


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _status_table(states: list) -> None:
    """`states`: each daemon's `reports.Status`, or its `reports.DaemonState` where its socket
    does not answer (loading or failed)."""
    table = Table("GPU", "state", "model", "rank/TP", "GiB", "fingerprint", "fill s", "leases")
    for s in states:
        if isinstance(s, reports.DaemonState):
            p = s.progress
            left = f", about {p.eta_s} s left" if p and p.eta_s is not None else ""
            detail = f"{p.model} {p.done / 2**30:.2f}/{p.total / 2**30:.2f} GiB{left}" if p else s.error
            table.add_row(str(s.gpu), s.state, detail, "", "", "", "", "")
            continue
        for m in s.models or ([] if s.missing else [None]):
            if m is None:
                table.add_row(str(s.gpu), "ready", "(none)", "", "", "", "", "-")
                continue
            held = [_lease(lease) for lease in s.leases if lease.model == m.name]
            table.add_row(str(s.gpu), "ready", m.name, f"{m.rank}/{m.tensor_parallel_size}", f"{m.bytes / 2**30:.2f}",
                          m.fingerprint, "re-adopted" if m.adopted else str(m.fill_seconds), " ".join(held) or "-")
        for m in s.missing:
            table.add_row(str(s.gpu), m.state, f"{m.name}: {m.detail}" if m.detail else m.name, "", "", "", "", "")
    out.print(table)
    for s in states:
        if s.started_at is not None:
            up = _duration(time.time() - s.started_at)
            out.print(f"GPU {s.gpu}: fast-start {s.version or '?'}, pid {s.pid}, up {up}", highlight=False)
        mem = getattr(s, "memory", None)
        if mem is not None:
            size = configs.format_bytes
            known = f"{size(mem.total)} total, " if mem.total is not None else ""
            free = f", {size(mem.free)} free" if mem.free is not None else " (free memory unknown: no NVML)"
            where = f"GPU {s.gpu}" + (" (host memory)" if s.device == "cpu" else "")
            out.print(f"{where}: {known}{size(mem.held)} held by the cache{free}, keep_free {size(mem.keep_free)}",
                      highlight=False)
        last = getattr(s, "last_failover", None)
        if last is not None:
            out.print(f"GPU {s.gpu}: {s.failovers} failover(s); the last {_duration(time.time() - last.at)} ago: "
                      f"{last.model}'s serving engine (pid {last.died}) died, standby pid {last.serving} serving "
                      f"{last.seconds:.3f} s later", highlight=False)
        for m in getattr(s, "models", []):
            if m.note:
                out.print(f"GPU {s.gpu} {m.name}: {m.note}", highlight=False)
        for a in getattr(s, "artifacts", None) or []:
            last = {"hit": "handed over", "miss": f"missed ({a.why})", "kept": "kept anew"}.get(a.last)
            when = f"; last engine start: {last}, {_duration(time.time() - a.at)} ago" if last else ""
            out.print(f"GPU {s.gpu} {a.model}: uid {a.uid}'s kept artifacts: {a.sets} set(s), "
                      f"{configs.format_bytes(a.bytes)}{when}", highlight=False)


def _lease(lease: reports.Lease) -> str:
    """"pid:mode", its role where it is not serving, the GPU memory its process uses where told."""
    role = "" if lease.role == "serving" else f":{lease.role}"
    used = f" {lease.gpu_bytes / 2**30:.2f} GiB" if lease.gpu_bytes is not None else ""
    return f"{lease.pid}:{lease.mode}{role}{used}"


def _duration(seconds: float) -> str:
    """"3 d 4 h", "2 h 5 min", "4 min 10 s", "12 s"."""
    s = max(0, int(seconds))
    for unit, size, sub, subsize in (("d", 86400, "h", 3600), ("h", 3600, "min", 60), ("min", 60, "s", 1)):
        if s >= size:
            return f"{s // size} {unit} {s % size // subsize} {sub}"
    return f"{s} s"


@app.command()
@fails
def fingerprints(gpu: Optional[int] = GPU, config: Path = CONFIG, as_json: bool = JSON):
    """The fingerprints each daemon holds, field by field."""
    data = each_report(config, gpu, protocol.Fingerprints(), reports.Fingerprints)

    def human(_):
        for d in data:
            for m in d.models:
                _field_table(f"GPU {d.gpu}: {m.name} ({m.digest[:16]})", m.fingerprint)
    emit([reports.body(d) for d in data], as_json, human)


def _field_table(title: str, fields: dict) -> None:
    table = Table("field", "value", title=title)
    for k, v in fields.items():
        table.add_row(k, str(v))
    out.print(table)


@app.command("fingerprint")
@fails
def fingerprint_cmd(model: Path = typer.Option(..., "--model", help="checkpoint folder"),
                    tp: int = typer.Option(1, "--tp"), rank: int = typer.Option(0, "--rank"),
                    dtype: str = typer.Option("bfloat16", "--dtype"),
                    quantization: str = typer.Option("none", "--quantization"),
                    engine: str = typer.Option("", "--engine", help="the engine that fills it (vllm)"),
                    layout: str = typer.Option("hf", "--layout", help="(older configs) the engine's name, as --engine"),
                    revision: str = typer.Option("main", "--revision"),
                    engine_version: str = typer.Option("", "--engine-version"),
                    pp: int = typer.Option(1, "--pp", help="pipeline stages (engine vllm); --rank is the global rank"),
                    settings: list[str] = typer.Option([], "--setting", help="KEY=VALUE of the engine's "
                                                       "[model.<engine>] table (a TOML value, or a bare word)"),
                    dp: int = typer.Option(1, "--dp", help="data-parallel ranks (engine vllm)"),
                    dp_rank: int = typer.Option(0, "--dp-rank", help="this engine's DP rank"),
                    ep: bool = typer.Option(False, "--ep", help="the engine's --enable-expert-parallel (engine vllm)"),
                    placement: str = typer.Option("linear", "--expert-placement",
                                                  help="the engine's --expert-placement-strategy"),
                    as_json: bool = JSON):
    """Compute a checkpoint's fingerprint without a daemon (engine vllm: with this shell's VLLM_* kernel variables).

    The options obey the config's rules for a [[model]] (and, without an engine, the TP size must divide
    the model's heads and widths, as the fill requires): a digest is only printed for a rank a
    daemon could serve. --rank counts TP × PP ranks within --dp-rank's engine."""
    m = configs.ModelConfig(name="fingerprint", path=str(model.absolute()), gpus=(0,), tensor_parallel_size=tp,
                            dtype=dtype, quantization=quantization, engine=engine, layout=layout, revision=revision,
                            engine_version=engine_version, pipeline_parallel_size=pp, data_parallel_size=dp,
                            enable_expert_parallel=ep, expert_placement_strategy=placement)
    m = configs.with_settings(m, dict(_setting(s) for s in settings), "fingerprint", "--setting")
    configs.check_model(m, "fingerprint:", check_paths=True, names=FLAGS)
    ranks = tp * pp
    if not 0 <= rank < ranks:
        raise ConfigError(f"fingerprint: --rank {rank} is outside the {ranks} rank(s) of --tp {tp} --pp {pp}",
                          f"use a rank from 0 to {ranks - 1}")
    if not 0 <= dp_rank < dp:
        raise ConfigError(f"fingerprint: --dp-rank {dp_rank} is outside the {dp} DP rank(s) of --dp {dp}",
                          f"use a DP rank from 0 to {dp - 1}")
    if m.filler is None:        # an engine judges its own TP sizes when it fills
        _check_tp(model, tp, "fingerprint: --tp")
    m = dataclasses.replace(m, rank_offset=dp_rank * ranks + rank)
    fp = fingerprint(m.spec(0))
    data = {"digest": fp.digest(), "fingerprint": fp.to_dict()}

    emit(data, as_json, lambda d: _field_table(f"fingerprint {d['digest'][:16]}", d["fingerprint"]))


# The fingerprint command's options, by the config key each stands for.
FLAGS = {"tensor_parallel_size": "--tp", "pipeline_parallel_size": "--pp", "dtype": "--dtype", "layout": "--layout",
         "engine": "--engine",
         "quantization": "--quantization", "engine_version": "--engine-version", "path": "--model",
         "data_parallel_size": "--dp", "enable_expert_parallel": "--ep", "expert_placement_strategy": "--expert-placement",
         "revision": "--revision"}


def _setting(text: str) -> tuple[str, object]:
    """--setting KEY=VALUE: VALUE as TOML reads it (`true`, `2`, `["A=1"]`), else the word itself."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"fingerprint: --setting {text!r} is not KEY=VALUE",
                          "write it as --setting KEY=VALUE, KEY one of the engine's [model.<engine>] table")
    try:
        return key.strip(), configs.tomllib.loads(f"v = {value}")["v"]
    except configs.tomllib.TOMLDecodeError:
        return key.strip(), value


def _check_tp(folder: Path, tp: int, name: str) -> None:
    """ConfigError unless TP size `tp` fits the model in `folder` (layout hf), the option `name`d."""
    from .headers import read_config, tp_sizes, tp_unfit
    dims = read_config(folder)
    bad = tp_unfit(dims, tp)
    if bad:
        raise ConfigError(f"{name} {tp} does not divide {', '.join(bad)} of {folder}",
                          f"use one of the TP sizes {tp_sizes(dims)}")


@app.command()
@fails
def verify(name: str = typer.Option(..., "--model", help="a model's name in the config, or a checkpoint folder"),
           gpu: Optional[int] = GPU,
           deep: bool = typer.Option(False, "--deep", help="re-derive the bytes from disk and compare checksums"),
           config: Path = CONFIG, as_json: bool = JSON):
    """Does the cache match this checkpoint? Exit 0 on a match, 1 on a mismatch or nothing cached."""
    model = _model_folder(name, config)
    directory = socket_dir(config)
    raws = {name: raw_header(model / name) for name in weight_files(model)}
    headers = checkpoint_hash(model, known=raws)
    for name, raw in raws.items():          # a damaged file matches no cache: name its fault
        fault = size_fault(model / name, raw)
        if fault:
            raise CheckpointError(fault, "re-download or re-export this file; the daemon refills it once it is whole")
    files = watch.identity(model)
    results = []
    for g in gpus(directory, gpu):
        for m in ask_report(directory, g, protocol.Fingerprints(), reports.Fingerprints).models:
            stored = Fingerprint.from_dict(m.fingerprint)
            same_folder = m.path is not None and Path(m.path).resolve() == model.resolve()
            if not same_folder and stored.checkpoint != headers:
                continue
            spec = stored.spec(str(model))
            fields = list(stored.diff(fingerprint(spec)))
            changed = watch.differs(m.files, files)
            if changed:      # the fill read other files, or these changed since
                fields.append("files")
            result = {"gpu": g, "model": m.name, "match": not fields, "fields": fields, "files": changed}
            if deep and not fields:
                result["tensors_differing"] = _deep_compare(directory, g, stored, spec, files, config,
                                                            as_json or _json[0])
                result["match"] = not result["tensors_differing"]
            results.append(result)

    def human(rs):
        if not rs:
            out.print(f"{model}: not cached by any daemon in {directory} (fast-start status shows models "
                      "being filled, stale or failed)")
        for r in rs:
            why = f"differs in {', '.join(r['fields'])}" + (f" ({r['files']})" if r["files"] else "") if r["fields"] else \
                f"{len(r.get('tensors_differing', []))} tensors differ" if not r["match"] else "match"
            out.print(f"GPU {r['gpu']} {r['model']}: {why}" + (" (deep)" if deep and not r["fields"] else ""))
    emit(results, as_json, human)
    if not results or not all(r["match"] for r in results):
        raise typer.Exit(1)


def _model_folder(name: str, config: Path) -> Path:
    """`--model`: a checkpoint folder, or the folder of the model the config names so."""
    if Path(name).is_dir():
        return Path(name)
    try:
        models = configs.load(config, check_paths=False).models
    except ConfigError as e:
        raise ConfigError(f"--model {name!r} is not a folder, and the config that could name it does not load: "
                          f"{e.what}", e.fix) from None
    found = next((m for m in models if m.name == name), None)
    if found is None:
        raise ConfigError(f"--model {name!r} is neither a checkpoint folder nor a model of {config}",
                          f"pass a folder or one of: {', '.join(m.name for m in models) or '(no models configured)'}")
    return Path(found.path)


def _deep_compare(directory: str, gpu: int, stored: Fingerprint, spec: WeightSpec, files: dict,
                  config: Path, as_json: bool = False) -> list[str]:
    """Names of tensors whose cached bytes or disk-derived bytes differ from the manifest's checksums.

    A fill worker (the model's `python`, else the config's `worker_python`) maps the arenas and
    derives the checkpoint's tensors one at a time, so neither this process nor the worker holds
    the shard in RAM. Its progress (the cache's bytes, then the disk's) is a bar on a terminal's
    stderr.
    """
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn
    from .fill import Worker, worker_env
    reply, fds = ask(directory, gpu, protocol.Acquire(stored.to_dict(), "zero_copy", files, manifest="json",
                                                      purpose="verify"), with_fds=True)
    if isinstance(reply, protocol.Miss):
        return [f"(cache miss: {reply.reason})"]
    python = sys.executable
    if config.exists():         # the interpreter that filled it: the model's own, else worker_python
        cfg = configs.load(config, check_paths=False)
        found = next((m for m in cfg.models if m.name == reply.model), None)
        python = cfg.python(found) if found else cfg.daemon.worker_python or python
    bar = Progress("{task.description}", BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                   console=Console(stderr=True), transient=True, disable=as_json or not sys.stderr.isatty())
    try:
        _runnable_by_root(Path(python))
        with bar, Worker(python, worker_env(1), threading.Event()) as worker:
            task = bar.add_task(f"GPU {gpu} {reply.model}: verifying", total=None)
            job = protocol.VerifyJob(reply.model, reply.manifest, spec._asdict())
            for msg, _ in worker.run(job, fds):
                if isinstance(msg, protocol.Progress):
                    bar.update(task, completed=msg.done, total=msg.total)
            return msg.bad
    finally:
        for fd in fds:
            os.close(fd)


@app.command("example-config")
def example_config():
    """Print the example config (every key, commented): fast-start example-config > /etc/fast-start/fast-start.toml"""
    from importlib.resources import files
    sys.stdout.write((files("fast_start") / "example" / "fast-start.toml").read_text())


VLLM_UTILIZATION = 0.9      # vLLM's default gpu_memory_utilization


# The wheel the Debian package ships (packaging/deb/debian/rules): the engine side at its version.
WHEELS = Path("/usr/share/fast-start")
CHECK_ENGINE = """import importlib.metadata as m, importlib.util as u, json, sys, fast_start
print(json.dumps({"version": fast_start.__version__, "file": fast_start.__file__, "prefix": sys.prefix,
                  "plugin": [e.value for e in m.entry_points(group="vllm.general_plugins") if e.name == "fast_start"],
                  "torch": u.find_spec("torch") is not None}))"""


@app.command("install-engine")
@fails
def install_engine(python: Path = typer.Argument(..., help="the engine environment's interpreter, "
                                                  "e.g. /opt/vllm/.venv/bin/python"),
                   wheel: Optional[Path] = typer.Option(None, "--wheel", help="the fast-start wheel to install "
                                                        f"(default: the one in {WHEELS})"),
                   as_json: bool = JSON):
    """Install this fast-start, at exactly this version, into an engine's Python environment (the
    vLLM plugin and the fill worker live there) with no package index, then check it there: it
    imports fast-start at this version, and vLLM finds the plugin. Exit 0 when it does, 1 if not."""
    wheel = _engine_wheel(python, wheel)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    run = functools.partial(_run, env=env)
    command = _installer(python, wheel, run)
    done = run(command)
    if done.returncode:
        raise FastStartError(f"installing {wheel.name} into {python} failed: "
                             f"{(done.stderr.strip().splitlines() or [f'exit {done.returncode}'])[-1]}",
                             f"run it by hand to see all of it: {' '.join(command)}")
    checked = run([str(python), "-c", CHECK_ENGINE])
    if checked.returncode:
        raise FastStartError(f"{python} does not import fast-start after the install: "
                             f"{(checked.stderr.strip().splitlines() or [''])[-1]}", "")
    got = _engine_report(python, checked.stdout)
    result = {"python": str(python), "wheel": str(wheel), "command": command, **got}
    problems = [*([f"it imports fast-start {got['version']} from {got['file']}, not {__version__}"]
                  if got["version"] != __version__ else []),
                *([f"it imports fast-start from {got['file']}, outside its environment {got['prefix']}"]
                  if not got["file"].startswith(got["prefix"].rstrip("/") + "/") else []),
                *([] if got["plugin"] else ["vLLM's plugin entry point (vllm.general_plugins) is missing"])]
    if problems:
        raise FastStartError(f"{python}: " + "; ".join(problems),
                             "remove what shadows it (PYTHONPATH, a .pth file, a second copy) and run this again")
    emit(result, as_json, lambda r: out.print(
        f"{python}: fast-start {r['version']} installed ({r['file']}); vLLM plugin {r['plugin'][0]}"
        + ("" if r["torch"] else "\nwarning: torch is not installed there: the fill worker and engines need it"),
        soft_wrap=True, highlight=False))


def _engine_wheel(python: Path, wheel: Optional[Path]) -> Path:
    """The wheel `install-engine` installs into `python`'s environment, both checked first."""
    if not os.access(python, os.X_OK) or python.is_dir():
        raise FastStartError(f"{python} is not an interpreter this user can run",
                             "name the engine environment's python, e.g. /opt/vllm/.venv/bin/python")
    wheel = wheel or WHEELS / f"fast_start-{__version__}-py3-none-any.whl"
    if not wheel.is_file():
        raise FastStartError(f"no fast-start {__version__} wheel at {wheel}",
                             "install the fast-start package, which ships it, or pass --wheel FILE "
                             f"(pip wheel --no-deps fast-start=={__version__} makes one)")
    if not wheel.name.startswith(f"fast_start-{__version__}-"):
        raise FastStartError(f"{wheel.name} is not fast-start {__version__}, the version here",
                             f"pass the wheel of fast-start {__version__}")
    _runnable_by_root(python)
    return wheel


def _installer(python: Path, wheel: Path, run) -> list[str]:
    """The command that installs only `wheel` (its dependencies, torch and safetensors, are the
    engine's own) into `python`'s environment: its pip, else uv."""
    import shutil
    if run([str(python), "-m", "pip", "--version"]).returncode == 0:
        return [str(python), "-m", "pip", "install", "--no-index", "--no-deps", "--force-reinstall",
                "--disable-pip-version-check", "--quiet", str(wheel)]
    if uv := shutil.which("uv"):
        return [uv, "pip", "install", "--python", str(python), "--offline", "--no-deps", "--reinstall", str(wheel)]
    raise FastStartError(f"{python}'s environment has no pip, and there is no uv on PATH",
                         f"{python} -m ensurepip installs pip without an index; then run this again")


INSTALL_TIMEOUT_S = 600     # for pip; the checks before and after it take seconds


def _run(command: list[str], env: dict):
    """`command`, its output captured, in "/" (`python -c` imports from the working directory
    first: a checkout would shadow the environment); one that does not finish is named."""
    import subprocess
    try:
        return subprocess.run(command, capture_output=True, text=True, env=env, timeout=INSTALL_TIMEOUT_S, cwd="/")
    except subprocess.TimeoutExpired:
        raise FastStartError(f"{' '.join(command[:3])} did not finish within {INSTALL_TIMEOUT_S:g} s",
                             f"run it by hand to see where it waits: {' '.join(command)}") from None


def _engine_report(python: Path, stdout: str) -> dict:
    """What CHECK_ENGINE printed, as its last line: an interpreter may print a banner first."""
    lines = stdout.strip().splitlines()
    try:
        got = json.loads(lines[-1]) if lines else None
    except ValueError:
        got = None
    keys = {"version", "file", "prefix", "plugin", "torch"}
    if not isinstance(got, dict) or set(got) != keys:
        raise FastStartError(f"{python} did not answer fast-start's check as a Python interpreter would "
                             f"(its last line: {(lines or [''])[-1][:200]!r})",
                             "name the engine environment's own python, not a wrapper that prints or answers "
                             "otherwise")
    return got


def _runnable_by_root(python: Path) -> None:
    """As root, refuse to run `python` where another user could change what it runs."""
    writable = trust.others_can_write(python) if os.geteuid() == 0 else None
    if writable:
        raise FastStartError(f"{python}: {writable}, so running it as root would run that user's code",
                             "run this as the environment's owner, or give the environment to root "
                             "(chown -R root: and chmod go-w)")


@app.command("check-config")
@fails
def check_config(config: Path = CONFIG, as_json: bool = JSON,
                 reload: bool = typer.Option(False, "--reload", help="the file alone, as a reload reads it "
                                             "(the unit's ExecReload= runs this before it signals the daemon)"),
                 paths: bool = typer.Option(False, "--paths", hidden=True, help="models and workers only: what "
                                            "check-config runs again as a unit's user"),
                 workers: bool = typer.Option(False, "--workers", hidden=True, help="the worker interpreters only: "
                                              "what the package checks before it restarts the instances")):
    """Check a config as `nginx -t` does: the file, each model's folder, the memory each GPU's
    models need against its budget, and each worker interpreter; run as root, also as each
    fast-start@N unit would see them (its User=, and paths its sandbox hides). Exit 0 when all
    pass, 2 if not."""
    def human(rows):
        table = Table("check", "", "detail")
        for r in rows:
            table.add_row(r["check"], "warn" if r.get("warn") else "ok" if r["ok"] else "FAIL", r["detail"])
        out.print(table)
    config = config.absolute()         # the checks as a unit's user run in "/"
    whole = not (reload or workers)
    cfg = configs.load(config, check_paths=whole)
    checks = [{"check": "config", "ok": bool(cfg.models) or not whole, "detail": f"{config}: {len(cfg.models)} model(s)"
               + ("" if cfg.models or not whole else ": no [[model]], so every daemon would serve an empty cache")}]
    checks += [{"check": "config", "ok": True, "warn": True, "detail": note} for note in cfg.deprecated]
    if reload:          # the unit's ExecReload=: its output is the journal's, and a passing file needs no table
        if as_json or _json[0]:
            emit(checks, as_json, human)
        return
    if not workers:
        rows, need, largest = _model_checks(cfg)
        checks += rows + ([] if paths else _memory_checks(cfg, need, largest))
    checks += _worker_checks(cfg)
    if os.geteuid() == 0 and whole and not paths:
        checks += _unit_checks(config, cfg)
    emit(checks, as_json, human)
    if not all(c["ok"] for c in checks):
        raise typer.Exit(2)


def _model_checks(cfg: configs.Config) -> tuple[list[dict], dict[int, int], dict[int, int]]:
    """A row per model (its folder, config.json and every header read as this user); the bytes
    each GPU's models need, and its largest model's."""
    from .headers import rank_bytes
    rows, need, largest = [], {}, {}
    for m in cfg.models:
        try:
            if m.filler is None:
                _check_tp(Path(m.path), m.tensor_parallel_size, "tensor_parallel_size")
            for gpu in m.gpus:
                spec = m.spec(gpu)
                fingerprint(spec)
                engine = m.filler
                nbytes = engine.estimate(spec) if engine else \
                    rank_bytes(Path(spec.path), spec.dtype, spec.tensor_parallel_size * spec.pipeline_parallel_size)
                need[gpu] = need.get(gpu, 0) + nbytes
                largest[gpu] = max(largest.get(gpu, 0), nbytes)
            rows.append({"check": f"model {m.name}", "ok": True, "detail": f"{m.path} readable by uid {os.geteuid()}"})
        except FastStartError as e:
            rows.append({"check": f"model {m.name}", "ok": False, "detail": str(e)})
    return rows, need, largest


def _memory_checks(cfg: configs.Config, need: dict[int, int], largest: dict[int, int]) -> list[dict]:
    """Per GPU: its models against the budget, the largest one's fill beside the others, and the
    room an engine at vLLM's default utilization has left."""
    from .memory import device_total, fill_need, gib, keep_free
    rows = []
    for gpu, nbytes in sorted(need.items()):
        try:
            total = device_total(cfg.daemon.device, gpu)
            budget = configs.parse_bytes(cfg.daemon.memory_budget, total)
            rows.append({"check": f"memory GPU {gpu}", "ok": nbytes <= budget,
                         "detail": f"models need about {configs.format_bytes(nbytes)} of a "
                                   f"{configs.format_bytes(budget)} budget (memory_budget = "
                                   f"{cfg.daemon.memory_budget!r} of {configs.format_bytes(total)})"})
            room = total - keep_free(cfg.daemon, gpu) - (nbytes - largest[gpu])
            peak = fill_need(largest[gpu], cfg.daemon.device)
            if peak > room:
                rows.append({"check": f"fill GPU {gpu}", "ok": False, "detail": (
                    f"the largest model's fill needs about {gib(peak)} at its peak; beside the other models and "
                    f"keep_free, {gib(room)} is left: serve fewer models on this GPU, or lower keep_free")})
            beside = nbytes - largest[gpu]
            if cfg.daemon.device != "cpu" and beside > total * (1 - VLLM_UTILIZATION):
                rows.append({"check": f"engine room GPU {gpu}", "ok": True, "warn": True, "detail": (
                    f"an engine at vLLM's default gpu_memory_utilization {VLLM_UTILIZATION} serving the largest model "
                    f"(its mapped weights count in its share) has {gib(beside)} of other cached models beside it, "
                    f"more than the {gib(int(total * (1 - VLLM_UTILIZATION)))} it leaves: start it with "
                    f"gpu_memory_utilization {max(0.0, (total - beside) / total - 0.01):.2f} or cache fewer models")})
        except FastStartError as e:
            rows.append({"check": f"memory GPU {gpu}", "ok": False, "detail": str(e)})
    return rows


def _worker_checks(cfg: configs.Config) -> list[dict]:
    """Each worker interpreter has fast-start of this protocol, torch and its engines, as the
    daemon starts it (cwd "/": a checkout where this runs must not stand in for its environment).
    Found, not imported: importing an engine takes seconds, and the daemon's start tries it."""
    import subprocess
    rows = []
    for python in sorted({cfg.python(m) for m in cfg.models}):
        try:
            _runnable_by_root(Path(python))
        except FastStartError as e:
            rows.append({"check": f"worker {python}", "ok": False, "detail": str(e)})
            continue
        named = sorted({m.filler.module for m in cfg.models if cfg.python(m) == python and m.filler})
        modules = ", ".join(["fast_start", "torch", *named])
        code = ("import fast_start, fast_start.protocol as p, importlib.util as u; "
                "print(fast_start.__version__, p.VERSION, flush=True); "
                f"missing = [n for n in {['torch', *named]!r} if u.find_spec(n) is None]; "
                "raise SystemExit(f'ModuleNotFoundError: no module named {missing[0]!r}' if missing else 0)")
        try:
            done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300, cwd="/")
        except (OSError, subprocess.TimeoutExpired) as e:
            rows.append({"check": f"worker {python}", "ok": False, "detail": str(e)})
            continue
        theirs = done.stdout.split()[:2]
        if len(theirs) == 2 and theirs[1] != str(protocol.VERSION):
            ok, detail = False, (f"runs fast-start {theirs[0]}, protocol {theirs[1]}; this one runs {__version__}, "
                                 f"protocol {protocol.VERSION}: fast-start install-engine {python}")
        else:
            ok = not done.returncode
            said = done.stderr.strip().splitlines() or [f"exit {done.returncode}"]
            detail = f"has {modules}" if ok else said[-1]
        rows.append({"check": f"worker {python}", "ok": ok, "detail": detail})
    return rows


def _unit_sees(unit, cfg: configs.Config, gpu: int) -> list[dict]:
    """FAIL rows for what `unit` (GPU `gpu`'s) cannot see or write: the socket directory (engines
    outside a PrivateTmp= would not find the socket), the metrics file's folder, each model's
    folder and files (a snapshot's links into a blob store), each worker and its environment."""
    from . import unitview
    fix = "move it where the unit sees it, or override {key}= in a drop-in (systemctl edit fast-start@.service)"
    wanted = [("socket_dir", cfg.daemon.socket_dir)]
    for m in (m for m in cfg.models if gpu in m.gpus):
        folder = Path(m.path)
        wanted += [(f"model {m.name}", str(p)) for p in (folder, *(folder / f for f in watch.checkpoint_files(folder)))]
        wanted += [(f"worker {m.name}", cfg.python(m)), (f"worker {m.name}", str(Path(cfg.python(m)).parent))]
    rows, seen = [], set()
    for what, path in wanted:
        setting = unitview.hider(unit, path)
        if setting and what not in seen:
            seen.add(what)
            real = os.path.realpath(path)
            rows.append({"check": f"{unit.name}: {what}", "ok": False, "detail": f"{path}"
                         + (f" (a link to {real})" if real != os.path.abspath(path) else "")
                         + f" is hidden from the unit by {setting}: " + fix.format(key=setting.split("=")[0])})
    metrics = cfg.daemon.metrics_file.replace("{gpu}", str(gpu))
    if metrics and not unitview.writable(unit, str(Path(metrics).parent)):
        rows.append({"check": f"{unit.name}: metrics_file", "ok": False, "detail": (
            f"the unit sees {Path(metrics).parent} read-only (ProtectSystem={unit.protect_system}): add a drop-in "
            f"with ReadWritePaths={Path(metrics).parent} (systemctl edit fast-start@.service)")})
    return rows


def _unit_checks(config: Path, cfg: configs.Config) -> list[dict]:
    """As the fast-start@N units serving the config's GPUs would see it (where systemd knows
    them): paths their sandbox hides, named by the setting, and the model and worker checks run
    again as each unit's User= (`unitview`)."""
    import subprocess
    from . import unitview
    rows, users = [], set()
    for gpu in sorted({g for m in cfg.models for g in m.gpus}):
        unit = unitview.read(gpu)
        if unit is None:
            continue
        rows += _unit_sees(unit, cfg, gpu)
        if (unit.user, unit.group, unit.groups) in users:
            continue
        users.add((unit.user, unit.group, unit.groups))
        who = f"User={unit.user or 'root'}"
        try:
            done = subprocess.run([sys.executable, "-m", "fast_start.cli", "check-config", "--config", str(config),
                                   "--json", "--paths"], capture_output=True, text=True, timeout=600, cwd="/",
                                  **unitview.as_user(unit))
            found = json.loads(done.stdout or "null")
        except (LookupError, OSError, subprocess.TimeoutExpired, ValueError) as e:
            rows.append({"check": unit.name, "ok": False, "detail": f"cannot check as {who}: {e}"})
            continue
        if isinstance(found, dict):         # the child's one-line error: the config itself
            rows.append({"check": f"{unit.name}: config", "ok": False,
                         "detail": f"as {who}: {found.get('error')} (fix: {found.get('fix')})"})
            continue
        failed = [r for r in found or [] if not r.get("ok")]
        rows += [{"check": f"{unit.name}: {r['check']}", "ok": False, "detail": f"as {who}: {r['detail']}"}
                 for r in failed]
        if not failed and found:
            rows.append({"check": unit.name, "ok": True, "detail": f"models and workers readable as {who}"})
    return rows


@app.command()
@fails
def evict(gpu: int = typer.Option(..., "--gpu"), model: Optional[str] = typer.Option(None, "--model"),
          every: bool = typer.Option(False, "--all", help="evict every model on the GPU (asked otherwise)"),
          config: Path = CONFIG, as_json: bool = JSON):
    """Drop a model (or, with --all, every model) from a GPU's cache; engines that map it keep working."""
    if model and every:
        raise ConfigError("evict: --model and --all exclude each other", "name one model, or pass --all alone")
    if not model and not every:
        if not sys.stdin.isatty() or as_json or _json[0]:
            raise ConfigError(f"evict --gpu {gpu} without --model would evict every model on GPU {gpu}",
                              "name the model with --model NAME, or pass --all")
        if not typer.confirm(f"Evict every model cached on GPU {gpu}?", default=False):
            raise typer.Exit(1)
    evicted = ask_report(socket_dir(config), gpu, protocol.Evict(model or ""), reports.Evicted).evicted
    emit({"evicted": evicted}, as_json, lambda _: out.print(f"GPU {gpu}: evicted {', '.join(evicted) or 'nothing'}"))


@app.command()
@fails
def fill(gpu: int = typer.Option(..., "--gpu"), model: Optional[str] = typer.Option(None, "--model"),
         wait: float = typer.Option(0.0, "--wait", help="seconds to wait for the fill to finish (0: return at once)"),
         config: Path = CONFIG, as_json: bool = JSON):
    """Fill a configured model that is not cached (evicted, failed), or every such model, without
    restarting the unit. Exit 0 once filled (or queued, without --wait), 1 if it failed or is not done."""
    directory = socket_dir(config)
    asked = ask_report(directory, gpu, protocol.Fill(model or ""), reports.Filling)
    body = reports.body(asked)
    if wait > 0 and asked.filling:
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            time.sleep(0.25)
            status = ask_report(directory, gpu, protocol.Status(), reports.Status)
            left = [m for m in status.missing if m.name in asked.filling]
            if not left or any(m.state == "failed" for m in left):
                break
        body["not_filled"] = [{"name": m.name, "state": m.state, "detail": m.detail} for m in left]

    def human(b):
        out.print(f"GPU {gpu}: " + (f"filling {', '.join(b['filling'])}" if b["filling"] else "nothing to fill")
                  + (f" (cached: {', '.join(b['cached'])})" if b["cached"] else ""))
        if "not_filled" in b:
            for m in b["not_filled"]:
                out.print(f"GPU {gpu}: {m['name']} not filled yet: {m['state']}" + (f" ({m['detail']})" if m["detail"] else ""))
            if not b["not_filled"]:
                out.print(f"GPU {gpu}: filled {', '.join(b['filling'])}")
    emit(body, as_json, human)
    if body.get("not_filled"):
        raise typer.Exit(1)


@app.command()
@fails
def reload(gpu: int = typer.Option(..., "--gpu"), timeout: float = typer.Option(
               300.0, "--timeout", help="seconds to wait for the daemon to have read its config"),
           config: Path = CONFIG, as_json: bool = JSON):
    """Make GPU N's daemon read its config again (SIGHUP) and wait until it has: new models queued
    to fill, removed or changed ones dropped. What `systemctl reload fast-start@N` runs, so that a
    `fast-start status` after it sees the new config. Exit 1 if the daemon kept the running config."""
    directory = socket_dir(config)
    before = ask_report(directory, gpu, protocol.Status(), reports.Status)
    with connect(socket_path(directory, gpu), timeout=10.0) as conn:
        pid = trust.peer(conn).pid      # as this process sees it: the status' pid is the daemon's view
    if not pid:
        raise FastStartError(f"GPU {gpu}: the daemon runs in a PID namespace this process cannot see",
                             f"reload it from there (systemctl reload fast-start@{gpu})")
    asked = time.time()     # a reload that began reading the config before this is not this one's
    try:
        os.kill(pid, signal.SIGHUP)
    except PermissionError:
        raise FastStartError(f"GPU {gpu}: no permission to signal the daemon (pid {pid})",
                             f"run it as root or as the daemon's user, or: systemctl reload fast-start@{gpu}") from None
    if before.reloads is None:         # a daemon older than this command: it cannot say when it is done
        print(f"warning: GPU {gpu}: the daemon (fast-start {before.version or '?'}) was sent SIGHUP but does "
              f"not report reloads; restart it to run this version", file=sys.stderr)
        return
    deadline = time.monotonic() + timeout
    while True:
        time.sleep(0.1)
        now = ask_report(directory, gpu, protocol.Status(), reports.Status)
        if now.pid != before.pid:
            raise FastStartError(f"GPU {gpu}: the daemon restarted (pid {before.pid}, now {now.pid}) "
                                 "while reloading", f"see journalctl -u fast-start@{gpu}")
        # reload_began 0: a daemon too old to say when its reload began, judged by the count alone
        if now.reloads is not None and now.reloads > before.reloads and (now.reload_began >= asked
                                                                         or not now.reload_began):
            break
        if time.monotonic() > deadline:
            raise FastStartError(f"GPU {gpu}: the daemon (pid {now.pid}) did not finish reloading in {timeout:g} s",
                                 f"see journalctl -u fast-start@{gpu}; a longer --timeout waits more")
    configured = [m.name for m in now.models] + [m.name for m in now.missing]
    body = {"gpu": gpu, "reloaded": not now.reload_error, "error": now.reload_error, "configured": configured}
    emit(body, as_json, lambda _: out.print(
        f"GPU {gpu}: reloaded, {len(configured)} model(s) configured" if not now.reload_error
        else f"GPU {gpu}: reload refused, the running config kept: {now.reload_error}"))
    if now.reload_error:
        raise typer.Exit(1)


@app.command()
@fails
def metrics(gpu: Optional[int] = GPU, config: Path = CONFIG, as_json: bool = JSON):
    """Counters and gauges of every daemon in Prometheus' text format (--json: the samples)."""
    from .metrics import render
    samples = [s for r in each_report(config, gpu, protocol.Metrics(), reports.Metrics) for s in r.samples]
    emit(samples, as_json, lambda s: sys.stdout.write(render(s)))


@app.command()
@fails
def evictions(gpu: Optional[int] = GPU, config: Path = CONFIG, as_json: bool = JSON):
    """Recent evictions with their reason (manual, release, ...)."""
    data = each_report(config, gpu, protocol.Evictions(), reports.Evictions)

    def human(_):
        table = Table("GPU", "time", "model", "reason", "GiB", "leases then")
        for d in data:
            for e in d.evictions:
                table.add_row(str(d.gpu), _when(e.time),
                              e.model, e.reason, f"{e.bytes / 2**30:.2f}", str(e.leases))
        out.print(table)
    emit([reports.body(d) for d in data], as_json, human)


def _when(t: float) -> str:
    """A local date and time; what was recorded where it is none (a history file edited by hand)."""
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
    except (OverflowError, OSError, ValueError):
        return f"{t!r} (not a time)"


def main() -> None:
    """The `fast-start` command (and `python -m fast_start`): click's usage errors become JSON
    with --json, like every other error."""
    # click's base of usage errors, whether typer vendors click (0.2x) or uses it (Debian's 0.7)
    usage = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
    try:
        code = app(standalone_mode=False)
    except usage as e:          # an unknown option, a missing value, no command
        if "--json" not in sys.argv[1:]:
            e.show()
        else:
            print(json.dumps({"error": e.format_message(), "fix": "see fast-start --help", "exit_code": e.exit_code}))
        sys.exit(e.exit_code)
    except typer.Abort:
        print("Aborted.", file=sys.stderr)
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)

if __name__ == "__main__":
    main()

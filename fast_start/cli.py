"""The `fast-start` command line.

Exit codes are part of the interface (runbooks branch on them): 0 ok / match, 1 mismatch or
not ready, 2 usage (including a bad config), 3 no daemon reachable. `fails` below is the one
place where errors become one line and an exit code; no command prints a traceback.

The CLI imports no torch: it talks to daemons (`transport.py`) and reads headers; `verify --deep`,
which compares tensor bytes, hands that to a fill worker.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from . import config as configs
from . import protocol, vllm_rules, watch
from .config import ConfigError
from .errors import FastStartError, NoDaemon, Refused
from .fingerprint import Fingerprint, WeightSpec, checkpoint_hash, fingerprint
from .transport import DEFAULT_SOCKET_DIR, connect, request, socket_path, state_path
from .trust import TrustError

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="Keep inference engines' weights resident on each GPU between restarts.")
out = Console()

CONFIG = typer.Option(configs.DEFAULT_PATH, "--config", help="config file (finds the socket directory)")
GPU = typer.Option(None, "--gpu", help="GPU index; all daemons in the socket directory when left out")
JSON = typer.Option(False, "--json", help="machine-readable output")


def fails(command):
    """Map errors to one line on stderr and the documented exit code; never a traceback."""
    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except FastStartError as e:
            print(f"error: {e}", file=sys.stderr)     # one line, never wrapped or highlighted
            code = 2 if isinstance(e, ConfigError) else 3 if isinstance(e, (NoDaemon, TrustError)) else 1
            raise typer.Exit(code) from None
        except MemoryError:
            print("error: out of memory (fix: raise the process's memory limit, e.g. LimitAS= or ulimit -v)",
                  file=sys.stderr)
            raise typer.Exit(1) from None
        except OSError as e:
            print(f"error: {e.strerror or e}{f': {e.filename}' if e.filename else ''}", file=sys.stderr)
            raise typer.Exit(1) from None
    return wrapper


def socket_dir(config: Path) -> str:
    """The config's socket_dir when --config is given, else $FAST_START_SOCKET_DIR, else that of
    /etc/fast-start/fast-start.toml, else /run/fast-start."""
    if config == configs.DEFAULT_PATH:
        if os.environ.get("FAST_START_SOCKET_DIR"):
            return os.environ["FAST_START_SOCKET_DIR"]
        if not config.exists():
            return DEFAULT_SOCKET_DIR
    return configs.load(config, check_paths=False).daemon.socket_dir


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
    if as_json:
        out.print_json(json.dumps(data))
    else:
        human(data)


@app.command("daemon")
@fails
def daemon_cmd(gpu: int = typer.Option(..., "--gpu", help="the GPU this daemon serves"), config: Path = CONFIG):
    """Run GPU N's daemon in the foreground (what fast-start@N.service runs)."""
    from . import daemon
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    raise typer.Exit(daemon.run(str(config), gpu))


@app.command()
@fails
def status(gpu: Optional[int] = GPU, config: Path = CONFIG, as_json: bool = JSON):
    """State per GPU: loading (progress), ready or failed; models, bytes, fingerprints, leases."""
    directory = socket_dir(config)
    states = []
    for g in gpus(directory, gpu):
        try:
            states.append(ask(directory, g, protocol.Status()).body)
        except Refused:
            raise
        except NoDaemon:
            state_file = state_path(directory, g)
            if not state_file.exists():
                if gpu is not None:
                    raise
                continue
            try:
                state = json.loads(state_file.read_text())
            except (OSError, ValueError) as e:
                raise NoDaemon(f"GPU {g}: no daemon answers and {state_file} is unreadable ({e})",
                               "run as root or the daemon's user") from None
            if not _alive(state["pid"]):
                state.update(state="failed", error=state.get("error") or f"daemon pid {state['pid']} is not running")
            states.append(state)
    if not states:
        raise NoDaemon(f"no fast-start daemon reachable in {directory}", "start one: systemctl start fast-start@N")
    emit(states, as_json, _status_table)
    if any(s["state"] != "ready" for s in states):
        raise typer.Exit(1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _status_table(states: list[dict]) -> None:
    table = Table("GPU", "state", "model", "rank/TP", "GiB", "fingerprint", "fill s", "leases")
    for s in states:
        if "models" not in s:       # from the state file: loading or failed, no socket yet
            p = s.get("progress")
            detail = f"{p['model']} {p['done'] / 2**30:.2f}/{p['total'] / 2**30:.2f} GiB" if p else s.get("error", "")
            table.add_row(str(s["gpu"]), s["state"], detail, "", "", "", "", "")
            continue
        leases = s["leases"]
        for m in s["models"] or ([] if s["missing"] else [{}]):
            held = [f"{l['pid']}:{l['mode']}" for l in leases if l["model"] == m.get("name")]
            table.add_row(str(s["gpu"]), "ready", m.get("name", "(none)"),
                          f"{m['rank']}/{m['tensor_parallel_size']}" if m else "",
                          f"{m['bytes'] / 2**30:.2f}" if m else "", m.get("fingerprint", ""),
                          str(m.get("fill_seconds", "")), " ".join(held) or "-")
        for m in s["missing"]:
            table.add_row(str(s["gpu"]), m["state"], f"{m['name']}: {m['detail']}" if m["detail"] else m["name"],
                          "", "", "", "", "")
    out.print(table)


@app.command()
@fails
def fingerprints(gpu: Optional[int] = GPU, config: Path = CONFIG, as_json: bool = JSON):
    """The fingerprints each daemon holds, field by field."""
    directory = socket_dir(config)
    data = [ask(directory, g, protocol.Fingerprints()).body for g in gpus(directory, gpu)]

    def human(data):
        for d in data:
            for m in d["models"]:
                _field_table(f"GPU {d['gpu']}: {m['name']} ({m['digest'][:16]})", m["fingerprint"])
    emit(data, as_json, human)


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
                    layout: str = typer.Option("hf", "--layout"), revision: str = typer.Option("main", "--revision"),
                    engine_version: str = typer.Option("", "--engine-version"),
                    pp: int = typer.Option(1, "--pp", help="pipeline stages (layout vllm); --rank is the global rank"),
                    kv_cache_dtype: str = typer.Option("auto", "--kv-cache-dtype", help="layout vllm"),
                    as_json: bool = JSON):
    """Compute a checkpoint's fingerprint without a daemon (layout vllm: with this shell's VLLM_* kernel variables)."""
    options = vllm_rules.engine_options(dict(os.environ), kv_cache_dtype, pp) if layout == "vllm" else ""
    fp = fingerprint(WeightSpec(str(model), tp, rank, dtype, quantization, layout, revision, engine_version, pp, options))
    data = {"digest": fp.digest(), "fingerprint": fp.to_dict()}

    emit(data, as_json, lambda d: _field_table(f"fingerprint {d['digest'][:16]}", d["fingerprint"]))


@app.command()
@fails
def verify(model: Path = typer.Option(..., "--model", help="checkpoint folder"), gpu: Optional[int] = GPU,
           deep: bool = typer.Option(False, "--deep", help="re-derive the bytes from disk and compare checksums"),
           config: Path = CONFIG, as_json: bool = JSON):
    """Does the cache match this checkpoint? Exit 0 on a match, 1 on a mismatch or nothing cached."""
    directory = socket_dir(config)
    headers = checkpoint_hash(model)
    files = watch.identity(model)
    results = []
    for g in gpus(directory, gpu):
        for m in ask(directory, g, protocol.Fingerprints()).body["models"]:
            stored = Fingerprint.from_dict(m["fingerprint"])
            same_folder = "path" in m and Path(m["path"]).resolve() == model.resolve()
            if not same_folder and stored.checkpoint != headers:
                continue
            spec = WeightSpec(str(model), stored.tensor_parallel_size, stored.rank, stored.dtype, stored.quantization,
                              stored.layout.split("/")[0], stored.revision, stored.engine_version,
                              stored.pipeline_parallel_size, stored.engine_options)
            fields = list(stored.diff(fingerprint(spec)))
            changed = watch.differs(m["files"], files)
            if changed:      # the fill read other files, or these changed since
                fields.append("files")
            result = {"gpu": g, "model": m["name"], "match": not fields, "fields": fields, "files": changed}
            if deep and not fields:
                result["tensors_differing"] = _deep_compare(directory, g, stored, spec, files, config)
                result["match"] = not result["tensors_differing"]
            results.append(result)

    def human(rs):
        if not rs:
            out.print(f"{model}: not cached by any daemon in {directory}")
        for r in rs:
            why = f"differs in {', '.join(r['fields'])}" + (f" ({r['files']})" if r["files"] else "") if r["fields"] else \
                f"{len(r.get('tensors_differing', []))} tensors differ" if not r["match"] else "match"
            out.print(f"GPU {r['gpu']} {r['model']}: {why}" + (" (deep)" if deep and not r["fields"] else ""))
    emit(results, as_json, human)
    if not results or not all(r["match"] for r in results):
        raise typer.Exit(1)


def _deep_compare(directory: str, gpu: int, stored: Fingerprint, spec: WeightSpec, files: dict,
                  config: Path) -> list[str]:
    """Names of tensors whose cached bytes or disk-derived bytes differ from the manifest's checksums.

    A fill worker (the config's `worker_python`) maps the arenas and derives the checkpoint's
    tensors one at a time, so neither this process nor the worker holds the shard in RAM.
    """
    from .fill import Worker, worker_env
    reply, fds = ask(directory, gpu, protocol.Acquire(stored.to_dict(), "zero_copy", files, manifest="json"),
                      with_fds=True)
    if isinstance(reply, protocol.Miss):
        return [f"(cache miss: {reply.reason})"]
    python = sys.executable
    if config.exists():
        python = configs.load(config, check_paths=False).daemon.worker_python or python
    try:
        with Worker(python, worker_env(1), threading.Event()) as worker:
            job = protocol.VerifyJob(reply.model, reply.manifest, spec._asdict())
            return [msg for msg, _ in worker.run(job, fds)][-1].bad
    finally:
        for fd in fds:
            os.close(fd)


@app.command()
@fails
def evict(gpu: int = typer.Option(..., "--gpu"), model: Optional[str] = typer.Option(None, "--model"),
          config: Path = CONFIG, as_json: bool = JSON):
    """Drop a model (or all) from a GPU's cache; engines that map it keep working."""
    body = ask(socket_dir(config), gpu, protocol.Evict(model or "")).body
    emit(body, as_json, lambda b: out.print(f"GPU {gpu}: evicted {', '.join(b['evicted']) or 'nothing'}"))


@app.command()
@fails
def evictions(gpu: Optional[int] = GPU, config: Path = CONFIG, as_json: bool = JSON):
    """Recent evictions with their reason (manual, release, ...)."""
    directory = socket_dir(config)
    data = [ask(directory, g, protocol.Evictions()).body for g in gpus(directory, gpu)]

    def human(data):
        table = Table("GPU", "time", "model", "reason", "GiB", "leases then")
        for d in data:
            for e in d["evictions"]:
                table.add_row(str(d["gpu"]), time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e["time"])),
                              e["model"], e["reason"], f"{e['bytes'] / 2**30:.2f}", str(e["leases"]))
        out.print(table)
    emit(data, as_json, human)


def main() -> None:
    app()


if __name__ == "__main__":
    main()

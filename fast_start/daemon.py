"""`fast-start daemon --gpu N`: fill the cache for GPU N, then serve it. No torch in here.

Start-up order is the contract with systemd and engines (the steps that need no daemon are
`startup.py`'s):
1. load and validate the config; create and check the socket directory and take the GPU's lock
   (`gpu<N>.lock`: a second daemon for the same GPU fails at once, naming the first's pid);
2. start a fill worker with each interpreter the GPU's models name (`worker_python`, a model's
   `python`): one that does not speak this protocol fails the start, naming both versions; its
   environment resolves `engine_version = "auto"`;
3. re-adopt what systemd's fd store kept from a previous process (`fdstore.py`: fingerprint and
   checkpoint files checked against the config, checksums re-verified by a worker; anything that
   fails is dropped and filled again, never a reason to fail); then a worker checks every other
   model's headers (TP sizes, rules, quantization) and sizes its arenas against the memory
   budget: a config mistake fails here, before any tensor data is read, while a model whose
   folder cannot be used fails alone (`broken`: named, retried once its files change);
4. the workers fill the remaining models, their progress relayed as `STATUS=` and the start
   timeout extended (`EXTEND_TIMEOUT_USEC=`) while they advance; each result goes into systemd's
   fd store;
5. bind `gpu<N>.sock` only now, then `READY=1`;
6. serve (`serve.py`): the main loop waits on one epoll set for connections, signals, checkpoint
   changes (inotify) and engine exits (pidfds), and pings the watchdog. The keeper thread
   (`keeper.py`) refills changed checkpoints and reloads the config on SIGHUP.

Until the socket exists, and whenever start-up fails, `gpu<N>.state` in the socket directory
says how the fill is going or why it failed, for `fast-start status`.
"""
from __future__ import annotations

import json
import logging
import os
import resource
import select
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from . import __version__, fdstore, files, memory, metrics, notify, protocol, reports, startup, trust, views, watch
from . import config as configs
from .artifact_store import Artifacts
from .cache import Cache, Events
from .entry import Entry
from .leases import Limits
from .errors import CheckpointError, ConfigError, FastStartError, NoRoom, StartError
from .fill import FillError, Workers, worker_env
from .inflight import InFlight
from .fingerprint import fingerprint
from .journal import fields
from .keeper import Keeper
from .manifest import Manifest
from .serve import Policy, Server
from .transport import socket_path, state_path

log = logging.getLogger("fast_start.daemon")
METRICS_S = 15.0     # how often `metrics_file` is rewritten
FD_RESERVE = 64      # descriptors kept for the daemon itself: listener, epoll, workers, arenas


def device_id(device: str, gpu: int) -> str:
    """"cpu", or GPU `gpu`'s UUID (asked of the driver without creating a context; through ctypes,
    so that a daemon on Debian's python3 needs no cuda-bindings)."""
    if device == "cpu":
        return "cpu"
    from .cudadrv import device_uuid
    return device_uuid(gpu)


def inflight_budget(gpus: int) -> InFlight:
    """What this daemon may have sent and not yet received (`inflight.py`): half its user's
    descriptor limit, shared by the host's daemons (the rest is for the fill workers' and systemd's
    sends); one uid a quarter of that."""
    total = max(256, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // (2 * max(1, gpus)))
    return InFlight(total, total // 4)


def fd_budget() -> tuple[Limits, int]:
    """Engine processes and connections the daemon can track within its file-descriptor limit.

    The soft limit is raised to the hard one first (systemd's default soft limit is 1024, for
    programs that use select(); this one does not).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    free = max(64, soft - len(os.listdir("/proc/self/fd")) - FD_RESERVE)
    connections = min(256, free // 4)
    return Limits(processes=free - connections), connections


class Daemon:
    def __init__(self, cfg: configs.Config, gpu: int):
        self.cfg, self.gpu = cfg, gpu
        self.directory = cfg.daemon.socket_dir
        self.stop, self.reload_asked = threading.Event(), threading.Event()
        self.fill_began: dict[str, tuple[float, int]] = {}     # model -> (monotonic start, bytes done): the ETA
        self.limits, max_connections = fd_budget()
        self.keeper, self.told, counters = Keeper(self), Told(self), metrics.Metrics(gpu)
        # systemd's StateDirectory=: engines' artifacts and the evictions survive restarts
        state = Path(os.environ["STATE_DIRECTORY"].split(":")[0]) if os.environ.get("STATE_DIRECTORY") else None
        self.artifacts = Artifacts(state / "artifacts" / f"gpu{gpu}" if state else None,
                                   configs.parse_bytes(cfg.daemon.artifacts), lambda: {m.name for m in self.models},
                                   counters)
        self.cache = Cache(gpu, device_id(cfg.daemon.device, gpu), cfg.daemon.on_release, self.limits, self.told,
                           counters)
        self.cache.configure(tuple(m.name for m in self.models), cfg.daemon.on_release,
                             memory.keep_free(cfg.daemon, gpu), tuple(m.path for m in self.models))
        if state:
            self.cache.history.keep(state / f"gpu{gpu}.evictions.json")
        self.sizes: dict[str, int] = {}     # model -> its bytes, as the worker estimated them (check_models)
        self.server = Server(self.cache, Policy.of(cfg.daemon), max_connections,
                             inflight_budget(len({g for m in cfg.models for g in m.gpus})), self.artifacts)
        self.watch = watch.Watch()
        self.epoll: select.epoll | None = None
        self.metrics_writer: threading.Thread | None = None
        self.started = time.monotonic()

    @property
    def models(self) -> tuple[configs.ModelConfig, ...]:
        return self.cfg.models_on(self.gpu)

    def model(self, name: str) -> configs.ModelConfig | None:
        return next((m for m in self.models if m.name == name), None)

    def workers(self, starting: bool = False) -> Workers:
        """Fill workers for this GPU (each gets its share of the host's CPUs)."""
        env = worker_env(len({g for m in self.cfg.models for g in m.gpus}))
        return Workers(env, self.stop, starting)

    # -- start-up ------------------------------------------------------------------------------
    def apply(self, cfg: configs.Config) -> list[str]:
        """Serve by a reloaded (and resolved) `cfg`: models removed, whose fingerprint changed or
        whose files are not those of the fill are evicted, the rest kept (under the new config);
        returns the configured models not cached (to be filled)."""
        new = {m.name: m for m in cfg.models_on(self.gpu)}
        changed = {}
        for name, entry in self.cache.cached().items():
            m = new.get(name)
            try:
                why = _changed(entry, m, self.gpu) if m else "is no longer served"
            except FastStartError as e:     # storage away: keep serving what was filled
                log.warning("reload: cannot read %s's checkpoint (%s); keeping it", name, e.what)
                why = None
            if why:
                changed[name] = why
            elif m:
                self.cache.reconfigure(name, m)
        if cfg.daemon.shared != self.cfg.daemon.shared:     # allowed users added or all removed: modes follow
            trust.prepare_socket_dir(self.directory, cfg.daemon.shared)
            os.chmod(socket_path(self.directory, self.gpu), 0o666 if cfg.daemon.shared else 0o600)
        self.cfg = cfg
        self.server.policy = Policy.of(cfg.daemon)
        self.artifacts.budget = configs.parse_bytes(cfg.daemon.artifacts)
        self.cache.configure(tuple(new), cfg.daemon.on_release, memory.keep_free(cfg.daemon, self.gpu),
                             tuple(m.path for m in new.values()))
        for name, why in changed.items():
            self.cache.evict(name, "config change", pending="filling")
            self.watch.remove(name)
            log.info("reload: %s %s", name, why)
        for name, m in new.items():
            self.watch.add(name, m.path)
        return [name for name in new if name not in self.cache.cached()]

    def check_models(self, models, workers: Workers, starting: bool = False) -> list[configs.ModelConfig]:
        """Every model's headers against its spec (in a worker), the total against the memory
        budget; returns the models to fill. Reads headers and config.json only, no tensor data.

        A config error fails; at the start, a model whose checkpoint cannot be used (a folder
        removed, a shard unreadable or truncated: `CheckpointError`) is left out, failed and named
        (`broken`), so that one bad folder never costs the other models their cache."""
        with self.cache.lock:
            need = sum(e.nbytes for e in self.cache.entries.values())
        usable = []
        for m in models:
            try:
                for msg, _ in workers.get(self.cfg.python(m)).run(protocol.CheckJob(m.name, m.spec(self.gpu)._asdict())):
                    need += msg.bytes
                    self.sizes[m.name] = msg.bytes
            except ConfigError as e:
                raise ConfigError(f"{self.cfg.path}: [[model]] {m.name!r}: {e.what}", e.fix) from None
            except CheckpointError as e:
                if not starting:
                    raise
                self.broken(m, e)
                continue
            usable.append(m)
        total = memory.device_total(self.cfg.daemon.device, self.gpu)
        budget = configs.parse_bytes(self.cfg.daemon.memory_budget, total)
        if need > budget:
            raise ConfigError(f"GPU {self.gpu}'s models need {configs.format_bytes(need)}, more than memory_budget "
                              f"{self.cfg.daemon.memory_budget!r} ({configs.format_bytes(budget)}) in {self.cfg.path}",
                              "raise memory_budget or serve fewer or smaller models on this GPU")
        return usable

    def broken(self, m: configs.ModelConfig, e: FastStartError) -> None:
        """`m` cannot be filled now for a reason of its own: failed, named at priority err, and
        looked at again by the keeper; the daemon serves the rest."""
        log.error("%s cannot be filled: %s; the other models are served (fix: %s)", m.name, e.what,
                  e.fix or "see fast-start status", extra=fields(m.name))
        self.cache.set_pending(m.name, "failed", str(e))
        self.keeper.put("retry", m.name)

    def write_state(self, state: str, **extra) -> None:
        record = reports.DaemonState(gpu=self.gpu, state=state, pid=os.getpid(), time=time.time(), version=__version__,
                                     started_at=self.cache.started, **extra)
        files.write_atomic(state_path(self.directory, self.gpu), json.dumps(reports.body(record)), 0o600)

    def device(self) -> str:
        return "cpu" if self.cfg.daemon.device == "cpu" else f"cuda:{self.gpu}"

    def fill(self, models, workers: Workers, starting: bool = False) -> None:
        """Fill `models`; each one is served as soon as its arena is complete."""
        for m in models:
            try:
                self.fill_one(m, workers, starting)
            except CheckpointError as e:
                if not starting:
                    raise
                self.broken(m, e)
            except NoRoom as e:
                if not starting:
                    raise
                self.keeper.wait_for_room(m.name, e)

    def fill_one(self, m: configs.ModelConfig, workers: Workers, starting: bool) -> None:
        """Fill `m` in a worker and serve it (and give it to systemd's fd store) once complete."""
        self.room_for(m)
        identity = watch.identity(m.path)       # before a byte of its data is read
        writes = self.watch.writes(m.name)
        job = protocol.FillJob(m.name, m.spec(self.gpu)._asdict(), self.device(),
                               configs.parse_bytes(self.cfg.daemon.fill_bandwidth),
                               configs.parse_bytes(self.cfg.daemon.arena_chunk))
        for msg, fds in workers.get(self.cfg.python(m)).run(job):
            if isinstance(msg, protocol.Progress):
                self.report_progress(msg, starting)
                continue
            manifest = filled_manifest(m.name, msg, fds)
            entry = Entry(m, manifest, fds, msg.seconds, identity)
            entry.names = fdstore.store(m.name, manifest, fds, entry.filled_at, identity)
            self.cache.add(entry)
            log.info("cached %s rank %d: %s in %.1f s", m.name, manifest.fingerprint.rank,
                     configs.format_bytes(entry.nbytes), msg.seconds, extra=fields(m.name, manifest.fingerprint.digest()))
            if self.watch.writes(m.name) != writes:     # the files' identity may not show it
                self.keeper.stale(m.name, "a checkpoint file was written during the fill")
            self.cache.metrics.inc("fast_start_fills_total", model=m.name)
            self.cache.metrics.inc("fast_start_filled_bytes_total", entry.nbytes, model=m.name)
            self.cache.metrics.set("fast_start_fill_seconds", msg.seconds, model=m.name)

    def room_for(self, m: configs.ModelConfig) -> None:
        """NoRoom naming the shortfall where `m`'s fill does not fit beside `keep_free` now (a size
        known from `check_models`; `memory.room_for`): a fill never takes memory an engine needs."""
        if m.name in self.sizes:
            lack = memory.room_for(m.name, self.sizes[m.name], self.cache.device, self.gpu, self.cache.keep_free)
            self.cache.metrics.set("fast_start_fill_shortfall_bytes", lack.short if lack else 0, model=m.name)
            if lack:
                raise lack

    def report_progress(self, p: protocol.Progress, starting: bool) -> None:
        now = time.monotonic()
        began, last = self.fill_began.get(p.model, (now, 0))
        if p.done < last:                   # another fill of it (a retry, a refill): timed afresh
            began = now
        self.fill_began[p.model] = (began, p.done)
        # The rest at the rate so far: known once some bytes are in and a second has passed.
        eta = round((now - began) * (p.total - p.done) / p.done) if p.done and now - began >= 1 else None
        left = f", about {eta} s left" if eta is not None and p.done < p.total else ""
        text = f"filling {p.model} rank {p.rank}: {p.done / 2**30:.2f} / {p.total / 2**30:.2f} GiB{left}"
        if starting:
            notify.status(text)
            self.write_state("loading", progress=reports.Progress(p.model, p.rank, p.done, p.total, eta))
        else:
            self.cache.set_pending(p.model, "filling", text)

    def start(self) -> socket.socket:
        """Steps 2-5: workers, adopt, check, fill, bind. Returns the listening socket."""
        with self.workers(starting=True) as workers:
            self.cfg = startup.resolve(self.cfg, self.gpu, workers)
            for m in self.models:
                self.watch.add(m.name, m.path)
            adopted = startup.adopt(self.cache, self.cfg, self.gpu, workers, self.stop)
            to_fill = self.check_models([m for m in self.models if m.name not in adopted], workers, starting=True)
            self.write_state("loading")
            notify.status(f"filling {len(to_fill)} model(s), {len(adopted)} kept by systemd's fd store")
            self.fill(to_fill, workers, starting=True)
        return startup.bind(self.directory, self.gpu, self.cfg.daemon.shared)

    # -- serving -------------------------------------------------------------------------------
    def prepare_serving(self, listener: socket.socket, wake: int) -> None:
        """Everything the serving loop holds (its epoll, the first connection thread), made before
        READY: a ready daemon's descriptors are those it serves with, and a failure here is a
        failed start."""
        self.epoll = select.epoll()
        for fd in (listener.fileno(), wake, self.watch.fd):
            if fd >= 0:
                self.epoll.register(fd, select.EPOLLIN)
        self.server.start()

    def serve(self, listener: socket.socket, wake: int) -> None:
        interval = notify.watchdog_interval()
        next_ping = time.monotonic()
        while not self.stop.is_set():
            if interval and time.monotonic() >= next_ping:
                notify.notify("WATCHDOG=1")
                next_ping = time.monotonic() + interval
            timeout = max(0.0, next_ping - time.monotonic()) if interval else 5.0
            for fd, _ in self.epoll.poll(timeout):
                try:
                    if fd == listener.fileno():
                        self.server.accept(listener)
                    elif fd == wake:
                        _drain(wake)
                        if self.reload_asked.is_set():
                            self.reload_asked.clear()
                            self.keeper.put("reload")
                    elif fd == self.watch.fd:
                        self.keeper.changed(self.watch.changed())
                    else:
                        self.cache.process_exited(fd)
                except Exception:           # nothing an event does may stop the serving loop
                    log.exception("handling an event on fd %d failed", fd)

    def watch_process(self, pidfd: int) -> None:
        if self.epoll is not None:
            self.epoll.register(pidfd, select.EPOLLIN)

    # -- whole life ----------------------------------------------------------------------------
    def run(self) -> int:
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wake_w)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop.set())
        signal.signal(signal.SIGHUP, lambda *_: self.reload_asked.set())
        trust.prepare_socket_dir(self.directory, self.cfg.daemon.shared)
        self.locks = startup.hold_locks(self.directory, self.gpu, self.cfg.daemon.device)
        listener = None
        try:
            try:
                listener = self.start()
                self.prepare_serving(listener, wake_r)
            except BaseException as e:
                if self.stop.is_set():       # SIGTERM during the start: a clean stop, not a failure
                    return 0
                self.write_state("failed", error=str(e) if isinstance(e, FastStartError)
                                 else f"{type(e).__name__}: {e}")
                raise
            self.write_state("ready")
            notify.notify(f"READY=1\nSTATUS={self.status_line()} in {time.monotonic() - self.started:.1f} s")
            self.told.ready = True      # STATUS= follows the cache from now on
            log.info("ready on %s", socket_path(self.directory, self.gpu))
            self.keeper.start()
            self.metrics_writer = threading.Thread(target=metrics.keep_textfile, name="metrics", daemon=True, args=(
                lambda: self.cfg.daemon.metrics_file.replace("{gpu}", str(self.gpu)),
                lambda: views.metric_samples(self.cache).samples, self.stop, METRICS_S))
            self.metrics_writer.start()
            self.serve(listener, wake_r)
            return 0
        finally:
            self.shutdown(listener)

    def status_line(self) -> str:
        """The unit's STATUS= once ready, kept current: what is cached, and each model that is not
        with its state ("ready: 1 model(s), 16.00 GiB cached; qwen3 stale")."""
        with self.cache.lock:
            total = sum(e.nbytes for e in self.cache.entries.values())
            line = f"ready: {len(self.cache.entries)} model(s), {total / 2**30:.2f} GiB cached"
            pending = [f"{name} {p.state}" for name, p in self.cache.pending.items()]
        return line + (f"; {', '.join(pending)}" if pending else "")

    def shutdown(self, listener: socket.socket | None) -> None:
        """Each step on its own: one that fails (a manager gone, a file removed) skips none of the rest."""
        self.stop.set()
        self.keeper.join(5)
        if self.metrics_writer is not None:
            self.metrics_writer.join(5)      # it removes its file
        steps = [lambda: notify.notify("STOPPING=1"),
                 lambda: socket_path(self.directory, self.gpu).unlink(missing_ok=True) if listener else None,
                 lambda: listener.close() if listener else None,
                 lambda: _unlink_state(self.directory, self.gpu),
                 self.cache.close, self.watch.close]
        for step in steps:
            try:
                step()
            except OSError as e:
                log.warning("shutting down: %s", e)


class Told(Events):
    """The cache's events, as the daemon acts on them."""

    def __init__(self, d: Daemon):
        self.d, self.ready = d, False

    def evicted(self, entry: Entry) -> None:
        fdstore.remove(entry.names)

    def process(self, pidfd: int) -> None:
        self.d.watch_process(pidfd)

    def stale(self, model: str, why: str) -> None:
        self.d.keeper.stale(model, why)

    def fill(self, model: str) -> None:
        self.d.keeper.put("fill", model)

    def changed(self) -> None:
        if self.ready:
            notify.status(self.d.status_line())

    def kept(self, uid: int | None) -> list:
        return self.d.artifacts.report(uid)


def _changed(entry: Entry, m: configs.ModelConfig, gpu: int) -> str | None:
    """Why `m` asks for other bytes than `entry` holds, in words; None if it asks for the same.

    The fingerprint compares headers; a folder of the same shapes rotated in, or a shard rewritten
    behind the same header, shows in the files' identity. A new path naming the same files (a
    renamed folder, a bind mount) is the same checkpoint; files of the same path that cannot be
    seen now (storage away) count as unchanged, as the keeper counts them."""
    fields = entry.manifest.fingerprint.diff(fingerprint(m.spec(gpu)))
    if fields:
        return f"changed its {', '.join(fields)}"
    files = watch.differs(entry.files, watch.identity(m.path), gone_is_change=m.path != entry.model.path)
    if files:
        where = f"{entry.model.path} -> {m.path}: " if m.path != entry.model.path else ""
        return f"changed its files ({where}{files})"
    return None


def filled_manifest(model: str, msg: protocol.Filled, fds: list[int]) -> Manifest:
    """The manifest of a worker's `Filled` frame, with exactly one fd per arena; else its fds are
    closed and the fill fails naming what was wrong."""
    try:
        manifest = Manifest.from_dict(msg.manifest)
        if len(fds) != len(manifest.arenas):
            raise FillError(f"the fill worker sent {len(fds)} fds for {model}'s {len(manifest.arenas)} arenas",
                            "see the daemon's log; the model is filled again at the next start or fast-start fill")
        return manifest
    except (FastStartError, KeyError, TypeError, ValueError) as e:
        for fd in fds:
            os.close(fd)
        if isinstance(e, FillError):
            raise
        raise FillError(f"the fill worker's manifest for {model} is malformed ({e})",
                        "use a fill worker of the daemon's version") from None


def _unlink_state(directory: str, gpu: int) -> None:
    path = state_path(directory, gpu)
    try:
        state = files.read_json(path)
        if isinstance(state, dict) and state.get("state") == "failed":
            return          # `fast-start status` shows why the start failed
    except (OSError, files.Unreadable):
        pass
    path.unlink(missing_ok=True)


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 512):
            pass
    except BlockingIOError:
        pass


def run(config_path: str, gpu: int) -> int:
    """The daemon's whole life. A model folder that cannot be used fails that model alone
    (`Daemon.broken`); any other error it names fails the start as `StartError`: restarting
    would fail the same way, so the unit ends failed (RestartPreventExitStatus=)."""
    cfg = configs.load(config_path, check_paths=False)
    for note in cfg.deprecated:
        log.warning("%s", note)
    if not cfg.models_on(gpu):
        log.warning("%s lists no model for GPU %d; serving an empty cache", config_path, gpu)
    log.info("fast-start %s daemon for GPU %d (%s)", __version__, gpu, sys.executable)
    try:
        return Daemon(cfg, gpu).run()
    except ConfigError:
        raise
    except FastStartError as e:
        raise StartError(e.what, e.fix) from None

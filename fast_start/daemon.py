"""`fast-start daemon --gpu N`: fill the cache for GPU N, then serve it. No torch in here.

Start-up order is the contract with systemd and engines:
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

import errno
import fcntl
import grp
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
from dataclasses import replace
from pathlib import Path

from . import __version__, fdstore, files, memory, metrics, notify, protocol, reports, trust, watch
from . import config as configs
from .artifact_store import Artifacts
from .cache import Cache, Entry
from .leases import Limits
from .errors import CheckpointError, ConfigError, FastStartError, NoRoom, StartError
from .fill import FillError, Workers, worker_env
from .inflight import InFlight
from .fingerprint import FROM_FILES, fingerprint, requested
from .journal import fields
from .keeper import Keeper
from .manifest import Manifest
from .serve import Policy, Server
from .transport import lock_path, socket_path, state_path

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


def config_fields(model: configs.ModelConfig, gpu: int) -> dict:
    """The fingerprint fields the config alone decides (no checkpoint file read)."""
    return {k: v for k, v in requested(model.spec(gpu))._asdict().items() if not (k in FROM_FILES and v == "")}


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
        self.cache = Cache(gpu, device_id(cfg.daemon.device, gpu), cfg.daemon.on_release, self.limits,
                           on_evict=lambda entry: fdstore.remove(entry.names),
                           on_process=self.watch_process, on_stale=lambda name, why: self.keeper.stale(name, why),
                           on_fill=lambda name: self.keeper.put("fill", name))
        self.cache.configure(tuple(m.name for m in self.models), cfg.daemon.on_release,
                             memory.keep_free(cfg.daemon, gpu), tuple(m.path for m in self.models))
        self.sizes: dict[str, int] = {}     # model -> its bytes, as the worker estimated them (check_models)
        state = Path(os.environ["STATE_DIRECTORY"].split(":")[0]) if os.environ.get("STATE_DIRECTORY") else None
        if state:           # systemd's StateDirectory=: evictions and engines' artifacts survive restarts
            self.cache.history.keep(state / f"gpu{gpu}.evictions.json")
        self.artifacts = Artifacts(state / "artifacts" / f"gpu{gpu}" if state else None,
                                   configs.parse_bytes(cfg.daemon.artifacts), lambda: {m.name for m in self.models},
                                   self.cache.metrics)
        self.cache.kept_artifacts = self.artifacts.report
        self.server = Server(self.cache, Policy.of(cfg.daemon), max_connections,
                             inflight_budget(len({g for m in cfg.models for g in m.gpus})), self.artifacts)
        self.watch = watch.Watch()
        self.keeper = Keeper(self)
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
    def lock(self) -> int:
        """Hold `gpu<N>.lock` for the life of the process; fail at once if another daemon holds it."""
        path = lock_path(self.directory, self.gpu)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise FastStartError(f"GPU {self.gpu}'s daemon already runs (pid {holder}, lock {path})",
                                 f"stop it first (systemctl stop fast-start@{self.gpu}), or serve another GPU") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.lock_device()
        return fd

    def lock_device(self) -> None:
        """Hold a lock on the GPU's device node for the life of the process: a daemon for the same
        GPU from another config (another socket_dir, so another gpu<N>.lock) fails at once. The
        node is opened, never used: no CUDA context. Where there is none (the CPU device, a
        container that names nodes otherwise), the socket directory's lock is the only one."""
        if self.cfg.daemon.device != "cuda":
            return
        node = f"/dev/nvidia{self.gpu}"
        try:
            fd = os.open(node, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise FastStartError(f"GPU {self.gpu} is served by another fast-start daemon (it holds {node}), though "
                                 f"not from {self.directory}", "stop that daemon first (another config's: its "
                                 "socket_dir differs), or serve another GPU") from None
        self.device_lock = fd

    def resolve(self, cfg: configs.Config, workers: Workers) -> configs.Config:
        """`cfg` with this GPU's `engine_version = "auto"` replaced by what each model's worker
        environment has installed. Starts (and so version-checks) every worker it names."""
        models = []
        for m in cfg.models:
            if self.gpu in m.gpus:
                hello = workers.get(cfg.python(m)).hello
                log.info("%s is filled by %s (environment %s: fast-start %s, %s)", m.name, hello.python, hello.prefix,
                         hello.version, ", ".join(f"{k} {v}" for k, v in hello.engines.items()) or "no engine")
                if m.engine_version == configs.AUTO:     # the config allows it for an engine's model only
                    if m.filler.name not in hello.engines:
                        raise ConfigError(f"{cfg.path}: [[model]] {m.name!r} has engine_version = \"auto\", but "
                                          f"{hello.python} has no {m.filler.title} installed",
                                          "set worker_python (or the model's python) to the engine's interpreter")
                    m = replace(m, engine_version=hello.engines[m.filler.name])
            models.append(m)
        return replace(cfg, models=tuple(models))

    def apply(self, cfg: configs.Config) -> list[str]:
        """Serve by a reloaded (and resolved) `cfg`: models removed, whose fingerprint changed or
        whose files are not those of the fill are evicted, the rest kept (under the new config);
        returns the configured models not cached (to be filled)."""
        new = {m.name: m for m in cfg.models_on(self.gpu)}
        changed = {}
        for name, entry in list(self.cache.entries.items()):
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
        return [name for name in new if name not in self.cache.entries]

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
        """NoRoom naming the shortfall where the device's free memory, less `keep_free`, cannot hold
        `m`'s fill at its peak (`memory.fill_need`): a fill never takes memory an engine needs."""
        nbytes, now = self.sizes.get(m.name), memory.of(self.cache.device)
        if nbytes is None or now is None:
            return
        need, room = memory.fill_need(nbytes, self.cfg.daemon.device), now.free - self.cache.keep_free
        self.cache.metrics.set("fast_start_fill_shortfall_bytes", max(0, need - room), model=m.name)
        if need > room:
            raise NoRoom(f"{m.name} needs {memory.gib(need)} of {memory.where(self.cfg.daemon.device, self.gpu)} to fill ({memory.gib(nbytes)} of weights); "
                         f"{memory.gib(now.free)} is free and keep_free leaves {memory.gib(self.cache.keep_free)} of it "
                         f"to engines: {memory.gib(need - room)} short",
                         "free that much (stop an engine or evict a model), or lower keep_free; the daemon tries "
                         "again meanwhile", need - room)

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

    def adopt(self, workers: Workers) -> set[str]:
        """Re-adopt what systemd's fd store kept from a previous daemon process.

        A stored shard is kept only if the config still asks for exactly it (same fingerprint,
        computed from the config and the checkpoint's headers, no tensor data read), its
        checkpoint files are those it was filled from, and its checksums still hold; anything
        else is dropped and its model filled again. Nothing here fails the start.
        """
        stored, problems = fdstore.adopt()
        for p in problems:
            log.warning("dropped %s", p)
        adopted = set()
        for st in stored:
            reason = self.adoptable(st)
            if reason:
                self.drop(st, *reason)
                continue
            notify.status(f"verifying {st.model}, kept by systemd's fd store")
            model = self.model(st.model)
            try:
                bad = [msg for msg, _ in workers.get(self.cfg.python(model)).run(
                    protocol.VerifyJob(st.model, st.manifest.to_dict(), {}), st.fds)][-1].bad
            except FastStartError as e:
                if self.stop.is_set():
                    raise
                self.drop(st, f"it could not be verified ({e.what})", "checksum")
                continue
            if bad:
                self.drop(st, f"checksums differ ({len(bad)} tensors)", "checksum")
                continue
            entry = Entry(model, st.manifest, st.fds, 0.0, st.files, st.filled_at, st.names, adopted=True)
            self.cache.add(entry)
            adopted.add(st.model)
            log.info("re-adopted %s rank %d (%s, %d tensors) from systemd's fd store", st.model,
                     st.manifest.fingerprint.rank, configs.format_bytes(entry.nbytes), len(st.manifest.tensors))
            self.cache.metrics.inc("fast_start_readoptions_total", model=st.model)
        return adopted

    def adoptable(self, st: fdstore.Stored) -> tuple[str, str] | None:
        """Why a stored shard cannot be re-adopted (what, eviction reason), or None."""
        model = self.model(st.model)
        if model is None:
            return f"GPU {self.gpu} no longer serves {st.model!r}", "config change"
        if any(a.device != self.cache.device for a in st.manifest.arenas):
            return "it lives on another device", "config change"
        try:
            fields = st.manifest.fingerprint.diff(fingerprint(model.spec(self.gpu)))
        except FastStartError as e:
            # Storage away (NFS down at boot): what the config decides must still match; engines
            # are matched against the files of the fill, so nothing stale can be served.
            fields = st.manifest.fingerprint.diff(st.manifest.fingerprint._replace(**config_fields(model, self.gpu)))
            if not fields:
                log.warning("cannot read %s's checkpoint now (%s); re-adopting what was filled from it", st.model,
                            e.what)
        if fields:
            return f"the config changed its {', '.join(fields)}", "config change"
        if not st.files:
            return "no file identities were stored with it", "checkpoint changed"
        changed = watch.differs(st.files, watch.identity(model.path), gone_is_change=False)
        if changed:
            return f"the checkpoint changed since the fill ({changed})", "checkpoint changed"
        return None

    def drop(self, st: fdstore.Stored, why: str, reason: str) -> None:
        log.warning("dropping the stored arena of %s: %s", st.model, why, extra=fields(st.model))
        for fd in st.fds:
            os.close(fd)
        fdstore.remove(st.names)
        self.cache.record(st.model, reason, sum(a.size for a in st.manifest.arenas))

    def bind(self) -> socket.socket:
        path = socket_path(self.directory, self.gpu)
        if path.is_symlink() or (path.exists() and not path.is_socket()):
            raise trust.TrustError(f"{path} exists and is not a socket", "remove it")
        path.unlink(missing_ok=True)     # a stale socket of a previous run; we hold the GPU's lock
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)            # no window in which the socket is more open than 0600
        try:
            sock.bind(str(path))
        finally:
            os.umask(old)
        if self.cfg.daemon.shared:
            os.chmod(path, 0o666)        # peers are admitted by their credentials (serve.py)
        sock.listen(128)
        sock.setblocking(False)
        return sock

    def start(self) -> socket.socket:
        """Steps 2-5: workers, adopt, check, fill, bind. Returns the listening socket."""
        with self.workers(starting=True) as workers:
            self.cfg = self.resolve(self.cfg, workers)
            for m in self.models:
                self.watch.add(m.name, m.path)
            adopted = self.adopt(workers)
            to_fill = self.check_models([m for m in self.models if m.name not in adopted], workers, starting=True)
            self.write_state("loading")
            notify.status(f"filling {len(to_fill)} model(s), {len(adopted)} kept by systemd's fd store")
            self.fill(to_fill, workers, starting=True)
        return self.bind()

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
                        self.accept(listener)
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

    def write_metrics(self) -> None:
        """Write the textfile for node_exporter (`metrics_file`, "{gpu}" = this GPU) every METRICS_S
        until the daemon stops, on a thread of its own: a hung filesystem stalls this thread alone."""
        failing = written = ""
        while True:
            path = self.cfg.daemon.metrics_file.replace("{gpu}", str(self.gpu))     # a reload may change it
            if written and written != path:
                _unlink(written)
                written = ""
            if path:
                try:
                    files.write_atomic(path, metrics.render(self.cache.metric_samples().samples))
                    failing, written = "", path
                except OSError as e:
                    if failing != path:         # once, not every METRICS_S
                        log.warning("cannot write the metrics file %s: %s (fix: %s)", path, e.strerror or e,
                                    _metrics_fix(e, os.path.dirname(path)))
                    failing = path
            if self.stop.wait(METRICS_S):
                if written:             # a stopped daemon exports nothing, not its last figures
                    _unlink(written)
                return

    def accept(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE):
                    log.warning("cannot accept a connection: %s; raise LimitNOFILE= of the unit", e.strerror)
                    time.sleep(0.1)         # the connection waits in the backlog meanwhile
                return
            try:
                self.server.admit(conn)
            except OSError:
                conn.close()

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
        self.lock()
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
            self.cache.on_change = lambda: notify.status(self.status_line())
            log.info("ready on %s", socket_path(self.directory, self.gpu))
            self.keeper.start()
            self.metrics_writer = threading.Thread(target=self.write_metrics, name="metrics", daemon=True)
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


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("cannot remove %s: %s", path, e.strerror or e)


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
    if not cfg.models_on(gpu):
        log.warning("%s lists no model for GPU %d; serving an empty cache", config_path, gpu)
    log.info("fast-start %s daemon for GPU %d (%s)", __version__, gpu, sys.executable)
    try:
        return Daemon(cfg, gpu).run()
    except ConfigError:
        raise
    except FastStartError as e:
        raise StartError(e.what, e.fix) from None


def _metrics_fix(e: OSError, folder: str) -> str:
    """What makes `folder` writable for the metrics file, by why the write failed."""
    if e.errno == errno.EROFS:
        return (f"the unit sees {folder} read-only (ProtectSystem=strict): add a drop-in with "
                f"ReadWritePaths={folder} (systemctl edit fast-start@.service)")
    if e.errno in (errno.EACCES, errno.EPERM):
        group = grp.getgrgid(os.getegid()).gr_name
        return (f"the daemon's user may not write {folder}: give its group the folder, e.g. "
                f"chgrp {group} {folder} && chmod g+w {folder}")
    if e.errno == errno.ENOENT:
        return f"create {folder}, writable by the daemon's user"
    return "check the folder and its file system"

"""`fast-start daemon --gpu N`: fill the cache for GPU N, then serve it.

Start-up order is the contract with systemd and engines:
1. load and validate the config; create and check the socket directory and take the GPU's lock
   (`gpu<N>.lock`: a second daemon for the same GPU fails at once, naming the first's pid);
2. re-adopt what systemd's fd store kept from a previous process (`fdstore.py`: fingerprint and
   checkpoint files checked against the config, checksums re-verified; anything that fails is
   dropped and filled again, never a reason to fail); then check every other model's headers
   (TP sizes, rules, quantization, memory budget): a mistake fails here, before any tensor data
   is read;
3. fill the remaining models in a worker child process, relaying its progress as `STATUS=` and
   extending the start timeout (`EXTEND_TIMEOUT_USEC=`) while it advances; store each result in
   systemd's fd store;
4. bind `gpu<N>.sock` only now, then `READY=1`;
5. serve (`serve.py`): the main loop waits on one epoll set for connections, signals, checkpoint
   changes (inotify) and engine exits (pidfds), and pings the watchdog. A *keeper* thread checks
   checkpoints against what was filled and refills in the background; SIGHUP reloads the config.

Until the socket exists, and whenever start-up fails, `gpu<N>.state` in the socket directory
says how the fill is going or why it failed, for `fast-start status`.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import queue
import resource
import select
import signal
import socket
import threading
import time
from dataclasses import replace
from pathlib import Path

from . import config as configs
from . import fdstore, fill, notify, protocol, trust, watch
from .cache import Cache, Entry, Limits
from .checkpoint import open_checkpoint
from .errors import FastStartError
from .fingerprint import LAYOUT_VERSION, fingerprint
from .manifest import Manifest, pack
from .materialize import plan
from .serve import Policy, Server

log = logging.getLogger("fast_start.daemon")
SETTLE_S = 2.0       # a changed checkpoint is refilled once its files stay the same this long
RETRY_S = 10.0       # how often an unusable changed checkpoint is looked at again
RECHECK_S = 30.0     # every cached model's files are compared with the fill's this often
FD_RESERVE = 64      # descriptors kept for the daemon itself: listener, epoll, workers, arenas


def device_id(device: str, gpu: int) -> str:
    """"cpu", or GPU `gpu`'s UUID (asked of the driver without creating a context)."""
    if device == "cpu":
        return "cpu"
    from . import vmm
    return vmm.device_uuid(gpu)


def device_memory(device: str, gpu: int) -> int:
    if device == "cpu":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    from . import vmm
    return vmm.total_memory(gpu)


def socket_path(socket_dir: str, gpu: int) -> Path:
    return Path(socket_dir) / f"gpu{gpu}.sock"


def state_path(socket_dir: str, gpu: int) -> Path:
    return Path(socket_dir) / f"gpu{gpu}.state"


def config_fields(model: configs.ModelConfig, gpu: int) -> dict:
    """The fingerprint fields the config alone decides (no checkpoint file read)."""
    spec = model.spec(gpu)
    return {"tensor_parallel_size": spec.tensor_parallel_size, "rank": spec.rank, "dtype": spec.dtype,
            "quantization": spec.quantization, "revision": spec.revision, "engine_version": spec.engine_version,
            "layout": f"{spec.layout}/{LAYOUT_VERSION}"}


def policy(cfg: configs.Config) -> Policy:
    d = cfg.daemon
    return Policy(frozenset(d.allowed_uids), d.gids("allowed_groups"), d.gids("admin_groups"))


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
        self.limits, max_connections = fd_budget()
        self.cache = Cache(gpu, device_id(cfg.daemon.device, gpu), cfg.daemon.on_release, self.limits,
                           on_evict=lambda entry: fdstore.remove(entry.names),
                           on_process=self.watch_process, on_stale=self.stale)
        self.cache.configured = tuple(m.name for m in self.models)
        self.server = Server(self.cache, policy(cfg), max_connections)
        self.watch = watch.Watch()
        self.jobs: queue.Queue = queue.Queue()      # for the keeper thread
        self.retry: dict[str, float] = {}           # keeper: model -> when to try filling it
        self.seen: dict[str, watch.Identity] = {}   # keeper: files last seen of a model waiting to settle
        self.epoll: select.epoll | None = None
        self.started = time.monotonic()
        self.keeper = threading.Thread(target=self.keep, name="keeper", daemon=True)

    @property
    def models(self) -> tuple[configs.ModelConfig, ...]:
        return self.cfg.models_on(self.gpu)

    def model(self, name: str) -> configs.ModelConfig | None:
        return next((m for m in self.models if m.name == name), None)

    # -- start-up ------------------------------------------------------------------------------
    def lock(self) -> int:
        """Hold `gpu<N>.lock` for the life of the process; fail at once if another daemon holds it."""
        path = Path(self.directory) / f"gpu{self.gpu}.lock"
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
        return fd

    def check_models(self, models) -> None:
        """Every model's headers against its spec, and the total against the memory budget.

        Reads headers and config.json only, no tensor data.
        """
        with self.cache.lock:
            need = sum(e.nbytes for e in self.cache.entries.values())
        for m in models:
            _, sizes = pack(plan(open_checkpoint(m.path), m.spec(self.gpu)))
            need += sum(sizes)
        total = device_memory(self.cfg.daemon.device, self.gpu)
        budget = configs.parse_bytes(self.cfg.daemon.memory_budget, total)
        if need > budget:
            raise FastStartError(f"GPU {self.gpu}'s models need {configs.format_bytes(need)}, more than memory_budget "
                                 f"{self.cfg.daemon.memory_budget!r} ({configs.format_bytes(budget)}) in {self.cfg.path}",
                                 "raise memory_budget or serve fewer or smaller models on this GPU")

    def write_state(self, state: str, **extra) -> None:
        path = state_path(self.directory, self.gpu)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"gpu": self.gpu, "state": state, "pid": os.getpid(), "time": time.time(), **extra}))
        tmp.replace(path)

    def device(self) -> str:
        return "cpu" if self.cfg.daemon.device == "cpu" else f"cuda:{self.gpu}"

    def worker_env(self) -> dict[str, str]:
        return fill.worker_env(len({g for m in self.cfg.models for g in m.gpus}))

    def fill(self, models, starting: bool = False) -> None:
        """Fill `models` in one worker child; each one is served as soon as its arena is complete."""
        if not models:
            return
        files = {m.name: watch.identity(m.path) for m in models}      # before a byte of data is read
        bandwidth = configs.parse_bytes(self.cfg.daemon.fill_bandwidth)
        jobs = [protocol.FillJob(m.name, m.spec(self.gpu).__dict__, self.device(), bandwidth) for m in models]
        by_name = {m.name: m for m in models}
        for msg, fds in fill.run(jobs, self.worker_env(), self.stop, starting=starting):
            if isinstance(msg, protocol.Progress):
                self.report_progress(msg, starting)
                continue
            manifest = Manifest.from_dict(msg.manifest)
            entry = Entry(by_name[msg.model], manifest, fds, msg.seconds, files[msg.model])
            entry.names = fdstore.store(msg.model, manifest, fds, entry.filled_at, entry.files)
            self.cache.add(entry)
            log.info("cached %s rank %d: %s in %.1f s", msg.model, manifest.fingerprint.rank,
                     configs.format_bytes(entry.nbytes), msg.seconds)

    def report_progress(self, p: protocol.Progress, starting: bool) -> None:
        text = f"filling {p.model} rank {p.rank}: {p.done / 2**30:.2f} / {p.total / 2**30:.2f} GiB"
        if starting:
            notify.status(text)
            self.write_state("loading", progress={"model": p.model, "rank": p.rank, "done": p.done, "total": p.total})
        else:
            self.cache.set_pending(p.model, "filling", text)

    def adopt(self) -> set[str]:
        """Re-adopt what systemd's fd store kept from a previous daemon process.

        A stored shard is kept only if the config still asks for exactly it (same fingerprint,
        computed from the config and the checkpoint's headers, no tensor data read), its
        checkpoint files are those it was filled from, and its checksums still hold; anything
        else is dropped and its model filled again. Nothing here fails the start.
        """
        stored, problems = fdstore.adopt()
        for p in problems:
            log.warning("dropped %s", p)
        keep = []
        for st in stored:
            reason = self.adoptable(st)
            if reason:
                self.drop(st, reason[0], reason[1])
            else:
                keep.append(st)
        if not keep:
            return set()
        notify.status(f"verifying {len(keep)} model(s) kept by systemd's fd store")
        jobs = [protocol.VerifyJob(st.model, st.manifest.to_dict(), st.fds, self.device()) for st in keep]
        try:
            bad = {msg.model: msg.bad for msg, _ in fill.run(jobs, self.worker_env(), self.stop,
                                                            [fd for st in keep for fd in st.fds], starting=True)}
        except FastStartError as e:
            if self.stop.is_set():
                raise
            log.warning("could not verify the stored arenas (%s); filling from disk", e)
            bad = {}
        adopted = set()
        for st in keep:
            if st.model not in bad or bad[st.model]:
                self.drop(st, f"checksums differ ({len(bad[st.model])} tensors)" if bad.get(st.model)
                          else "it could not be verified", "checksum")
                continue
            entry = Entry(self.model(st.model), st.manifest, st.fds, 0.0, st.files, st.filled_at, st.names)
            self.cache.add(entry)
            adopted.add(st.model)
            log.info("re-adopted %s rank %d (%s, %d tensors) from systemd's fd store", st.model,
                     st.manifest.fingerprint.rank, configs.format_bytes(entry.nbytes), len(st.manifest.tensors))
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
            fields = st.manifest.fingerprint.diff(replace(st.manifest.fingerprint, **config_fields(model, self.gpu)))
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
        log.warning("dropping the stored arena of %s: %s", st.model, why)
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
        """Steps 2-4: adopt, check, fill, bind. Returns the listening socket."""
        for m in self.models:
            self.watch.add(m.name, m.path)
        adopted = self.adopt()
        to_fill = [m for m in self.models if m.name not in adopted]
        self.check_models(to_fill)
        self.write_state("loading")
        notify.status(f"filling {len(to_fill)} model(s), {len(adopted)} kept by systemd's fd store")
        self.fill(to_fill, starting=True)
        return self.bind()

    # -- serving -------------------------------------------------------------------------------
    def serve(self, listener: socket.socket, wake: int) -> None:
        self.epoll = select.epoll()
        for fd in (listener.fileno(), wake, self.watch.fd):
            if fd >= 0:
                self.epoll.register(fd, select.EPOLLIN)
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
                            self.jobs.put(("reload", None))
                    elif fd == self.watch.fd:
                        changed = self.watch.changed()
                        if changed:
                            self.jobs.put(("check", changed))
                    else:
                        self.cache.process_exited(fd)
                except Exception:           # nothing an event does may stop the serving loop
                    log.exception("handling an event on fd %d failed", fd)

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

    # -- keeping the cache fresh ---------------------------------------------------------------
    def stale(self, name: str, why: str) -> None:
        """`name`'s checkpoint changed under its cache: stop serving it, then refill it."""
        if not self.cache.evict(name, "checkpoint changed", pending="stale"):
            return
        log.warning("%s: the checkpoint changed since the fill (%s); no longer served", name, why)
        if self.cfg.daemon.refill_on_change:
            self.jobs.put(("fill", name))
        else:
            self.cache.set_pending(name, "stale", f"{why}; refill_on_change is off: fast-start fill or a restart "
                                                  "fills it")

    def keep(self) -> None:
        """The keeper thread: checks, refills and reloads, one at a time, off the serving loop."""
        next_sweep = time.monotonic() + RECHECK_S
        while not self.stop.is_set():
            wake = min([next_sweep, *self.retry.values()])
            try:
                kind, arg = self.jobs.get(timeout=max(0.05, wake - time.monotonic()))
            except queue.Empty:
                kind, arg = None, None
            try:
                if kind == "check":
                    for name in arg:
                        self.check(name)
                elif kind == "fill":
                    self.retry[arg] = time.monotonic()
                elif kind == "reload":
                    self.reload()
                for name in [n for n, t in self.retry.items() if t <= time.monotonic()]:
                    del self.retry[name]
                    self.refill(name)
                if time.monotonic() >= next_sweep:
                    for name in list(self.cache.entries):
                        self.check(name)
                    next_sweep = time.monotonic() + RECHECK_S
            except Exception:
                log.exception("the keeper failed on %s", kind)

    def check(self, name: str) -> None:
        """Compare `name`'s files with its fill's; a stale or failed model is looked at again."""
        entry = self.cache.entries.get(name)
        if entry is not None:
            changed = watch.differs(entry.files, watch.identity(entry.model.path), gone_is_change=False)
            if changed:
                self.stale(name, changed)
        elif self.cache.pending.get(name, {}).get("state") in ("stale", "failed") and self.cfg.daemon.refill_on_change:
            self.retry.setdefault(name, time.monotonic())

    def refill(self, name: str) -> None:
        """Fill `name` in the background once its checkpoint has settled and is usable."""
        model = self.model(name)
        if model is None or name in self.cache.entries or self.stop.is_set():
            return
        files = watch.identity(model.path)
        if self.seen.get(name) != files:            # still changing: wait until it stays put
            self.seen[name] = files
            self.cache.set_pending(name, "stale", "waiting for the checkpoint's files to settle")
            self.retry[name] = time.monotonic() + SETTLE_S
            return
        try:
            self.check_models([model])
        except FastStartError as e:
            self.cache.set_pending(name, "stale", f"waiting for a usable checkpoint: {e.what}")
            self.retry[name] = time.monotonic() + RETRY_S
            return
        self.seen.pop(name, None)
        self.cache.set_pending(name, "filling")
        try:
            self.fill([model])
        except FastStartError as e:
            log.error("refilling %s failed: %s", name, e)
            self.cache.set_pending(name, "failed", str(e))
            return
        self.watch.add(name, model.path)
        self.check(name)            # changed while it filled: stale again at once

    def reload(self) -> None:
        """SIGHUP: read the config again; add new models, drop removed or changed ones, keep the rest."""
        notify.notify(f"RELOADING=1\nMONOTONIC_USEC={time.monotonic_ns() // 1000}")
        try:
            cfg = configs.load(self.cfg.path, check_paths=False)
        except FastStartError as e:
            log.error("reload failed, keeping the running config: %s", e)
            notify.notify("READY=1\nSTATUS=ready (the last reload failed: see the log)")
            return
        new = {m.name: m for m in cfg.models_on(self.gpu)}
        changed = {}
        for name, entry in list(self.cache.entries.items()):
            m = new.get(name)
            try:
                fields = entry.manifest.fingerprint.diff(fingerprint(m.spec(self.gpu))) if m else ()
            except FastStartError as e:     # storage away: keep serving what was filled
                log.warning("reload: cannot read %s's checkpoint (%s); keeping it", name, e.what)
                continue
            if m is None or fields:
                changed[name] = fields
        if (cfg.daemon.socket_dir, cfg.daemon.device) != (self.cfg.daemon.socket_dir, self.cfg.daemon.device):
            log.warning("socket_dir and device changes take effect at the next restart")
            cfg = replace(cfg, daemon=replace(cfg.daemon, socket_dir=self.cfg.daemon.socket_dir,
                                              device=self.cfg.daemon.device))
        self.cfg = cfg
        self.server.policy = policy(cfg)
        self.cache.on_release = cfg.daemon.on_release
        with self.cache.lock:
            self.cache.configured = tuple(new)
            for name in [n for n in self.cache.pending if n not in new]:
                del self.cache.pending[name]
        for name, fields in changed.items():
            self.cache.evict(name, "config change", pending="filling")
            self.watch.remove(name)
            log.info("reload: %s %s", name, f"changed its {', '.join(fields)}" if fields else "is no longer served")
        for name, m in new.items():
            self.watch.add(name, m.path)
            if name not in self.cache.entries:
                self.retry.setdefault(name, time.monotonic())
        log.info("reloaded %s: %d model(s) for GPU %d", cfg.path, len(new), self.gpu)
        notify.notify(f"READY=1\nSTATUS=ready: reloaded, {len(new)} model(s) configured")

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
            except BaseException as e:
                if self.stop.is_set():       # SIGTERM during the start: a clean stop, not a failure
                    return 0
                self.write_state("failed", error=str(e) if isinstance(e, FastStartError)
                                 else f"{type(e).__name__}: {e}")
                raise
            total = sum(e.nbytes for e in self.cache.entries.values())
            self.write_state("ready")
            notify.notify(f"READY=1\nSTATUS=ready: {len(self.cache.entries)} model(s), {total / 2**30:.2f} GiB "
                          f"cached in {time.monotonic() - self.started:.1f} s")
            log.info("ready on %s", socket_path(self.directory, self.gpu))
            self.keeper.start()
            self.serve(listener, wake_r)
            return 0
        finally:
            self.shutdown(listener)

    def shutdown(self, listener: socket.socket | None) -> None:
        """Each step on its own: one that fails (a manager gone, a file removed) skips none of the rest."""
        self.stop.set()
        if self.keeper.is_alive():
            self.keeper.join(5)         # a refill in progress kills its worker within a second
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


def _unlink_state(directory: str, gpu: int) -> None:
    path = state_path(directory, gpu)
    try:
        if json.loads(path.read_text()).get("state") == "failed":
            return          # `fast-start status` shows why the start failed
    except (OSError, ValueError):
        pass
    path.unlink(missing_ok=True)


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 512):
            pass
    except BlockingIOError:
        pass


def run(config_path: str, gpu: int) -> int:
    cfg = configs.load(config_path)
    if not cfg.models_on(gpu):
        log.warning("%s lists no model for GPU %d; serving an empty cache", config_path, gpu)
    return Daemon(cfg, gpu).run()

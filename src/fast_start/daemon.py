"""`fast-start daemon --gpu N`: fill the cache for GPU N, then serve it.

Start-up order is the contract with systemd and engines:
1. load and validate the config; re-adopt what systemd's fd store kept from a previous process
   (`fdstore.py`: fingerprint checked against the config, checksums re-verified); then check
   every other model's headers (TP sizes, rules, quantization, memory budget): a mistake fails
   here, before any tensor data is read;
2. create and check the socket directory;
3. fill the remaining models in a worker child process, relaying its progress as `STATUS=` and
   extending the start timeout (`EXTEND_TIMEOUT_USEC=`) while it advances; store each result in
   systemd's fd store;
4. bind `gpu<N>.sock` (0600, or 0660 for a configured group) only now, then `READY=1`;
5. serve: one thread per connection, peers checked with `SO_PEERCRED` before a byte is read;
   the main loop pings the watchdog, ends leases of exited processes and watches for SIGTERM.

While the socket does not exist yet, `gpu<N>.state` in the socket directory says how the fill is
going (or why it failed), for `fast-start status`.
"""
from __future__ import annotations

import grp
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from . import config as configs
from . import fdstore, notify, protocol, trust
from .cache import Cache, Entry
from .checkpoint import open_checkpoint
from .errors import FastStartError
from .fingerprint import fingerprint
from .manifest import Manifest, pack
from .materialize import plan

log = logging.getLogger("fast_start.daemon")
TICK = 0.5                 # main-loop period: lease reaping, watchdog, stop flag
EXTEND_USEC = 30_000_000   # each EXTEND_TIMEOUT_USEC promises the next message within 30 s
STALL_S = 300              # a fill with no progress for this long is declared hung
IDLE_S = 60                # a connection silent this long mid-conversation is closed
MAX_CONNECTIONS = 256


def worker_env(cfg: configs.Config) -> dict[str, str]:
    """The fill worker's environment: its share of the CPUs for torch's thread pool.

    Every GPU's daemon fills at boot, at once; each worker's OpenMP pool defaults to every CPU,
    and N pools spinning on the same cores made a fill 10x slower on two H200s (1565 small
    expert tensors: 10.6 s against 1.1 s). An OMP_NUM_THREADS set by the operator wins.
    """
    env = dict(os.environ)
    if "OMP_NUM_THREADS" not in env:
        daemons = len({g for m in cfg.models for g in m.gpus}) or 1
        env["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // daemons))
    return env


class FillError(FastStartError):
    """The fill worker failed or stalled."""


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


class Daemon:
    def __init__(self, cfg: configs.Config, gpu: int):
        self.cfg, self.gpu = cfg, gpu
        self.models = cfg.models_on(gpu)
        self.cache = Cache(gpu, device_id(cfg.daemon.device, gpu), cfg.daemon.on_release,
                           on_evict=lambda entry: fdstore.remove(entry.names))
        self.stop = threading.Event()
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.group = grp.getgrnam(cfg.daemon.allowed_groups[0]).gr_gid if cfg.daemon.allowed_groups else None
        self.allowed_gids = {grp.getgrnam(g).gr_gid for g in cfg.daemon.allowed_groups}

    # -- start-up ------------------------------------------------------------------------------
    def check_models(self, models) -> None:
        """Every model's headers against its spec, and the total against the memory budget.

        Reads headers and config.json only, no tensor data.
        """
        need = sum(e.nbytes for e in self.cache.entries.values())
        for m in models:
            _, sizes = pack(plan(open_checkpoint(m.path), m.spec(self.gpu)))
            need += sum(sizes)
        total = device_memory(self.cfg.daemon.device, self.gpu)
        budget = configs.parse_bytes(self.cfg.daemon.memory_budget, total)
        if need > budget:
            raise FastStartError(f"GPU {self.gpu}'s models need {need / 2**30:.2f} GiB, more than memory_budget "
                                 f"{self.cfg.daemon.memory_budget!r} ({budget / 2**30:.2f} GiB) in {self.cfg.path}",
                                 "raise memory_budget or serve fewer or smaller models on this GPU")

    def write_state(self, state: str, **extra) -> None:
        path = state_path(self.cfg.daemon.socket_dir, self.gpu)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"gpu": self.gpu, "state": state, "pid": os.getpid(), "time": time.time(), **extra}))
        tmp.replace(path)

    def worker(self, jobs: list[dict], pass_fds: list[int] = ()):
        """Run the worker child on `jobs`, yielding its messages; keeps systemd's start timeout
        extended while the child lives and makes progress."""
        ours, theirs = socket.socketpair()
        proc = subprocess.Popen([sys.executable, "-m", "fast_start.worker", str(theirs.fileno()), json.dumps(jobs)],
                                pass_fds=[theirs.fileno(), *pass_fds], env=worker_env(self.cfg))
        theirs.close()
        last_progress, finished = time.monotonic(), False
        try:
            while True:
                if self.stop.is_set():
                    raise FillError("stopped during the fill", "start the daemon again")
                notify.notify(f"EXTEND_TIMEOUT_USEC={EXTEND_USEC}")
                if not select.select([ours], [], [], 1.0)[0]:
                    if time.monotonic() - last_progress > STALL_S:
                        raise FillError(f"the fill made no progress for {STALL_S} s", "check the model's storage")
                    continue
                msg, fds = protocol.recv(ours, allowed=("progress", "filled", "report", "error"))
                last_progress = time.monotonic()
                if msg is None:
                    code = proc.wait()
                    if code:
                        raise FillError(f"the fill worker exited with code {code}", "see the traceback in the log")
                    finished = True
                    return
                if isinstance(msg, protocol.Error):
                    raise FillError(msg.what, msg.fix)
                yield msg, fds
        finally:
            ours.close()
            if not finished and proc.poll() is None:
                proc.kill()
            proc.wait()

    def fill(self, models) -> None:
        device = "cpu" if self.cfg.daemon.device == "cpu" else f"cuda:{self.gpu}"
        jobs = [{"model": m.name, "spec": m.spec(self.gpu).__dict__, "device": device,
                 "bandwidth": configs.parse_bytes(self.cfg.daemon.fill_bandwidth)} for m in models]
        if not jobs:
            return
        by_name = {m.name: m for m in models}
        for msg, fds in self.worker(jobs):
            if isinstance(msg, protocol.Progress):
                self.report_progress(msg)
                continue
            manifest = Manifest.from_dict(msg.manifest)
            entry = Entry(by_name[msg.model], manifest, fds, msg.seconds)
            entry.names = fdstore.store(msg.model, manifest, fds, entry.filled_at)
            self.cache.add(entry)
            log.info("cached %s rank %d: %.2f GiB in %.1f s", msg.model, manifest.fingerprint.rank,
                     entry.nbytes / 2**30, msg.seconds)

    def adopt(self) -> set[str]:
        """Re-adopt what systemd's fd store kept from a previous daemon process.

        A stored shard is kept only if the config still asks for exactly it (same fingerprint,
        computed from the config and the checkpoint's headers, no tensor data read) and its
        checksums still hold; anything else is dropped, and its model filled again.
        """
        stored, problems = fdstore.adopt()
        for p in problems:
            log.warning("dropped %s", p)
        device = self.cache.device
        keep, jobs = [], []
        for st in stored:
            model = next((m for m in self.models if m.name == st.model), None)
            reason = None
            if model is None:
                reason = f"GPU {self.gpu} no longer serves {st.model!r}"
            elif any(a.device != device for a in st.manifest.arenas):
                reason = "it lives on another device"
            else:
                fields = st.manifest.fingerprint.diff(fingerprint(model.spec(self.gpu)))
                reason = f"the config changed its {', '.join(fields)}" if fields else None
            if reason:
                self.drop(st, reason, "config change")
                continue
            keep.append((model, st))
            jobs.append({"model": st.model, "verify": st.manifest.to_dict(), "fds": st.fds,
                         "device": "cpu" if device == "cpu" else f"cuda:{self.gpu}"})
        bad = {}
        if jobs:
            notify.status(f"verifying {len(jobs)} model(s) kept by systemd's fd store")
            bad = {msg.body["model"]: msg.body["bad"] for msg, _ in self.worker(jobs, [fd for _, st in keep
                                                                                         for fd in st.fds])}
        adopted = set()
        for model, st in keep:
            if bad.get(st.model, ["(not verified)"]):
                self.drop(st, f"checksums differ ({len(bad.get(st.model, []))} tensors)", "checksum")
                continue
            entry = Entry(model, st.manifest, st.fds, 0.0, st.filled_at, st.names)
            self.cache.add(entry)
            adopted.add(st.model)
            log.info("re-adopted %s rank %d (%.2f GiB) from systemd's fd store", st.model,
                     st.manifest.fingerprint.rank, entry.nbytes / 2**30)
        return adopted

    def drop(self, st: fdstore.Stored, why: str, reason: str) -> None:
        log.warning("dropping the stored arena of %s: %s", st.model, why)
        for fd in st.fds:
            os.close(fd)
        fdstore.remove(st.names)
        self.cache.record(st.model, reason, sum(a.size for a in st.manifest.arenas))

    def report_progress(self, p: protocol.Progress) -> None:
        text = f"filling {p.model} rank {p.rank}: {p.done / 2**30:.2f} / {p.total / 2**30:.2f} GiB"
        notify.status(text)
        self.write_state("loading", progress={"model": p.model, "rank": p.rank, "done": p.done, "total": p.total})

    def bind(self) -> socket.socket:
        path = socket_path(self.cfg.daemon.socket_dir, self.gpu)
        if path.is_symlink() or (path.exists() and not path.is_socket()):
            raise trust.TrustError(f"{path} exists and is not a socket", "remove it")
        path.unlink(missing_ok=True)     # a stale socket of a previous run; the directory is ours alone
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)            # no window in which the socket is more open than 0600
        try:
            sock.bind(str(path))
        finally:
            os.umask(old)
        if self.group is not None:
            os.chown(path, -1, self.group)
            os.chmod(path, 0o660)
        sock.listen(128)
        sock.settimeout(TICK)
        return sock

    # -- serving -------------------------------------------------------------------------------
    def allowed(self, peer: trust.Peer) -> bool:
        if peer.uid == os.geteuid() or peer.uid in self.cfg.daemon.allowed_uids:
            return True
        return bool(self.allowed_gids & peer.groups())

    def serve(self, listener: socket.socket) -> None:
        interval = notify.watchdog_interval()
        next_ping = time.monotonic()
        while not self.stop.is_set():
            if interval and time.monotonic() >= next_ping:
                notify.notify("WATCHDOG=1")
                next_ping = time.monotonic() + interval
            pidfds = self.cache.pidfds()
            if pidfds:
                self.cache.reap(set(select.select(pidfds, [], [], 0)[0]))
            try:
                conn, _ = listener.accept()
            except (socket.timeout, InterruptedError):
                continue
            peer = trust.peer(conn)
            if not self.allowed(peer):
                log.warning("refused connection from pid %d uid %d", peer.pid, peer.uid)
                self.reply_and_close(conn, protocol.Error(f"uid {peer.uid} may not use this daemon",
                                                          "run as the daemon's user or list it in allowed_uids"))
            elif not self.slots.acquire(blocking=False):
                self.reply_and_close(conn, protocol.Error("too many connections", "retry shortly"))
            else:
                threading.Thread(target=self.connection, args=(conn, peer), daemon=True).start()

    def reply_and_close(self, conn: socket.socket, msg) -> None:
        try:
            conn.settimeout(1.0)
            protocol.send(conn, msg)
        except OSError:
            pass
        conn.close()

    def connection(self, conn: socket.socket, peer: trust.Peer) -> None:
        try:
            conn.settimeout(IDLE_S)
            while not self.stop.is_set():
                try:
                    msg, _ = protocol.recv(conn, protocol.MAX_REQUEST, protocol.REQUESTS, accept_fds=False)
                except protocol.FramingError as e:
                    protocol.send(conn, protocol.Error(e.what, e.fix))
                    return
                except protocol.ProtocolError as e:
                    protocol.send(conn, protocol.Error(e.what, e.fix))
                    continue
                if msg is None:
                    return
                reply, fds, lease = self.cache.handle(msg, peer)
                try:
                    protocol.send(conn, reply, fds)
                finally:
                    for fd in fds:
                        os.close(fd)
                if lease:
                    self.cache.register(lease)
        except OSError:
            pass            # the peer went away or stalled: nothing of ours is left half-done
        finally:
            conn.close()
            self.slots.release()

    # -- whole life ----------------------------------------------------------------------------
    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop.set())
        start = time.monotonic()
        adopted = self.adopt()
        to_fill = [m for m in self.models if m.name not in adopted]
        self.check_models(to_fill)
        trust.prepare_socket_dir(self.cfg.daemon.socket_dir, self.group)
        self.write_state("loading")
        notify.status(f"filling {len(to_fill)} model(s), {len(adopted)} kept by systemd's fd store")
        try:
            self.fill(to_fill)
            listener = self.bind()
        except FastStartError as e:
            if self.stop.is_set():       # SIGTERM during the fill: a clean stop, not a failure
                state_path(self.cfg.daemon.socket_dir, self.gpu).unlink(missing_ok=True)
                self.cache.close()
                return 0
            self.write_state("failed", error=str(e))
            raise
        total = sum(e.nbytes for e in self.cache.entries.values())
        self.write_state("ready")
        notify.notify(f"READY=1\nSTATUS=ready: {len(self.cache.entries)} model(s), {total / 2**30:.2f} GiB "
                      f"cached in {time.monotonic() - start:.1f} s")
        log.info("ready on %s", socket_path(self.cfg.daemon.socket_dir, self.gpu))
        try:
            self.serve(listener)
        finally:
            notify.notify("STOPPING=1")
            listener.close()
            socket_path(self.cfg.daemon.socket_dir, self.gpu).unlink(missing_ok=True)
            state_path(self.cfg.daemon.socket_dir, self.gpu).unlink(missing_ok=True)
            self.cache.close()
        return 0


def run(config_path: str, gpu: int) -> int:
    cfg = configs.load(config_path)
    if not cfg.models_on(gpu):
        log.warning("%s lists no model for GPU %d; serving an empty cache", config_path, gpu)
    return Daemon(cfg, gpu).run()

"""The keeper: a daemon thread that keeps the cache in line with the checkpoints and the config.

A write the inotify watch reports is acted on by the serving loop itself (`changed`): a model
one of whose files was written stops being served at once, whatever the keeper is busy with. Off
the serving loop, one thing at a time, the keeper compares a model's files with its fill's on
other events in its folder and every `RECHECK_S`, refills a changed model once its files have
stayed the same for `SETTLE_S` and the checkpoint is usable, and applies a reloaded config
(SIGHUP): new models filled, removed or changed ones dropped, the rest kept. Fills run in worker
children like the start-up's; the new arena is served the moment it is complete, and engines
that mapped the old one keep it.
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import Protocol

from . import config as configs
from . import notify, startup, watch
from .journal import fields
from .cache import Cache
from .errors import FastStartError, NoRoom
from .fill import Workers


class Host(Protocol):
    """What the keeper asks of the daemon it runs in (`daemon.Daemon`)."""
    cfg: configs.Config
    gpu: int
    cache: Cache
    watch: watch.Watch
    stop: threading.Event

    @property
    def models(self) -> tuple[configs.ModelConfig, ...]: ...
    def model(self, name: str) -> configs.ModelConfig | None: ...
    def workers(self, starting: bool = False) -> Workers: ...
    def apply(self, cfg: configs.Config) -> list[str]: ...
    def room_for(self, m: configs.ModelConfig) -> None: ...
    def check_models(self, models, workers: Workers, starting: bool = False) -> list[configs.ModelConfig]: ...
    def fill(self, models, workers: Workers, starting: bool = False) -> None: ...


log = logging.getLogger("fast_start.daemon")
SETTLE_S = 2.0       # a changed checkpoint is refilled once its files stay the same this long
RETRY_S = 10.0       # how often an unusable changed checkpoint is looked at again
RECHECK_S = 30.0     # every cached model's files are compared with the fill's this often
ROOM_S = 30.0        # how often a fill waiting for device memory looks again
RESTART_ONLY = ("socket_dir", "device")     # [daemon] settings a reload cannot change: named, kept


class Keeper:
    def __init__(self, daemon: Host):
        self.d = daemon
        self.jobs: queue.Queue = queue.Queue()
        self.retry: dict[str, float] = {}           # model -> when to try filling it
        self.seen: dict[str, watch.Identity] = {}   # files last seen of a model waiting to settle
        self.tried: dict[str, watch.Identity] = {}  # files a model's last check found unusable
        self.short: set[str] = set()                # models whose fill waits for device memory (logged once)
        self.thread = threading.Thread(target=self.run, name="keeper", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def join(self, timeout: float) -> None:
        """Wait for the thread to end (the daemon's stop is set): a refill in progress kills its
        worker within a second."""
        if self.thread.is_alive():
            self.put("stop")            # wakes the wait for the next job
            self.thread.join(timeout)

    def put(self, kind: str, arg=None) -> None:
        """Queue "check" (a model name: compare its files), "fill" (a model name: now), "retry" (a
        model name: now unless a retry is due), "reload" or "stop"."""
        self.jobs.put((kind, arg))

    def changed(self, hit: dict[str, str | None]) -> None:
        """On the serving loop: what the watch saw ({model: what was written, or None: compare the
        files' identity}). A model one of whose files was written is no longer served from here
        on; the comparisons, which stat the files (a hung NFS mount blocks there), are the keeper's."""
        for name, written in hit.items():
            if written:
                self.check(name, written)
            else:
                self.put("check", name)

    def run(self) -> None:
        next_sweep = time.monotonic() + RECHECK_S
        while not self.d.stop.is_set():
            wake = min([next_sweep, *self.retry.values()])
            try:
                kind, arg = self.jobs.get(timeout=max(0.05, wake - time.monotonic()))
            except queue.Empty:
                kind, arg = None, None
            try:
                if kind == "check":
                    self.check(arg)
                elif kind == "fill":
                    self.retry[arg] = time.monotonic()
                elif kind == "retry":
                    self.retry.setdefault(arg, time.monotonic())
                elif kind == "reload":
                    self.reload()
                for name in [n for n, t in self.retry.items() if t <= time.monotonic()]:
                    del self.retry[name]
                    self.refill(name)
                if time.monotonic() >= next_sweep:
                    for name in self.d.cache.cached():
                        self.check(name)
                    next_sweep = time.monotonic() + RECHECK_S
            except Exception:
                log.exception("the keeper failed on %s", kind)

    def stale(self, name: str, why: str) -> None:
        """`name`'s checkpoint changed under its cache: stop serving it, then refill it."""
        if not self.d.cache.evict(name, "checkpoint changed", pending="stale"):
            return
        log.warning("%s: the checkpoint changed since the fill (%s); no longer served", name, why, extra=fields(name))
        if self.d.cfg.daemon.refill_on_change:
            self.put("fill", name)
        else:
            self.d.cache.set_pending(name, "stale", f"{why}; refill_on_change is off: a restart fills it")

    def check(self, name: str, written: str | None = None) -> None:
        """Compare `name`'s files with its fill's (or take the watch's word that one was
        `written`: no file is looked at then); a stale or failed model is looked at again. Safe on
        any thread."""
        entry = self.d.cache.cached().get(name)
        if entry is not None:
            changed = written or watch.differs(entry.files, watch.identity(entry.model.path), gone_is_change=False)
            if changed:
                self.stale(name, changed)
        elif self.d.cache.state(name) in ("stale", "failed") \
                and self.d.cfg.daemon.refill_on_change:
            self.put("retry", name)

    def refill(self, name: str) -> None:
        """Fill `name` in the background: a stale or failed model once its checkpoint has settled,
        any other (asked for, new in the config, waiting for room) at once."""
        model = self.d.model(name)
        if model is None or name in self.d.cache.cached() or self.d.stop.is_set() or not self.settled(name, model):
            return
        try:
            self.d.room_for(model)      # a size known from before: no worker starts while there is no room
        except NoRoom as e:
            self.wait_for_room(name, e)
            return
        with self.d.workers() as workers:
            try:
                self.d.check_models([model], workers)
            except FastStartError as e:
                if self.d.cache.state(name) == "failed":
                    self.d.cache.set_pending(name, "failed", str(e))
                else:
                    self.d.cache.set_pending(name, "stale", f"waiting for a usable checkpoint: {e.what}")
                self.tried[name] = self.seen.get(name)
                log.warning("%s cannot be filled yet: %s (fix: %s)", name, e.what, e.fix or "see fast-start status",
                            extra=fields(name))
                self.retry[name] = time.monotonic() + RETRY_S
                return
            self.seen.pop(name, None)
            self.tried.pop(name, None)
            self.d.cache.set_pending(name, "filling")
            try:
                self.d.fill([model], workers)
            except NoRoom as e:
                self.wait_for_room(name, e)
                return
            except FastStartError as e:
                self.short.discard(name)
                log.error("refilling %s failed: %s", name, e, extra=fields(name))
                self.d.cache.set_pending(name, "failed", str(e))
                return
        if name in self.short:
            self.short.discard(name)
            log.info("%s had room and is filled", name)
        self.d.watch.add(name, model.path)
        self.check(name)            # changed while it filled: stale again at once

    def settled(self, name: str, model: configs.ModelConfig) -> bool:
        """Whether `name` may be filled now: a stale or failed model once its files have stayed
        the same for SETTLE_S, and not while they are those its last check found unusable (only a
        change can help then; looked at again every RETRY_S, a stat of each file)."""
        state = self.d.cache.state(name)
        if state not in ("stale", "failed"):
            return True
        files = watch.identity(model.path)
        if self.seen.get(name) != files:        # still changing: wait until it stays put
            self.seen[name] = files
            if state == "stale":                # a failed model keeps its reason meanwhile
                self.d.cache.set_pending(name, "stale", "waiting for the checkpoint's files to settle")
            self.retry[name] = time.monotonic() + SETTLE_S
            return False
        if self.tried.get(name) == files:
            self.retry[name] = time.monotonic() + RETRY_S
            return False
        return True

    def wait_for_room(self, name: str, e: NoRoom) -> None:
        """`name`'s fill does not fit the device's free memory: it waits (whatever is cached keeps
        serving), looked at again every ROOM_S and at each reload; logged once."""
        if name not in self.short:
            self.short.add(name)
            log.warning("%s waits for room: %s (fix: %s)", name, e.what, e.fix, extra=fields(name))
        self.d.cache.set_pending(name, "no_room", e.what)
        self.retry[name] = time.monotonic() + ROOM_S

    def reload(self) -> None:
        """SIGHUP: read the config again; add new models, drop removed or changed ones, keep the rest."""
        d, began = self.d, time.time()
        notify.notify(f"RELOADING=1\nMONOTONIC_USEC={time.monotonic_ns() // 1000}")
        try:
            cfg = configs.load(d.cfg.path, check_paths=False)
            for note in cfg.deprecated:
                log.warning("reload: %s", note)
            held = {k: getattr(d.cfg.daemon, k) for k in RESTART_ONLY
                    if getattr(cfg.daemon, k) != getattr(d.cfg.daemon, k)}
            if held:        # the rest is applied; these keep their running values
                log.warning("reload: %s changed in %s and take effect at a restart (systemctl restart "
                            "fast-start@%d); until then the daemon keeps %s", ", ".join(held), cfg.path, d.gpu,
                            ", ".join(f"{k} = {v!r}" for k, v in held.items()))
                cfg = dataclasses.replace(cfg, daemon=dataclasses.replace(cfg.daemon, **held))
            with d.workers() as workers:
                cfg = startup.resolve(cfg, d.gpu, workers)
        except FastStartError as e:
            log.error("reload failed, keeping the running config: %s", e)
            d.cache.reloaded(began, str(e))
            notify.notify("READY=1\nSTATUS=ready (the last reload failed: see the log)")
            return
        for name in d.apply(cfg):
            self.retry[name] = time.monotonic()
        log.info("reloaded %s: %d model(s) for GPU %d", cfg.path, len(d.models), d.gpu)
        d.cache.reloaded(began)
        restart = f"; restart to apply {', '.join(held)}" if held else ""
        notify.notify(f"READY=1\nSTATUS=ready: reloaded, {len(d.models)} model(s) configured{restart}")

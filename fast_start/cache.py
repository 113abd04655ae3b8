"""The daemon's state: cached model shards (arena fds + manifests), leases and evictions.

`Cache.handle` answers one decoded request; it is called from many connection threads and takes
the lock for every change. It never raises for a bad request: the reply says what was wrong.

No client can make the daemon run out of file descriptors: leases are bounded and share one
pidfd per engine process (`leases.py`); arena fds go out as they are (no dup per reply): an
entry is pinned while a reply carrying its fds is being sent, and an eviction closes them once
the last such reply is out. Evictions are kept in `history.py`.

Roles: any allowed peer may acquire and release its own leases and read status; evicting needs
an *admin* (root, the daemon's user, or a member of `admin_groups`), and other peers see neither
model paths nor other users' leases.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from . import __version__, memory, protocol, reports, table, trust, watch
from .config import ModelConfig
from .fingerprint import Fingerprint
from .history import History
from .leases import Leases, Limits
from .manifest import Manifest
from .metrics import Metrics
from .trust import Peer

log = logging.getLogger("fast_start.daemon")

MODEL_STATES = ("cached", "filling", "no_room", "stale", "failed", "evicted", "missing")   # fast_start_model_state
# The reasons a miss and an eviction are counted by (`fast-start metrics`): each configured model's
# counters are there from the start, at 0, so that a rate or an alert sees them before any event.
MISS_REASONS = ("fingerprint", "files", "access", "memory", "evicted", "not_cached")
EVICTION_REASONS = ("manual", "release", "config change", "checkpoint changed")


@dataclass
class Entry:
    model: ModelConfig
    manifest: Manifest
    fds: list[int]
    fill_seconds: float
    files: watch.Identity                               # the checkpoint files' identity at the fill
    filled_at: float = field(default_factory=time.time)
    names: list[str] = field(default_factory=list)     # its FDNAMEs in systemd's fd store
    pins: int = 0                                       # replies carrying its fds being sent
    retired: bool = False                               # evicted: fds close with the last pin
    adopted: bool = False                               # taken back from systemd's fd store, not filled

    def __post_init__(self):
        # Encoded once, sent to every engine: the tensor table and the rest of the manifest.
        self.manifest_dict = self.manifest.to_dict()
        self.table = table.encode(self.manifest)
        self.head = {k: v for k, v in self.manifest_dict.items() if k != "tensors"}

    @property
    def nbytes(self) -> int:
        return sum(a.size for a in self.manifest.arenas)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)       # engines that mapped it keep it alive until they exit
        self.fds = []


class Cache:
    def __init__(self, gpu: int, device: str, on_release: str, limits: Limits = Limits(),
                 on_evict: Callable[[Entry], None] = lambda entry: None,
                 on_process: Callable[[int], None] = lambda pidfd: None,
                 on_stale: Callable[[str, str], None] = lambda model, why: None,
                 on_fill: Callable[[str], None] = lambda model: None):
        self.gpu, self.device, self.on_release = gpu, device, on_release
        self.started = time.time()
        self.keep_free = 0                              # bytes fills leave free for engines (`[daemon] keep_free`)
        self.notes: dict[str, str] = {}                 # model -> the last copy refused for want of room
        self.on_evict, self.on_stale, self.on_fill = on_evict, on_stale, on_fill
        self.on_change: Callable[[], None] = lambda: None     # what is cached or pending changed (STATUS=)
        self.entries: dict[str, Entry] = {}
        self.leases = Leases(limits, on_process)        # under `lock`
        self.configured: tuple[str, ...] = ()          # models this GPU should hold
        self.folders: tuple[str, ...] = ()             # their paths: what a non-admin's reply never names
        self.pending: dict[str, reports.Missing] = {}   # configured but not cached
        self.former: dict[str, tuple[Fingerprint, str]] = {}   # a pending model's evicted fingerprint, why
        self.history = History()
        self.reloads, self.reload_error = 0, ""       # SIGHUPs handled; why the last one was refused
        self.reload_began = 0.0                         # when the last one began to read the config
        self.kept_artifacts: Callable[[int | None], list] = lambda uid: []     # the daemon's artifact_store.report
        self.lock = threading.Lock()
        self.metrics = Metrics(gpu)

    def add(self, entry: Entry) -> None:
        """Serve `entry`, replacing (and evicting) any entry of the same model at once."""
        with self.lock:
            old = self.entries.pop(entry.model.name, None)
            self.entries[entry.model.name] = entry
            self.pending.pop(entry.model.name, None)
            self.former.pop(entry.model.name, None)
            self.notes.pop(entry.model.name, None)
        if old is not None:
            self._retire(old)
        self.on_change()

    def reconfigure(self, name: str, model: ModelConfig) -> None:
        """A cached model kept by a reload serves under its new config (a renamed path shows)."""
        with self.lock:
            if name in self.entries:
                self.entries[name].model = model

    def configure(self, models: tuple[str, ...], on_release: str, keep_free: int, folders: tuple[str, ...] = ()) -> None:
        """The models this GPU should hold (pending states of others are dropped) and their
        `folders`, what a released copy does (`on_release`) and the bytes fills leave free for
        engines (`keep_free`)."""
        with self.lock:
            self.configured, self.on_release, self.keep_free = models, on_release, keep_free
            self.folders = tuple(sorted(set(folders), key=len, reverse=True))
            for name in [n for n in self.pending if n not in models]:
                del self.pending[name]
        self.metrics.zero("fast_start_refused_peers_total")
        for name in models:
            for family in ("fast_start_fills_total", "fast_start_filled_bytes_total", "fast_start_readoptions_total",
                           "fast_start_failovers_total"):
                self.metrics.zero(family, model=name)
            for mode in protocol.MODES:
                self.metrics.zero("fast_start_cache_hits_total", model=name, mode=mode)
            for reason in MISS_REASONS:
                self.metrics.zero("fast_start_cache_misses_total", model=name, reason=reason)
            for reason in EVICTION_REASONS:
                self.metrics.zero("fast_start_evictions_total", model=name, reason=reason)
        self.on_change()

    def reloaded(self, began: float, error: str = "") -> None:
        """A reload that began reading the config at `began` ended: applied, or refused for
        `error` (the running config kept)."""
        with self.lock:
            self.reloads, self.reload_error, self.reload_began = self.reloads + 1, error, began

    def state(self, model: str) -> str:
        """A configured model's state: "cached", its pending state, or "missing"."""
        with self.lock:
            return self._state(model)

    def _state(self, model: str) -> str:
        pending = self.pending.get(model)
        return "cached" if model in self.entries else pending.state if pending else "missing"

    def set_pending(self, model: str, state: str, detail: str = "") -> None:
        with self.lock:
            self._pend(model, state, detail)
        self.on_change()

    def _pend(self, model: str, state: str, detail: str = "") -> None:
        """Note (lock held) why configured `model` is not cached, from now: `state` is one of
        MODEL_STATES but "cached"."""
        if state not in MODEL_STATES or state == "cached":
            raise ValueError(f"{model}: {state!r} is not a pending state (one of {MODEL_STATES[1:]})")
        self.pending[model] = reports.Missing(model, state, detail, time.time())

    # -- requests ------------------------------------------------------------------------------
    def handle(self, msg, peer: Peer):
        """One request -> (reply, fds to send with it, `done(sent: bool)` to call once sent)."""
        if isinstance(msg, protocol.Hello):
            if msg.protocol != protocol.VERSION:
                return _no(protocol.Error(f"protocol version {msg.protocol} is not spoken here (daemon speaks "
                                          f"{protocol.VERSION})", "use a fast-start client of the daemon's version"))
            return _no(protocol.Welcome(protocol.VERSION, self.device, self.gpu, os.getpid()))
        if isinstance(msg, protocol.Acquire):
            return self.acquire(msg, peer)
        if isinstance(msg, protocol.Release):
            return _no(self.release(msg.lease, peer, msg.copied))
        if isinstance(msg, protocol.Role):
            return _no(self.assign(msg.lease, peer, msg.role))
        if isinstance(msg, protocol.Evict):
            if not peer.admin:
                return _no(protocol.Error(f"uid {peer.uid} may not evict: that needs root, the daemon's user or a "
                                          "member of admin_groups", "run fast-start evict as one of them"))
            return _no(self.evict_request(msg.model))
        if isinstance(msg, protocol.Fill):
            if not peer.admin:
                return _no(protocol.Error(f"uid {peer.uid} may not fill: that needs root, the daemon's user or a "
                                          "member of admin_groups", "run fast-start fill as one of them"))
            return _no(self.fill_request(msg.model))
        report = {"status": self.status, "fingerprints": self.fingerprints, "evictions": self.eviction_list,
                  "metrics": self.metric_samples}[msg.kind]
        return _no(protocol.Report(reports.body(report(peer))))

    def acquire(self, msg: protocol.Acquire, peer: Peer):
        """A lease and the reply that carries the model's fds: its manifest as the tensor table
        (engines) or as JSON (`fast-start verify`). A copy-mode lease ends when the engine, its reply
        come, says it takes the model over (`Release` with `copied`): only then does `on_release = "drop"` evict the
        model, so a hand-over that breaks off (a timeout, an engine killed, a reply turned down)
        leaves the cache serving; the engine's copy is made from the fds it received, which keep
        the memory alive. With "keep", a copy the device has no room for beside the cache is
        refused (`_no_room_for_copy`).

        A partial request (`fingerprint.requested`: sent before the engine read its checkpoint) is
        served by the model equal in its other fields whose files are the engine's (their identity
        pins the bytes the rest of the fingerprint is read from; the engine checks the reply's
        fingerprint against its own). Anything else gets `_PARTIAL_MISS`, neither logged nor
        counted: the engine asks again with the whole fingerprint, and that answer says why."""
        want = self._wanted(msg)
        if not isinstance(want, Fingerprint):
            return _no(want)
        best = self._match(msg, want, peer)
        if not isinstance(best, Entry):
            return _no(best)
        refused = self._authorize(msg, peer, best)
        if refused:
            return _no(self._missed(peer, refused))
        with self.lock:
            if best.retired:
                return _no(protocol.Miss("the model was evicted meanwhile", [], best.model.name))
            first_new = self.leases.next_id
            lease = self.leases.take(peer, best.model.name, msg.mode, f"GPU {self.gpu}")
            if isinstance(lease, protocol.Error):
                return _no(lease)
            best.pins += 1
        log.info("served %s to pid %d uid %d (%s, lease %d%s%s)", best.model.name, peer.pid, peer.uid, msg.mode,
                 lease.id, ", ends at the engine's hand-over" if msg.mode == "copy" else "",
                 ", to verify it" if msg.purpose == "verify" else "")
        if msg.purpose == "engine":
            self.metrics.inc("fast_start_cache_hits_total", model=best.model.name, mode=msg.mode)
        if msg.manifest == "json":
            reply = protocol.Acquired(lease.id, best.model.name, best.manifest_dict, fds=len(best.fds))
        else:
            reply = protocol.Acquired(lease.id, best.model.name, best.head, len(best.table),
                                      len(best.fds)).attach(best.table)
        return reply, best.fds, lambda sent: self._sent(best, lease, sent or lease.id < first_new)

    def _wanted(self, msg: protocol.Acquire) -> Fingerprint | protocol.Error | protocol.Miss:
        """The fingerprint an acquire asks for, or why it cannot be served as asked."""
        if msg.protocol and msg.protocol != protocol.VERSION:
            return protocol.Error(f"protocol version {msg.protocol} is not spoken here (daemon speaks "
                                  f"{protocol.VERSION})", "use a fast-start client of the daemon's version")
        if msg.mode not in protocol.MODES or msg.manifest not in ("table", "json") \
                or msg.purpose not in ("engine", "verify"):
            return protocol.Error(f"mode {msg.mode!r}, manifest form {msg.manifest!r} or purpose {msg.purpose!r} "
                                  "is unknown", f"use a mode of {', '.join(protocol.MODES)}, manifest \"table\" or "
                                  "\"json\" and purpose \"engine\" or \"verify\"")
        if msg.device and msg.device != self.device:
            return protocol.Miss(f"this daemon serves {self.device}, not {msg.device}", ["device"])
        try:
            return Fingerprint.from_dict(msg.fingerprint)
        except (ValueError, TypeError) as e:
            return protocol.Error(f"fingerprint is malformed: {e}", "send all fingerprint fields")

    def _match(self, msg: protocol.Acquire, want: Fingerprint, peer: Peer) -> Entry | protocol.Miss:
        """The entry that holds `want` from the engine's very files, or the miss (a partial request's
        is `_PARTIAL_MISS`, neither logged nor counted)."""
        with self.lock:
            best = min(self.entries.values(), default=None, key=lambda e: (
                len(e.manifest.fingerprint.diff(want, msg.partial)), e.files != msg.files, e.model.name))
            if best is None or best.manifest.fingerprint.diff(want, msg.partial):
                return _PARTIAL_MISS if msg.partial else self._missed(peer, self._miss(want, best))
        if msg.files != best.files:
            return _PARTIAL_MISS if msg.partial else self._missed(peer, self._files_miss(best, msg.files))
        return best

    def _authorize(self, msg: protocol.Acquire, peer: Peer, best: Entry) -> protocol.Miss | None:
        """Why `peer` may not have `best` as asked: a checkpoint it cannot read (knowing the
        fingerprint and the files' identities is not reading them), or no room for its copy."""
        denied = self._unreadable(peer, best, msg.path)
        if denied:
            return protocol.Miss(f"uid {peer.uid} cannot read {denied}", ["access"], best.model.name,
                                 "let that user read the checkpoint")
        return self._no_room_for_copy(best) if msg.mode == "copy" else None

    @staticmethod
    def _unreadable(peer: Peer, entry: Entry, theirs: str) -> str | None:
        """The first of `entry`'s files `peer` could not read, by the configured path or, where
        that fails, by the folder the engine names (`theirs`: a bind mount, hard links) if the
        files there are the very files of the fill; None where it could read them all."""
        names = [n for n, i in entry.files.items() if i[2] >= 0]
        denied = trust.unreadable(peer, entry.model.path, names)
        if denied and theirs and theirs != entry.model.path:
            there = watch.identity(theirs)
            if all(there.get(n) == entry.files[n] for n in names):
                return trust.unreadable(peer, theirs, names) and denied
        return denied

    def _no_room_for_copy(self, entry: Entry) -> protocol.Miss | None:
        """A copy the device has no room for while the daemon keeps its cache (`on_release = "keep"`):
        the engine's copy and the cache would both need the model's bytes, and the cache kept
        beside a copy leaves `keep_free` to the other engines as a fill does."""
        if self.on_release != "keep":
            return None
        now = memory.of(self.device)
        need = entry.nbytes + max((a.size for a in entry.manifest.arenas), default=0) + self.keep_free
        if now is None or now.free >= need:
            return None
        what = (f"no room on {memory.where(self.device, self.gpu)} for a copy of {entry.model.name} ({memory.gib(entry.nbytes)}) beside the cache "
                f"(on_release = \"keep\"): {memory.gib(now.free)} free, {memory.gib(need)} needed with keep_free")
        with self.lock:
            self.notes[entry.model.name] = f"{time.strftime('%H:%M:%S')}: copy refused: {what}"
        log.warning("%s", what)
        return protocol.Miss(what, ["memory"], entry.model.name, 'set on_release = "drop" in the daemon\'s config '
                             "(a copy then takes the cache's place), or load with mode zero_copy")

    def _miss(self, want: Fingerprint, closest: Entry | None) -> protocol.Miss:
        """No entry holds `want` (under the lock): say why as exactly as the daemon knows."""
        for name, state in self.pending.items():
            fp, reason = self.former.get(name, (None, ""))
            if fp == want:
                changed = reason == "checkpoint changed"
                why = "checkpoint changed since the fill" if changed else f"evicted ({reason})"
                return protocol.Miss(f"{why}; {name} is {state.state}" + (f": {state.detail}" if state.detail else ""),
                                     ["files"] if changed else [], name, "see fast-start status")
        if closest is None and self.pending:
            states = "; ".join(f"{name} is {p.state}" + (f" ({p.detail})" if p.detail else "")
                               for name, p in self.pending.items())
            return protocol.Miss(f"no model is cached now: {states}", [], "",
                                 "see fast-start status; a model is served as soon as its fill completes")
        if closest is None:
            return protocol.Miss("this daemon caches no model", [], "", "add the model to the daemon's config "
                                 "([[model]] with this GPU in gpus) and run systemctl reload")
        return protocol.Miss("fingerprint differs", list(closest.manifest.fingerprint.diff(want)), closest.model.name)

    def _missed(self, peer: Peer, miss: protocol.Miss) -> protocol.Miss:
        """Count and log a miss (one line naming the engine and the fingerprint fields that differ);
        the reply, for a peer that is not an admin, with no model folder in it."""
        log.info("miss for pid %d uid %d: %s%s", peer.pid, peer.uid, miss.reason,
                 f"; differing fields: {', '.join(miss.fields)}" if miss.fields else "")
        reason = next((f for f in ("memory", "access", "files") if f in miss.fields), None) or \
            ("fingerprint" if miss.fields else "evicted" if miss.reason.startswith("evicted") else "not_cached")
        self.metrics.inc("fast_start_cache_misses_total", model=miss.model or "", reason=reason)
        if peer.admin:
            return miss
        text = miss.reason
        for folder in self.folders:
            text = text.replace(folder, "the model's folder")
        return protocol.Miss(text, miss.fields, miss.model, miss.fix)

    def _files_miss(self, entry: Entry, theirs) -> protocol.Miss:
        """The engine's files are not those of the fill: the checkpoint changed, or it is another copy."""
        changed = watch.differs(entry.files, watch.identity(entry.model.path), gone_is_change=False)
        if changed:
            self.on_stale(entry.model.name, changed)
            return protocol.Miss(f"checkpoint changed since the fill ({changed})", ["files"], entry.model.name,
                                 "wait for the daemon to refill it (fast-start status)")
        other = watch.differs(entry.files, theirs) if isinstance(theirs, dict) else "no file identities sent"
        return protocol.Miss(f"the engine's checkpoint files are not those the daemon cached from "
                             f"{entry.model.path} ({other})", ["files"], entry.model.name,
                             "load the model from the folder the daemon's [[model]] path names")

    def _sent(self, entry: Entry, lease: reports.Lease, keep: bool) -> None:
        """A reply carrying `entry`'s fds is out, or failed: a lease made for it ends unless kept."""
        with self.lock:
            entry.pins -= 1
            if not keep and lease.id in self.leases.held:
                self.leases.drop(lease)
            close = entry.retired and entry.pins == 0
        if close:
            entry.close()

    def process_exited(self, pidfd: int) -> None:
        """`pidfd` became readable: if its process really exited, end all its leases."""
        with self.lock:
            self.leases.exited(pidfd)

    def release(self, lease_id: int, peer: Peer, copied: bool = False):
        """End a lease. A copy-mode lease `copied` (its engine has the reply) hands the model
        over: `on_release = "drop"` evicts it now. A lease given back unused changes nothing."""
        with self.lock:
            lease = self.leases.held.get(lease_id)
            if lease is None or lease.pid != peer.pid:
                return protocol.Error(f"lease {lease_id} is not held by pid {peer.pid}",
                                      "release only leases your process acquired")
            self.leases.drop(lease)
            evict = copied and lease.mode == "copy" and self.on_release == "drop" and lease.model in self.entries
        log.info("lease %d on %s %s by pid %d uid %d", lease_id, lease.model,
                 "handed over" if copied and lease.mode == "copy" else "released", peer.pid, peer.uid)
        if evict:
            self.evict(lease.model, "release")
        return protocol.Report(reports.body(reports.Released(lease_id, self.on_release)))

    def assign(self, lease_id: int, peer: Peer, role: str):
        """A lease's engine says its role; a standby woken after its model's serving engine died
        is a failover: counted, and one line in the journal."""
        with self.lock:
            said = self.leases.assign(lease_id, peer.pid, role)
        if isinstance(said, protocol.Error):
            return said
        log.info("lease %d on GPU %d: pid %d %s", lease_id, self.gpu, peer.pid, role)
        if said is not None:
            self.metrics.inc("fast_start_failovers_total", model=said.model)
            log.info("failover: %s's serving engine (pid %d) died; standby pid %d serving %.3f s later",
                     said.model, said.died, said.serving, said.seconds)
        return protocol.Report(reports.body(reports.Assigned(lease_id, role)))

    def evict_request(self, model: str):
        with self.lock:
            if model and model not in self.entries:
                return protocol.Error(f"model {model!r} is not cached on GPU {self.gpu}",
                                      f"cached: {', '.join(self.entries) or 'none'}")
            names = [model] if model else list(self.entries)
        for name in names:
            self.evict(name, "manual")
        return protocol.Report(reports.body(reports.Evicted(names)))

    def fill_request(self, model: str):
        """Queue a fill of `model` (or of every configured model not cached) with the keeper."""
        with self.lock:
            if model and model not in self.configured:
                return protocol.Error(f"model {model!r} is not configured for GPU {self.gpu}",
                                      f"configured: {', '.join(self.configured) or 'none'}; add it to the config "
                                      "and run systemctl reload")
            names = [n for n in ([model] if model else self.configured) if n not in self.entries]
            for name in names:
                self._pend(name, "filling", "asked by fast-start fill")
        for name in names:
            self.on_fill(name)
        self.on_change()
        return protocol.Report(reports.body(reports.Filling(names, [n for n in self.configured if n not in names])))

    def evict(self, name: str, reason: str, pending: str = "evicted") -> bool:
        """Stop serving `name`; its fds close once no reply carries them. False if it was not cached."""
        with self.lock:
            entry = self.entries.pop(name, None)
            if entry is None:
                return False
            if name in self.configured:
                self._pend(name, pending, reason)
                self.former[name] = (entry.manifest.fingerprint, reason)
            leases = self.leases.on(name)
        self.history.add(reports.Eviction(time.time(), name, reason, entry.nbytes, leases))
        log.info("evicted %s (%s; %.2f GiB, %d lease(s) held then)", name, reason, entry.nbytes / 2**30, leases)
        self.metrics.inc("fast_start_evictions_total", model=name, reason=reason)
        self._retire(entry)
        self.on_change()
        return True

    def record(self, model: str, reason: str, nbytes: int = 0) -> None:
        """An eviction that happened outside the cache (a stored arena the config no longer matches)."""
        self.history.add(reports.Eviction(time.time(), model, reason, nbytes, 0))
        self.metrics.inc("fast_start_evictions_total", model=model, reason=reason)

    def _retire(self, entry: Entry) -> None:
        self.on_evict(entry)
        with self.lock:
            entry.retired = True
            close = entry.pins == 0
        if close:
            entry.close()

    def close(self) -> None:
        with self.lock:
            self.leases.close()
            entries, self.entries = list(self.entries.values()), {}
        for entry in entries:
            entry.close()

    # -- reports -------------------------------------------------------------------------------
    def status(self, peer: Peer | None = None) -> reports.Status:
        admin = peer is None or peer.admin
        now, used = memory.of(self.device), memory.by_process(self.device)
        with self.lock:
            missing = [self.pending.get(n) or reports.Missing(n, "missing")
                       for n in self.configured if n not in self.entries]
            models = [reports.CachedModel(
                name=n, rank=e.manifest.fingerprint.rank, tensor_parallel_size=e.manifest.fingerprint.tensor_parallel_size,
                bytes=e.nbytes, tensors=len(e.manifest.tensors), fingerprint=e.manifest.fingerprint.digest()[:16],
                fill_seconds=round(e.fill_seconds, 3), filled_at=e.filled_at, adopted=e.adopted,
                arenas=len(e.manifest.arenas), path=e.model.path if admin else None, note=self.notes.get(n))
                for n, e in self.entries.items()]
            leases = [l._replace(gpu_bytes=used.get(l.pid)) for l in self.leases.held.values()
                      if admin or l.uid == peer.uid]
            return reports.Status(gpu=self.gpu, state="ready" if not missing else "incomplete", pid=os.getpid(),
                                  models=models, missing=missing, leases=leases, device=self.device,
                                  version=__version__, started_at=self.started, reloads=self.reloads,
                                  reload_error=self.reload_error, reload_began=self.reload_began,
                                  memory=self._memory(now), artifacts=self.kept_artifacts(None if admin else peer.uid),
                                  failovers=self.leases.failovers, last_failover=self.leases.last_failover)

    def _memory(self, now: memory.Memory | None) -> reports.Memory:
        """The device's total and free memory (None where they cannot be told) and what this
        daemon holds of it, under the lock."""
        return reports.Memory(held=sum(e.nbytes for e in self.entries.values()), keep_free=self.keep_free,
                              total=now.total if now else None, free=now.free if now else None)

    def fingerprints(self, peer: Peer | None = None) -> reports.Fingerprints:
        admin = peer is None or peer.admin
        with self.lock:
            models = [reports.ModelFingerprint(name=n, digest=e.manifest.fingerprint.digest(), bytes=e.nbytes,
                                               fingerprint=e.manifest.fingerprint.to_dict(), files=e.files,
                                               path=e.model.path if admin else None)
                      for n, e in self.entries.items()]
            return reports.Fingerprints(self.gpu, self.on_release, models)

    def metric_samples(self, peer: Peer | None = None) -> reports.Metrics:
        """The counters, and the gauges read off the cache now."""
        now = memory.of(self.device)
        with self.lock:
            gauges = [self.metrics.sample("fast_start_cached_bytes", e.nbytes, model=name)
                      for name, e in self.entries.items()]
            gauges += [self.metrics.sample("fast_start_leases", self.leases.on(name), model=name)
                       for name in self.entries]
            gauges += [self.metrics.sample("fast_start_device_memory_bytes", value, kind=kind)
                       for kind, value in self._memory(now)._asdict().items()
                       if kind != "keep_free" and value is not None]
            for name in self.configured:
                state = self._state(name)
                gauges += [self.metrics.sample("fast_start_model_state", int(s == state), model=name, state=s)
                           for s in MODEL_STATES]
        gauges += [self.metrics.sample("fast_start_up", 1), self.metrics.sample("fast_start_build_info", 1,
                                                                               version=__version__)]
        return reports.Metrics(self.gpu, self.metrics.samples() + gauges)

    def eviction_list(self, peer: Peer | None = None) -> reports.Evictions:
        return reports.Evictions(self.gpu, self.history.listed())


_PARTIAL_MISS = protocol.Miss("no cached model matches before the checkpoint's headers are compared", ["partial"],
                              fix="ask again with the whole fingerprint")


def _no(reply):
    """A reply without fds and with nothing to do once it is sent."""
    return reply, [], lambda sent: None

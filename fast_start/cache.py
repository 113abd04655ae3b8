"""The daemon's state: cached model shards (arena fds + manifests), leases and evictions.

`Cache.handle` answers one decoded request that changes or leases (reports are `views.py`'s, the
words of a miss `misses.py`'s); it is called from many connection threads and takes the lock for
every change. It never raises for a bad request: the reply says what was wrong. What the daemon
must act on (an eviction, an engine's pidfd, a stale checkpoint, a fill asked for) it is told
through `Events`.

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
from . import misses, protocol, reports
from .config import ModelConfig
from .entry import Entry
from .fingerprint import Fingerprint
from .history import History
from .leases import Leases, Limits
from .metrics import Metrics
from .trust import Peer

log = logging.getLogger("fast_start.daemon")

MODEL_STATES = ("cached", "filling", "no_room", "stale", "failed", "evicted", "missing")   # fast_start_model_state
# The reasons a miss and an eviction are counted by (`fast-start metrics`): each configured model's
# counters are there from the start, at 0, so that a rate or an alert sees them before any event.
MISS_REASONS = ("fingerprint", "files", "access", "memory", "evicted", "not_cached")
EVICTION_REASONS = ("manual", "release", "config change", "checkpoint changed")


class Events:
    """What the cache tells the daemon it serves in (`daemon.Told` acts on each); alone, nothing."""

    def evicted(self, entry: Entry) -> None:
        """`entry` is no longer served (its fds leave systemd's fd store)."""

    def process(self, pidfd: int) -> None:
        """A new engine process's pidfd, readable once it exits: then call `Cache.process_exited`."""

    def stale(self, model: str, why: str) -> None:
        """`model`'s checkpoint changed under its entry."""

    def fill(self, model: str) -> None:
        """Fill `model` (`fast-start fill` asked)."""

    def changed(self) -> None:
        """What is cached or pending changed (the unit's STATUS=)."""

    def kept(self, uid: int | None) -> list:
        """Engines' kept artifacts for `status`: user `uid`'s, all users' for None."""
        return []


class Cache:
    def __init__(self, gpu: int, device: str, on_release: str, limits: Limits = Limits(), events: Events = Events(),
                 metrics: Metrics | None = None):
        self.gpu, self.device, self.on_release, self.events = gpu, device, on_release, events
        self.started = time.time()
        self.keep_free = 0                              # bytes fills leave free for engines (`[daemon] keep_free`)
        self.notes: dict[str, str] = {}                 # model -> the last copy refused for want of room
        self.entries: dict[str, Entry] = {}
        self.leases = Leases(limits, events.process)    # under `lock`
        self.configured: tuple[str, ...] = ()          # models this GPU should hold
        self.folders: tuple[str, ...] = ()             # their paths: what a non-admin's reply never names
        self.pending: dict[str, reports.Missing] = {}   # configured but not cached
        self.former: dict[str, tuple[Fingerprint, str]] = {}   # a pending model's evicted fingerprint, why
        self.history = History()
        self.reloads, self.reload_error, self.reload_began = 0, "", 0.0   # SIGHUPs done; the last's error, start
        self.lock = threading.Lock()
        self.metrics = metrics or Metrics(gpu)

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
        self.events.changed()

    def cached(self) -> dict[str, Entry]:
        """What is cached now, by model name (a copy, taken under the lock)."""
        with self.lock:
            return dict(self.entries)

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
        _zero_counters(self.metrics, models)
        self.events.changed()

    def reloaded(self, began: float, error: str = "") -> None:
        """A reload that began reading the config at `began` ended: applied, or refused for
        `error` (the running config kept)."""
        with self.lock:
            self.reloads, self.reload_error, self.reload_began = self.reloads + 1, error, began

    def state(self, model: str) -> str:
        """A configured model's state: "cached", its pending state, or "missing"."""
        with self.lock:
            return self.locked_state(model)

    def locked_state(self, model: str) -> str:
        """`state`, the lock held."""
        pending = self.pending.get(model)
        return "cached" if model in self.entries else pending.state if pending else "missing"

    def set_pending(self, model: str, state: str, detail: str = "") -> None:
        with self.lock:
            self._pend(model, state, detail)
        self.events.changed()

    def _pend(self, model: str, state: str, detail: str = "") -> None:
        """Note (lock held) why configured `model` is not cached, from now: `state` is one of
        MODEL_STATES but "cached"."""
        if state not in MODEL_STATES or state == "cached":
            raise ValueError(f"{model}: {state!r} is not a pending state (one of {MODEL_STATES[1:]})")
        self.pending[model] = reports.Missing(model, state, detail, time.time())

    # -- requests ------------------------------------------------------------------------------
    def handle(self, msg, peer: Peer):
        """One request -> (reply, fds to send with it, `done(sent: bool)` to call once sent)."""
        if isinstance(msg, protocol.Acquire):
            return self.acquire(msg, peer)
        if isinstance(msg, protocol.Hello):
            return _no(_unspoken(msg.protocol) or protocol.Welcome(protocol.VERSION, self.device, self.gpu, os.getpid()))
        if isinstance(msg, protocol.Release):
            return _no(self.release(msg.lease, peer, msg.copied))
        if isinstance(msg, protocol.Role):
            return _no(self.assign(msg.lease, peer, msg.role))
        if not peer.admin:          # evict, fill
            return _no(protocol.Error(f"uid {peer.uid} may not {msg.kind}: that needs root, the daemon's user or a "
                                      f"member of admin_groups", f"run fast-start {msg.kind} as one of them"))
        return _no(self.evict_request(msg.model) if isinstance(msg, protocol.Evict) else self.fill_request(msg.model))

    def acquire(self, msg: protocol.Acquire, peer: Peer):
        """A lease and the reply that carries the model's fds: its manifest as the tensor table
        (engines) or as JSON (`fast-start verify`). A copy-mode lease ends when the engine, its reply
        come, says it takes the model over (`Release` with `copied`): only then does `on_release = "drop"` evict the
        model, so a hand-over that breaks off (a timeout, an engine killed, a reply turned down)
        leaves the cache serving; the engine's copy is made from the fds it received, which keep
        the memory alive. With "keep", a copy the device has no room for beside the cache is
        refused (`misses.no_room_for_copy`).

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
        if msg.protocol and _unspoken(msg.protocol):
            return _unspoken(msg.protocol)
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
                return _PARTIAL_MISS if msg.partial else \
                    self._missed(peer, misses.unmatched(want, best, self.pending, self.former))
        if msg.files != best.files:
            if msg.partial:
                return _PARTIAL_MISS
            miss, changed = misses.other_files(best, msg.files)
            if changed:
                self.events.stale(best.model.name, changed)
            return self._missed(peer, miss)
        return best

    def _authorize(self, msg: protocol.Acquire, peer: Peer, best: Entry) -> protocol.Miss | None:
        """Why `peer` may not have `best` as asked: a checkpoint it cannot read, or no room for its
        copy beside the cache kept (`on_release = "keep"`; noted for `status`)."""
        refused = misses.unreadable(peer, best, msg.path)
        if refused is None and msg.mode == "copy" and self.on_release == "keep":
            refused = misses.no_room_for_copy(best, self.device, self.gpu, self.keep_free)
            if refused:
                log.warning("%s", refused.reason)
                with self.lock:
                    self.notes[best.model.name] = f"{time.strftime('%H:%M:%S')}: copy refused: {refused.reason}"
        return refused

    def _missed(self, peer: Peer, miss: protocol.Miss) -> protocol.Miss:
        """Count and log a miss (one line naming the engine and the fingerprint fields that differ);
        the reply, for a peer that is not an admin, with no model folder in it."""
        log.info("miss for pid %d uid %d: %s%s", peer.pid, peer.uid, miss.reason,
                 f"; differing fields: {', '.join(miss.fields)}" if miss.fields else "")
        self.metrics.inc("fast_start_cache_misses_total", model=miss.model or "", reason=misses.reason(miss))
        return miss if peer.admin else misses.without_folders(miss, self.folders)

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
            self.events.fill(name)
        self.events.changed()
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
        self.events.changed()
        return True

    def record(self, model: str, reason: str, nbytes: int = 0) -> None:
        """An eviction that happened outside the cache (a stored arena the config no longer matches)."""
        self.history.add(reports.Eviction(time.time(), model, reason, nbytes, 0))
        self.metrics.inc("fast_start_evictions_total", model=model, reason=reason)

    def _retire(self, entry: Entry) -> None:
        self.events.evicted(entry)
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


_PARTIAL_MISS = protocol.Miss("no cached model matches before the checkpoint's headers are compared", ["partial"],
                              fix="ask again with the whole fingerprint")


def _zero_counters(metrics: Metrics, models: tuple[str, ...]) -> None:
    """Each of `models`' counters, at 0 until it counts (an alert sees them before any event)."""
    metrics.zero("fast_start_refused_peers_total")
    for name in models:
        for family in ("fast_start_fills_total", "fast_start_filled_bytes_total", "fast_start_readoptions_total",
                       "fast_start_failovers_total"):
            metrics.zero(family, model=name)
        for mode in protocol.MODES:
            metrics.zero("fast_start_cache_hits_total", model=name, mode=mode)
        for reason in MISS_REASONS:
            metrics.zero("fast_start_cache_misses_total", model=name, reason=reason)
        for reason in EVICTION_REASONS:
            metrics.zero("fast_start_evictions_total", model=name, reason=reason)


def _unspoken(version: int) -> protocol.Error | None:
    if version == protocol.VERSION:
        return None
    return protocol.Error(f"protocol version {version} is not spoken here (daemon speaks {protocol.VERSION})",
                          "use a fast-start client of the daemon's version")


def _no(reply):
    """A reply without fds and with nothing to do once it is sent."""
    return reply, [], lambda sent: None

"""The daemon's state: cached model shards (arena fds + manifests), leases and evictions.

`Cache.handle` answers one decoded request; it is called from many connection threads and takes
the lock for every change. It never raises for a bad request: the reply says what was wrong.
"""
from __future__ import annotations

import collections
import os
import threading
import time
from dataclasses import asdict, dataclass, field

from . import protocol
from .config import ModelConfig
from .fingerprint import Fingerprint
from .manifest import Manifest
from .trust import Peer

MODES = ("zero_copy", "copy")


@dataclass
class Entry:
    model: ModelConfig
    manifest: Manifest
    fds: list[int]
    fill_seconds: float
    filled_at: float = field(default_factory=time.time)
    names: list[str] = field(default_factory=list)     # its FDNAMEs in systemd's fd store

    def __post_init__(self):
        self.manifest_dict = self.manifest.to_dict()   # encoded once, sent to every engine

    @property
    def nbytes(self) -> int:
        return sum(a.size for a in self.manifest.arenas)


@dataclass
class Lease:
    id: int
    pid: int
    model: str
    mode: str
    since: float
    pidfd: int = -1          # readable once the process exits


class Cache:
    def __init__(self, gpu: int, device: str, on_release: str, on_evict=lambda entry: None):
        self.gpu, self.device, self.on_release, self.on_evict = gpu, device, on_release, on_evict
        self.entries: dict[str, Entry] = {}
        self.leases: dict[int, Lease] = {}
        self.evictions: collections.deque = collections.deque(maxlen=200)
        self.lock = threading.Lock()
        self.next_lease = 1

    def add(self, entry: Entry) -> None:
        with self.lock:
            self.entries[entry.model.name] = entry

    # -- requests ------------------------------------------------------------------------------
    def handle(self, msg, peer: Peer):
        """One request -> (reply, fds to send with it, lease to register once sent)."""
        if isinstance(msg, protocol.Hello):
            if msg.protocol != protocol.VERSION:
                return protocol.Error(f"protocol version {msg.protocol} is not spoken here (daemon speaks "
                                      f"{protocol.VERSION})", "use a fast-start client of the daemon's version"), [], None
            return protocol.Welcome(protocol.VERSION, self.device, self.gpu, os.getpid()), [], None
        if isinstance(msg, protocol.Acquire):
            return self.acquire(msg, peer)
        if isinstance(msg, protocol.Release):
            return self.release(msg.lease, peer), [], None
        if isinstance(msg, protocol.Evict):
            return self.evict_request(msg.model), [], None
        body = {"status": self.status, "fingerprints": self.fingerprints, "evictions": self.eviction_list}[msg.kind]()
        return protocol.Report(body), [], None

    def acquire(self, msg: protocol.Acquire, peer: Peer):
        if msg.mode not in MODES:
            return protocol.Error(f"mode {msg.mode!r} is unknown", f"use one of {', '.join(MODES)}"), [], None
        try:
            want = Fingerprint.from_dict(msg.fingerprint)
        except (ValueError, TypeError) as e:
            return protocol.Error(f"fingerprint is malformed: {e}", "send all fingerprint fields"), [], None
        with self.lock:
            if not self.entries:
                return protocol.Miss("this daemon caches no model"), [], None
            diffs = sorted((len(e.manifest.fingerprint.diff(want)), name) for name, e in self.entries.items())
            best = self.entries[diffs[0][1]]
            fields = best.manifest.fingerprint.diff(want)
            if fields:
                return protocol.Miss("fingerprint differs", list(fields), best.model.name), [], None
            try:
                fds = [os.dup(fd) for fd in best.fds]   # the reply owns these; our copies stay ours
            except OSError as e:
                return protocol.Error(f"cannot hand out arena fds: {e}", "raise the daemon's fd limit"), [], None
            lease = Lease(self.next_lease, peer.pid, best.model.name, msg.mode, time.time())
            self.next_lease += 1
        reply = protocol.Acquired(lease.id, best.model.name, best.manifest_dict)
        return reply, fds, lease

    def register(self, lease: Lease) -> None:
        """Track a lease whose reply went out; it ends when its process exits."""
        try:
            lease.pidfd = os.pidfd_open(lease.pid)
        except OSError:
            return              # already gone (or not visible in our pid namespace): nothing to track
        with self.lock:
            self.leases[lease.id] = lease

    def reap(self, exited_pidfds: set[int]) -> None:
        with self.lock:
            for lease in [l for l in self.leases.values() if l.pidfd in exited_pidfds]:
                self._drop_lease(lease)

    def release(self, lease_id: int, peer: Peer):
        with self.lock:
            lease = self.leases.get(lease_id)
            if lease is None or lease.pid != peer.pid:
                return protocol.Error(f"lease {lease_id} is not held by pid {peer.pid}",
                                      "release only leases your process acquired")
            self._drop_lease(lease)
            if self.on_release == "drop" and lease.model in self.entries:
                self._evict(lease.model, "release")
        return protocol.Report({"released": lease_id, "on_release": self.on_release})

    def evict_request(self, model: str):
        with self.lock:
            if model and model not in self.entries:
                return protocol.Error(f"model {model!r} is not cached on GPU {self.gpu}",
                                      f"cached: {', '.join(self.entries) or 'none'}")
            names = [model] if model else list(self.entries)
            for name in names:
                self._evict(name, "manual")
        return protocol.Report({"evicted": names})

    def record(self, model: str, reason: str, nbytes: int = 0) -> None:
        """An eviction that happened outside a request (e.g. a stored arena the config no longer matches)."""
        with self.lock:
            self.evictions.append({"time": time.time(), "model": model, "reason": reason, "bytes": nbytes,
                                   "leases": 0})

    def _evict(self, name: str, reason: str) -> None:
        entry = self.entries.pop(name)
        self.on_evict(entry)
        for fd in entry.fds:
            os.close(fd)       # engines that mapped it keep it alive until they exit
        self.evictions.append({"time": time.time(), "model": name, "reason": reason, "bytes": entry.nbytes,
                               "leases": sum(1 for l in self.leases.values() if l.model == name)})

    def _drop_lease(self, lease: Lease) -> None:
        self.leases.pop(lease.id, None)
        if lease.pidfd >= 0:
            os.close(lease.pidfd)

    def close(self) -> None:
        with self.lock:
            for lease in list(self.leases.values()):
                self._drop_lease(lease)
            for entry in self.entries.values():
                for fd in entry.fds:
                    os.close(fd)
            self.entries.clear()

    # -- reports -------------------------------------------------------------------------------
    def status(self) -> dict:
        with self.lock:
            return {"gpu": self.gpu, "state": "ready", "device": self.device, "pid": os.getpid(),
                    "models": [{"name": n, "path": e.model.path, "rank": e.manifest.fingerprint.rank,
                                "tensor_parallel_size": e.manifest.fingerprint.tensor_parallel_size,
                                "bytes": e.nbytes, "tensors": len(e.manifest.tensors),
                                "fingerprint": e.manifest.fingerprint.digest()[:16],
                                "fill_seconds": round(e.fill_seconds, 3), "filled_at": e.filled_at}
                               for n, e in self.entries.items()],
                    "leases": [{k: v for k, v in asdict(l).items() if k != "pidfd"} for l in self.leases.values()]}

    def fingerprints(self) -> dict:
        with self.lock:
            return {"gpu": self.gpu, "models": [{"name": n, "path": e.model.path,
                                                 "digest": e.manifest.fingerprint.digest(), "bytes": e.nbytes,
                                                 "fingerprint": e.manifest.fingerprint.to_dict()}
                                                for n, e in self.entries.items()]}

    def eviction_list(self) -> dict:
        with self.lock:
            return {"gpu": self.gpu, "evictions": list(self.evictions)}

    def pidfds(self) -> list[int]:
        with self.lock:
            return [l.pidfd for l in self.leases.values()]

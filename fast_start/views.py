"""What the daemon's cache reports (`fast-start status`, `fingerprints`, `metrics`, `evictions`):
read-only views of a `Cache`, each taken under its lock. A peer that is not an admin sees neither
model paths nor other users' leases and kept artifacts.
"""
from __future__ import annotations

import os

from . import __version__, memory, reports
from .cache import MODEL_STATES, Cache
from .trust import Peer


def report(cache: Cache, kind: str, peer: Peer | None = None):
    """The report a request of `kind` (one of KINDS) asks for."""
    return REPORTS[kind](cache, peer)


def status(cache: Cache, peer: Peer | None = None) -> reports.Status:
    """What is cached, pending and leased (each lease with its process's GPU memory), the
    device's memory, reloads, kept artifacts and failovers."""
    admin = peer is None or peer.admin
    now, used = memory.of(cache.device), memory.by_process(cache.device)
    with cache.lock:
        missing = [cache.pending.get(n) or reports.Missing(n, "missing")
                   for n in cache.configured if n not in cache.entries]
        models = [reports.CachedModel(
            name=n, rank=e.manifest.fingerprint.rank, tensor_parallel_size=e.manifest.fingerprint.tensor_parallel_size,
            bytes=e.nbytes, tensors=len(e.manifest.tensors), fingerprint=e.manifest.fingerprint.digest()[:16],
            fill_seconds=round(e.fill_seconds, 3), filled_at=e.filled_at, adopted=e.adopted,
            arenas=len(e.manifest.arenas), path=e.model.path if admin else None, note=cache.notes.get(n))
            for n, e in cache.entries.items()]
        leases = [l._replace(gpu_bytes=used.get(l.pid)) for l in cache.leases.held.values()
                  if admin or l.uid == peer.uid]
        return reports.Status(gpu=cache.gpu, state="ready" if not missing else "incomplete", pid=os.getpid(),
                              models=models, missing=missing, leases=leases, device=cache.device,
                              version=__version__, started_at=cache.started, reloads=cache.reloads,
                              reload_error=cache.reload_error, reload_began=cache.reload_began,
                              memory=_memory(cache, now), artifacts=cache.events.kept(None if admin else peer.uid),
                              failovers=cache.leases.failovers, last_failover=cache.leases.last_failover)


def _memory(cache: Cache, now: memory.Memory | None) -> reports.Memory:
    """The device's total and free memory (None where they cannot be told) and what this
    daemon holds of it, under the lock."""
    return reports.Memory(held=sum(e.nbytes for e in cache.entries.values()), keep_free=cache.keep_free,
                          total=now.total if now else None, free=now.free if now else None)


def fingerprints(cache: Cache, peer: Peer | None = None) -> reports.Fingerprints:
    admin = peer is None or peer.admin
    with cache.lock:
        models = [reports.ModelFingerprint(name=n, digest=e.manifest.fingerprint.digest(), bytes=e.nbytes,
                                           fingerprint=e.manifest.fingerprint.to_dict(), files=e.files,
                                           path=e.model.path if admin else None)
                  for n, e in cache.entries.items()]
        return reports.Fingerprints(cache.gpu, cache.on_release, models)


def metric_samples(cache: Cache, peer: Peer | None = None) -> reports.Metrics:
    """The counters, and the gauges read off the cache now."""
    now = memory.of(cache.device)
    with cache.lock:
        gauges = [cache.metrics.sample("fast_start_cached_bytes", e.nbytes, model=name)
                  for name, e in cache.entries.items()]
        gauges += [cache.metrics.sample("fast_start_leases", cache.leases.on(name), model=name)
                   for name in cache.entries]
        gauges += [cache.metrics.sample("fast_start_device_memory_bytes", value, kind=kind)
                   for kind, value in _memory(cache, now)._asdict().items()
                   if kind != "keep_free" and value is not None]
        for name in cache.configured:
            state = cache.locked_state(name)
            gauges += [cache.metrics.sample("fast_start_model_state", int(s == state), model=name, state=s)
                       for s in MODEL_STATES]
    gauges += [cache.metrics.sample("fast_start_up", 1), cache.metrics.sample("fast_start_build_info", 1,
                                                                           version=__version__)]
    return reports.Metrics(cache.gpu, cache.metrics.samples() + gauges)


def evictions(cache: Cache, peer: Peer | None = None) -> reports.Evictions:
    return reports.Evictions(cache.gpu, cache.history.listed())


REPORTS = {"status": status, "fingerprints": fingerprints, "evictions": evictions, "metrics": metric_samples}
KINDS = tuple(REPORTS)

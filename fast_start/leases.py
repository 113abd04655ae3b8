"""Leases: which engine processes hold which cached models, tracked by one pidfd per process.

No client can make the daemon run out of file descriptors: a process's leases share its pidfd,
a process that asks again for a model it already maps in `zero_copy` gets its lease back, a
process holds at most `MAX_LEASES_PER_PROCESS` leases, a uid has leases in at most
`Limits.processes_per_uid` processes, and all processes together fit the daemon's fd budget.

Each lease carries its engine's role, as the engine's worker says it (`assign`): serving, a
standby asleep (vLLM's sleep mode), waking. A standby that wakes to serve after the serving
engine of its model died is a failover, timed from that death as the pidfd told it.

Not locked itself: the cache calls it under its own lock.
"""
from __future__ import annotations

import logging
import os
import select
import time
from dataclasses import dataclass, field
from typing import Callable

from . import protocol
from .reports import Failover, Lease
from .trust import Peer

log = logging.getLogger("fast_start.daemon")
MAX_LEASES_PER_PROCESS = 64


@dataclass
class Process:
    """An engine process holding leases; its pidfd becomes readable when it exits."""
    pid: int
    uid: int
    pidfd: int
    leases: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class Limits:
    processes: int = 4096           # engine processes with leases, all users (one pidfd each)
    processes_per_uid: int = 256


class Leases:
    def __init__(self, limits: Limits = Limits(), on_process: Callable[[int], None] = lambda pidfd: None):
        self.limits, self.on_process = limits, on_process     # on_process: watch a new pidfd
        self.held: dict[int, Lease] = {}
        self.procs: dict[int, Process] = {}
        self.next_id = 1
        self.deaths: dict[str, tuple[float, int]] = {}     # model -> (time, pid) its serving engine last died
        self.asleep: dict[int, float] = {}      # lease -> when its engine last went to standby
        self.failovers, self.last_failover = 0, None

    def take(self, peer: Peer, model: str, mode: str, where: str) -> Lease | protocol.Error:
        """A lease for `peer` on `model`: its existing zero_copy one, or a new one (tracked where
        the process could be; one already gone holds nothing). `where` names the daemon in errors."""
        proc = self.procs.get(peer.pid)
        if proc is not None:
            if mode == "zero_copy":
                for lid in proc.leases:
                    if self.held[lid].model == model and self.held[lid].mode == mode:
                        return self.held[lid]
            if len(proc.leases) >= MAX_LEASES_PER_PROCESS:
                return protocol.Error(f"pid {peer.pid} holds {len(proc.leases)} leases on {where}, the most "
                                      "one process may hold", "release copy-mode leases, or reuse fetched weights")
        else:
            if sum(1 for p in self.procs.values() if p.uid == peer.uid) >= self.limits.processes_per_uid:
                return protocol.Error(f"uid {peer.uid} has leases in {self.limits.processes_per_uid} processes, the "
                                      "most one user may have", "end engine processes that no longer need the cache")
            if len(self.procs) >= self.limits.processes:
                return protocol.Error(f"the daemon tracks {len(self.procs)} engine processes, its limit",
                                      "raise LimitNOFILE= of the unit, or end engine processes")
            try:
                pidfd = os.pidfd_open(peer.pid) if peer.pid > 0 else -1
            except ProcessLookupError:
                pidfd = -1              # already gone: nothing to track
            except OSError as e:
                return protocol.Error(f"cannot track pid {peer.pid}: {e.strerror}", "raise LimitNOFILE= of the unit")
            if pidfd >= 0:
                proc = self.procs[peer.pid] = Process(peer.pid, peer.uid, pidfd)
                self.on_process(pidfd)
        lease = Lease(self.next_id, peer.pid, peer.uid, model, mode, time.time())
        self.next_id += 1
        if proc is not None:
            proc.leases.add(lease.id)
            self.held[lease.id] = lease
        return lease

    def drop(self, lease: Lease) -> None:
        """End `lease`; its process's pidfd closes with its last lease."""
        self.held.pop(lease.id, None)
        self.asleep.pop(lease.id, None)
        proc = self.procs.get(lease.pid)
        if proc is not None:
            proc.leases.discard(lease.id)
            if not proc.leases:
                del self.procs[lease.pid]
                os.close(proc.pidfd)

    def exited(self, pidfd: int) -> None:
        """`pidfd` became readable: if its process really exited, end all its leases."""
        poll = select.poll()
        poll.register(pidfd, select.POLLIN)
        if not poll.poll(0):
            return              # a stale event for an fd number already reused
        proc = next((p for p in self.procs.values() if p.pidfd == pidfd), None)
        if proc is not None:
            ended = sorted(proc.leases)
            for lid in ended:
                if self.held[lid].role == "serving":
                    self.deaths[self.held[lid].model] = (time.time(), proc.pid)
                self.drop(self.held[lid])
            log.info("pid %d (uid %d) exited: lease(s) %s ended", proc.pid, proc.uid, ", ".join(map(str, ended)))

    def assign(self, lease_id: int, pid: int, role: str) -> Failover | protocol.Error | None:
        """Lease `lease_id`'s engine now has `role`, as pid `pid` (its holder) says: the failover
        it ends, if it does."""
        lease = self.held.get(lease_id)
        if lease is None or lease.pid != pid:
            return protocol.Error(f"lease {lease_id} is not held by pid {pid}", "say the role of a lease your "
                                  "process acquired")
        if role not in protocol.ROLES:
            return protocol.Error(f"{role!r} is not a role", f"say one of {', '.join(protocol.ROLES)}")
        now, failover = time.time(), None
        died, dead = self.deaths.get(lease.model, (0.0, 0))
        if role == "standby":
            self.asleep[lease_id] = now
        elif role == "serving" and lease.role != "serving" and died > self.asleep.get(lease_id, now):
            failover = Failover(lease.model, dead, pid, round(now - died, 3), now)
            self.failovers, self.last_failover = self.failovers + 1, failover
            del self.deaths[lease.model]
        self.held[lease_id] = lease._replace(role=role)
        return failover

    def on(self, model: str) -> int:
        """How many leases `model` has."""
        return sum(1 for lease in self.held.values() if lease.model == model)

    def close(self) -> None:
        for lease in list(self.held.values()):
            self.drop(lease)

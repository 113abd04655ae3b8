"""Serving `gpu<N>.sock`: who is let in, how many connections each user may hold, and deadlines.

A peer's role is decided from the credentials of its connect (`SO_PEERCRED`, `SO_PEERGROUPS`)
before a byte is read: *admin* (root, the daemon's own user, or a member of `admin_groups`),
*engine* (listed in `allowed_uids` or a member of `allowed_groups`), or refused with a reply
that says why. Each admitted connection is served by a thread of its own: one that is already
waiting for it where there is one (starting a thread took a quarter of a millisecond of every
engine's fetch), else a new one. A thread that has served its connection waits up to
`WAIT_S` for the next, and one always waits. No client can lock others out:

- at most `MAX_CONNECTIONS_PER_UID` connections per user and `limits.connections` in all
  (from the fd budget), each refusal a reply naming the limit;
- a connection waits at most `IDLE_S` for a request to begin, and a request (or a reply) must
  be complete within `FRAME_S`: a peer trickling a byte a second is cut off;
- descriptors sent to the daemon are discarded by the kernel (`protocol.recv`).
"""
from __future__ import annotations

import collections
import logging
import os
import queue
import select
import socket
import threading
from dataclasses import dataclass

from . import protocol, transport, trust
from .cache import Cache
from .config import DaemonConfig

log = logging.getLogger("fast_start.daemon")
IDLE_S = 10.0
FRAME_S = 10.0
MAX_CONNECTIONS_PER_UID = 64
WAIT_S = 60.0               # how long a thread with no connection waits for one before it ends
THREAD_NAME = "fast-start-connection"


@dataclass(frozen=True)
class Policy:
    """Who may connect (from the config); replaced as a whole on reload."""
    allowed_uids: frozenset[int] = frozenset()
    allowed_gids: frozenset[int] = frozenset()
    admin_gids: frozenset[int] = frozenset()

    @classmethod
    def of(cls, daemon: DaemonConfig) -> "Policy":
        return cls(frozenset(daemon.allowed_uids), daemon.gids("allowed_groups"), daemon.gids("admin_groups"))

    def role(self, peer: trust.Peer) -> trust.Peer | None:
        """`peer` with its role set, or None when it may not connect at all."""
        if peer.uid in (0, os.geteuid()) or peer.groups & self.admin_gids:
            return peer._replace(admin=True)
        if peer.uid in self.allowed_uids or peer.groups & self.allowed_gids:
            return peer
        return None


class Server:
    def __init__(self, cache: Cache, policy: Policy, max_connections: int):
        self.cache, self.policy, self.max_connections = cache, policy, max_connections
        self.open: collections.Counter[int] = collections.Counter()     # uid -> open connections
        self.lock = threading.Lock()
        self.handoff: queue.SimpleQueue = queue.SimpleQueue()           # admitted (conn, peer) for waiting threads
        self.waiting = 0            # threads waiting on `handoff`: each takes one connection or ends

    def start(self) -> None:
        """Start the thread that waits for the first connection (as serving begins). It is counted
        once it runs: a connection admitted before that gets a thread of its own."""
        threading.Thread(target=self.serve_connections, name=THREAD_NAME, daemon=True).start()
        with self.lock:
            self.waiting += 1

    def admit(self, conn: socket.socket) -> None:
        """A freshly accepted connection: refuse it with a reason, or serve it in a thread."""
        creds = trust.peer(conn)
        peer = self.policy.role(creds)
        if peer is None:
            log.warning("refused connection from pid %d uid %d", creds.pid, creds.uid)
            self.cache.metrics.inc("fast_start_refused_peers_total")
            return _refuse(conn, protocol.Error(f"uid {creds.uid} may not use this daemon",
                                                "run as the daemon's user or list it in allowed_uids"))
        with self.lock:
            if self.open[peer.uid] >= MAX_CONNECTIONS_PER_UID:
                why = (f"uid {peer.uid} has {MAX_CONNECTIONS_PER_UID} connections open to this daemon, the most "
                       "one user may have")
            elif sum(self.open.values()) >= self.max_connections:
                why = f"the daemon serves {self.max_connections} connections, its limit"
            else:
                why = None
                self.open[peer.uid] += 1
                handed = self.waiting > 0
                if handed:
                    self.waiting -= 1
                    self.handoff.put((conn, peer))
        if why:
            log.warning("refused connection from pid %d uid %d: %s", peer.pid, peer.uid, why)
            self.cache.metrics.inc("fast_start_refused_peers_total")
            return _refuse(conn, protocol.Error(why, "close idle connections and retry"))
        if not handed:
            try:
                threading.Thread(target=self.serve_connections, args=((conn, peer),), name=THREAD_NAME,
                                 daemon=True).start()
            except RuntimeError as e:       # no thread to be had (TasksMax=): this one is refused, others served
                self.closed(peer)
                log.warning("refused connection from pid %d uid %d: cannot start a thread (%s)", peer.pid, peer.uid, e)
                _refuse(conn, protocol.Error("the daemon cannot start a thread for this connection",
                                             "raise TasksMax= of the unit, or close idle connections"))

    def serve_connections(self, first: tuple[socket.socket, trust.Peer] | None = None) -> None:
        """A connection thread: serve `first`, then each connection handed over, until none came
        for `WAIT_S` while another thread waits too."""
        item = first
        while True:
            if item is None:
                item = self.next_connection()
                if item is None:
                    return
            self.connection(*item)
            item = None
            with self.lock:
                self.waiting += 1

    def next_connection(self) -> tuple[socket.socket, trust.Peer] | None:
        """The connection handed to this waiting thread; None when it may end instead."""
        while True:
            try:
                return self.handoff.get(timeout=WAIT_S)
            except queue.Empty:
                pass
            with self.lock:          # `admit` hands over under the lock: what it counted on us for is there
                try:
                    return self.handoff.get_nowait()
                except queue.Empty:
                    if self.waiting > 1:
                        self.waiting -= 1
                        return None

    def connection(self, conn: socket.socket, peer: trust.Peer) -> None:
        try:
            # An engine's request follows its connection within a millisecond (it reads the
            # checkpoint's headers meanwhile): it is watched for awake, at most `AWAKE_S`.
            first = select.poll()
            first.register(conn, select.POLLIN)
            transport.stay_awake(first, transport.AWAKE_S)
            while True:
                conn.settimeout(IDLE_S)
                try:
                    msg, _ = protocol.recv(conn, protocol.MAX_REQUEST, protocol.REQUESTS, accept_fds=False,
                                           frame_timeout=FRAME_S)
                except protocol.FramingError as e:
                    conn.settimeout(FRAME_S)
                    protocol.send(conn, protocol.Error(e.what, e.fix))
                    return
                except protocol.ProtocolError as e:
                    conn.settimeout(FRAME_S)
                    protocol.send(conn, protocol.Error(e.what, e.fix))
                    continue
                if msg is None:
                    return
                self.answer(conn, msg, peer)
        except OSError:
            pass            # the peer went away or stalled: nothing of ours is left half-done
        finally:
            conn.close()
            self.closed(peer)

    def closed(self, peer: trust.Peer) -> None:
        with self.lock:
            self.open[peer.uid] -= 1
            if not self.open[peer.uid]:
                del self.open[peer.uid]

    def answer(self, conn: socket.socket, msg, peer: trust.Peer) -> None:
        try:
            reply, fds, done = self.cache.handle(msg, peer)
        except Exception:           # a bug must cost one reply, never the daemon
            log.exception("request %s from pid %d failed", msg.kind, peer.pid)
            reply, fds, done = protocol.Error(f"the daemon failed on a {msg.kind!r} request",
                                              "see the daemon's log"), [], lambda sent: None
        sent = False
        try:
            conn.settimeout(FRAME_S)
            protocol.send(conn, reply, fds)
            sent = True
        finally:
            done(sent)


def _refuse(conn: socket.socket, error: protocol.Error) -> None:
    """Tell a refused peer why, then close; the client reads this even if its request fails to send."""
    try:
        conn.settimeout(1.0)
        protocol.send(conn, error)
        conn.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    conn.close()

"""Serving `gpu<N>.sock`: who is let in, how many connections each user may hold, and deadlines.

A peer's role is decided from the credentials of its connect (`SO_PEERCRED`, `SO_PEERGROUPS`)
before a byte is read, and again, under the config of the moment (a reload may revoke a uid), at
each request: *admin* (root, the daemon's own user, or a member of `admin_groups`), *engine*
(listed in `allowed_uids` or a member of `allowed_groups`), or refused with a reply that says
why. Each admitted connection is served by a thread of its own: one that is already waiting for
it where there is one (starting a thread took a quarter of a millisecond of every engine's
fetch), else a new one. A thread that has served its connection waits up to `WAIT_S` for the
next, and one always waits. No client can lock others out:

- a user holds at most `MAX_CONNECTIONS_PER_UID` connections and all users `max_connections`
  (from the fd budget), of which `ADMIN_RESERVE` only admins may take. A connection that finds
  a limit reached closes the longest-idle connection (waiting for a request for `REAP_AFTER_S` or
  more: never one an engine has just opened) of its own user, or of the user holding the most;
  only where none is idle is it refused, with a reply naming the limit;
- a connection waits at most `request_timeout_s` (the config's) for a request to begin, and a
  request (or a reply) must be complete within it: a peer trickling a byte a second is cut off;
- descriptors sent to the daemon are discarded by the kernel (`protocol.recv`);
- the artifacts a `Keep` sends after its frame must all arrive within the request timeout and a
  second for each `UPLOAD_RATE` bytes, and a Keep refused before they were read closes the
  connection (the stream is out of step);
- descriptors sent *by* the daemon and not yet received are bounded per connection, per uid and
  in all (`inflight.py`): a peer that asks and never reads cannot stop fd passing for others.
"""
from __future__ import annotations

import errno
import logging
import os
import queue
import select
import socket
import threading
import time
from dataclasses import dataclass

from . import artifact_store as artifacts, protocol, reports, transport, trust, views
from .cache import Cache
from .config import DaemonConfig
from .inflight import InFlight

log = logging.getLogger("fast_start.daemon")
MAX_CONNECTIONS_PER_UID = 64
ADMIN_RESERVE = 8           # of max_connections, for admins only (root's status gets in)
REAP_AFTER_S = 1.0          # a connection idle this long may be closed to make room for a new one
UPLOAD_RATE = 32 << 20     # bytes/s of a Keep's artifacts a peer must at least send
WAIT_S = 60.0               # how long a thread with no connection waits for one before it ends
THREAD_NAME = "fast-start-connection"


@dataclass(frozen=True)
class Policy:
    """Who may connect, and for how long a request may take (from the config); replaced as a
    whole on reload."""
    allowed_uids: frozenset[int] = frozenset()
    allowed_gids: frozenset[int] = frozenset()
    admin_gids: frozenset[int] = frozenset()
    timeout_s: float = 10.0        # for a request to begin on an idle connection, and for a frame to complete

    @classmethod
    def of(cls, daemon: DaemonConfig) -> "Policy":
        return cls(frozenset(daemon.allowed_uids), daemon.gids("allowed_groups"), daemon.gids("admin_groups"),
                   float(daemon.request_timeout_s))

    def role(self, peer: trust.Peer) -> trust.Peer | None:
        """`peer` with its role set, or None when it may not connect at all."""
        if peer.uid in (0, os.geteuid()) or peer.groups & self.admin_gids:
            return peer._replace(admin=True)
        if peer.uid in self.allowed_uids or peer.groups & self.allowed_gids:
            return peer
        return None


class Server:
    def __init__(self, cache: Cache, policy: Policy, max_connections: int, inflight: InFlight,
                 kept: artifacts.Artifacts):
        self.cache, self.policy, self.max_connections, self.inflight = cache, policy, max_connections, inflight
        self.artifacts = kept
        # uid -> its open connections, each with when it began to wait for a request (None: busy)
        self.open: dict[int, dict[socket.socket, float | None]] = {}
        self.lock = threading.Lock()
        self.handoff: queue.SimpleQueue = queue.SimpleQueue()           # admitted (conn, peer) for waiting threads
        self.waiting = 0            # threads waiting on `handoff`: each takes one connection or ends

    def start(self) -> None:
        """Start the thread that waits for the first connection (as serving begins). It is counted
        once it runs: a connection admitted before that gets a thread of its own."""
        threading.Thread(target=self.serve_connections, name=THREAD_NAME, daemon=True).start()
        with self.lock:
            self.waiting += 1

    def accept(self, listener: socket.socket) -> None:
        """Admit every connection waiting on `listener` (the daemon's loop saw it readable)."""
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
                self.admit(conn)
            except OSError:
                conn.close()

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
            why = self._room(peer)
            if why is None:
                self.open.setdefault(peer.uid, {})[conn] = time.monotonic()
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
                self.closed(conn, peer.uid)
                log.warning("refused connection from pid %d uid %d: cannot start a thread (%s)", peer.pid, peer.uid, e)
                _refuse(conn, protocol.Error("the daemon cannot start a thread for this connection",
                                             "raise TasksMax= of the unit, or close idle connections"))

    def _room(self, peer: trust.Peer) -> str | None:
        """Make room for a connection of `peer` (under the lock): None, or why there is none."""
        mine = self.open.get(peer.uid, {})
        if len(mine) >= MAX_CONNECTIONS_PER_UID and not self._reap([peer.uid]):
            return (f"uid {peer.uid} has {MAX_CONNECTIONS_PER_UID} connections open to this daemon, the most one "
                    "user may have, and none of them idle")
        limit = self.max_connections - (0 if peer.admin else min(ADMIN_RESERVE, self.max_connections // 2))
        if sum(map(len, self.open.values())) >= limit and \
                not self._reap(sorted(self.open, key=lambda uid: -len(self.open[uid]))):
            return f"the daemon serves {limit} connections, its limit, and none of them idle"
        return None

    def _reap(self, uids: list[int]) -> bool:
        """Close the longest-idle connection of the first of `uids` that has one idle for
        REAP_AFTER_S (under the lock); its thread sees its end. False if there is none."""
        now = time.monotonic()
        for uid in uids:
            idle = [(since, id(c), c) for c, since in self.open.get(uid, {}).items()
                    if since is not None and now - since >= REAP_AFTER_S]
            if idle:
                _, _, conn = min(idle)
                self._forget(conn, uid)
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                log.info("closed an idle connection of uid %d to make room for a new one", uid)
                return True
        return False

    def _forget(self, conn: socket.socket, uid: int) -> bool:
        mine = self.open.get(uid, {})
        if mine.pop(conn, False) is False:
            return False
        if not mine:
            del self.open[uid]
        return True

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
        creds = peer
        try:
            # An engine's request follows its connection within a millisecond (it reads the
            # checkpoint's headers meanwhile): it is watched for awake, at most `AWAKE_S`.
            first = select.poll()
            first.register(conn, select.POLLIN)
            transport.stay_awake(first, transport.AWAKE_S)
            while True:
                if not self._waits(conn, creds.uid, True):
                    return              # closed to make room for another
                timeout = self.policy.timeout_s
                conn.settimeout(timeout)
                try:
                    msg, _ = protocol.recv(conn, protocol.MAX_REQUEST, protocol.REQUESTS, accept_fds=False,
                                           frame_timeout=timeout)
                except protocol.FramingError as e:
                    conn.settimeout(timeout)
                    protocol.send(conn, protocol.Error(e.what, e.fix))
                    return
                except protocol.ProtocolError as e:
                    conn.settimeout(timeout)
                    protocol.send(conn, protocol.Error(e.what, e.fix))
                    continue
                if msg is None or not self._waits(conn, creds.uid, False):
                    return
                peer = self.policy.role(peer._replace(admin=False))     # as the config says now (a reload)
                if peer is None:
                    conn.settimeout(timeout)
                    protocol.send(conn, protocol.Error(f"uid {creds.uid} may no longer use this daemon",
                                                       "run as the daemon's user or list it in allowed_uids"))
                    return
                if not self.answer(conn, msg, peer):
                    return
        except OSError:
            pass            # the peer went away or stalled: nothing of ours is left half-done
        finally:
            self.closed(conn, creds.uid)
            self.inflight.close(conn)

    def _waits(self, conn: socket.socket, uid: int, waiting: bool) -> bool:
        """Mark `conn` as waiting for a request, or busy with one; False if it was closed to make room."""
        with self.lock:
            mine = self.open.get(uid, {})
            if conn not in mine:
                return False
            mine[conn] = time.monotonic() if waiting else None
            return True

    def closed(self, conn: socket.socket, uid: int) -> None:
        with self.lock:
            self._forget(conn, uid)

    def answer(self, conn: socket.socket, msg, peer: trust.Peer) -> bool:
        """Reply to `msg`; False if the connection is out of step (bytes it sent are left unread)."""
        upload = _upload(conn, msg.size, self.policy.timeout_s) if isinstance(msg, protocol.Keep) else None
        try:
            if msg.kind in protocol.ARTIFACTS:
                reply, fds, done = self.artifacts.handle(msg, peer, upload)
            elif msg.kind in views.KINDS:
                reply, fds, done = protocol.Report(reports.body(views.report(self.cache, msg.kind, peer))), [], \
                    lambda sent: None
            else:
                reply, fds, done = self.cache.handle(msg, peer)
        except artifacts.Cut:
            raise
        except Exception:           # a bug must cost one reply, never the daemon
            log.exception("request %s from pid %d failed", msg.kind, peer.pid)
            reply, fds, done = protocol.Error(f"the daemon failed on a {msg.kind!r} request",
                                              "see the daemon's log"), [], lambda sent: None
        full = self.inflight.room(conn, peer.uid, len(fds)) if fds else None
        if full:
            done(False)
            reply, fds, done = protocol.Error(full, "read each reply before asking again, and close connections you "
                                              "do not use"), [], lambda sent: None
        sent = False
        try:
            conn.settimeout(self.policy.timeout_s)
            protocol.send(conn, reply, fds)
            sent = True
        finally:
            done(sent)
        if fds:
            self.inflight.sent_on(conn, peer.uid, len(fds))
        return not (upload and upload.left)


def _upload(conn: socket.socket, size: int, timeout: float) -> artifacts.Upload:
    """The `size` bytes after a Keep frame, read from `conn`: all of them within `timeout` and a
    second for each `UPLOAD_RATE` bytes, so that a trickling peer cannot hold its thread."""
    deadline = time.monotonic() + timeout + max(0, size) / UPLOAD_RATE

    def read(n: int) -> bytes:
        conn.settimeout(max(0.001, deadline - time.monotonic()))
        return conn.recv(n)
    return artifacts.Upload(read, max(0, size))


def _refuse(conn: socket.socket, error: protocol.Error) -> None:
    """Tell a refused peer why, then close; the client reads this even if its request fails to send."""
    try:
        conn.settimeout(1.0)
        protocol.send(conn, error)
        conn.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    conn.close()

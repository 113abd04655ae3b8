"""Descriptors in flight: sent over a Unix socket to a peer that has not received them yet.

The kernel charges a descriptor in flight to the *sender's* user and, past that user's
RLIMIT_NOFILE, refuses every SCM_RIGHTS send of the user (ETOOMANYREFS): to every peer, from every
GPU's daemon (they share the service user), the fill workers' sends included. A peer that asks
and never reads could so stop fd passing for everyone. The daemon bounds what it has in flight:
a connection carries at most one unread reply with descriptors, one uid at most `per_uid`
descriptors and all peers together `total` (a share of the limit; a reply larger than a bound
still goes out when nothing else is in flight). A reply counts as received once its bytes have
left the socket's send queue (SIOCOUTQ 0: the peer read it, or closed and the kernel dropped it).
Closing our end frees nothing that waits in the peer's queue, so a connection closed with such a
reply unread is kept open here until it is.
"""
from __future__ import annotations

import fcntl
import logging
import socket
import struct
import termios
import threading

log = logging.getLogger("fast_start.daemon")


class InFlight:
    def __init__(self, total: int, per_uid: int):
        self.total, self.per_uid = total, per_uid
        self.sent: dict[socket.socket, tuple[int, int]] = {}     # conn -> (uid, fds of its unread reply)
        self.closed: set[socket.socket] = set()                  # kept open until their reply is read
        self.over: set[int] = set()                             # uids refused (logged once) until they read
        self.lock = threading.Lock()

    def room(self, conn: socket.socket, uid: int, n: int) -> str | None:
        """Why a reply of `n` descriptors to `uid` on `conn` may not go out now, or None."""
        with self.lock:
            self._settle()
            if conn in self.sent:
                return "this connection's last reply with descriptors is still unread"
            mine = sum(k for u, k in self.sent.values() if u == uid)
            everyone = sum(k for _, k in self.sent.values())
            if mine and mine + n > self.per_uid:
                if uid not in self.over:
                    self.over.add(uid)
                    log.warning("uid %d holds %d descriptors sent and unread, the most one user may: its further "
                                "replies with descriptors are refused until it reads them", uid, mine)
                return (f"uid {uid} has {mine} descriptors sent and not yet received, the most one user may "
                        f"have ({self.per_uid})")
            if everyone and everyone + n > self.total:
                return f"the daemon has {everyone} descriptors sent and not yet received, its limit ({self.total})"
        return None

    def sent_on(self, conn: socket.socket, uid: int, n: int) -> None:
        with self.lock:
            self.sent[conn] = (uid, n)

    def close(self, conn: socket.socket) -> None:
        """Close `conn`, or keep it open until the reply it carries is read."""
        with self.lock:
            self._settle()
            if conn in self.sent:
                self.closed.add(conn)
                return
        conn.close()

    def _settle(self) -> None:
        """Forget replies that were read (under the lock); close the kept connections they held."""
        for conn in [c for c in self.sent if _unread(c) == 0]:
            uid, _ = self.sent.pop(conn)
            if conn in self.closed:
                self.closed.discard(conn)
                conn.close()
            if all(u != uid for u, _ in self.sent.values()):
                self.over.discard(uid)


def _unread(conn: socket.socket) -> int:
    """Bytes `conn` sent that its peer has not read (SIOCOUTQ); 0 once the socket is closed."""
    try:
        return struct.unpack("i", fcntl.ioctl(conn, termios.TIOCOUTQ, bytes(4)))[0]
    except (OSError, ValueError):
        return 0

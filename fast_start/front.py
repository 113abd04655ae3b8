"""The public address of an engine that has a standby: `python -m fast_start.front FD`.

The supervisor binds the address once and hands this process its listening socket (fd FD). It
says on stdin which engine serves (`serve PATH`, the engine's Unix socket) or that none does
(`hold`). Each accepted connection is joined to the serving engine's socket and its bytes copied
both ways until the engine's side ends. While none serves (a failover), a new connection waits
here, none is refused, and goes to the next engine that serves. The end of stdin (the supervisor
gone) ends this process; stop signals do not. Stdlib only: it imports no engine.
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import threading

CHUNK = 1 << 16


class Front:
    def __init__(self, listener: socket.socket):
        self.listener = listener
        self.target: str | None = None
        self.changed = threading.Condition()

    def serve(self, target: str | None) -> None:
        """The engine whose socket new connections join from now on; None: hold them."""
        with self.changed:
            self.target = target
            self.changed.notify_all()

    def accept_forever(self) -> None:
        while True:
            client, _ = self.listener.accept()
            threading.Thread(target=self.join, args=(client,), daemon=True).start()

    def engine(self) -> socket.socket:
        """A connection to the serving engine, waited for while none serves or it no longer listens."""
        while True:
            with self.changed:
                self.changed.wait_for(lambda: self.target is not None)
                target = self.target
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                upstream.connect(target)
                return upstream
            except OSError:         # it died: the supervisor names the next one (a 1 s look again, to be sure)
                upstream.close()
                with self.changed:
                    self.changed.wait_for(lambda: self.target != target, timeout=1.0)

    def join(self, client: socket.socket) -> None:
        """Copy the client's bytes to the engine and back; the engine's end (its answer done, or its
        death) ends the connection."""
        with client:
            with self.engine() as upstream:
                asking = threading.Thread(target=copy, args=(client, upstream), daemon=True)
                asking.start()
                copy(upstream, client)
                for s in (client, upstream):
                    _shutdown(s, socket.SHUT_RDWR)
                asking.join()


def copy(src: socket.socket, dst: socket.socket) -> None:
    """src's bytes to dst until src ends, then dst's writing side ends too (a half-close passed on)."""
    try:
        while data := src.recv(CHUNK):
            dst.sendall(data)
    except OSError:
        pass
    _shutdown(dst, socket.SHUT_WR)


def _shutdown(s: socket.socket, how: int) -> None:
    try:
        s.shutdown(how)
    except OSError:         # already closed by its peer
        pass


def commands(front: Front, lines) -> None:
    """`serve PATH` and `hold` from the supervisor, one a line."""
    for line in lines:
        verb, _, path = line.strip().partition(" ")
        front.serve(path if verb == "serve" else None)


def main() -> None:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):     # systemd's stop reaches the whole unit:
        signal.signal(sig, signal.SIG_IGN)                          # this ends when the supervisor has
    listener = socket.socket(fileno=int(sys.argv[1]))
    front = Front(listener)
    threading.Thread(target=front.accept_forever, daemon=True).start()
    commands(front, sys.stdin)
    os._exit(0)


if __name__ == "__main__":
    main()

"""Where daemons listen and how to ask them: below both the engine side and the CLI.

`gpu<N>.sock` (the daemon), `gpu<N>.state` (its start-up progress or why it failed) and
`gpu<N>.lock` (one daemon per GPU) live in the socket directory: `socket_dir` of the config,
`$FAST_START_SOCKET_DIR`, or /run/fast-start. `connect` checks the directory, the socket and
the daemon's credentials before a byte is sent (`trust.py`); `request` sends one typed frame and
reads the reply. Stdlib only.
"""
from __future__ import annotations

import os
import select
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from . import protocol, trust
from .errors import FastStartError

DEFAULT_SOCKET_DIR = "/run/fast-start"
AWAKE_S = 0.002     # how long a side watches awake for a message due within a millisecond (`stay_awake`)


def socket_dir(explicit: str | os.PathLike | None = None) -> Path:
    """The socket directory: `explicit`, else `$FAST_START_SOCKET_DIR`, else /run/fast-start."""
    return Path(explicit or os.environ.get("FAST_START_SOCKET_DIR") or DEFAULT_SOCKET_DIR)


def socket_path(directory: str | os.PathLike, gpu: int) -> Path:
    return Path(directory) / f"gpu{gpu}.sock"


def state_path(directory: str | os.PathLike, gpu: int) -> Path:
    return Path(directory) / f"gpu{gpu}.state"


def lock_path(directory: str | os.PathLike, gpu: int) -> Path:
    return Path(directory) / f"gpu{gpu}.lock"


def sockets(directory: Path) -> list[Path]:
    """Every daemon socket in `directory` (none if it is missing or unreadable)."""
    try:       # not Path.glob: it compiles a pattern on every engine start
        return [directory / n for n in sorted(os.listdir(directory)) if n.startswith("gpu") and n.endswith(".sock")]
    except OSError:
        return []


def connect(path: Path, timeout: float) -> socket.socket:
    """A connection to a daemon whose directory, socket and credentials we trust."""
    trusted = trust.TrustedUids()
    trust.check_socket_path(path, trusted)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    conn.settimeout(timeout)
    try:
        conn.connect(str(path))
        server = trust.peer(conn)
        if server.uid not in trusted:
            raise trust.TrustError(f"{path} is served by uid {server.uid}, not a trusted daemon user",
                                   "check which process owns the socket")
    except BaseException:
        conn.close()
        raise
    return conn


def request(conn: socket.socket, msg, with_fds: bool = False, meanwhile: Iterator | None = None,
            first_batch: bool = False):
    """Send one request and return its reply (and fds when asked for); daemon errors raise. An
    Acquired reply's fds are all read, or with `first_batch` only those on its frame (the caller
    reads the rest with `protocol.fd_batches`).
    `meanwhile` is advanced a step at a time while the daemon works on the reply, and left where
    it is once the reply has arrived: its remaining steps are skipped, not waited for. Once it is
    done, the reply is watched for awake (`stay_awake`) before the read blocks.

    A daemon that refuses a peer says why and closes at once, so the request may fail to send
    (EPIPE): the refusal is then still waiting to be read, and is what this raises.
    """
    try:
        protocol.send(conn, msg)
    except (BrokenPipeError, ConnectionResetError):
        reply, _ = protocol.recv(conn, accept_fds=False)
        if isinstance(reply, protocol.Error):
            raise FastStartError(reply.what, reply.fix) from None
        raise
    if meanwhile is not None:
        arrived = select.poll()         # not select.select: an engine's fds may number above 1024
        arrived.register(conn, select.POLLIN)
        for _ in meanwhile:
            if arrived.poll(0):
                break
        else:
            stay_awake(arrived, AWAKE_S)
    reply, fds = protocol.recv(conn)
    if reply is None:
        raise protocol.ProtocolError("the daemon closed the connection", "see the daemon's log")
    if not (with_fds and first_batch):
        fds = protocol.all_fds(conn, reply, fds)        # the stream is in step for the next request
    if isinstance(reply, protocol.Error) or not with_fds:
        for fd in fds:
            os.close(fd)
    if isinstance(reply, protocol.Error):
        raise FastStartError(reply.what, reply.fix)
    return (reply, fds) if with_fds else reply


def stay_awake(ready: select.poll, seconds: float) -> bool:
    """Poll `ready` without sleeping for up to `seconds`; whether it fired.

    For a message due within a millisecond, where a thread that sleeps on it takes longer to see it
    (presumably as its CPU idles more deeply): watching this way shortens the reply's wait and
    cuts its tail (BENCHMARKS.md). Each look releases the GIL; after `seconds` the caller's
    blocking read waits as before.
    """
    end = time.monotonic() + seconds
    while not ready.poll(0):
        if time.monotonic() > end:
            return False
    return True

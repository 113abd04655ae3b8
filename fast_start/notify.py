"""sd_notify written against the protocol, with the stdlib only.

A datagram to `$NOTIFY_SOCKET` (a path, or `@name` for an abstract socket) carrying
newline-separated `KEY=VALUE` assignments, optionally with file descriptors (`SCM_RIGHTS`) for
systemd's fd store. When the variable is unset (not run by systemd) every call is a no-op.
Sending never raises: a manager that went away must not take the daemon's shutdown with it; nor
does it wait longer than `TIMEOUT_S` for one whose queue is full (a datagram to a socket nobody
reads blocks once ten wait there): a stuck manager must not stall the requests that notify it.
"""
from __future__ import annotations

import array
import os
import socket

LISTEN_FDS_START = 3
TIMEOUT_S = 1.0


def notify(message: str, fds: list[int] | tuple[int, ...] = ()) -> bool:
    """Send `message` (e.g. "READY=1\\nSTATUS=ready"); False when there is no manager or it is gone."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.settimeout(TIMEOUT_S)
            s.sendmsg([message.encode("utf-8")], ancillary, 0, addr)
    except OSError:
        return False
    return True


def status(text: str) -> bool:
    # One line: systemd shows STATUS= as-is, and a newline would start a new assignment.
    return notify("STATUS=" + " ".join(text.split()))


def watchdog_interval() -> float | None:
    """Seconds between WATCHDOG=1 pings (half of WATCHDOG_USEC), or None when not armed for us."""
    usec, pid = os.environ.get("WATCHDOG_USEC"), os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 2e6


def listen_fds() -> list[tuple[str, int]]:
    """(name, fd) pairs systemd passed to this process (`LISTEN_FDS`, checked against `LISTEN_PID`)."""
    if os.environ.get("LISTEN_PID") != str(os.getpid()):
        return []
    n = int(os.environ.get("LISTEN_FDS", "0"))
    names = os.environ.get("LISTEN_FDNAMES", "").split(":") if n else []
    names += ["unknown"] * (n - len(names))
    return [(names[i], LISTEN_FDS_START + i) for i in range(n)]

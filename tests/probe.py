"""Ask a running daemon (a `harness.Daemon`) what it holds, and wait for what it will hold."""
from __future__ import annotations

import time

from fast_start import protocol
from fast_start.transport import connect, request


def ask(d, msg) -> dict:
    with connect(d.socket, 5) as conn:
        request(conn, protocol.Hello(protocol.VERSION))
        return request(conn, msg).body


def status(d) -> dict:
    return ask(d, protocol.Status())


def evictions(d) -> list[tuple[str, str]]:
    """(model, reason) of every eviction the daemon recorded."""
    return [(e["model"], e["reason"]) for e in ask(d, protocol.Evictions())["evictions"]]


def wait_until(cond, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} not met in {timeout} s"
        time.sleep(0.1)

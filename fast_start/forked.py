"""An engine forked from a warm interpreter: what both supervisors (`supervise`, `standby`) share.

The engine runs in a forked child of its own process group with default signals (`child`); the
supervisor forks it with the stops held (`stops_held`), is the subreaper of what it leaves
(`children`), forwards `STOPS` to it, counts its failures in a window (`Failures`) and writes
one journal line per event (`say`). Stdlib only.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
import traceback
from collections import deque

WINDOW_S = 600
STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)      # forwarded to the engine; no restart follows


def say(line: str) -> None:
    """One line in one write: the engine writes to the same journal stream at the same time."""
    sys.stderr.write(f"fast-start: {line}\n")
    sys.stderr.flush()


@contextlib.contextmanager
def stops_held():
    """The stop signals blocked while an engine is forked and recorded: one that comes meanwhile
    waits, then reaches the engine too. One whose handler ran just before the block does not: the
    caller checks for it inside, and forks no engine that would never be told to stop."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPS)


def own_group(pid: int) -> None:
    """Put the forked engine in its own process group from the supervisor's side too (it does so
    itself in `child`): a stop forwarded at once reaches the group."""
    try:
        os.setpgid(pid, pid)
    except OSError:
        pass


def child(main, argv: list[str], first: str) -> None:
    """The forked engine: its own process group, default signals, `argv` as its command line. It says
    `first` itself, so that the line comes whole before the engine's own output (an unbuffered
    engine writes a line's text and its newline apart, and the supervisor's line could fall between)."""
    code = 1
    try:
        os.setpgid(0, 0)
        say(first)
        for sig in STOPS:       # blocked since before the fork: none reached the supervisor's handler here
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPS)
        sys.argv = argv
        result = main()
        code = result if isinstance(result, int) else 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):      # closed by the engine
                pass
        os._exit(code)


def children() -> list[int]:
    """The supervisor's living children (an engine's orphans are reparented here)."""
    out = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                out += [int(p) for p in f.read().split()]
        except OSError:
            continue
    return out


class Failures:
    """An engine's failures within the last `WINDOW_S`."""

    def __init__(self):
        self.times: deque[float] = deque()

    def add(self) -> int:
        """Count one now: how many the window holds."""
        now = time.monotonic()
        self.times.append(now)
        while now - self.times[0] > WINDOW_S:
            self.times.popleft()
        return len(self.times)

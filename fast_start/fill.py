"""The daemon's side of the fill worker: start the child, hand it typed jobs, relay its reports.

Jobs go to the child as frames over a socketpair, never on its command line: a manifest set
re-verified after a restart runs to megabytes (a 128-expert MoE shard alone is ~4 MB of JSON),
far past Linux's 128 KiB limit on one argument.
"""
from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

from . import notify, protocol
from .errors import FastStartError

EXTEND_USEC = 30_000_000   # each EXTEND_TIMEOUT_USEC promises the next message within 30 s
STALL_S = 300              # a worker with no progress for this long is declared hung
REPORTS = ("progress", "filled", "verified", "error")


class FillError(FastStartError):
    """The fill worker failed or stalled."""


def worker_env(cpus_share: int) -> dict[str, str]:
    """The fill worker's environment: its share of the CPUs for torch's thread pool.

    Every GPU's daemon fills at boot, at once; each worker's OpenMP pool defaults to every CPU,
    and N pools spinning on the same cores made a fill 10x slower on two H200s (1565 small
    expert tensors: 10.6 s against 1.1 s). An OMP_NUM_THREADS set by the operator wins.
    """
    env = dict(os.environ)
    env.pop("LISTEN_FDS", None)
    env.pop("LISTEN_FDNAMES", None)
    env.pop("LISTEN_PID", None)
    if "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // max(1, cpus_share)))
    return env


def run(jobs: list, env: dict[str, str], stop: threading.Event, pass_fds: list[int] = (),
        starting: bool = False) -> Iterator[tuple[object, list[int]]]:
    """Run a worker child on `jobs`, yielding its reports (message, fds) until it is done.

    While `starting`, each second extends systemd's start timeout; a worker silent for
    `STALL_S` is killed, as is one still running when `stop` is set.
    """
    ours, theirs = socket.socketpair()
    proc = subprocess.Popen([sys.executable, "-m", "fast_start.worker", str(theirs.fileno())],
                            pass_fds=[theirs.fileno(), *pass_fds], env=env)
    theirs.close()
    finished = False
    try:
        for job in jobs:
            protocol.send(ours, job)
        ours.shutdown(socket.SHUT_WR)
        poll = select.poll()
        poll.register(ours, select.POLLIN)
        last_progress = time.monotonic()
        while True:
            if stop.is_set():
                raise FillError("stopped during the fill", "start the daemon again")
            if starting:
                notify.notify(f"EXTEND_TIMEOUT_USEC={EXTEND_USEC}")
            if not poll.poll(1000):
                if time.monotonic() - last_progress > STALL_S:
                    raise FillError(f"the fill made no progress for {STALL_S} s", "check the model's storage")
                continue
            msg, fds = protocol.recv(ours, allowed=REPORTS)
            last_progress = time.monotonic()
            if msg is None:
                code = proc.wait()
                if code:
                    raise FillError(f"the fill worker exited with code {code}", "see the traceback in the log")
                finished = True
                return
            if isinstance(msg, protocol.Error):
                raise FillError(msg.what, msg.fix)
            yield msg, fds
    except OSError as e:
        raise FillError(f"lost the fill worker: {e}", "see the daemon's log") from None
    finally:
        ours.close()
        if not finished and proc.poll() is None:
            proc.kill()
        proc.wait()

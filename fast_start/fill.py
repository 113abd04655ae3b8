"""The daemon's side of the fill worker: start it with the engine's interpreter, check that it
speaks this protocol, hand it typed jobs one at a time, relay its reports.

Jobs go to the child as frames over a socketpair, never on its command line: a manifest set
re-verified after a restart runs to megabytes (a 128-expert MoE shard alone is ~4 MB of JSON),
far past Linux's 128 KiB limit on one argument. Arena fds ride on the frames.
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

from . import __version__, notify, protocol
from .errors import CheckpointError, ConfigError, FastStartError

EXTEND_USEC = 30_000_000   # each EXTEND_TIMEOUT_USEC promises the next message within 30 s
STALL_S = 300              # a worker with no progress for this long is declared hung
FRAME_S = 20               # a frame begun must be complete by then (within EXTEND_USEC)
HELLO_S = 120              # an interpreter that has not introduced itself by then is not a worker
REPORTS = ("progress", "checked", "filled", "verified", "error")
FINAL = (protocol.Checked, protocol.Filled, protocol.Verified)
ANSWER = {"check_job": protocol.Checked, "fill_job": protocol.Filled, "verify_job": protocol.Verified}


class FillError(FastStartError):
    """The fill worker failed, stalled, or is not a worker of this protocol."""


def worker_env(cpus_share: int) -> dict[str, str]:
    """The fill worker's environment: its share of the CPUs for torch's thread pool.

    Every GPU's daemon fills at boot, at once; each worker's OpenMP pool defaults to every CPU,
    and N pools spinning on the same cores slow every fill several times over (most of all a
    model of many small expert tensors). An OMP_NUM_THREADS set by the operator wins.

    Its output is the daemon's log: progress bars (tqdm's, vLLM's loading bars) are off, since a
    journal holds them as blobs of carriage returns; the daemon reports the fill's progress itself.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("LISTEN_FDS", "LISTEN_FDNAMES", "LISTEN_PID")}
    if "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // max(1, cpus_share)))
    env.setdefault("TQDM_DISABLE", "1")
    return env


class Worker:
    """One worker child (`python -m fast_start.worker`) of the interpreter `python`.

    Raises `FillError` with one line naming both interpreters and both versions when the child
    does not speak this daemon's protocol. While `starting`, every second of a job extends
    systemd's start timeout. A job whose `Progress` has not advanced for `STALL_S` (silent, or
    repeating itself), or whose frame stops half-way for `FRAME_S`, is declared hung, as is one
    that answers out of protocol: the child is killed when the session closes, as on `stop`, and
    never given another job. So is one `busy` with a job whose answer nobody read to its end (its
    caller failed mid-fill): its stream is out of step. Descriptors ride on `Filled` frames only:
    any others are closed as they arrive.
    """

    def __init__(self, python: str, env: dict[str, str], stop: threading.Event, starting: bool = False):
        self.python, self.stop, self.starting = python, stop, starting
        self.hung = self.busy = False
        self.sock, theirs = socket.socketpair()
        try:
            # cwd "/": `python -m` puts the working directory first on sys.path, and the worker must
            # import its own environment's fast_start, not one that happens to lie where we run.
            self.proc = subprocess.Popen([python, "-m", "fast_start.worker", str(theirs.fileno())], cwd="/",
                                         pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL)
        except OSError as e:
            self.sock.close()
            raise FillError(f"cannot start the fill worker {python}: {e.strerror or e}",
                            "set worker_python (or the model's python) to an interpreter with fast-start") from None
        finally:
            theirs.close()
        self.poll = select.poll()
        self.poll.register(self.sock, select.POLLIN)
        try:
            self.hello = self._hello()
        except BaseException:
            self.close()
            raise

    def _hello(self) -> protocol.WorkerHello:
        # Said by the daemon and by the CLI (verify --deep): name the interpreter, not the role.
        ours = f"{sys.executable} here runs fast-start {__version__}, protocol {protocol.VERSION}"
        fix = f"fast-start install-engine {self.python}"
        why = None
        if not self._wait(HELLO_S):
            why = f"said nothing in {HELLO_S} s"
        else:
            try:
                msg, _ = protocol.recv(self.sock, allowed=("worker_hello",))
            except (protocol.ProtocolError, OSError) as e:
                msg, why = None, f"sent no hello ({e})"
            if msg is None and why is None:
                why = f"exited with code {self.proc.wait()}"
            if msg is not None and msg.protocol != protocol.VERSION:
                raise FillError(f"the fill worker {self.python} runs fast-start {msg.version}, protocol {msg.protocol}, "
                                "and " + ours, fix)
            if msg is not None:
                return msg
        raise FillError(f"the fill worker {self.python} did not answer as fast-start ({why}); " + ours, fix)

    def _wait(self, seconds: float) -> bool:
        """Wait up to `seconds` for a frame, extending systemd's start timeout meanwhile."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.stop.is_set():
                raise FillError("stopped during the fill", "start the daemon again")
            if self.starting:
                notify.notify(f"EXTEND_TIMEOUT_USEC={EXTEND_USEC}")
            if self.poll.poll(1000):
                return True
        return False

    def run(self, job, fds: list[int] = ()) -> Iterator[tuple[object, list[int]]]:
        """Send `job` (with `fds`), yield its reports up to and including the final one."""
        try:
            self.busy = True
            protocol.send(self.sock, job, fds)
            advanced, done = time.monotonic(), -1
            while True:
                if not self._wait(max(0.0, advanced + STALL_S - time.monotonic())):
                    raise self._declare_hung(f"the fill made no progress for {STALL_S} s", "check the model's storage")
                try:
                    msg, got = protocol.recv(self.sock, allowed=REPORTS, frame_timeout=FRAME_S)
                except protocol.ProtocolError as e:
                    raise self._declare_hung(f"the fill worker {self.python} sent a bad frame: {e.what}",
                                             "see the daemon's log; the worker is stopped") from None
                if msg is None:
                    raise FillError(f"the fill worker exited with code {self.proc.wait()}",
                                    "see the traceback in the log")
                other = getattr(msg, "model", job.model) != job.model       # an Error names none
                wrong = other or isinstance(msg, FINAL) and not isinstance(msg, ANSWER[job.kind])
                if got and (wrong or not isinstance(msg, protocol.Filled)):
                    for fd in got:
                        os.close(fd)
                    got = []
                if isinstance(msg, protocol.Error):
                    self.busy = False
                    raise (ConfigError if msg.config else CheckpointError if msg.checkpoint else FillError)(
                        msg.what, msg.fix)
                if wrong:
                    raise self._declare_hung(f"the fill worker {self.python} answered {job.model!r}'s {job.kind} with "
                                             f"a {msg.kind}" + (f" on {msg.model!r}" if other else ""),
                                             "see the daemon's log; the worker is stopped")
                self.busy = not isinstance(msg, FINAL)
                if not isinstance(msg, protocol.Progress) or msg.done > done:
                    advanced, done = time.monotonic(), getattr(msg, "done", done)
                yield msg, got
                if isinstance(msg, FINAL):
                    return
        except OSError as e:
            raise FillError(f"lost the fill worker: {e}", "see the daemon's log") from None

    def _declare_hung(self, what: str, fix: str) -> FillError:
        self.hung = True
        return FillError(what, fix)

    def close(self) -> None:
        """End the session: the child sees the end of its stream and exits; a stuck one is killed."""
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        self.sock.close()
        if self.stop.is_set() or self.hung or self.busy:
            self.proc.kill()          # it would not look at its socket before it is done, if ever
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "Worker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Workers:
    """Fill workers by interpreter, each started on first use and again if it died."""

    def __init__(self, env: dict[str, str], stop: threading.Event, starting: bool = False):
        self.env, self.stop, self.starting = env, stop, starting
        self.sessions: dict[str, Worker] = {}

    def get(self, python: str) -> Worker:
        w = self.sessions.get(python)
        if w is None or w.hung or w.busy or w.proc.poll() is not None:
            if w is not None:
                w.close()
            w = self.sessions[python] = Worker(python, self.env, self.stop, self.starting)
        return w

    def close(self) -> None:
        for w in self.sessions.values():
            w.close()
        self.sessions.clear()

    def __enter__(self) -> "Workers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

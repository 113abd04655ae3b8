"""A daemon process under a real NOTIFY_SOCKET listener, as systemd runs it.

The demo, the benchmarks and the tests start daemons through this module: `NotifyListener`
receives sd_notify datagrams the way systemd does (and records, for each, whether the daemon's
socket existed when it arrived); `Daemon` runs `fast-start daemon --gpu N` with it.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from fast_start.config import tomllib


class NotifyListener:
    """Receives sd_notify datagrams like systemd does; records each with what was true at arrival."""

    def __init__(self, path: Path, watch: Path | None = None):
        self.path, self.watch = path, watch
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.messages: list[tuple[float, str, bool]] = []   # (time, text, watched path existed)
        self.store: dict[str, int] = {}                      # the fd store, as systemd keeps it
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.done.is_set():
            try:
                data, anc, _, _ = self.sock.recvmsg(65536, socket.CMSG_SPACE(64 * 4))
            except socket.timeout:
                continue
            exists = bool(self.watch and self.watch.exists())
            fds = [fd for _, kind, payload in anc if kind == socket.SCM_RIGHTS
                   for fd in memoryview(payload).cast("i")]
            fields = dict(line.split("=", 1) for line in data.decode().split("\n") if "=" in line)
            name = fields.get("FDNAME", "stored")
            if fields.get("FDSTOREREMOVE") == "1" and name in self.store:
                os.close(self.store.pop(name))
            for fd in fds:
                if fields.get("FDSTORE") == "1" and name not in self.store:
                    self.store[name] = fd
                else:
                    os.close(fd)
            for line in data.decode().split("\n"):
                self.messages.append((time.monotonic(), line, exists))

    def texts(self, prefix: str = "") -> list[str]:
        return [m for _, m, _ in self.messages if m.startswith(prefix)]

    def wait_for(self, text: str, timeout: float = 60.0) -> tuple[float, str, bool]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for m in self.messages:
                if m[1].startswith(text):
                    return m
            time.sleep(0.05)
        raise AssertionError(f"no {text!r} within {timeout} s; got {self.texts()}")

    def close(self):
        self.done.set()
        self.thread.join()
        self.sock.close()
        for fd in self.store.values():
            os.close(fd)
        self.store.clear()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(path: Path, socket_dir: Path, models: list[dict], device: str = "cpu", **daemon) -> Path:
    lines = ["[daemon]", f'socket_dir = "{socket_dir}"', f'device = "{device}"']
    lines += [f"{k} = {_toml(v)}" for k, v in daemon.items()]
    for m in models:        # a dict value: the model's [model.<key>] table (an engine's settings)
        lines += ["", "[[model]]"] + [f"{k} = {_toml(v)}" for k, v in m.items() if not isinstance(v, dict)]
        for table, values in ((k, v) for k, v in m.items() if isinstance(v, dict)):
            lines += [f"[model.{table}]"] + [f"{k} = {_toml(v)}" for k, v in values.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def _toml(v) -> str:
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    return str(v).lower() if isinstance(v, bool) else str(v)


# Puts the given fds at 3, 4, ... and sets LISTEN_PID to its own pid, then execs the daemon.
_LISTEN = """
import os, sys
given = [int(fd) for fd in sys.argv[1].split(",")]
moved = [os.dup(fd) for fd in given]            # increasing, each >= its target: no clobbering
for i, fd in enumerate(moved):
    if fd != 3 + i:
        os.dup2(fd, 3 + i)
    os.set_inheritable(3 + i, True)     # dup2 onto itself would leave close-on-exec set
for fd in given:
    if fd >= 3 + len(given):
        os.close(fd)
os.environ["LISTEN_PID"] = str(os.getpid())
os.execv(sys.argv[2], sys.argv[2:])
"""


class Daemon:
    """`fast-start daemon --gpu N` as a real process with its own NOTIFY_SOCKET listener."""
    _count = itertools.count()

    def __init__(self, tmp: Path, config: Path, gpu: int = 0, env: dict | None = None, log=None,
                 listen: dict[str, int] | None = None, rlimits: dict[int, int] | None = None,
                 cwd: Path | None = None, python: str = sys.executable, wrap: tuple[str, ...] = ()):
        """`listen`: FDNAME -> fd handed to the daemon as systemd does (LISTEN_FDS, from fd 3 on).
        `rlimits`: resource limits of the daemon (and its workers), e.g. {RLIMIT_NOFILE: 1024}.
        `cwd`: where it runs; `python -m` imports fast-start from there first (a benchmark's
        baseline tree). `python`: the daemon's interpreter (its fill workers are the config's).
        `wrap`: a command the daemon runs under (`setpriv ...` to drop root's capabilities)."""
        self.config, self.gpu = config, gpu
        # Read the socket directory without validating: tests start daemons on bad configs on purpose.
        self.socket_dir = Path(tomllib.loads(config.read_text())["daemon"]["socket_dir"])
        self.socket = self.socket_dir / f"gpu{gpu}.sock"
        self.listener = NotifyListener(tmp / f"notify-{gpu}-{time.monotonic_ns()}", self.socket)
        self.log = Path(log or tmp / f"daemon-{gpu}-{next(self._count)}.log")
        full_env = {**os.environ, "NOTIFY_SOCKET": str(self.listener.path), **(env or {})}
        command = [*wrap, python, "-m", "fast_start.cli", "daemon", "--gpu", str(gpu), "--config", str(config)]
        listen = listen or {}
        if listen:
            full_env.update(LISTEN_FDS=str(len(listen)), LISTEN_FDNAMES=":".join(listen))
            command = [sys.executable, "-c", _LISTEN, ",".join(map(str, listen.values())), *command]
        with open(self.log, "w") as log_file:
            def limit():
                for which, value in (rlimits or {}).items():
                    resource.setrlimit(which, (value, value))
            self.proc = subprocess.Popen(command, env=full_env, stdout=log_file, stderr=subprocess.STDOUT, cwd=cwd,
                                         pass_fds=list(listen.values()), preexec_fn=limit)

    def wait_ready(self, timeout: float = 120.0) -> "Daemon":
        """Until the daemon says READY=1; an AssertionError with its log once it has exited or
        `timeout` has passed without a word from it. Each message it sends (STATUS= progress,
        EXTEND_TIMEOUT_USEC=) starts the wait afresh, as it extends systemd's: a fill slowed down
        by a busy machine is waited for while it advances."""
        deadline, heard = time.monotonic() + timeout, 0
        while True:
            try:
                self.listener.wait_for("READY=1", min(1.0, max(0.0, deadline - time.monotonic())))
                return self
            except AssertionError:
                if len(self.listener.messages) > heard:
                    heard, deadline = len(self.listener.messages), time.monotonic() + timeout
                if self.proc.poll() is not None or time.monotonic() >= deadline:
                    state = f"exited {self.proc.returncode}" if self.proc.poll() is not None else "not ready"
                    raise AssertionError(f"daemon {state}; log:\n{self.log.read_text()}") from None

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.listener.close()
        return self.proc.returncode


@contextlib.contextmanager
def serving(*daemons: Daemon):
    """Daemons started together: each waited for until ready, all stopped on the way out."""
    try:
        for d in daemons:
            d.wait_ready()
        yield daemons
    finally:
        for d in daemons:
            d.stop()

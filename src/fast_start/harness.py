"""A daemon process under a real NOTIFY_SOCKET listener, as systemd runs it.

The demo, the benchmarks and the tests start daemons through this module: `NotifyListener`
receives sd_notify datagrams the way systemd does (and records, for each, whether the daemon's
socket existed when it arrived); `Daemon` runs `fast-start daemon --gpu N` with it.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from .config import tomllib


class NotifyListener:
    """Receives sd_notify datagrams like systemd does; records each with what was true at arrival."""

    def __init__(self, path: Path, watch: Path | None = None):
        self.path, self.watch = path, watch
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.messages: list[tuple[float, str, bool]] = []   # (time, text, watched path existed)
        self.fds: list[int] = []
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
            for _level, kind, payload in anc:
                if kind == socket.SCM_RIGHTS:
                    self.fds += list(memoryview(payload).cast("i"))
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
        for fd in self.fds:
            os.close(fd)


def write_config(path: Path, socket_dir: Path, models: list[dict], **daemon) -> Path:
    lines = ["[daemon]", f'socket_dir = "{socket_dir}"', 'device = "cpu"']
    lines += [f"{k} = {_toml(v)}" for k, v in daemon.items()]
    for m in models:
        lines += ["", "[[model]]"] + [f"{k} = {_toml(v)}" for k, v in m.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def _toml(v) -> str:
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    return str(v).lower() if isinstance(v, bool) else str(v)


class Daemon:
    """`fast-start daemon --gpu N` as a real process with its own NOTIFY_SOCKET listener."""

    def __init__(self, tmp: Path, config: Path, gpu: int = 0, env: dict | None = None, log=None):
        self.config, self.gpu = config, gpu
        # Read the socket directory without validating: tests start daemons on bad configs on purpose.
        self.socket_dir = Path(tomllib.loads(config.read_text())["daemon"]["socket_dir"])
        self.socket = self.socket_dir / f"gpu{gpu}.sock"
        self.listener = NotifyListener(tmp / f"notify-{gpu}-{time.monotonic_ns()}", self.socket)
        self.log = Path(log or tmp / f"daemon-{gpu}.log")
        full_env = {**os.environ, "NOTIFY_SOCKET": str(self.listener.path), **(env or {})}
        self.proc = subprocess.Popen([sys.executable, "-m", "fast_start.cli", "daemon", "--gpu", str(gpu),
                                      "--config", str(config)], env=full_env,
                                     stdout=open(self.log, "w"), stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 120.0) -> "Daemon":
        try:
            self.listener.wait_for("READY=1", timeout)
        except AssertionError:
            raise AssertionError(f"daemon not ready; log:\n{self.log.read_text()}") from None
        return self

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

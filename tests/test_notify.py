"""sd_notify against a real datagram listener: path and abstract sockets, fds, no-op when unset."""
from __future__ import annotations

import os
import socket

from fast_start import notify


def listener(addr: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(addr)
    s.settimeout(5)
    return s


def test_path_socket_with_utf8_status(tmp_path, monkeypatch):
    s = listener(str(tmp_path / "n"))
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "n"))
    assert notify.status("filling modèle\nrank 1")
    assert s.recv(4096).decode() == "STATUS=filling modèle rank 1"


def test_abstract_socket(monkeypatch):
    name = f"fast-start-test-{os.getpid()}"
    s = listener("\0" + name)
    monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
    assert notify.notify("READY=1")
    assert s.recv(4096) == b"READY=1"


def test_fds_are_passed(tmp_path, monkeypatch):
    s = listener(str(tmp_path / "n"))
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "n"))
    fd = os.memfd_create("x")
    os.write(fd, b"payload")
    notify.notify("FDSTORE=1\nFDNAME=arena", [fd])
    os.close(fd)
    msg, fds, _, _ = socket.recv_fds(s, 4096, 4)
    assert msg == b"FDSTORE=1\nFDNAME=arena" and len(fds) == 1
    assert os.pread(fds[0], 7, 0) == b"payload"
    os.close(fds[0])


def test_unset_is_a_no_op(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify.notify("READY=1") is False


def test_watchdog_interval_is_half(monkeypatch):
    monkeypatch.setenv("WATCHDOG_USEC", "4000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert notify.watchdog_interval() == 2.0
    monkeypatch.setenv("WATCHDOG_PID", "1")
    assert notify.watchdog_interval() is None

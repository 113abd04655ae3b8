"""Who may connect: peer credentials, socket-directory and socket checks on both sides."""
from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

import fast_start
from fast_start.errors import CacheMiss
from fast_start.harness import write_config

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
NOBODY = pwd.getpwnam("nobody")

# Connects as nobody and prints what the daemon answered.
AS_NOBODY = textwrap.dedent("""
    import os, socket, sys
    from fast_start import protocol
    os.setgroups([]); os.setgid(int(sys.argv[2])); os.setuid(int(sys.argv[3]))
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(sys.argv[1])
    protocol.send(s, protocol.Hello(protocol.VERSION))
    reply, _ = protocol.recv(s)
    print(reply.kind, getattr(reply, "what", ""))
""")


def model(path):
    return {"name": "small", "path": str(path), "gpus": [0], "engine_version": "test"}


def connect_as_nobody(sock_path) -> str:
    # Open the path up so that only SO_PEERCRED stands between nobody and the daemon.
    os.chmod(sock_path.parent, 0o711)
    os.chmod(sock_path, 0o666)
    p = subprocess.run([sys.executable, "-c", AS_NOBODY, str(sock_path), str(NOBODY.pw_gid), str(NOBODY.pw_uid)],
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert p.returncode == 0, p.stderr
    return p.stdout.strip()


@pytest.fixture
def open_dir():
    """A directory another uid can traverse (pytest's own tmp folders are private)."""
    d = tempfile.mkdtemp(prefix="fast-start-sec-")
    os.chmod(d, 0o711)
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


@root_only
def test_connection_from_another_uid_is_refused(tmp_path, open_dir, small, daemons):
    d = daemons(write_config(tmp_path / "fs.toml", open_dir / "run", [model(small)]))
    assert connect_as_nobody(d.socket).startswith("error uid 65534 may not use this daemon")
    os.chmod(d.socket, 0o600)
    assert fast_start.fetch(fast_start.WeightSpec(str(small), engine_version="test"),
                            socket_dir=str(open_dir / "run"), fallback=False).source == "cache"


@root_only
def test_allowed_uid_is_served(tmp_path, open_dir, small, daemons):
    d = daemons(write_config(tmp_path / "fs.toml", open_dir / "run", [model(small)], allowed_uids=[NOBODY.pw_uid]))
    assert connect_as_nobody(d.socket) == "welcome"


@pytest.mark.parametrize("problem,message", [("world_writable", "group- or world-writable"),
                                             ("foreign", "not by the daemon's uid"),
                                             ("symlink", "is a symlink")])
def test_daemon_refuses_an_unsafe_socket_directory(tmp_path, small, daemons, problem, message):
    run = tmp_path / "run"
    if problem == "symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        run.symlink_to(tmp_path / "elsewhere")
    else:
        run.mkdir(mode=0o700)
        if problem == "world_writable":
            os.chmod(run, 0o777)
        elif os.geteuid() == 0:
            os.chown(run, NOBODY.pw_uid, NOBODY.pw_gid)
        else:
            pytest.skip("needs root to give the directory away")
    d = daemons(write_config(tmp_path / "fs.toml", run, [model(small)]), wait=False)
    assert d.proc.wait(60) != 0
    assert message in d.log.read_text()
    assert not d.listener.texts("READY=1")


def test_daemon_refuses_a_symlink_where_its_socket_goes(tmp_path, small, daemons):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    (run / "gpu0.sock").symlink_to(tmp_path / "target")
    d = daemons(write_config(tmp_path / "fs.toml", run, [model(small)]), wait=False)
    assert d.proc.wait(120) != 0
    assert "exists and is not a socket" in d.log.read_text()


def test_client_refuses_symlinked_socket_and_unsafe_directories(tmp_path, small, daemons):
    d = daemons(write_config(tmp_path / "fs.toml", tmp_path / "run", [model(small)]))
    spec = fast_start.WeightSpec(str(small), engine_version="test")
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    (other / "gpu0.sock").symlink_to(d.socket)
    with pytest.raises(CacheMiss, match="is a symlink"):
        fast_start.fetch(spec, socket_dir=str(other), fallback=False)
    os.chmod(tmp_path / "run", 0o777)
    with pytest.raises(CacheMiss, match="writable by others"):
        fast_start.fetch(spec, socket_dir=str(tmp_path / "run"), fallback=False)
    assert fast_start.fetch(spec, socket_dir=str(tmp_path / "run")).source == "disk"   # falls back
    os.chmod(tmp_path / "run", 0o700)
    if os.geteuid() == 0:
        os.chown(tmp_path / "run", NOBODY.pw_uid, -1)
        with pytest.raises(CacheMiss, match="owned by uid 65534"):
            fast_start.fetch(spec, socket_dir=str(tmp_path / "run"), fallback=False)
        os.chown(tmp_path / "run", 0, -1)
    assert fast_start.fetch(spec, socket_dir=str(tmp_path / "run"), fallback=False).source == "cache"


def test_socket_is_0600_and_no_abstract_socket_is_created(tmp_path, small, daemons):
    d = daemons(write_config(tmp_path / "fs.toml", tmp_path / "run", [model(small)]))
    assert os.stat(d.socket).st_mode & 0o777 == 0o600
    assert os.stat(d.socket.parent).st_mode & 0o777 == 0o700
    inodes = set()
    for fd in os.listdir(f"/proc/{d.proc.pid}/fd"):
        target = os.readlink(f"/proc/{d.proc.pid}/fd/{fd}")
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    with open("/proc/net/unix") as f:
        ours = [line.split() for line in f if line.split()[6] in inodes]
    paths = [row[7] for row in ours if len(row) > 7]
    assert str(d.socket) in paths
    assert not [p for p in paths if p.startswith("@")]

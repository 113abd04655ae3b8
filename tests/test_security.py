"""Who may connect: peer credentials, socket-directory and socket checks on both sides."""
from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import fast_start
from fast_start.errors import CacheMiss
from devtools.harness import write_config

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
NOBODY = pwd.getpwnam("nobody")
USERS = grp.getgrnam("users").gr_gid

# Runs a snippet as nobody (with the given supplementary groups); prints what it prints.
AS_NOBODY = textwrap.dedent("""
    import json, os, select, socket, sys
    import fast_start, fast_start.client       # import all before the interpreter's own folder is out of reach
    from fast_start import protocol
    from fast_start.transport import connect, request
    os.setgroups(json.loads(sys.argv[2])); os.setgid(65534); os.setuid(65534)
    sock, what = sys.argv[1], sys.argv[3]
    try:
        if what == "hello":
            with connect(sock, 5) as conn:
                print(request(conn, protocol.Hello(protocol.VERSION)).kind)
        elif what == "late hello":        # send only after the daemon's refusal and close are in
            with connect(sock, 5) as conn:
                p = select.poll(); p.register(conn, select.POLLRDHUP)
                assert p.poll(10_000)
                print(request(conn, protocol.Hello(protocol.VERSION)).kind)
        elif what in ("evict", "fill"):
            with connect(sock, 5) as conn:
                request(conn, protocol.Hello(protocol.VERSION))
                ask = protocol.Evict("small") if what == "evict" else protocol.Fill("small")
                print(request(conn, ask).body)
        elif what.startswith("status"):        # "status FOLDER": fetch it, then ask for the status
            w = fast_start.fetch(fast_start.WeightSpec(what.split()[1], engine_version="test"),
                                 socket_dir=os.path.dirname(sock), fallback=False)
            with connect(sock, 5) as conn:
                request(conn, protocol.Hello(protocol.VERSION))
                print(json.dumps(request(conn, protocol.Status()).body))
        else:                             # a fetch of the checkpoint folder `what`
            w = fast_start.fetch(fast_start.WeightSpec(what, engine_version="test"),
                                 socket_dir=os.path.dirname(sock), fallback=False)
            print(w.source)
    except fast_start.FastStartError as e:
        print("error", e)
""")


def model(path):
    return {"name": "small", "path": str(path), "gpus": [0], "engine_version": "test"}


def as_nobody(sock_path, what: str = "hello", groups=()) -> str:
    p = subprocess.run([sys.executable, "-c", AS_NOBODY, str(sock_path), json.dumps(list(groups)), what],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    return p.stdout.strip()


def readable_copy(small, open_dir) -> Path:
    """The checkpoint where another user can read it."""
    folder = shutil.copytree(small, open_dir / "model")
    folder.chmod(0o755)
    for f in folder.iterdir():
        f.chmod(0o644)
    return folder


@root_only
@pytest.mark.parametrize("when", ["hello", "late hello"])
def test_a_refused_peer_is_told_why(tmp_path, open_dir, small, daemons, when):
    d = daemons(write_config(tmp_path / "fs.toml", open_dir / "run", [model(small)], allowed_uids=[12345]))
    assert as_nobody(d.socket, when).startswith("error uid 65534 may not use this daemon")
    assert fast_start.fetch(fast_start.WeightSpec(str(small), engine_version="test"),
                            socket_dir=str(open_dir / "run"), fallback=False).source == "cache"


@root_only
def test_a_refused_operator_gets_one_line_from_the_cli(tmp_path, open_dir, small, daemons):
    cfg = write_config(open_dir / "fs.toml", open_dir / "run", [model(small)], allowed_uids=[12345])
    cfg.chmod(0o644)
    daemons(cfg)
    p = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                        Path(sys.executable).parent / "fast-start", "status", "--config", cfg],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 3 and "Traceback" not in p.stderr
    assert p.stderr.strip() == ("error: GPU 0: uid 65534 may not use this daemon (fix: run as the daemon's user "
                                "or list it in allowed_uids)")


@root_only
def test_an_allowed_uid_fetches_from_the_cache(tmp_path, open_dir, small, daemons):
    folder = readable_copy(small, open_dir)
    d = daemons(write_config(tmp_path / "fs.toml", open_dir / "run", [model(folder)], allowed_uids=[NOBODY.pw_uid]))
    assert os.stat(d.socket).st_mode & 0o777 == 0o666 and os.stat(d.socket.parent).st_mode & 0o777 == 0o755
    assert as_nobody(d.socket, str(folder)) == "cache"


@root_only
def test_engines_may_not_evict_or_see_others_and_admin_groups_may(tmp_path, open_dir, small, daemons):
    folder = readable_copy(small, open_dir)
    d = daemons(write_config(tmp_path / "fs.toml", open_dir / "run", [model(folder)], allowed_groups=["nogroup"],
                             admin_groups=["users"]))
    fast_start.fetch(fast_start.WeightSpec(str(folder), engine_version="test"), socket_dir=str(open_dir / "run"))
    assert as_nobody(d.socket, str(folder)) == "cache"          # a member of nogroup is an engine
    seen = json.loads(as_nobody(d.socket, f"status {folder}"))
    assert "path" not in seen["models"][0]
    assert [l["uid"] for l in seen["leases"]] == [NOBODY.pw_uid]   # root's lease is not shown
    assert as_nobody(d.socket, "evict").startswith("error uid 65534 may not evict")
    assert as_nobody(d.socket, "fill").startswith("error uid 65534 may not fill")
    assert as_nobody(d.socket, "evict", groups=[USERS]) == "{'evicted': ['small']}"
    assert as_nobody(d.socket, "fill", groups=[USERS]) == "{'filling': ['small'], 'cached': []}"


@root_only
def test_an_engine_that_cannot_read_the_checkpoint_gets_a_clear_error(tmp_path, open_dir, small, daemons):
    folder = readable_copy(small, open_dir)
    d = daemons(write_config(tmp_path / "fs.toml", open_dir / "run", [model(folder)], allowed_uids=[NOBODY.pw_uid]))
    (folder / "model.safetensors").chmod(0o600)       # nobody can reach the file, not read it
    out = as_nobody(d.socket, str(folder))
    assert out == (f"error cannot read {folder}/model.safetensors: Permission denied (fix: make the checkpoint "
                   "readable by this process's user (uid 65534))"), out
    folder.chmod(0o700)                               # nor enter the folder
    out = as_nobody(d.socket, str(folder))
    assert out.startswith(f"error cannot read {folder}: Permission denied (fix: make the checkpoint readable"), out


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

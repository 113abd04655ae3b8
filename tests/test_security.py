"""Who may connect: peer credentials, socket-directory and socket checks on both sides."""
from __future__ import annotations

import grp
import json
import os
import pwd
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import fast_start
from fast_start.checkpoint import open_checkpoint
from fast_start.errors import CacheMiss
from fast_start.fingerprint import fingerprint
from fast_start.serve import ADMIN_RESERVE, MAX_CONNECTIONS_PER_UID, REAP_AFTER_S
from fast_start.watch import identity
from devtools.harness import write_config
from probe import status, wait_until

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
REPO = Path(__file__).resolve().parent.parent
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
        elif what.startswith("acquire "):  # an Acquire with the fingerprint and files someone else read
            fp, files = json.loads(what[len("acquire "):])
            with connect(sock, 5) as conn:
                reply, fds = request(conn, protocol.Acquire(fp, "zero_copy", files, protocol.VERSION), with_fds=True)
                print(reply.kind, getattr(reply, "reason", ""), len(fds))
        elif what == "hold":              # a connection kept open, asked again once stdin says so
            with connect(sock, 5) as conn:
                print(request(conn, protocol.Hello(protocol.VERSION)).kind, flush=True)
                sys.stdin.readline()
                print(request(conn, protocol.Status()).kind)
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
                       capture_output=True, text=True, timeout=120, env=ENV)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    return p.stdout.strip()


ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


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


@pytest.mark.slow
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


@root_only
def test_a_foreign_socket_directory_with_live_sockets_is_never_to_be_removed(tmp_path, small, daemons):
    """Root starting a daemon by hand on the unit's directory (another user's, holding the running
    daemons' sockets) is told to start it as the unit does, not to remove the directory."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    live = socket.socket(socket.AF_UNIX)
    live.bind(str(run / "gpu0.sock"))
    os.chown(run, NOBODY.pw_uid, NOBODY.pw_gid)
    d = daemons(write_config(tmp_path / "fs.toml", run, [model(small)]), wait=False, gpu=1)
    assert d.proc.wait(60) == 2
    (line,) = [l for l in d.log.read_text().splitlines() if l.startswith("error")]
    assert line == (f"error: socket directory {run} is owned by uid {NOBODY.pw_uid}, not by the daemon's uid 0, and "
                    "holds gpu0.sock of its daemons (fix: start this daemon as its unit does (systemctl start "
                    "fast-start@N), as that user)")
    assert (run / "gpu0.sock").is_socket()
    live.close()


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


@root_only
def test_a_uid_that_cannot_read_the_checkpoint_gets_no_weights_from_the_cache(tmp_path, open_dir, small, daemons):
    """Knowing a model's fingerprint and its files' identities (`fast-start fingerprints` shows
    them) is not reading it: the daemon serves only an engine that could read the files itself.
    Its misses name no model folder to a peer that is not an admin."""
    secret = shutil.copytree(small, open_dir / "secret")
    secret.chmod(0o700)                                  # root's alone
    folder = readable_copy(small, open_dir)
    cfg = write_config(tmp_path / "fs.toml", open_dir / "run", [model(secret), {**model(folder), "name": "open"}],
                       allowed_uids=[NOBODY.pw_uid])
    d = daemons(cfg)
    asked = []
    for path in (secret, folder):
        fp = fingerprint(fast_start.WeightSpec(str(path), engine_version="test"), open_checkpoint(path)).to_dict()
        asked.append(as_nobody(d.socket, "acquire " + json.dumps([fp, identity(path)])))
    # The reply names no folder to a peer that is not an admin (the log does, for the operator).
    assert asked == ["miss uid 65534 cannot read the model's folder/config.json 0", "acquired  1"]
    assert "miss for pid" in d.log.read_text() and f"cannot read {secret}/config.json" in d.log.read_text()
    fp = fingerprint(fast_start.WeightSpec(str(folder), engine_version="test"), open_checkpoint(folder)).to_dict()
    other = as_nobody(d.socket, "acquire " + json.dumps([fp, {**identity(folder), "extra.safetensors": [1, 2, 3, 4]}]))
    assert other.startswith("miss the engine's checkpoint files are not those the daemon cached from the model's "
                            "folder (extra.safetensors was added)") and str(open_dir) not in other, other
    assert fast_start.fetch(fast_start.WeightSpec(str(secret), engine_version="test"),
                            socket_dir=str(open_dir / "run"), fallback=False).source == "cache"   # root may


@root_only
def test_a_uid_revoked_by_a_reload_is_refused_on_the_connections_it_holds(tmp_path, open_dir, small, daemons):
    folder = readable_copy(small, open_dir)
    cfg = write_config(tmp_path / "fs.toml", open_dir / "run", [model(folder)], allowed_uids=[NOBODY.pw_uid])
    d = daemons(cfg)
    holder = subprocess.Popen([sys.executable, "-c", AS_NOBODY, str(d.socket), "[]", "hold"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    assert holder.stdout.readline().strip() == "welcome"
    write_config(tmp_path / "fs.toml", open_dir / "run", [model(folder)], allowed_uids=[12345])
    d.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: "reloaded" in d.log.read_text(), 60, "the reload")
    out, err = holder.communicate("\n", timeout=60)
    assert out.strip() == ("error uid 65534 may no longer use this daemon (fix: run as the daemon's user or list it "
                           "in allowed_uids)"), err


# Opens up to N connections as uid U and holds them, idle, until stdin closes.
HOLD = textwrap.dedent("""
    import os, socket, sys
    path, uid, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    os.setgroups([]); os.setgid(65534); os.setuid(uid)
    held = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        held.append(s)
    print(len(held), flush=True)
    sys.stdin.read()
""")


@root_only
def test_idle_connections_yield_to_new_ones_and_admins_always_get_in(tmp_path, open_dir, small, daemons):
    """Four users hold every connection they may, idle; root still gets in at once (a reserve), and
    once those are idle for REAP_AFTER_S a user's new connection takes the place of an idle one: its
    own engines fetch from the cache and its status answers."""
    folder = readable_copy(small, open_dir)
    uids = [NOBODY.pw_uid, 65533, 65532, 65531]
    cfg = write_config(tmp_path / "fs.toml", open_dir / "run", [model(folder)], allowed_uids=uids)
    d = daemons(cfg, rlimits={resource.RLIMIT_NOFILE: 1024})
    holders = [subprocess.Popen([sys.executable, "-c", HOLD, str(d.socket), str(uid), str(MAX_CONNECTIONS_PER_UID)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for uid in uids]
    try:
        assert [int(h.stdout.readline()) for h in holders] == [MAX_CONNECTIONS_PER_UID] * 4
        started = time.monotonic()
        r = subprocess.run([Path(sys.executable).parent / "fast-start", "status", "--config", cfg, "--json"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and json.loads(r.stdout)[0]["state"] == "ready", r.stderr
        time.sleep(max(0.0, REAP_AFTER_S - (time.monotonic() - started)) + 0.2)
        assert as_nobody(d.socket, str(folder)) == "cache"
        seen = json.loads(as_nobody(d.socket, f"status {folder}"))
        assert seen["state"] == "ready"
        assert "closed an idle connection of uid" in d.log.read_text()
    finally:
        for h in holders:
            h.communicate("", timeout=30)
    assert ADMIN_RESERVE > 0


# One allowed uid asks over and over and never reads: 60 connections, 20 Acquires pipelined on
# each (zero_copy: its one lease, reused), three times, each after the daemon may close its idle
# connections (`REAP_AFTER_S`) to let in new ones; it holds them open until stdin closes.
HOARDER = textwrap.dedent("""
    import json, os, sys, time
    from fast_start import protocol
    from fast_start.serve import REAP_AFTER_S
    from fast_start.transport import connect
    os.setgroups([]); os.setgid(65534); os.setuid(65534)
    ask = protocol.Acquire(*json.loads(sys.argv[2]), protocol.VERSION)
    held = []
    for _ in range(3):
        for _ in range(60):
            conn = connect(sys.argv[1], 10)
            held.append(conn)
            try:
                for _ in range(20):
                    protocol.send(conn, ask)
            except OSError:         # refused (none of its connections idle yet) or cut off: its bound
                pass
        time.sleep(REAP_AFTER_S + 1)
    print(len(held), flush=True)
    sys.stdin.read()
""")
# The unit's LimitNOFILE, or this machine's hard limit where that is lower (no CAP_SYS_RESOURCE).
UNIT_NOFILE = min(resource.getrlimit(resource.RLIMIT_NOFILE)[1], int(re.search(
    r"^LimitNOFILE=(\d+)$", (REPO / "packaging/systemd/fast-start@.service").read_text(), re.M).group(1)))


@root_only
def test_a_uid_that_never_reads_its_replies_cannot_stop_fd_passing_for_others(tmp_path, open_dir, daemons):
    """Descriptors in flight count against the daemon's user, and past its RLIMIT_NOFILE every send
    of fds fails (ETOOMANYREFS), to anyone. The daemon runs here as the unit runs it: without
    CAP_SYS_RESOURCE, at its LimitNOFILE. A hoarding uid gets its bound and then errors; another
    user's engine still gets the cache, and the daemon names the hoarder once."""
    from fast_start.fingerprint import WeightSpec, fingerprint
    from fast_start.watch import identity
    from devtools import synth
    folder = readable_copy(synth.write_checkpoint(tmp_path / "many", synth.Shape(num_layers=24)), open_dir)
    cfg = write_config(tmp_path / "fs.toml", open_dir / "run", [model(folder)], allowed_uids=[NOBODY.pw_uid],
                       arena_chunk="64KiB")
    d = daemons(cfg, rlimits={resource.RLIMIT_NOFILE: UNIT_NOFILE},
                wrap=("setpriv", "--bounding-set=-all", "--inh-caps=-all"))
    arenas = status(d)["models"][0]["arenas"]
    assert arenas * 20 * 180 > UNIT_NOFILE and arenas * 180 > UNIT_NOFILE // 8      # past each bound unbounded
    fp = fingerprint(WeightSpec(str(folder), engine_version="test")).to_dict()
    hoarder = subprocess.Popen([sys.executable, "-c", HOARDER, str(d.socket), json.dumps([fp, "zero_copy", identity(folder)])],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=ENV)
    try:
        assert hoarder.stdout.readline().strip() == "180"
        wait_until(lambda: "uid 65534 holds" in d.log.read_text(), 60, "the hoarder named")
        for _ in range(3):
            w = fast_start.fetch(WeightSpec(str(folder), engine_version="test"), socket_dir=str(open_dir / "run"),
                                 mode="copy", fallback=False)
            assert w.source == "cache"
        assert d.log.read_text().count("uid 65534 holds") == 1
    finally:
        hoarder.stdin.close()
        hoarder.wait(60)
    # Connections closed with a reply unread are kept until the daemon next looks (its next reply
    # with descriptors): then all of the hoarder's are gone.
    assert fast_start.fetch(WeightSpec(str(folder), engine_version="test"), socket_dir=str(open_dir / "run"),
                            mode="copy", fallback=False).source == "cache"
    wait_until(lambda: len(os.listdir(f"/proc/{d.proc.pid}/fd")) < arenas + 64, 30, "the hoarder's connections closed")


@root_only
def test_an_engine_reading_the_same_files_by_another_path_is_served(tmp_path, open_dir, small, daemons):
    """The configured folder is root's alone; an engine user reads the same files (hard links, as
    a bind mount shows them) from a folder of its own: served, since it reads those very files.
    A copy of the files there (other inodes) is not."""
    private = shutil.copytree(small, open_dir / "private")
    private.chmod(0o700)
    linked = open_dir / "linked"
    linked.mkdir(mode=0o755)
    for f in private.iterdir():
        os.link(f, linked / f.name)
        f.chmod(0o644)
    d = daemons(write_config(tmp_path / "fs.toml", open_dir / "run", [model(private)], allowed_uids=[NOBODY.pw_uid]))
    assert as_nobody(d.socket, str(linked)) == "cache"
    copied = readable_copy(small, open_dir)
    out = as_nobody(d.socket, str(copied))
    assert out.startswith("error ") and "the model's folder" in out, out

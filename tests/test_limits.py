"""One client cannot exhaust the daemon: leases, file descriptors, connections, slow frames.

Each daemon here runs with a file-descriptor limit of 1024 (soft and hard, as systemd's default
soft limit), and each test checks that the daemon keeps serving another engine afterwards.
"""
from __future__ import annotations

import array
import fcntl
import os
import resource
import socket
import struct
import subprocess
import sys
import termios
import textwrap
import threading
import time

import pytest

from probe import wait_until

import fast_start
from fast_start import protocol, serve
from fast_start.artifact_store import Artifacts
from fast_start.cache import Cache
from fast_start.inflight import InFlight
from fast_start.checkpoint import open_checkpoint
from fast_start.transport import connect, request
from fast_start.fingerprint import WeightSpec, fingerprint
from devtools.harness import write_config
from fast_start.leases import MAX_LEASES_PER_PROCESS
from fast_start.serve import MAX_CONNECTIONS_PER_UID
from fast_start.watch import identity

NOFILE = 1024


def start(tmp_path, small, daemons, **daemon):
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run",
                       [{"name": "small", "path": str(small), "gpus": [0], "engine_version": "test"}], **daemon)
    return daemons(cfg, rlimits={resource.RLIMIT_NOFILE: NOFILE})


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def acquire(path, small, mode: str) -> protocol.Acquire:
    fp = fingerprint(WeightSpec(str(small), engine_version="test"), open_checkpoint(small))
    return protocol.Acquire(fp.to_dict(), mode, identity(small))


def still_serves(d, small) -> None:
    assert d.proc.poll() is None, d.log.read_text()
    w = fast_start.fetch(WeightSpec(str(small), engine_version="test"), socket_dir=str(d.socket_dir), fallback=False)
    assert w.source == "cache"


FLOOD = textwrap.dedent("""
    import sys, fast_start
    spec = fast_start.WeightSpec(sys.argv[1], engine_version="test")
    kept = [fast_start.fetch(spec, socket_dir=sys.argv[2], fallback=False) for _ in range(int(sys.argv[3]))]
    print(sum(w.source == "cache" for w in kept), kept[0].lease, kept[-1].lease, flush=True)
    sys.stdin.readline()                  # hold every mapping while the test looks at the daemon
""")


def test_a_flood_of_zero_copy_fetches_costs_the_daemon_one_descriptor(tmp_path, small, daemons):
    d = start(tmp_path, small, daemons)
    before = open_fds(d.proc.pid)
    engine = subprocess.Popen([sys.executable, "-c", FLOOD, str(small), str(d.socket_dir), "1500"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    hits, first, last = engine.stdout.readline().split()
    assert int(hits) == 1500 and first == last            # one lease, given back on every fetch
    # its pidfd; the last fetch's connection closes on the daemon's side a moment later
    wait_until(lambda: open_fds(d.proc.pid) <= before + 1, 10, "connections closed")
    with connect(d.socket, 5) as conn:
        request(conn, protocol.Hello(protocol.VERSION))
        leases = request(conn, protocol.Status()).body["leases"]
    assert [(l["pid"], l["mode"]) for l in leases] == [(engine.pid, "zero_copy")]
    still_serves(d, small)
    engine.communicate("done\n", timeout=60)


def test_copy_leases_end_with_their_hand_over_and_do_not_pile_up(tmp_path, small, daemons):
    """A copy's lease ends when the engine says it holds every fd (or with its process): a process
    taking copies over and over holds nothing, one that never hands over holds a bounded number of
    leases, and the daemon's descriptors stay flat."""
    d = start(tmp_path, small, daemons)
    msg = acquire(d.socket, small, "copy")
    before = open_fds(d.proc.pid)
    with connect(d.socket, 5) as conn:
        for _ in range(200):
            reply, fds = request(conn, msg, with_fds=True)
            assert isinstance(reply, protocol.Acquired) and reply.table > 0 and len(reply.attachment) == reply.table
            for fd in fds:
                os.close(fd)
            request(conn, protocol.Release(reply.lease, copied=True))
        assert request(conn, protocol.Status()).body["leases"] == []
        with pytest.raises(fast_start.FastStartError, match=f"lease {reply.lease} is not held"):
            request(conn, protocol.Release(reply.lease))
        held = []
        for _ in range(MAX_LEASES_PER_PROCESS):
            reply, fds = request(conn, msg, with_fds=True)
            held.append(reply.lease)
            for fd in fds:
                os.close(fd)
        with pytest.raises(fast_start.FastStartError, match=f"holds {MAX_LEASES_PER_PROCESS} leases"):
            request(conn, msg, with_fds=True)
        for lease in held:          # given back unused
            request(conn, protocol.Release(lease))
    wait_until(lambda: open_fds(d.proc.pid) <= before, 10, "the connection closed, no descriptor left behind")
    still_serves(d, small)


HOLDERS = textwrap.dedent("""
    import os, sys
    from fast_start import protocol
    from fast_start.transport import connect, request
    from fast_start.checkpoint import open_checkpoint
    from fast_start.fingerprint import WeightSpec, fingerprint
    from fast_start.watch import identity
    small, sock, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    msg = protocol.Acquire(fingerprint(WeightSpec(small, engine_version="test"), open_checkpoint(small)).to_dict(),
                           "zero_copy", identity(small))
    hold_r, hold_w = os.pipe()            # children live until this closes
    children = []
    for i in range(n):                    # one child at a time: each takes a lease and keeps living
        said_r, said_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(hold_w)
            try:
                with connect(sock, 10) as conn:
                    request(conn, protocol.Hello(protocol.VERSION))
                    reply, fds = request(conn, msg, with_fds=True)
                    line = "ok" if fds else "no fds"
            except Exception as e:
                line = f"refused: {e}"
            os.write(said_w, line.encode() + b"\\n")
            os.read(hold_r, 1)
            os._exit(0)
        os.close(said_w)
        print(os.read(said_r, 4096).decode().strip(), flush=True)
        os.close(said_r)
        children.append(pid)
    os.close(hold_r)
    sys.stdin.readline()
    os.close(hold_w)
    for pid in children:
        os.waitpid(pid, 0)
""")


def test_one_user_has_leases_in_at_most_256_processes(tmp_path, small, daemons):
    d = start(tmp_path, small, daemons)
    holders = subprocess.Popen([sys.executable, "-c", HOLDERS, str(small), str(d.socket), "260"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    lines = [holders.stdout.readline().strip() for _ in range(260)]
    assert lines.count("ok") == 256, lines
    assert all("has leases in 256 processes, the most one user may have" in l for l in lines if l != "ok")
    assert open_fds(d.proc.pid) < NOFILE - 100
    holders.communicate("done\n", timeout=120)
    deadline = time.monotonic() + 30                       # their pidfds report the exits
    while time.monotonic() < deadline:
        with connect(d.socket, 5) as conn:
            request(conn, protocol.Hello(protocol.VERSION))
            if not request(conn, protocol.Status()).body["leases"]:
                break
        time.sleep(0.2)
    else:
        raise AssertionError("leases of exited processes were not ended")
    still_serves(d, small)


def unread(conn: socket.socket) -> int:
    """Bytes this socket sent that its peer has not read yet (SIOCOUTQ)."""
    return struct.unpack("i", fcntl.ioctl(conn, termios.TIOCOUTQ, bytes(4)))[0]


def test_descriptors_sent_with_a_half_frame_are_never_held(tmp_path, small, daemons):
    d = start(tmp_path, small, daemons)
    before = open_fds(d.proc.pid)
    junk = [os.open("/dev/null", os.O_RDONLY) for _ in range(250)]
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(str(d.socket))
    for byte in (b"\0", b"\0"):       # two bytes of a four-byte length, 500 descriptors along
        conn.sendmsg([byte], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", junk).tobytes())])
    deadline = time.monotonic() + 10
    while unread(conn) and time.monotonic() < deadline:     # until the daemon has read both bytes
        time.sleep(0.01)
    assert unread(conn) == 0
    assert open_fds(d.proc.pid) <= before + 1             # the connection alone
    for fd in junk:
        os.close(fd)
    still_serves(d, small)
    conn.close()


def test_slow_and_silent_connections_are_cut_off(tmp_path, small, daemons):
    timeout = 3
    d = start(tmp_path, small, daemons, request_timeout_s=timeout)
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.connect(str(d.socket))
    slow = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    slow.connect(str(d.socket))
    frame = protocol.encode(protocol.Hello(protocol.VERSION))
    t0 = time.monotonic()
    reply = None
    slow.settimeout(1.0)
    for i, byte in enumerate(frame):       # one byte a second: the frame would take ~30 s
        try:
            slow.send(bytes([byte]))
        except OSError:                    # cut off since the last read: its reply came first
            slow.settimeout(5.0)
            reply, _ = protocol.recv(slow)
            break
        try:
            reply, _ = protocol.recv(slow)
            break
        except socket.timeout:
            continue
    assert isinstance(reply, protocol.Error) and "frame not complete in time" in reply.what
    assert time.monotonic() - t0 > timeout - 1      # not cut before its deadline (load only makes it later)
    silent.settimeout(timeout + 5)
    assert silent.recv(1) == b""            # closed once idle for request_timeout_s
    still_serves(d, small)


AS_NOBODY = textwrap.dedent("""
    import os, sys
    from fast_start import protocol
    from fast_start.transport import connect, request
    os.setgroups([]); os.setgid(65534); os.setuid(65534)
    with connect(sys.argv[1], 5) as conn:
        print(request(conn, protocol.Hello(protocol.VERSION)).kind)
""")


def test_one_user_holds_at_most_64_connections_and_others_still_get_in(tmp_path, small, daemons, open_dir):
    cfg = write_config(tmp_path / "fs.toml", open_dir / "run", [{"name": "small", "path": str(small), "gpus": [0],
                                                                 "engine_version": "test"}], allowed_uids=[65534])
    d = daemons(cfg, rlimits={resource.RLIMIT_NOFILE: NOFILE})
    held = []
    for _ in range(MAX_CONNECTIONS_PER_UID):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(d.socket))
        held.append(s)
    with connect(d.socket, 5) as conn:
        with pytest.raises(fast_start.FastStartError, match=f"has {MAX_CONNECTIONS_PER_UID} connections open"):
            request(conn, protocol.Hello(protocol.VERSION))
    if os.geteuid() == 0:             # another user is not locked out by this one
        p = subprocess.run([sys.executable, "-c", AS_NOBODY, str(d.socket)], capture_output=True, text=True,
                           timeout=60, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        assert p.stdout.strip() == "welcome", p.stderr
    for s in held:
        s.close()
    deadline = time.monotonic() + 10      # the daemon's threads see the closes one by one
    while True:
        try:
            still_serves(d, small)
            break
        except fast_start.FastStartError:
            assert time.monotonic() < deadline
            time.sleep(0.1)


def test_connection_threads_wait_for_the_next_connection_and_spare_ones_end(monkeypatch):
    """In process, over socket pairs: every connection is served, by a waiting thread where there is
    one; threads left waiting end after WAIT_S, all but one, which serves the next connections."""
    def all_threads() -> set[int]:
        return {t.ident for t in threading.enumerate() if t.name == serve.THREAD_NAME and t.is_alive()}

    others = all_threads()          # of servers that earlier tests in this process started, if any

    def threads() -> set[int]:
        return all_threads() - others

    monkeypatch.setattr(serve, "WAIT_S", 0.3)
    cache = Cache(0, "cpu", "keep")
    server = serve.Server(cache, serve.Policy(), max_connections=100, inflight=InFlight(1024, 256),
                          kept=Artifacts(None, 0, set, cache.metrics))
    assert threads() == set()               # none before serving begins
    server.start()

    def hello(client: socket.socket) -> None:
        client.settimeout(10)
        assert request(client, protocol.Hello(protocol.VERSION)).kind == "welcome"

    wait_until(lambda: len(threads()) == 1, 10, "one thread waiting from the start")
    clients = []
    for _ in range(20):                       # all at once: the waiting thread takes one, 19 are started
        ours, theirs = socket.socketpair()
        server.admit(theirs)
        clients.append(ours)
    for client in clients:
        hello(client)
    assert len(threads()) == 20
    for client in clients:
        client.close()
    wait_until(lambda: len(threads()) == 1 and server.waiting == 1, 10, "the spare threads ended")
    (kept,) = threads()
    for _ in range(10):                       # one after another: all served by the thread that waits
        ours, theirs = socket.socketpair()
        server.admit(theirs)
        hello(ours)
        ours.close()
        wait_until(lambda: server.waiting == 1, 10, "the thread waiting again")
        assert threads() == {kept}
    assert server.open == {}

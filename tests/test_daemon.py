"""The daemon as a real process: readiness, serving, misses, leases, evictions, signals."""
from __future__ import annotations

import json
import logging
import os
import re
import select
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from probe import evictions, status, wait_until

import fast_start
from fast_start import protocol
from fast_start.transport import connect, request, stay_awake
from fast_start.errors import CacheMiss
from devtools.harness import Daemon, serving, write_config

METHODS = ["none", "fp8", "fp8-channel", "fp8-block"]


def model(name, path, gpus=(0,), **kw):
    return {"name": name, "path": str(path), "gpus": list(gpus), "engine_version": "test", **kw}



def raw(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_ready_comes_after_every_model_is_cached_and_the_socket_exists(tmp_path, llama, daemons):
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", [model("llama", llama)], fill_bandwidth="8MB")
    d = daemons(cfg, wait=False)
    t_ready, _, socket_existed = d.listener.wait_for("READY=1", 120)
    assert socket_existed, "READY before the socket was bound"
    before = [(t, m, e) for t, m, e in d.listener.messages if t < t_ready]
    progress = [m for _, m, _ in before if m.startswith("STATUS=filling llama rank 0:")]
    assert len(progress) >= 3, d.listener.texts()          # the fill takes ~2 s at 8 MB/s
    assert any(re.search(r"GiB, about \d+ s left$", m) for m in progress), progress    # once a second has passed
    assert len([m for _, m, _ in before if m.startswith("EXTEND_TIMEOUT_USEC=")]) >= 2
    assert not any(e for _, _, e in before), "the socket existed before READY"
    s = status(d)
    assert s["state"] == "ready" and [m["name"] for m in s["models"]] == ["llama"]
    assert s["models"][0]["bytes"] > 10 * 2**20


def test_cache_fetch_is_bit_identical_to_disk_for_every_method_and_rank(tmp_path, llama, daemons):
    # Every method through real daemons at TP 2 (both ranks, GQA with 2 KV heads); the full
    # method x TP 1/2/4 x rank matrix runs in-process in test_pipeline, on the same code.
    models = [model(q, llama, gpus=range(2), tensor_parallel_size=2, quantization=q) for q in METHODS]
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", models)
    for gpu in range(2):
        daemons(cfg, gpu)
    for q in METHODS:
        for rank in range(2):
            spec = fast_start.WeightSpec(str(llama), 2, rank, quantization=q, engine_version="test")
            cache = fast_start.fetch(spec, socket_dir=str(tmp_path / "run"), fallback=False)
            disk = fast_start.fetch(spec, socket_dir=str(tmp_path / "nowhere"))
            assert cache.source == "cache" and disk.source == "disk"
            assert cache.keys() == disk.keys()
            for name in disk:
                assert torch.equal(raw(cache[name]), raw(disk[name])), (q, rank, name)


@pytest.fixture(scope="module")
def llama_cached(tmp_path_factory, llama):
    """The socket folder of a daemon holding `llama` at TP 1 (the miss tests only ask it)."""
    tmp = tmp_path_factory.mktemp("llama-cached")
    with serving(Daemon(tmp, write_config(tmp / "fs.toml", tmp / "run", [model("llama", llama)]))):
        yield str(tmp / "run")


@pytest.mark.parametrize("change,fields", [
    ({"engine_version": "other"}, {"engine_version"}),
    ({"dtype": "float16"}, {"dtype"}),
    ({"tensor_parallel_size": 2}, {"tensor_parallel_size"}),
])
def test_mismatch_falls_back_to_disk_naming_the_fields(llama, llama_cached, caplog, change, fields):
    spec = fast_start.WeightSpec(str(llama), engine_version="test")
    spec = spec._replace(**change)
    with caplog.at_level(logging.WARNING, logger="fast_start"):
        w = fast_start.fetch(spec, socket_dir=llama_cached)
    assert w.source == "disk"
    assert any(f"differing fields: {', '.join(sorted(fields))}" in r.getMessage() for r in caplog.records), caplog.text
    with pytest.raises(CacheMiss) as err:
        fast_start.fetch(spec, socket_dir=llama_cached, fallback=False)
    assert set(err.value.fields) == fields


def test_different_checkpoint_is_a_miss_on_the_checkpoint_field(llama_tied, llama_cached):
    with pytest.raises(CacheMiss) as err:
        fast_start.fetch(fast_start.WeightSpec(str(llama_tied), engine_version="test"),
                         socket_dir=llama_cached, fallback=False)
    assert "checkpoint" in err.value.fields


def test_a_shard_replaced_while_the_engine_reads_it_is_a_miss(tmp_path, small, daemons, monkeypatch):
    """The identities are sent before the headers are read: a shard replaced in between (a new
    file moved over it) is a miss on `files` even though the daemon still matched the old ones."""
    import shutil
    from fast_start import client
    daemons(write_config(tmp_path / "fs.toml", tmp_path / "run", [model("small", small)]))
    shard = sorted(small.glob("*.safetensors"))[0]
    identity = client.watch.identity

    def then_replace(*a):
        taken = identity(*a)
        shutil.copy(shard, tmp_path / "copy")
        os.replace(tmp_path / "copy", shard)
        return taken
    monkeypatch.setattr(client.watch, "identity", then_replace)
    with pytest.raises(CacheMiss) as err:
        fast_start.fetch(fast_start.WeightSpec(str(small), engine_version="test"), socket_dir=str(tmp_path / "run"),
                         fallback=False)
    assert err.value.fields == ("files",) and shard.name in err.value.what


def test_a_reply_to_a_partial_request_that_is_not_the_engines_model_is_given_back_and_asked_again(
        tmp_path, small, daemons, monkeypatch):
    """Where a partial request matches more than one model (vLLM's layout leaves a quantization it
    takes from config.json empty; here the engine is made to leave it empty, with the same files
    cached as fp8 and unquantized), the daemon may answer with the other one: the engine gives
    that lease back and asks again with the whole fingerprint, which gets its own model. Its
    arenas are many: the fds of the reply given back are read to the end before the new request."""
    from fast_start import client
    d = daemons(write_config(tmp_path / "fs.toml", tmp_path / "run",
                             [model("a-fp8", small, quantization="fp8"), model("b-none", small)], arena_chunk="64KiB"))
    assert min(m["arenas"] for m in status(d)["models"]) > 2 * protocol.FD_BATCH
    requested = client.requested
    monkeypatch.setattr(client, "requested", lambda spec: requested(spec)._replace(quantization=""))
    w = fast_start.fetch(fast_start.WeightSpec(str(small), engine_version="test"), socket_dir=str(tmp_path / "run"),
                         fallback=False)
    assert w.source == "cache" and w.fingerprint.quantization == "none"
    held = [l["model"] for l in status(d)["leases"] if l["pid"] == os.getpid()]
    assert held == ["b-none"], held
    assert "served a-fp8" in d.log.read_text() and "served b-none" in d.log.read_text()


def test_a_partial_request_is_served_only_on_the_engines_files_and_its_misses_are_not_counted(
        tmp_path, small, llama, daemons):
    """The daemon serves a request sent before the headers were read (`partial`) from the model
    equal in the other fields whose files are the engine's; else it says to ask again with the
    whole fingerprint, without logging or counting a miss: the whole request's answer is the miss."""
    from fast_start import watch
    from fast_start.fingerprint import requested
    d = daemons(write_config(tmp_path / "fs.toml", tmp_path / "run", [model("small", small), model("llama", llama)]))
    spec = fast_start.WeightSpec(str(llama), engine_version="test")

    def ask(spec, files):
        with connect(d.socket, 5) as conn:
            reply, fds = request(conn, protocol.Acquire(requested(spec).to_dict(), "copy", files, protocol.VERSION,
                                                        partial=1), with_fds=True)
        for fd in fds:
            os.close(fd)
        return reply
    hit = ask(spec, watch.identity(llama))
    assert isinstance(hit, protocol.Acquired) and hit.model == "llama"
    assert ask(fast_start.WeightSpec(str(small), engine_version="test"), watch.identity(small)).model == "small"
    for other in (ask(spec._replace(engine_version="other"), watch.identity(llama)),
                  ask(spec, {**watch.identity(llama), "config.json": [1, 2, 3, 4]})):
        assert isinstance(other, protocol.Miss) and other.fields == ["partial"]
    assert "miss for" not in d.log.read_text()
    with connect(d.socket, 5) as conn:
        request(conn, protocol.Hello(protocol.VERSION))
        samples = request(conn, protocol.Metrics()).body["samples"]
    assert not [x for x in samples if x[0] == "fast_start_cache_misses_total" and x[2]], samples


def test_a_fetch_whose_checkpoint_reads_are_slow_asks_on_a_new_connection(tmp_path, small, daemons, monkeypatch):
    """fetch connects to the daemon before it takes the checkpoint files' identities (the daemon
    admits the connection meanwhile); when that took longer than FRESH_S (slow storage) it asks on
    a connection made anew, since the daemon cuts connections that stay idle. Headers read slowly
    are read while the daemon answers: the reply waits for them."""
    from fast_start import client
    daemons(write_config(tmp_path / "fs.toml", tmp_path / "run", [model("small", small)]))
    opened, connect_at = [], client.connect
    monkeypatch.setattr(client, "connect", lambda *a: opened.append(time.monotonic()) or connect_at(*a))
    identity, hashed = client.watch.identity, client.fingerprint
    monkeypatch.setattr(client.watch, "identity", lambda *a: time.sleep(client.FRESH_S + 0.5) or identity(*a))
    w = fast_start.fetch(fast_start.WeightSpec(str(small), engine_version="test"), socket_dir=str(tmp_path / "run"),
                         fallback=False)
    assert w.source == "cache" and len(opened) == 2 and opened[1] - opened[0] > client.FRESH_S
    monkeypatch.setattr(client.watch, "identity", identity)
    monkeypatch.setattr(client, "fingerprint", lambda *a, **kw: time.sleep(client.FRESH_S + 0.5) or hashed(*a, **kw))
    opened.clear()
    assert fast_start.fetch(fast_start.WeightSpec(str(small), engine_version="test"), socket_dir=str(tmp_path / "run"),
                            fallback=False).source == "cache"
    assert len(opened) == 1
    monkeypatch.setattr(client, "fingerprint", hashed)
    opened.clear()
    assert fast_start.fetch(fast_start.WeightSpec(str(small), engine_version="test"), socket_dir=str(tmp_path / "run"),
                            fallback=False).source == "cache"
    assert len(opened) == 1


def test_the_steps_meant_for_the_wait_stop_when_the_reply_arrives():
    """`request(meanwhile=...)` advances its steps while the peer answers and skips the rest once
    the reply is there: a warm-up never delays the map it warms up for. The peer is a thread on a
    socket pair that answers at once, or only once the last step has run (`gate`)."""
    ours, theirs = socket.socketpair()

    def peer(gate):
        protocol.recv(theirs)
        if gate is not None:
            gate.wait(10)
        protocol.send(theirs, protocol.Welcome(protocol.VERSION, "cpu", 0, os.getpid()))

    def steps(done, gate):
        for i in range(5):
            if gate is None and i == 0:
                select.select([ours], [], [], 10)     # the reply is readable before step 0 ends
            done.append(i)
            if gate is not None and i == 4:
                gate.set()
            yield

    with ours, theirs:
        for gate, expected in ((None, [0]), (threading.Event(), [0, 1, 2, 3, 4]), (None, [])):
            done = []
            answering = threading.Thread(target=peer, args=(gate,))
            answering.start()
            meanwhile = steps(done, gate) if expected else iter(())
            assert request(ours, protocol.Hello(protocol.VERSION), meanwhile=meanwhile).kind == "welcome"
            answering.join()
            assert done == expected


def test_staying_awake_sees_a_message_that_arrives_and_gives_up_on_one_that_does_not():
    """`stay_awake` polls without sleeping for a message due soon: it reports one that arrives in
    its time and returns once that is up when none does (the caller's read then blocks as before)."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        ready = select.poll()
        ready.register(ours, select.POLLIN)
        assert not stay_awake(ready, 0.005)
        later = threading.Timer(0.001, theirs.send, args=(b"x",))
        later.start()
        assert stay_awake(ready, 10)
        later.join()
        assert ours.recv(1) == b"x"


def test_no_daemon_falls_back_and_fallback_false_raises(tmp_path, small):
    spec = fast_start.WeightSpec(str(small))
    assert fast_start.fetch(spec, socket_dir=str(tmp_path)).source == "disk"
    with pytest.raises(CacheMiss, match="no fast-start daemon socket"):
        fast_start.fetch(spec, socket_dir=str(tmp_path), fallback=False)


def test_copy_mode_releases_and_drop_evicts(tmp_path, small, daemons):
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", [model("small", small)], on_release="drop")
    d = daemons(cfg)
    spec = fast_start.WeightSpec(str(small), engine_version="test")
    w = fast_start.fetch(spec, socket_dir=str(tmp_path / "run"), mode="copy", fallback=False)
    assert w.source == "cache"
    w["model.norm.weight"].add_(1)                       # ours to write
    # The lease ends and the drop happens as the engine hands over, before fetch returns.
    assert status(d)["models"] == []
    assert status(d)["leases"] == [] and evictions(d) == [("small", "release")]
    # The unit's STATUS= follows: it said one model at READY, and says the drop now.
    assert d.listener.texts("STATUS=ready: 1 model(s), 0.00 GiB cached in ")
    wait_until(lambda: d.listener.texts("STATUS=ready: 0 model(s), 0.00 GiB cached; small evicted"), 10,
               "STATUS= after the drop")


# A copy engine that breaks off its hand-over: it asks, then dies with the reply unread ("kill"),
# or reads every fd and dies before it says so ("read"), or turns the reply down ("give back").
BROKEN_COPY = textwrap.dedent("""
    import os, signal, sys
    from fast_start import protocol
    from fast_start.transport import connect, request
    from fast_start.fingerprint import WeightSpec, fingerprint
    from fast_start.watch import identity
    fp = fingerprint(WeightSpec(sys.argv[1], engine_version="test"))
    conn = connect(sys.argv[2], 5)
    ask = protocol.Acquire(fp.to_dict(), "copy", identity(sys.argv[1]), protocol.VERSION)
    if sys.argv[3] == "kill":
        protocol.send(conn, ask)
        os.kill(os.getpid(), signal.SIGKILL)
    reply, fds = request(conn, ask, with_fds=True)
    assert isinstance(reply, protocol.Acquired) and fds, reply
    if sys.argv[3] == "give back":
        request(conn, protocol.Release(reply.lease))
    print("asked", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_a_copy_hand_over_that_breaks_off_leaves_the_cache_serving(tmp_path, small, daemons):
    """With on_release = "drop", the daemon lets go of a model only once a copy engine says it
    holds every fd: an engine killed before that, or one that turns the reply down, costs the
    cache nothing, and the next copy still takes the cache's place."""
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", [model("small", small)], on_release="drop")
    d = daemons(cfg)
    for how in ("kill", "read", "give back"):
        p = subprocess.run([sys.executable, "-c", BROKEN_COPY, str(small), str(d.socket), how], timeout=60)
        assert p.returncode == -signal.SIGKILL, how
        wait_until(lambda: status(d)["leases"] == [], 10, f"the {how} engine's lease ended")
        assert [m["name"] for m in status(d)["models"]] == ["small"] and evictions(d) == [], how
    spec = fast_start.WeightSpec(str(small), engine_version="test")
    w = fast_start.fetch(spec, socket_dir=str(tmp_path / "run"), mode="copy", fallback=False)
    assert w.source == "cache" and status(d)["models"] == [] and evictions(d) == [("small", "release")]
    assert re.search(r"lease \d+ on small handed over by pid %d" % os.getpid(), d.log.read_text())


HOLDER = textwrap.dedent("""
    import sys, time, torch, fast_start
    from fast_start.arena import checksum
    spec = fast_start.WeightSpec(sys.argv[1], engine_version="test")
    w = fast_start.fetch(spec, socket_dir=sys.argv[2], fallback=False)
    before = {n: checksum(t) for n, t in w.items()}
    print("mapped", flush=True)
    sys.stdin.readline()                       # the test evicts meanwhile
    print("same" if before == {n: checksum(t) for n, t in w.items()} else "changed", flush=True)
""")


def test_evicting_a_mapped_model_leaves_the_engine_tensors_valid(tmp_path, small, daemons):
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", [model("small", small)])
    d = daemons(cfg)
    engine = subprocess.Popen([sys.executable, "-c", HOLDER, str(small), str(tmp_path / "run")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert engine.stdout.readline().strip() == "mapped"
    assert [l["pid"] for l in status(d)["leases"]] == [engine.pid]
    with connect(d.socket, 5) as conn:
        request(conn, protocol.Hello(protocol.VERSION))
        assert request(conn, protocol.Evict("small")).body == {"evicted": ["small"]}
        ev = request(conn, protocol.Evictions()).body["evictions"]
    assert ev[0]["reason"] == "manual" and ev[0]["leases"] == 1
    out, _ = engine.communicate("go\n", timeout=60)
    assert out.strip() == "same"
    deadline = time.monotonic() + 10
    while status(d)["leases"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert status(d)["leases"] == []                        # the engine exited: its lease is gone


KILLED = textwrap.dedent("""
    import os, signal, socket, sys
    from fast_start import protocol
    from fast_start.transport import connect, request
    from fast_start.fingerprint import WeightSpec, fingerprint
    from fast_start.checkpoint import open_checkpoint
    from fast_start.watch import identity
    fp = fingerprint(WeightSpec(sys.argv[1], engine_version="test"), open_checkpoint(sys.argv[1]))
    conn = connect(sys.argv[2], 5)
    request(conn, protocol.Hello(protocol.VERSION))
    protocol.send(conn, protocol.Acquire(fp.to_dict(), "zero_copy", identity(sys.argv[1])))
    os.kill(os.getpid(), signal.SIGKILL)        # dies with the reply (and its fds) unread
""")


def test_client_killed_mid_acquire_leaves_no_lease(tmp_path, small, daemons):
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", [model("small", small)])
    d = daemons(cfg)
    for _ in range(5):
        p = subprocess.run([sys.executable, "-c", KILLED, str(small), str(d.socket)], timeout=60)
        assert p.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while status(d)["leases"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert status(d)["leases"] == []
    assert fast_start.fetch(fast_start.WeightSpec(str(small), engine_version="test"),
                            socket_dir=str(tmp_path / "run"), fallback=False).source == "cache"


# 32 engine processes forked from one parent that imported fast_start and torch once (each is
# its own pid to the daemon: its own lease, pidfd and connection), all fetching at once.
FORKED = textwrap.dedent("""
    import os, sys, fast_start
    from fast_start.arena import checksum
    children = []
    for _ in range(int(sys.argv[3])):
        pid = os.fork()
        if pid == 0:
            try:
                w = fast_start.fetch(fast_start.WeightSpec(sys.argv[1], engine_version="test"),
                                     socket_dir=sys.argv[2], fallback=False)
                line = f'{os.getpid()} {w.source} {checksum(w["model.layers.0.mlp.down_proj.weight"])}\\n'
                os.write(1, line.encode())      # one write under PIPE_BUF: lines never interleave
                os._exit(0)
            except BaseException as e:
                print(os.getpid(), "failed", repr(e), file=sys.stderr, flush=True)
                os._exit(1)
        children.append(pid)
    sys.exit(max(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0 for pid in children))
""")


def test_32_engines_fetch_at_once(tmp_path, small, daemons):
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", [model("small", small)])
    daemons(cfg)
    p = subprocess.run([sys.executable, "-c", FORKED, str(small), str(tmp_path / "run"), "32"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = [line.split() for line in p.stdout.splitlines()]
    assert len({pid for pid, _, _ in lines}) == 32
    assert {(source, digest) for _, source, digest in lines} == {("cache", lines[0][2])}


def test_bad_frames_get_errors_and_the_daemon_keeps_serving(tmp_path, small, daemons):
    import random
    import socket
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", [model("small", small)])
    d = daemons(cfg)
    rng = random.Random(0)
    sent = errors = closed = 0
    while sent < 10_000:
        with connect(d.socket, 5) as conn:
            for _ in range(rng.randint(1, 200)):
                sent += 1
                kind = rng.random()
                if kind < 0.6:      # random bytes in a well-formed frame
                    body = bytes(rng.randrange(256) for _ in range(rng.randint(0, 64)))
                elif kind < 0.9:    # JSON that is not a valid message
                    body = json.dumps(rng.choice([{"kind": "acquire", "fingerprint": 3, "mode": "x"},
                                                  {"kind": "release"}, {"kind": "evict", "model": 7},
                                                  {"kind": "fill", "model": ["x"]},
                                                  [1, 2], {"kind": "welcome", "protocol": 1, "device": "cpu",
                                                           "gpu": 0, "pid": 1}, "x" * 100,
                                                  {"kind": "hello", "protocol": 99}])).encode()
                else:               # oversize or truncated: the connection ends
                    if rng.random() < 0.5:
                        conn.sendall((protocol.MAX_REQUEST + 1).to_bytes(4, "big"))
                        reply, _ = protocol.recv(conn)
                        assert isinstance(reply, protocol.Error) and "exceeds" in reply.what
                    else:
                        conn.sendall((100).to_bytes(4, "big") + b"{" * 10)
                        conn.shutdown(socket.SHUT_WR)
                        reply, _ = protocol.recv(conn)
                        assert isinstance(reply, protocol.Error) and "closed after 10 of 100" in reply.what
                    assert protocol.recv(conn) == (None, [])
                    closed += 1
                    break
                conn.sendall(len(body).to_bytes(4, "big") + body)
                reply, _ = protocol.recv(conn)
                assert isinstance(reply, protocol.Error), reply
                errors += 1
    assert errors > 8000 and closed > 10
    assert status(d)["state"] == "ready"
    assert d.proc.poll() is None


def test_sigterm_sends_stopping_and_removes_the_socket(tmp_path, small, daemons):
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", [model("small", small)])
    d = daemons(cfg)
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(20) == 0
    d.listener.wait_for("STOPPING=1", 5)
    assert not d.socket.exists()


def test_watchdog_pings_keep_coming_while_ready(tmp_path, small, daemons):
    """The interval (half of WATCHDOG_USEC) is `notify.watchdog_interval`'s, tested alone; here
    the pings keep arriving after READY (how far apart they land depends on the machine's load)."""
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", [model("small", small)])
    d = daemons(cfg, env={"WATCHDOG_USEC": "1000000"})
    wait_until(lambda: len(d.listener.texts("WATCHDOG=1")) >= 4, 10, "four pings")
    ready = next(i for i, (_, m, _) in enumerate(d.listener.messages) if "READY=1" in m)
    assert sum(m == "WATCHDOG=1" for _, m, _ in d.listener.messages[ready:]) >= 2


def test_bad_config_fails_fast_without_reading_a_checkpoint(tmp_path, small, daemons):
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", [model("small", small, tensor_parallel_size=3,
                                                                      gpus=[0, 1, 2])])
    d = daemons(cfg, wait=False)
    assert d.proc.wait(60) == 2       # every config error exits 2, found in the config or by the worker
    assert "fs.toml: [[model]] 'small': TP size 3 does not divide num_attention_heads" in d.log.read_text()
    assert not d.listener.texts("STATUS=filling") and not d.listener.texts("READY=1")
    cfg = write_config(tmp_path / "bad.toml", tmp_path / "run", [model("small", small, quantization="nvfp4-checkpoint")])
    d = daemons(cfg, wait=False)
    assert d.proc.wait(60) == 2
    assert "not verified for sharing" in d.log.read_text() and "bad.toml" in d.log.read_text()


def test_fill_workers_share_the_cpus_between_the_hosts_daemons(tmp_path, small, monkeypatch):
    from fast_start import config as configs
    from fast_start.daemon import Daemon
    cfg = configs.load(write_config(tmp_path / "fs.toml", tmp_path / "run", [
        {"name": "a", "path": str(small), "gpus": [0, 1], "tensor_parallel_size": 2},
        {"name": "b", "path": str(small), "gpus": [2, 3], "tensor_parallel_size": 2}]))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert Daemon(cfg, 0).workers().env["OMP_NUM_THREADS"] == str(max(1, len(os.sched_getaffinity(0)) // 4))
    monkeypatch.setenv("OMP_NUM_THREADS", "3")          # the operator's choice wins
    assert Daemon(cfg, 0).workers().env["OMP_NUM_THREADS"] == "3"


def test_a_replicated_model_serves_rank_0_on_each_replicas_gpu(tmp_path, small, daemons):
    """One engine of TP 1 per GPU: GPU 1's daemon serves the same rank-0 weights as GPU 0's."""
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", [model("small", small, gpus=(0, 1), replicas=2)])
    daemons(cfg, gpu=1)
    spec = fast_start.WeightSpec(str(small), engine_version="test")
    w = fast_start.fetch(spec, socket_dir=str(tmp_path / "run"), fallback=False)
    assert w.source == "cache" and w.fingerprint.rank == 0 and w.fingerprint.tensor_parallel_size == 1
    fast_start.client.release(w)


def test_config_fields_name_only_fingerprint_fields_and_leave_vllms_quantization_to_the_checkpoint():
    """While a model's storage is away, re-adoption compares what the config alone decides; for a
    vLLM model with quantization "none" that excludes the quantization (vLLM reads it from
    config.json), and includes the pipeline size and the engine options."""
    from fast_start.config import ModelConfig
    from fast_start.startup import config_fields
    from fast_start.fingerprint import Fingerprint
    hf = config_fields(ModelConfig("m", "/models/m", (0,), quantization="fp8"), 0)
    vllm = config_fields(ModelConfig("m", "/models/m", (0, 1), pipeline_parallel_size=2, layout="vllm"), 1)
    assert set(hf) <= set(Fingerprint._fields) and hf["quantization"] == "fp8"
    assert "quantization" not in vllm and vllm["pipeline_parallel_size"] == 2 and vllm["rank"] == 1
    assert '"pp":2' in vllm["engine_options"]
    stored = Fingerprint("h", "Qwen3ForCausalLM", 1, 1, "bfloat16", "fp8", "c", "main", "", "vllm/2", 2,
                         vllm["engine_options"], 1, 0, "")
    assert stored.diff(stored._replace(**vllm)) == ()


def test_the_log_has_a_line_per_lease_release_miss_engine_exit_and_eviction(tmp_path, small, daemons):
    import re
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", [model("small", small)])
    d = daemons(cfg)
    run = str(tmp_path / "run")
    spec = fast_start.WeightSpec(str(small), engine_version="test")
    w = fast_start.fetch(spec, socket_dir=run, fallback=False)
    fast_start.client.release(w)
    with pytest.raises(CacheMiss):
        fast_start.fetch(spec._replace(engine_version="other"), socket_dir=run, fallback=False)
    engine = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import fast_start
        fast_start.fetch(fast_start.WeightSpec({str(small)!r}, engine_version="test"), socket_dir={run!r},
                         fallback=False)""")], timeout=120)
    assert engine.returncode == 0
    with connect(d.socket, 5) as conn:
        request(conn, protocol.Hello(protocol.VERSION))
        request(conn, protocol.Evict("small"))
    me = f"pid {os.getpid()} uid {os.getuid()}"
    lines = [r"served small to " + me + r" \(zero_copy, lease (\d+)\)",
             r"lease \1 on small released by " + me,
             "miss for " + me + ": fingerprint differs; differing fields: engine_version",
             r"pid \d+ \(uid \d+\) exited: lease\(s\) \d+ ended",
             r"evicted small \(manual; 0\.\d\d GiB, 0 lease\(s\) held then\)"]
    wait_until(lambda: "evicted small" in d.log.read_text(), 10)
    text = d.log.read_text()
    assert re.search(r"\n.*".join(lines), text, re.S), text


def test_names_at_the_kernels_limits_are_served_and_stored(tmp_path, small, daemons):
    """A model name of 77 CJK characters (231 bytes) and a folder name of 240 characters: memfd
    names are cut to the kernel's 249 bytes, so the fill, systemd's fd store and engines work."""
    import shutil
    name = "模" * 77
    folder = shutil.copytree(small, tmp_path / ("m" * 240))
    d = daemons(write_config(tmp_path / "fs.toml", tmp_path / "run", [model(name, folder)]))
    assert [m["name"] for m in status(d)["models"]] == [name] and len(d.listener.store) == 2
    w = fast_start.fetch(fast_start.WeightSpec(str(folder), engine_version="test"), socket_dir=str(tmp_path / "run"),
                         fallback=False)
    assert w.source == "cache"


def test_what_a_client_sends_reaches_the_log_as_one_bounded_line(tmp_path, small, daemons):
    """A file name in an Acquire is quoted in the miss line: a newline and `<0>` cannot forge a
    record (journald reads a `<N>` prefix from a service's stderr), control characters are
    escaped, and a 900,000-character name costs the log a few kB."""
    from fast_start.fingerprint import WeightSpec, fingerprint
    from fast_start.watch import identity
    d = daemons(write_config(tmp_path / "fs.toml", tmp_path / "run", [model("small", small)]))
    fp = fingerprint(WeightSpec(str(small), engine_version="test")).to_dict()
    before = d.log.stat().st_size
    for name in ("\n<0>forged emergency\0\x1b[2J", "n" * 900_000):
        with connect(d.socket, 5) as conn:
            reply = request(conn, protocol.Acquire(fp, "zero_copy", {**identity(small), name: [1, 2, 3, 4]},
                                                   protocol.VERSION))
        assert isinstance(reply, protocol.Miss) and reply.fields == ["files"]
    wait_until(lambda: d.log.read_text().count("miss for pid") == 2, 10, "both misses logged")
    lines = d.log.read_text()[before:].splitlines()
    assert not [l for l in lines if not l.startswith(("INFO ", "WARNING ", "ERROR "))], lines
    assert "\\n<0>forged emergency\\x00\\x1b[2J was added" in lines[0]
    assert d.log.stat().st_size - before < 10_000
    assert fast_start.fetch(fast_start.WeightSpec(str(small), engine_version="test"), socket_dir=str(tmp_path / "run"),
                            fallback=False).source == "cache"


def test_a_miss_while_the_only_model_is_not_cached_names_its_state(tmp_path, small, daemons):
    """Evicted (or filling, failed): the miss says which model and why, not that the daemon
    caches no model."""
    d = daemons(write_config(tmp_path / "fs.toml", tmp_path / "run", [model("small", small)]))
    with connect(d.socket, 5) as conn:
        request(conn, protocol.Hello(protocol.VERSION))
        request(conn, protocol.Evict("small"))
    spec = fast_start.WeightSpec(str(small), engine_version="other")        # not the evicted fingerprint
    with pytest.raises(CacheMiss) as e:
        fast_start.fetch(spec, socket_dir=str(tmp_path / "run"), fallback=False)
    assert e.value.what == "no model is cached now: small is evicted (manual)", e.value.what
    assert e.value.fix == "see fast-start status; a model is served as soon as its fill completes"


def test_a_service_manager_that_stops_reading_stalls_nothing(tmp_path, small, daemons):
    """sd_notify datagrams to a socket nobody reads block once its queue is full: the daemon still
    starts, serves (a copy's drop notifies), and stops within seconds of SIGTERM."""
    deaf = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    deaf.bind(str(tmp_path / "deaf"))
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", [model("small", small)], on_release="drop")
    d = daemons(cfg, env={"NOTIFY_SOCKET": str(tmp_path / "deaf")}, wait=False)
    wait_until(lambda: d.socket.is_socket() or d.proc.poll() is not None, 120, "the socket")
    spec = fast_start.WeightSpec(str(small), engine_version="test")
    for mode in ("zero_copy", "copy"):
        assert fast_start.fetch(spec, socket_dir=str(tmp_path / "run"), mode=mode, fallback=False).source == "cache"
    t0 = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(30) == 0 and time.monotonic() - t0 < 5
    deaf.close()

"""`python -m fast_start.supervise --standby HOST:PORT`: one engine serves through the front while a
second sleeps; when a process of the serving one dies, the standby is woken and answers, a new
standby starts, and a stop ends them all. Real processes: a test engine (an HTTP server on its
`--uds` socket with vLLM's /health, /sleep and /wake_up) and vLLM's CPU build."""
from __future__ import annotations

import http.client
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import tempfile

import pytest

from devtools.harness import free_port, write_config
from probe import status
from fast_start.standby import group_of
from test_supervise import SUPERVISE, Supervised, alive, answer, ours, tiny_model, write_module

ENGINE = """
import http.server, json, os, socketserver, sys
path = sys.argv[sys.argv.index("--uds") + 1]
state = {"asleep": False}
print(f"test engine {os.getpid()} starts as {os.environ.get('FAST_START_STARTS_AS')}", flush=True)
if os.environ.get("ENGINE_GATE"):          # a FIFO: the engine listens once the test has opened it for it
    open(os.environ["ENGINE_GATE"]).read()
if os.environ.get("ENGINE_ORPHAN") and os.fork() == 0:     # a careless helper: out of the engine's group
    os.setsid()
    print(f"test engine {os.getppid()} left orphan {os.getpid()}", flush=True)
    open(os.environ["ENGINE_ORPHAN"]).read()
    os._exit(0)
if os.environ.get("ENGINE_HELPER"):        # a helper in the engine's group that ends once the test opens this FIFO
    import subprocess
    subprocess.Popen([sys.executable, "-c", f"open({os.environ['ENGINE_HELPER']!r}).read()"])

class Handler(http.server.BaseHTTPRequestHandler):
    def reply(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.reply({"pid": os.getpid(), **state})

    def do_POST(self):
        state["asleep"] = self.path.startswith("/sleep")
        self.reply(state)

    def log_message(self, *args):
        pass

class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    def get_request(self):
        conn, _ = self.socket.accept()
        return conn, ("engine", 0)

Server(path, Handler).serve_forever()
"""


# What a standby's engines must be given (the test engine ignores it): the daemon's weights or none.
CACHE_ONLY = ["--load-format", "fast_start", "--model-loader-extra-config", '{"fallback": false}']


def who(port: int) -> dict:
    """The answer of whichever engine the front joins this connection to."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("GET", "/who")
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def engine_with_standby(tmp_path, fifo: str = "", restarts: int = 3) -> tuple[Supervised, int, object]:
    """(the supervisor of the test engine with a standby, its public port, the FIFO named `fifo`
    that the engine reads from the variable ENGINE_<FIFO>, if any)."""
    env = write_module(tmp_path / "mods", "engine", ENGINE)
    path = None
    if fifo:
        path = tmp_path / fifo
        os.mkfifo(path)
        env[f"ENGINE_{fifo.upper()}"] = str(path)
    port = free_port()
    return Supervised(["--restarts", str(restarts), "--standby", f"127.0.0.1:{port}", "--", "-m", "engine",
                       *CACHE_ONLY], env, tmp_path / "out.log"), port, path


def stopped(s: Supervised) -> int:
    """systemctl stop: the supervisor's status once it and every engine ended; killed (and the
    test failed) where it hangs, as systemd's stop timeout would."""
    s.proc.send_signal(signal.SIGTERM)
    try:
        return s.proc.wait(120)
    except subprocess.TimeoutExpired:
        for pid in [s.proc.pid, *(p for line in s.lines if line for p in map(int, re.findall(r"engine (\d+)", line)))]:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        s.proc.kill()
        raise


def roles(s: Supervised, count: int = 1) -> tuple[int, int]:
    """(serving, standby) pids once the `count`-th standby stands by."""
    standby = int(s.wait_for(r"^fast-start: engine (\d+) standing by", count)[-1][1])
    last = s.wait_for(r"^fast-start: (?:engine (\d+) serving|failover: .* standby (\d+) serving)", count)[-1]
    return int(last[1] or last[2]), standby


def test_the_standby_answers_once_the_serving_engine_dies_and_a_new_one_stands_by(tmp_path):
    s, port, _ = engine_with_standby(tmp_path)
    try:
        serving, standby = roles(s)
        assert who(port) == {"pid": serving, "asleep": False}
        assert who(port)["pid"] == serving          # the standby is asked nothing but to sleep
        os.kill(serving, signal.SIGKILL)
        s.wait_for(rf"^fast-start: failover: engine {serving} died \(its process {serving} ended\); standby "
                   rf"{standby} serving \d+\.\d\d s later$")
        assert who(port) == {"pid": standby, "asleep": False}      # woken before the front sends it anything
        now_serving, next_standby = roles(s, 2)
        assert now_serving == standby and next_standby not in (serving, standby)
        assert not alive(serving)
        for pid, role in ((serving, "serving"), (standby, "standby"), (next_standby, "standby")):
            s.wait_for(rf"^test engine {pid} starts as {role}$")      # a standby's KV cache starts light
    finally:
        code = stopped(s)
    assert code in (0, -signal.SIGTERM)
    assert not any(alive(p) for p in (standby, next_standby))


def test_failovers_that_served_are_no_failures_and_deaths_no_standby_covered_end_it(tmp_path):
    """A failover drill kills the serving engine more times than `--restarts` allows: each death a
    standby took over leaves the address answering, so it counts for nothing; deaths of standbys
    count, and one more than `--restarts` ends the supervisor for systemd to restart."""
    s, port, _ = engine_with_standby(tmp_path, restarts=1)
    try:
        serving, standby = roles(s)
        standing = r"^fast-start: engine (\d+) standing by"
        for drill in range(1, 4):
            os.kill(serving, signal.SIGKILL)
            s.wait_for(rf"^fast-start: failover: engine {serving} died .*; standby {standby} serving")
            assert who(port) == {"pid": standby, "asleep": False}
            serving, standby = standby, int(s.wait_for(standing, 1 + drill)[-1][1])
        for death in range(1, 3):
            os.kill(standby, signal.SIGKILL)
            s.wait_for(rf"^fast-start: engine {standby} \(standby\) died")
            if death == 1:
                standby = int(s.wait_for(standing, 5)[-1][1])
        s.wait_for(r"^fast-start: engines died 2 times in 10 minutes; the supervisor ends")
        assert s.proc.wait(120) == 1
        assert not alive(serving)
    finally:
        if s.proc.poll() is None:
            stopped(s)


def test_the_orphan_a_dead_engine_left_outside_its_group_is_killed_and_reaped(tmp_path):
    """A helper that left the engine's process group (setsid) outlives it as the supervisor's orphan:
    the failover kills and reaps it with the engine; the serving engine's own helper lives on."""
    s, port, _ = engine_with_standby(tmp_path, "orphan")
    try:
        serving, standby = roles(s)
        orphans = {int(m[1]): int(m[2]) for m in s.wait_for(r"^test engine (\d+) left orphan (\d+)$", 2)}
        os.kill(serving, signal.SIGKILL)
        s.wait_for(rf"^fast-start: failover: engine {serving} died")
        assert not os.path.exists(f"/proc/{orphans[serving]}")         # killed and reaped
        assert alive(orphans[standby])
    finally:
        stopped(s)
    assert not os.path.exists(f"/proc/{orphans[standby]}")             # and the stop leaves none


def test_a_stop_sent_to_the_whole_unit_ends_it_cleanly(tmp_path):
    """systemd's default stop signals every process of the unit, the front too: the engines end
    by their own shutdown and the supervisor as they did."""
    s, port, _ = engine_with_standby(tmp_path)
    serving, standby = roles(s)
    with open(f"/proc/{s.proc.pid}/task/{s.proc.pid}/children") as f:
        front = next(int(p) for p in f.read().split() if b"fast_start.front" in open(f"/proc/{p}/cmdline", "rb").read())
    for pid in (front, serving, standby, s.proc.pid):
        os.kill(pid, signal.SIGTERM)
    assert s.proc.wait(120) in (0, -signal.SIGTERM)
    assert not any("the front ended" in line for line in s.lines if line), s.log.read_text()
    assert not any(alive(p) for p in (front, serving, standby))


def test_a_helper_of_the_engine_that_ends_on_its_own_is_no_death(tmp_path):
    s, port, helper = engine_with_standby(tmp_path, "helper")
    try:
        serving, standby = roles(s)
        helpers = [os.pidfd_open(p) for p in group_of(serving) if p != serving]
        assert helpers
        helper.write_text("done")           # every engine's helper ends, exit 0
        for fd in helpers:
            select.select([fd], [], [])     # ended
            os.close(fd)
        os.kill(standby, signal.SIGKILL)    # an event after those: by its line, the helper's end was seen
        seen = s.wait_for(rf"^fast-start: (?:engine {standby} \(standby\) died|.*engine {serving} died)")[0]
        assert "(standby) died" in seen[0], s.log.read_text()
        assert who(port) == {"pid": serving, "asleep": False}
    finally:
        stopped(s)


def test_a_connection_made_while_no_engine_serves_waits_for_the_next(tmp_path):
    """The serving engine dies with no standby ready: the front holds a connection made then (none
    is refused) and the next engine to listen answers it, woken first (it started as the standby,
    its KV cache light)."""
    s, port, gate = engine_with_standby(tmp_path, "gate")
    try:
        gate.write_text("go")           # the first engine may listen; the second then waits at the gate
        first = int(s.wait_for(r"^fast-start: engine (\d+) serving$")[0][1])
        second = int(s.wait_for(r"^fast-start: engine (\d+) starting .*\(standby once it listens\)$")[0][1])
        os.kill(first, signal.SIGKILL)
        s.wait_for(rf"^fast-start: engine {first} died \(its process {first} ended\) with no standby ready")
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        conn.request("GET", "/who")                 # made while no engine serves
        gate.write_text("go")
        assert json.loads(conn.getresponse().read()) == {"pid": second, "asleep": False}
        s.wait_for(rf"^fast-start: engine {second} serving$")
        s.wait_for(rf"^test engine {second} starts as standby$")
        lines = [ours(ln) for ln in s.lines if ln]
        assert lines.index(f"fast-start: engine {second} serving") > next(
            i for i, ln in enumerate(lines) if ln.startswith(f"fast-start: engine {second} standing by")), lines
    finally:
        stopped(s)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_vllm_server_whose_engine_core_is_killed_fails_over_to_its_standby_with_the_same_tokens(tmp_path,
                                                                                                 daemons, tp):
    """vLLM's CPU build (its sleep frees nothing on the CPU, yet pauses the scheduler as on a GPU),
    both engines on their daemons' weights in zero_copy, one worker per GPU (TP 2: each worker on
    its own GPU's daemon): every daemon shows its worker's role and the failover."""
    vllm = pytest.importorskip("vllm")
    model = tiny_model(tmp_path / "tiny")
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", [
        {"name": "tiny", "path": str(model), "gpus": list(range(tp)), "tensor_parallel_size": tp, "layout": "vllm",
         "engine_version": vllm.__version__}])
    ds = [daemons(cfg, gpu) for gpu in range(tp)]
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="fs-")        # short: vLLM's sockets live there, named within 107 bytes
    env = {**write_module(tmp_path / "mods", "unused", ""), "VLLM_CPU_KVCACHE_SPACE": "1", "TMPDIR": tmp,
           "VLLM_CPU_OMP_THREADS_BIND": "|".join(str(rank % os.cpu_count()) for rank in range(tp))}  # a core per worker
    s = Supervised(["--standby", f"127.0.0.1:{port}", "--", "-m", "vllm.entrypoints.openai.api_server", "--model",
                    str(model), "--enforce-eager", "--max-model-len", "256", "--kv-cache-memory-bytes",
                    str(64 << 20), "--tensor-parallel-size", str(tp), "--load-format", "fast_start",
                    "--model-loader-extra-config", json.dumps({"socket_dir": str(tmp_path / "run"), "fallback": False})],
                   env, tmp_path / "out.log")
    try:
        serving, standby = roles(s)
        want = answer(s, port, model)
        holders = [{engine: holder(d, engine) for engine in (serving, standby)} for d in ds]
        assert [leases(d) for d in ds] == [{h[serving]: "serving", h[standby]: "standby"} for h in holders]
        old = group_of(serving)
        core = next(p for p in old if open(f"/proc/{p}/cmdline").read().startswith("VLLM::EngineCore"))
        os.kill(core, signal.SIGKILL)
        s.wait_for(rf"^fast-start: failover: engine {serving} died \(its process {core} ended\); standby {standby} "
                   r"serving")
        assert answer(s, port, model) == want
        assert not any(alive(p) for p in old)
        serving_now, next_standby = roles(s, 2)
        assert serving_now == standby
        assert [leases(d) for d in ds] == [{h[standby]: "serving", holder(d, next_standby): "standby"}
                                           for d, h in zip(ds, holders)]
        for d, h in zip(ds, holders):
            last = status(d)["last_failover"]
            assert (last["died"], last["serving"], status(d)["failovers"]) == (h[serving], h[standby], 1)
        assert sum("imported in" in ln for ln in s.lines if ln) == 1
    finally:
        stopped(s)
        shutil.rmtree(tmp, ignore_errors=True)


def holder(d, engine: int) -> int:
    """The process of the engine's group that holds its lease (its worker)."""
    [pid] = set(group_of(engine)) & set(leases(d))
    return pid


def leases(d) -> dict[int, str]:
    return {lease["pid"]: lease["role"] for lease in status(d)["leases"]}


def test_an_address_it_cannot_listen_on_is_named_with_the_fix(tmp_path):
    env = write_module(tmp_path / "mods", "engine", ENGINE)
    env["TMPDIR"] = str(tmp_path / "tmp")           # where its engines' sockets would be
    (tmp_path / "tmp").mkdir()
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        out = subprocess.run([*SUPERVISE, "--standby", f"127.0.0.1:{port}", "--", "-m", "engine", *CACHE_ONLY],
                             env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    assert (f"fast-start: cannot listen on 127.0.0.1:{port} for --standby: Address already in use; give a free "
            "address (another server on the port?)") in out.stderr
    assert list((tmp_path / "tmp").iterdir()) == []
    out = subprocess.run([*SUPERVISE, "--standby", "8000", "--", "-m", "engine"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "'8000' is not HOST:PORT (e.g. 0.0.0.0:8000, [::]:8000)" in out.stderr


@pytest.mark.parametrize("flags", [[], ["--load-format", "fast_start"], ["--load_format=fast_start",
                                   '--model-loader-extra-config={"fallback": true}'],
                                   ["--load-format", "auto", "--model-loader-extra-config", '{"fallback": false}'],
                                   ["--load-format", "fast_start", "--model-loader-extra-config", "{fallback"]])
def test_engines_that_could_answer_from_disk_weights_are_refused_with_the_flags_to_add(tmp_path, flags):
    env = write_module(tmp_path / "mods", "engine", ENGINE)
    out = subprocess.run([*SUPERVISE, "--standby", "127.0.0.1:8000", "--", "-m", "engine", *flags], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and ("a standby serves only the daemon's weights, and these engines would load from "
                                    "disk on a miss: add --load-format fast_start --model-loader-extra-config "
                                    "'{\"fallback\": false}'") in out.stderr, out.stderr

"""The client of `tests/vllm_engine.py --serve`: engines forked from one process that imported vLLM
(one per test session: conftest.py's `session_engines`)."""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

SERVER = Path(__file__).with_name("vllm_engine.py")
# In-process engine core: the engines size their KV cache (vllm_engine.py). No torch.compile:
# the engines run eager, yet vLLM compiles a few helpers with inductor as they are first called
# (the vocabulary mask at TP > 1, grouped top-k), seconds in every rank of every engine here.
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TORCHDYNAMO_DISABLE": "1"}


class Engines:
    """The client of `serve`: a server process started in `folder`, engines started through it."""

    def __init__(self, folder, env: dict):
        self.path = os.path.join(folder, "engines.sock")
        self.log = open(os.path.join(folder, "engine-server.log"), "w")
        # The engines' temp dir: where a TP engine's ranks meet (a FileStore, `vllm_dist_<id>`),
        # whose name also names the shared memory of vLLM's CPU collectives. An engine killed
        # mid-way leaves both; `close` removes this session's.
        self.tmp = os.path.join(folder, "tmp")
        os.mkdir(self.tmp)
        env = {**env, "TMPDIR": self.tmp}
        # OpenBLAS (numpy's, OpenCV's) starts a thread pool at import unless told one thread: the
        # server forks, and must hold no thread but its own (its engines get `env` as it is).
        self.proc = subprocess.Popen([sys.executable, str(SERVER), "--serve", self.path], stdout=self.log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**env, "OPENBLAS_NUM_THREADS": "1"})
        deadline = time.monotonic() + 300
        while not os.path.exists(self.path):
            assert self.proc.poll() is None, open(self.log.name).read()[-4000:]
            assert time.monotonic() < deadline, "the engine server did not listen in 300 s"
            time.sleep(0.1)

    def start(self, args: dict, env: dict, log) -> "Started":
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.path)
        conn.sendall(json.dumps({"args": args, "env": {**env, "TMPDIR": self.tmp}, "log": str(log)}).encode() + b"\n")
        return Started(conn)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()
        for store in Path(self.tmp).glob("vllm_dist_*"):
            for shm in Path("/dev/shm").glob(store.name + "-*"):
                shm.unlink(missing_ok=True)


class Started:
    """One engine the server forked: `wait` its exit status as `subprocess.Popen.wait` would."""

    def __init__(self, conn: socket.socket):
        self.conn, self.replies = conn, conn.makefile("rb", buffering=0)     # a line at a time, no read-ahead
        self.pid = json.loads(self.replies.readline())["pid"]

    def running(self) -> bool:
        """Whether the engine has not exited yet: its exit status is not there to read."""
        return not select.select([self.conn], [], [], 0)[0]

    def wait(self, timeout: float) -> int:
        self.conn.settimeout(timeout)
        try:
            line = self.replies.readline()
        except TimeoutError:
            os.kill(self.pid, signal.SIGKILL)
            raise subprocess.TimeoutExpired(f"engine {self.pid}", timeout) from None
        finally:
            self.conn.close()
        assert line, f"the engine server lost engine {self.pid}"
        return json.loads(line)["rc"]

"""`python -m fast_start.supervise`: an engine restarted from a warm interpreter, with real processes:
a vLLM server killed with -9 answers again, same tokens, its orphans gone; a crash loop ends in
systemd's hands; `systemctl stop`'s SIGTERM reaches the engine and restarts nothing."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
from pathlib import Path

import pytest

from devtools.harness import free_port
from fast_start.standby import group_of

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
SUPERVISE = [sys.executable, "-m", "fast_start.supervise"]


class Supervised:
    """The supervisor as a unit would run it; its output (the engine's too) read line by line."""

    def __init__(self, args: list[str], env: dict, log: Path):
        self.lines: list[str] = []
        self.seen = threading.Condition()
        self.log = log
        self.proc = subprocess.Popen([*SUPERVISE, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, errors="replace")
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        with open(self.log, "w") as out:
            for line in self.proc.stdout:
                out.write(line)
                out.flush()
                with self.seen:
                    self.lines.append(line.rstrip("\n"))
                    self.seen.notify_all()
        with self.seen:
            self.lines.append(None)
            self.seen.notify_all()

    def wait_for(self, pattern: str, count: int = 1, timeout: float = 600) -> list[re.Match]:
        """The first `count` lines that match `pattern` (an event, not a guess at how long it takes)."""
        with self.seen:
            found = lambda: [m for ln in self.lines if ln is not None and (m := re.search(pattern, ours(ln)))]
            ended = lambda: None in self.lines
            assert self.seen.wait_for(lambda: len(found()) >= count or ended(), timeout), self.log.read_text()[-4000:]
            assert len(found()) >= count, f"{pattern!r} not seen; output:\n{self.log.read_text()[-6000:]}"
            return found()[:count]


def ours(line: str) -> str:
    """The line from its first "fast-start: " on: the engine shares the supervisor's output, so a line
    of ours can follow a part the engine wrote without its newline yet (a traceback's rule)."""
    return line[max(line.find("fast-start: "), 0):]


def write_module(folder: Path, name: str, source: str) -> dict:
    folder.mkdir(exist_ok=True)
    (folder / f"{name}.py").write_text(source)
    return {**ENV, "PYTHONPATH": os.pathsep.join([str(folder), ENV["PYTHONPATH"]])}


CRASHER = """
import os, signal, time
pid = os.fork()
if pid == 0:
    os.setsid()                 # out of the engine's process group, as a careless helper would be
    time.sleep(3600)
    os._exit(0)
print(f"orphan {pid}", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def test_a_crash_loop_ends_in_systemd_s_hands_and_leaves_no_orphan(tmp_path):
    env = write_module(tmp_path / "mods", "crasher", CRASHER)
    s = Supervised(["--restarts", "1", "--", "-m", "crasher"], env, tmp_path / "out.log")
    assert s.proc.wait(120) == -signal.SIGKILL            # ended as the engine did, for systemd to judge
    orphans = [int(m[1]) for m in s.wait_for(r"^orphan (\d+)$", 2)]
    assert not any(alive(p) for p in orphans)                   # killed and reaped by the supervisor
    s.wait_for(r"^fast-start: the engine ended \(signal SIGKILL\); starting it again from the warm interpreter "
               r"\(1 of 1 restarts in 10 minutes\)$")
    s.wait_for(r"^fast-start: the engine ended \(signal SIGKILL\) 2 times in 10 minutes; the supervisor ends with "
               r"it and leaves the next restart to systemd$")


WAITER = """
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: (print("engine stopping", flush=True), sys.exit(0)))
print("engine ready", flush=True)
time.sleep(3600)
"""


def test_systemctl_stop_reaches_the_engine_and_restarts_nothing(tmp_path):
    env = write_module(tmp_path / "mods", "waiter", WAITER)
    s = Supervised(["--", "-m", "waiter"], env, tmp_path / "out.log")
    s.wait_for("^engine ready$")
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(60) == 0
    s.wait_for("^engine stopping$")
    assert sum("engine started" in ln for ln in s.lines if ln) == 1


def test_an_engine_ended_by_the_stop_signal_ends_the_supervisor_by_it_too(tmp_path):
    """systemd takes a main process killed by SIGTERM on stop as a clean stop, as for the engine itself."""
    env = write_module(tmp_path / "mods", "sleeper", 'import time\nprint("engine ready", flush=True)\ntime.sleep(3600)\n')
    s = Supervised(["--", "-m", "sleeper"], env, tmp_path / "out.log")
    s.wait_for("^engine ready$")
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(60) == -signal.SIGTERM


def test_the_engines_first_line_comes_whole_after_the_supervisors(tmp_path):
    """An unbuffered engine (PYTHONUNBUFFERED=1, as units often set) writes a line's text and its
    newline apart; the supervisor's line never falls between them, on any of 20 starts."""
    env = write_module(tmp_path / "mods", "ready", 'print("engine ready")\n')
    for _ in range(20):
        out = subprocess.run([*SUPERVISE, "--", "-m", "ready"], env={**env, "PYTHONUNBUFFERED": "1"}, timeout=60,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines = out.stdout.splitlines()
        assert out.returncode == 0 and lines[2] == "engine ready", out.stdout
        assert re.fullmatch(r"fast-start: engine started \(pid \d+\) from the warm interpreter, [\d.]+ s", lines[1])


def test_a_command_it_cannot_run_is_named_with_the_fix(tmp_path):
    out = subprocess.run([*SUPERVISE, "--", "no-such-engine", "serve"], capture_output=True, text=True, env=ENV,
                         timeout=60)
    assert out.returncode == 1
    assert "no console script named 'no-such-engine' in this Python" in out.stderr
    assert "give the engine's command as its script (`vllm serve ...`) or as `-m MODULE ...`" in out.stderr
    out = subprocess.run(SUPERVISE, capture_output=True, text=True, env=ENV, timeout=60)
    assert out.returncode == 2 and "give the engine's command after --" in out.stderr


def tiny_model(folder: Path) -> Path:
    """A two-layer Qwen3 with a word-level tokenizer ("t17" is token 17)."""
    from devtools import synth
    synth.write_checkpoint(folder, synth.Shape(architecture="Qwen3ForCausalLM", hidden_size=256, num_layers=2,
                                               num_heads=8, num_kv_heads=2, head_dim=32, intermediate_size=512,
                                               vocab_size=1000, tie_word_embeddings=True))
    synth.write_tokenizer(folder, 1000)
    return folder


def answer(s: Supervised, port: int, model: Path) -> str:
    """The server's completion, asked until it listens (it logs its start-up before it binds)."""
    from bench.serve_restart import complete
    deadline = time.monotonic() + 600
    while True:
        try:
            return complete(port, str(model), "t17 t230 t45")
        except (urllib.error.URLError, ConnectionError):
            assert s.proc.poll() is None and time.monotonic() < deadline, s.log.read_text()[-6000:]
            time.sleep(0.1)


def test_a_vllm_server_killed_with_9_answers_again_from_the_warm_interpreter(tmp_path):
    """A real `vllm serve` (vLLM's CPU build, its engine core a process of its own): after kill -9
    of the server, the supervisor reaps the orphaned engine core and the restarted server answers
    the same tokens, vLLM imported once."""
    pytest.importorskip("vllm")
    model = tiny_model(tmp_path / "tiny")
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="fs-")        # short: vLLM's sockets live there, named within 107 bytes
    env = {**ENV, "VLLM_CPU_KVCACHE_SPACE": "1", "TMPDIR": tmp}
    s = Supervised(["--", "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
                    "--port", str(port), "--enforce-eager", "--max-model-len", "256",
                    "--kv-cache-memory-bytes", str(64 << 20)], env, tmp_path / "out.log")
    try:
        first = int(s.wait_for(r"engine started \(pid (\d+)\)")[0][1])
        want = answer(s, port, model)
        old = group_of(first)
        assert len(old) >= 2, old          # the server and its engine core
        os.kill(first, signal.SIGKILL)
        s.wait_for(r"^fast-start: the engine ended \(signal SIGKILL\); starting it again from the warm interpreter")
        second = int(s.wait_for(r"engine started \(pid (\d+)\)", 2)[1][1])
        assert answer(s, port, model) == want
        assert second != first and not any(alive(p) for p in old)
        assert sum("imported in" in ln for ln in s.lines if ln) == 1
    finally:
        s.proc.send_signal(signal.SIGTERM)
        s.proc.wait(120)
        shutil.rmtree(tmp, ignore_errors=True)

"""Every engine process that used fast-start leaves with its own exit status, however it leaves."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from devtools.harness import write_config

ENGINE = Path(__file__).with_name("exit_engine.py")
# How each way of leaving ends when nothing of fast-start's is left running.
HOWS = {"end": 0, "del": 0, "raise": 1, "sys_exit": 7, "fork": 0}
FATAL = ("Fatal Python error", "terminate called", "PyEval_SaveThread", "Exception ignored", "Segmentation fault")


def engine_exits(socket_dir: Path, model: Path, device: str, mode: str, how: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ENGINE), str(socket_dir), str(model), device, mode, how],
                          capture_output=True, text=True, timeout=300)


# Python >= 3.12 notes a fork() of a process with more than one thread: on a GPU, the CUDA
# driver's own threads (`test_a_fetch_on_a_gpu_starts_no_thread` shows none is fast-start's).
FORK_NOTE = re.compile(r".*: DeprecationWarning: This process \(pid=\d+\) is multi-threaded, use of fork\(\) may "
                       r"lead to deadlocks in the child\.\n  pid = os\.fork\(\)\n")


def assert_left_cleanly(out: subprocess.CompletedProcess, how: str) -> None:
    assert out.returncode == HOWS[how], f"exit {out.returncode}, stderr:\n{out.stderr[-3000:]}"
    assert out.stdout.split()[:1] == ["cache"], out.stdout + out.stderr
    assert not [f for f in FATAL if f in out.stderr], out.stderr[-3000:]
    stderr = FORK_NOTE.sub("", out.stderr) if how == "fork" else out.stderr
    if how == "raise":
        assert stderr.rstrip().endswith("ValueError: the engine's own error"), stderr[-3000:]
    else:
        assert stderr == "", stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["zero_copy", "copy"])
def test_every_engine_process_leaves_with_its_own_exit_status(tmp_path, small, daemons, mode):
    d = daemons(write_config(tmp_path / "fs.toml", tmp_path / "run",
                             [{"name": "small", "path": str(small), "gpus": [0], "engine_version": "test"}]))
    for how in HOWS:
        assert_left_cleanly(engine_exits(d.socket_dir, small, "cpu", mode, how), how)


THREADS = """
import os, sys, torch, fast_start
torch.set_num_threads(1)
torch.zeros(1, device=sys.argv[3])          # the device's own threads (the CUDA driver's) start here
before = sorted(os.listdir('/proc/self/task'))
for mode in ('zero_copy', 'copy'):
    w = fast_start.fetch(fast_start.WeightSpec(sys.argv[2], engine_version='test'), device=sys.argv[3], mode=mode,
                         fallback=False, socket_dir=sys.argv[1])
    assert w.source == 'cache'
print(len(before), len(os.listdir('/proc/self/task')))
"""


def fetch_threads(socket_dir, model, device: str) -> tuple[str, str]:
    """The kernel's count of an engine process's threads before and after it fetches, both modes."""
    out = subprocess.run([sys.executable, "-c", THREADS, str(socket_dir), str(model), device], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    before, after = out.stdout.split()
    return before, after


def test_a_fetch_leaves_no_thread_in_the_engines_process(tmp_path, small, daemons):
    d = daemons(write_config(tmp_path / "fs.toml", tmp_path / "run",
                             [{"name": "small", "path": str(small), "gpus": [0], "engine_version": "test"}]))
    before, after = fetch_threads(d.socket_dir, small, "cpu")
    assert before == after


@pytest.mark.slow
def test_a_hundred_engines_per_mode_fetch_and_exit_with_the_daemons_fds_and_rss_flat():
    """The soak (`python -m bench.soak`, 1,000 cycles in BENCHMARKS.md), shortened: every engine
    exits 0 with nothing on stderr, and the daemon's fds and RSS after the warm-up stay flat."""
    out = subprocess.run([sys.executable, "-m", "bench.soak", "--cycles", "100"], capture_output=True, text=True,
                         timeout=900, cwd=Path(__file__).parent.parent)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert out.stdout.count("100 engines, 0 failed, 0 stderr lines") == 2, out.stdout

"""Every engine process that used fast-start leaves with its own exit status, however it leaves."""
from __future__ import annotations

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


def assert_left_cleanly(out: subprocess.CompletedProcess, how: str) -> None:
    assert out.returncode == HOWS[how], f"exit {out.returncode}, stderr:\n{out.stderr[-3000:]}"
    assert out.stdout.split()[:1] == ["cache"], out.stdout + out.stderr
    assert not [f for f in FATAL if f in out.stderr], out.stderr[-3000:]
    if how == "raise":
        assert out.stderr.rstrip().endswith("ValueError: the engine's own error"), out.stderr[-3000:]
    else:
        assert out.stderr == "", out.stderr[-3000:]


@pytest.mark.parametrize("mode", ["zero_copy", "copy"])
def test_every_engine_process_leaves_with_its_own_exit_status(tmp_path, small, daemons, mode):
    d = daemons(write_config(tmp_path / "fs.toml", tmp_path / "run",
                             [{"name": "small", "path": str(small), "gpus": [0], "engine_version": "test"}]))
    for how in HOWS:
        assert_left_cleanly(engine_exits(d.socket_dir, small, "cpu", mode, how), how)


def test_a_fetch_leaves_no_thread_in_the_engines_process(tmp_path, small, daemons):
    d = daemons(write_config(tmp_path / "fs.toml", tmp_path / "run",
                             [{"name": "small", "path": str(small), "gpus": [0], "engine_version": "test"}]))
    code = ("import os, sys, torch, fast_start\n"
            "torch.set_num_threads(1)\n"
            "before = sorted(os.listdir('/proc/self/task'))\n"
            "for mode in ('zero_copy', 'copy'):\n"
            "    w = fast_start.fetch(fast_start.WeightSpec(sys.argv[2], engine_version='test'), mode=mode,\n"
            "                         fallback=False, socket_dir=sys.argv[1])\n"
            "    assert w.source == 'cache'\n"
            "print(len(before), len(os.listdir('/proc/self/task')))\n")
    out = subprocess.run([sys.executable, "-c", code, str(d.socket_dir), str(small)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    before, after = out.stdout.split()
    assert before == after, out.stdout     # the kernel's count of the process's threads, not Python's

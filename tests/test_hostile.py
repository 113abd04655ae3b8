"""What hostile testing found, each against a real daemon, real files and real processes: planted
links and FIFOs, checkpoints rewritten behind the keeper's back, a broken fill worker, damaged
state and history files, a truncated checkpoint. Each time the daemon serves on, and the
operator gets one line that names the thing and the fix."""
from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save, save_file
from typer.testing import CliRunner

from probe import evictions, status, wait_until

import fast_start
from fast_start import fill, files, protocol, watch
from fast_start.headers import file_identity
from fast_start.cli import app
from fast_start.errors import CacheMiss
from devtools import synth
from devtools.harness import write_config

runner = CliRunner()
HOSTILE = Path(__file__).with_name("hostile_worker.py")


def model(name, path, **kw):
    return {"name": name, "path": str(path), "gpus": [0], "engine_version": "test", **kw}


def spec(path):
    return fast_start.WeightSpec(str(path), engine_version="test")


def evict(cfg) -> None:
    assert runner.invoke(app, ["evict", "--gpu", "0", "--model", "small", "--config", str(cfg)]).exit_code == 0


# -- 1: the metrics and history writers ----------------------------------------------------------

def test_the_daemons_writers_follow_no_planted_link_and_open_no_planted_fifo(tmp_path, small, daemons):
    textfiles, state = tmp_path / "textfile", tmp_path / "state"
    textfiles.mkdir(mode=0o1777)
    state.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    victim.chmod(0o600)
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", [model("small", small)],
                       metrics_file=str(textfiles / "fast-start-gpu{gpu}.prom"))
    d = daemons(cfg, env={"STATE_DIRECTORY": str(state)}, wait=False)
    # The names the writers once used, planted as soon as the pid is known (it is public).
    os.symlink(victim, textfiles / f".fast-start-gpu0.prom.{d.proc.pid}.tmp")
    os.mkfifo(state / f".gpu0.evictions.json.{d.proc.pid}.tmp")
    d.wait_ready()
    prom = textfiles / "fast-start-gpu0.prom"
    wait_until(prom.exists, 30, "the metrics file")
    evict(cfg)                                            # the history is written
    assert victim.read_text() == "precious\n" and stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert not prom.is_symlink() and "fast_start_cache_hits_total" in prom.read_text()
    assert stat.S_IMODE(prom.stat().st_mode) == 0o644
    assert [(e["model"], e["reason"]) for e in json.loads((state / "gpu0.evictions.json").read_text())] == \
        [("small", "manual")]
    assert status(d)["gpu"] == 0                          # the serving loop never waited on a FIFO
    made = sorted(p.name for p in [*textfiles.iterdir(), *state.iterdir()] if not stat.S_ISFIFO(p.lstat().st_mode))
    assert made == sorted([f".fast-start-gpu0.prom.{d.proc.pid}.tmp", "fast-start-gpu0.prom", "gpu0.evictions.json"])


def test_a_write_that_fails_leaves_no_temporary_file_and_the_old_file_whole(tmp_path):
    target = tmp_path / "out.json"
    target.write_text("old")
    (tmp_path / "dir.json").mkdir()
    with pytest.raises(IsADirectoryError):
        files.write_atomic(tmp_path / "dir.json", "new")
    # The file size limit makes the kernel fail the write itself (EFBIG), as a full disk would (ENOSPC).
    code = ("import resource, sys\nfrom fast_start import files\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))\n"
            "try:\n    files.write_atomic(sys.argv[1], 'x' * 100000)\nexcept OSError as e:\n    print(e.errno)\n")
    out = subprocess.run([sys.executable, "-c", code, str(target)], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "27", out.stderr         # EFBIG
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir.json", "out.json"]
    assert target.read_text() == "old"


# -- 2: rewrites the keeper cannot see -----------------------------------------------------------

def rewrite_keeping_size_and_mtime(folder: Path) -> dict[str, torch.Tensor]:
    """New values written into the same file under the same header, the old mtime put back: the
    file's identity (device, inode, size, mtime) is unchanged, only inotify sees it."""
    path = folder / "model.safetensors"
    before = path.stat()
    tensors = {n: (t.float() * 1.5).to(t.dtype) for n, t in load_file(path).items()}
    with open(path, "r+b") as f:
        f.write(save(tensors, metadata={"format": "pt"}))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert watch.identity(folder) == {**watch.identity(folder), "model.safetensors": file_identity(before)}
    return tensors


def old_bytes_served(path: Path, run: Path, old: dict[str, torch.Tensor]) -> bool | None:
    """True: the cache serves `old`; None: a miss; False: the cache serves other bytes."""
    try:
        w = fast_start.fetch(spec(path), socket_dir=str(run), fallback=False)
    except CacheMiss:
        return None
    return all(torch.equal(w[n].view(torch.uint8), t.view(torch.uint8)) for n, t in old.items())


@pytest.mark.slow
def test_a_rewrite_only_inotify_sees_stops_serving_at_once_while_the_keeper_refills_another(tmp_path, small,
                                                                                           daemons):
    big = synth.write_checkpoint(tmp_path / "big", synth.Shape(num_layers=4), seed=3)
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", [model("small", small), model("big", big)],
                       fill_bandwidth="1MiB")     # a refill of `big` keeps the keeper busy for seconds
    d = daemons(cfg)
    old = {n: t.clone() for n, t in load_file(small / "model.safetensors").items()}
    assert old_bytes_served(small, tmp_path / "run", old) is True
    save_file({n: t + 1 for n, t in load_file(big / "model.safetensors").items()}, big / "model.safetensors")
    wait_until(lambda: any(m["name"] == "big" and m["state"] == "filling" for m in status(d)["missing"]), 30,
               "big refilling")
    rewrite_keeping_size_and_mtime(small)
    started = time.monotonic()
    wait_until(lambda: old_bytes_served(small, tmp_path / "run", old) is not True, 2, "small no longer served")
    assert any(m["name"] == "big" and m["state"] == "filling" for m in status(d)["missing"]), \
        f"the keeper was not busy: the test proves nothing ({time.monotonic() - started:.1f} s)"


def test_lost_inotify_events_make_every_model_count_as_written(tmp_path, small, daemons):
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", [model("small", small)])
    d = daemons(cfg)
    old = {n: t.clone() for n, t in load_file(small / "model.safetensors").items()}
    noise = [small / "noise-a", small / "noise-b"]      # alternating: the kernel merges repeated events
    for each in noise:
        each.write_text("")
    queue = int(Path("/proc/sys/fs/inotify/max_queued_events").read_text())
    os.kill(d.proc.pid, signal.SIGSTOP)
    try:
        for i in range(queue + 1000):                # more events than the kernel queues
            os.utime(noise[i % 2])
        rewrite_keeping_size_and_mtime(small)
    finally:
        os.kill(d.proc.pid, signal.SIGCONT)
    wait_until(lambda: old_bytes_served(small, tmp_path / "run", old) is not True, 10, "small no longer stale")
    assert "inotify queue overflowed" in d.log.read_text()
    wait_until(lambda: old_bytes_served(small, tmp_path / "run", old) is False, 60, "small refilled")


# -- 5 and 8: a broken fill worker ---------------------------------------------------------------

def hostile(tmp_path: Path, mode: str) -> str:
    """An interpreter path the daemon can be given as worker_python: it runs the hostile worker."""
    path = tmp_path / f"python-{mode}"
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{HOSTILE}" {mode} "$3"\n')    # $3: the socket fd
    path.chmod(0o755)
    return str(path)


def job(small) -> protocol.FillJob:
    return protocol.FillJob("small", spec(small)._asdict(), "cpu", 0)


@pytest.mark.slow
@pytest.mark.parametrize("mode,error", [("stall", "sent a bad frame: frame not complete in time"),
                                        ("repeat", "the fill made no progress for 3 s")])
def test_a_worker_stalled_mid_frame_or_repeating_its_progress_is_declared_hung(tmp_path, small, monkeypatch,
                                                                             mode, error):
    """A worker declared hung is killed as its session ends (not left 10 s to exit on its own) and
    is never given another job."""
    monkeypatch.setattr(fill, "FRAME_S", 1)
    monkeypatch.setattr(fill, "STALL_S", 3)
    with fill.Workers(fill.worker_env(1), threading.Event()) as workers:
        worker = workers.get(hostile(tmp_path, mode))
        with pytest.raises(fill.FillError, match=error):
            for _ in worker.run(job(small)):
                pass
        assert worker.hung and workers.get(worker.python) is not worker
    assert worker.proc.returncode == -signal.SIGKILL


def test_a_worker_reporting_on_another_model_is_declared_hung(tmp_path, small):
    with fill.Workers(fill.worker_env(1), threading.Event()) as workers:
        worker = workers.get(hostile(tmp_path, "other"))
        with pytest.raises(fill.FillError, match="answered 'small''s fill_job with a progress on 'another'"):
            for _ in worker.run(job(small)):
                pass
        assert worker.hung and workers.get(worker.python) is not worker
    assert worker.proc.returncode == -signal.SIGKILL


def test_a_worker_whose_answer_was_left_unread_is_not_given_the_next_job(tmp_path, small):
    """A caller that fails mid-fill leaves the rest of the job's answer in the stream: the next job
    would read it as its own. The worker is replaced, and killed as the session ends."""
    with fill.Workers(fill.worker_env(1), threading.Event()) as workers:
        worker = workers.get(hostile(tmp_path, "repeat"))
        reports = worker.run(job(small))
        assert next(reports)[0].kind == "progress"
        reports.close()
        assert worker.busy and not worker.hung and workers.get(worker.python) is not worker
    assert worker.proc.returncode == -signal.SIGKILL


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_descriptors_on_progress_and_checked_frames_are_closed(tmp_path, small):
    with fill.Worker(hostile(tmp_path, "fds"), fill.worker_env(1), threading.Event()) as worker:
        before = open_fds()
        checked = list(worker.run(protocol.CheckJob("small", spec(small)._asdict())))
        assert [m.kind for m, _ in checked] == ["checked"] and checked[0][1] == [] and not worker.busy
        reports = list(worker.run(job(small)))
        assert [m.kind for m, _ in reports][-1] == "filled" and all(not fds for _, fds in reports[:-1])
        for fd in reports[-1][1]:                 # the arena's: the caller's to keep
            os.close(fd)
        assert open_fds() == before


def test_a_filled_frame_without_its_arena_fds_fails_the_start_naming_it(tmp_path, small, daemons):
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", [model("small", small)],
                       worker_python=hostile(tmp_path, "count"))
    d = daemons(cfg, wait=False)
    assert d.proc.wait(120) == 2       # a worker out of protocol: a restart would not cure it
    log = d.log.read_text()
    assert "the fill worker sent 0 fds for small's 1 arenas" in log and "Traceback" not in log, log
    assert not d.listener.texts("READY=1")


# -- 6: damaged state and history files ----------------------------------------------------------

@pytest.mark.parametrize("damage", ["[" * 200_000, "fifo", '[{"time": "yesterday", "model": "x", "reason": "manual", '
                                                          '"bytes": 1, "leases": 0}, 7, {"model": 1}]'])
def test_a_damaged_eviction_history_is_set_aside_and_the_daemon_starts(tmp_path, small, daemons, damage):
    state = tmp_path / "state"
    state.mkdir()
    history = state / "gpu0.evictions.json"
    if damage == "fifo":
        os.mkfifo(history)
    else:
        history.write_text(damage)
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", [model("small", small)])
    d = daemons(cfg, env={"STATE_DIRECTORY": str(state)})
    log = d.log.read_text()
    assert "eviction history" in log and "Traceback" not in log, log
    assert evictions(d) == []
    evict(cfg)
    r = runner.invoke(app, ["evictions", "--config", str(cfg)])
    assert r.exit_code == 0 and "manual" in r.stdout, r.output
    assert [e["reason"] for e in json.loads(history.read_text())] == ["manual"]


@pytest.mark.parametrize("damage", ['{"gpu": 0, "state": "loading"}', '["ready"]', '{"gpu": 0, "state": "failed", '
                                    '"pid": 0}', "[" * 200_000, "fifo"])
def test_a_damaged_state_file_is_one_line_from_status(tmp_path, damage):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    if damage == "fifo":
        os.mkfifo(run / "gpu0.state")
    else:
        (run / "gpu0.state").write_text(damage)
    cfg = write_config(tmp_path / "fs.toml", run, [])
    out = subprocess.run([sys.executable, "-m", "fast_start", "status", "--config", str(cfg)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 3 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith(f"error: GPU 0: no daemon answers and {run / 'gpu0.state'} is damaged ("), out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


# -- 9: verify of a damaged checkpoint -----------------------------------------------------------

def test_verify_of_a_truncated_checkpoint_names_the_truncation(tmp_path, small, daemons):
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", [model("small", small)])
    daemons(cfg)
    path = small / "model.safetensors"
    size = path.stat().st_size
    os.truncate(path, size - 10)
    r = subprocess.run([sys.executable, "-m", "fast_start", "verify", "--model", str(small), "--config", str(cfg)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stderr.strip() == (
        f"error: {path} is truncated: {size - 10} bytes, its header needs {size} (fix: re-download or re-export this "
        "file; the daemon refills it once it is whole)"), r.stderr

"""Big models on the CPU device: arenas in chunks, a copy that takes the cache's place chunk by
chunk, fills that wait for room naming the shortfall, and the memory `status` reports."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from probe import ask, evictions, status, wait_until

import fast_start
from fast_start import protocol
from fast_start.cli import app
from fast_start.config import load
from fast_start.errors import CacheMiss, ConfigError
from fast_start.materialize import load_from_disk
from devtools.harness import write_config

runner = CliRunner()
CHUNK = 256 << 10


def model(name, path, **kw):
    return {"name": name, "path": str(path), "gpus": [0], "engine_version": "test", **kw}


def memfds(pid: int) -> set[int]:
    """The fds of fast-start arenas (memfds) process `pid` holds open (this one may hold some of
    earlier tests' too)."""
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue
        if target.startswith("/memfd:fast-start"):
            out.add(int(fd))
    return out


@pytest.mark.parametrize("mode", ["zero_copy", "copy"])
def test_a_model_in_chunks_is_served_bit_identical_to_the_disk_in_both_modes(tmp_path, small, daemons, mode):
    run = tmp_path / "run"
    d = daemons(write_config(tmp_path / "fs.toml", run, [model("small", small)], arena_chunk="256KiB"))
    (m,) = status(d)["models"]
    assert m["arenas"] >= 4
    spec = fast_start.WeightSpec(str(small), engine_version="test")
    before = memfds(os.getpid())
    w = fast_start.fetch(spec, mode=mode, socket_dir=str(run), fallback=False)
    disk, _, _ = load_from_disk(spec)
    assert w.source == "cache" and set(w) == set(disk)
    assert all(torch.equal(w[n], disk[n]) for n in disk)
    # Each arena fd was closed once mapped or copied; on the CPU a zero_copy map holds its own
    # (Python's mmap keeps a duplicate of the fd).
    assert len(memfds(os.getpid()) - before) == (m["arenas"] if mode == "zero_copy" else 0)


def test_a_copy_with_on_release_drop_takes_the_caches_place_chunk_by_chunk(tmp_path, small, daemons):
    """The daemon lets go of the arenas (and the fd store of its copies) before its reply goes
    out, and the engine closes each arena's fd once it is copied: when the copy is made, no
    process but the engine holds an arena, so no more than one is ever held twice."""
    run = tmp_path / "run"
    d = daemons(write_config(tmp_path / "fs.toml", run, [model("small", small)], arena_chunk="256KiB",
                             on_release="drop"))
    assert len(memfds(d.proc.pid)) == status(d)["models"][0]["arenas"] >= 4
    assert len(d.listener.store) >= 4           # systemd's fd store holds its copies
    spec = fast_start.WeightSpec(str(small), engine_version="test")
    before = memfds(os.getpid())            # the fd store's copies among them (the listener is in this process)
    w = fast_start.fetch(spec, mode="copy", socket_dir=str(run), fallback=False)
    assert w.source == "cache"
    wait_until(lambda: memfds(d.proc.pid) == set(), what="the daemon closing the copied arenas")
    wait_until(lambda: not d.listener.store, what="the fd store emptied")
    assert memfds(os.getpid()) <= before
    assert evictions(d) == [("small", "release")]
    disk, _, _ = load_from_disk(spec)
    assert all(torch.equal(w[n], disk[n]) for n in disk)


@pytest.mark.slow
def test_a_reload_adding_a_model_with_no_room_waits_naming_the_shortfall(tmp_path, small, llama_tied, daemons):
    run = tmp_path / "run"
    cfg = write_config(tmp_path / "fs.toml", run, [model("small", small)])
    d = daemons(cfg)
    before = status(d)["models"][0]["filled_at"]
    write_config(tmp_path / "fs.toml", run, [model("small", small), model("big", llama_tied)], keep_free="100%")
    d.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: [m["state"] for m in status(d)["missing"]] == ["no_room"], what="the shortfall")
    (waiting,) = status(d)["missing"]
    assert re.fullmatch(r"big needs \d+\.\d\d [KMG]iB of host memory to fill \(\d+\.\d\d [KMG]iB of weights\); "
                        r"\d+\.\d\d [KMG]iB is free and keep_free leaves \d+\.\d\d [KMG]iB of it to engines: \d+\.\d\d [KMG]iB short",
                        waiting["detail"]), waiting["detail"]
    assert [m["name"] for m in status(d)["models"]] == ["small"] and status(d)["models"][0]["filled_at"] == before
    assert evictions(d) == []
    spec = fast_start.WeightSpec(str(small), engine_version="test")
    assert fast_start.fetch(spec, socket_dir=str(run), fallback=False).source == "cache"
    shortfall = [s for s in ask(d, protocol.Metrics())["samples"] if s[0] == "fast_start_fill_shortfall_bytes"]
    assert {s[1]["model"]: s[2] > 0 for s in shortfall} == {"small": False, "big": True}
    assert d.log.read_text().count("big waits for room") == 1
    r = runner.invoke(app, ["status", "--config", str(cfg)], env={"COLUMNS": "200"})
    assert r.exit_code == 1 and "no_room" in r.stdout
    assert re.search(r"GPU 0 \(host memory\): \d+\.\d\d [KMG]iB total, \d+\.\d\d MiB held by the cache, \d+\.\d\d [KMG]iB free, "
                     r"keep_free \d+\.\d\d [KMG]iB", r.stdout), r.stdout
    write_config(tmp_path / "fs.toml", run, [model("small", small), model("big", llama_tied)])
    d.proc.send_signal(signal.SIGHUP)           # room again: filled at once
    wait_until(lambda: sorted(m["name"] for m in status(d)["models"]) == ["big", "small"], what="the fill")
    assert status(d)["memory"]["held"] == sum(m["bytes"] for m in status(d)["models"]) > 0


@pytest.mark.parametrize("key,value,fix", [
    ("arena_chunk", '"4KiB"', "from 64KiB to 2GiB"),
    ("arena_chunk", '"3GiB"', "from 64KiB to 2GiB"),
    ("keep_free", '"120%"', "a share up to 100%"),
    ("memory_budget", '"120%"', "a share up to 100%"),
    ("keep_free", '"lots"', 'write bytes'),
])
def test_memory_keys_out_of_range_name_the_key_and_the_fix(tmp_path, key, value, fix):
    path = tmp_path / "fs.toml"
    path.write_text(f'[daemon]\ndevice = "cpu"\n{key} = {value}\n')
    with pytest.raises(ConfigError, match=rf"\[daemon\] key '{key}' is .*fix: .*{re.escape(fix)}"):
        load(path, check_paths=False)


def test_status_json_reports_the_devices_memory(tmp_path, small, daemons):
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", [model("small", small)], keep_free="1MiB")
    d = daemons(cfg)
    r = runner.invoke(app, ["status", "--config", str(cfg), "--json"])
    assert r.exit_code == 0
    mem = json.loads(r.stdout)[0]["memory"]
    assert mem["keep_free"] == 1 << 20 and mem["held"] == status(d)["models"][0]["bytes"]
    assert mem["total"] >= mem["free"] > 0


def test_check_config_fails_a_device_whose_largest_model_cannot_be_filled(tmp_path, small, llama_tied):
    models = [model("small", small), model("big", llama_tied)]
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", models, worker_python=sys.executable)
    r = runner.invoke(app, ["check-config", "--config", str(cfg), "--json"])
    checks = {c["check"]: c for c in json.loads(r.stdout)}
    assert r.exit_code == 0 and "fill GPU 0" not in checks
    full = write_config(tmp_path / "full.toml", tmp_path / "run", models, worker_python=sys.executable,
                        keep_free="100%")
    r = runner.invoke(app, ["check-config", "--config", str(full), "--json"])
    checks = {c["check"]: c for c in json.loads(r.stdout)}
    assert r.exit_code == 2 and not checks["fill GPU 0"]["ok"]
    assert re.fullmatch(r"the largest model's fill needs about \d+\.\d\d [KMG]iB at its peak; beside the other models "
                        r"and keep_free, -\d+\.\d\d [KMG]iB is left: serve fewer models on this GPU, or lower keep_free",
                        checks["fill GPU 0"]["detail"]), checks["fill GPU 0"]["detail"]


def test_a_copy_beside_a_kept_cache_without_room_is_refused_naming_both_options(tmp_path, small, daemons):
    run = tmp_path / "run"
    cfg = write_config(tmp_path / "fs.toml", run, [model("small", small)], keep_free="0")
    d = daemons(cfg)
    write_config(tmp_path / "fs.toml", run, [model("small", small)], keep_free="100%")
    d.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: "reloaded" in d.log.read_text(), what="the reload")
    spec = fast_start.WeightSpec(str(small), engine_version="test")
    with pytest.raises(CacheMiss) as e:
        fast_start.fetch(spec, mode="copy", socket_dir=str(run), fallback=False)
    assert re.fullmatch(r"no room on host memory for a copy of small \(\d+\.\d\d [KMG]iB\) beside the cache "
                        r'\(on_release = "keep"\): \d+\.\d\d [KMG]iB free, \d+\.\d\d [KMG]iB needed with keep_free '
                        r"\(model 'small'\)", e.value.what)
    assert e.value.fix == ('set on_release = "drop" in the daemon\'s config (a copy then takes the cache\'s place), '
                           "or load with mode zero_copy")
    assert fast_start.fetch(spec, mode="zero_copy", socket_dir=str(run), fallback=False).source == "cache"
    (m,) = status(d)["models"]
    assert "copy refused" in m["note"] and evictions(d) == []
    misses = [s for s in ask(d, protocol.Metrics())["samples"] if s[0] == "fast_start_cache_misses_total" and s[2]]
    assert [(s[1]["reason"], s[2]) for s in misses] == [("memory", 1)]
    r = runner.invoke(app, ["status", "--config", str(cfg)], env={"COLUMNS": "200"})
    assert "small: " in r.stdout and "copy refused: no room on host memory" in r.stdout


ENGINE_WITH_A_FULL_FD_TABLE = r"""
import json, os, sys, threading
import fast_start
from fast_start import protocol

def fd_size():
    return int(next(l.split()[1] for l in open("/proc/self/status") if l.startswith("FDSize:")))

# Threads share the fd table, as in an engine: the kernel then grows it the slow way.
threading.Thread(target=threading.Event().wait, daemon=True).start()
size, held = fd_size(), []
while True:                      # every fd below the last `room` of the table taken
    fd = os.open("/dev/null", os.O_RDONLY)
    if fd >= size - int(sys.argv[2]):
        os.close(fd)
        break
    held.append(fd)
w = fast_start.fetch(fast_start.WeightSpec(sys.argv[1], engine_version="test"), mode="copy",
                     socket_dir=os.environ["FAST_START_SOCKET_DIR"], fallback=False)
print(json.dumps({"source": w.source, "before": size, "after": fd_size(), "batch": protocol.FD_BATCH}))
"""


def test_an_engine_with_few_free_fds_gets_many_arenas_without_its_fd_table_growing(tmp_path, llama_tied, daemons):
    """An Acquired reply's fds come FD_BATCH at a time and each batch is mapped and closed before
    the next is read: an engine needs that many free slots in its fd table, not one per arena (the
    kernel's growth of a threaded process's table waits for an RCU grace period, BENCHMARKS.md)."""
    run = tmp_path / "run"
    d = daemons(write_config(tmp_path / "fs.toml", run, [model("llama", llama_tied)], arena_chunk="64KiB"))
    (m,) = status(d)["models"]
    room = 2 * protocol.FD_BATCH         # the connection, the batch, a copy's map and a header's file
    assert m["arenas"] >= 2 * room        # all at once would need twice the room
    env = {**os.environ, "FAST_START_SOCKET_DIR": str(run)}
    out = subprocess.run([sys.executable, "-c", ENGINE_WITH_A_FULL_FD_TABLE, str(llama_tied), str(room)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["source"] == "cache" and got["after"] == got["before"], got

"""The cache outlives the daemon process through the fd store (systemd's protocol, emulated by
the test's NOTIFY_SOCKET listener; tests/test_systemd.py does the same under a real systemd)."""
from __future__ import annotations

import shutil
import signal
import time

import torch
from scramble import scramble

import fast_start
from devtools.harness import write_config
from fast_start.cli import app
from typer.testing import CliRunner


def model(path, **kw):
    return {"name": "llama", "path": str(path), "gpus": [0], "engine_version": "test", **kw}


def raw(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_restarted_daemon_readopts_the_store_without_reading_tensors(tmp_path, llama, daemons):
    folder = shutil.copytree(llama, tmp_path / "model")
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", [model(folder, quantization="fp8")])
    spec = fast_start.WeightSpec(str(folder), quantization="fp8", engine_version="test")
    disk = fast_start.fetch(spec, socket_dir=str(tmp_path / "none"))
    first = daemons(cfg)
    names = sorted(first.listener.store)
    assert len(names) == 2 and names[0].endswith("-a0") and names[1].endswith("-m")
    first.proc.send_signal(signal.SIGKILL)                 # a crash
    first.proc.wait(30)
    scramble(folder)                                       # a tensor read from disk now comes out wrong
    listen = dict(first.listener.store)
    second = daemons(cfg, listen=listen)
    assert not second.listener.texts("STATUS=filling llama")
    assert "re-adopted llama rank 0" in second.log.read_text()
    r = CliRunner().invoke(app, ["status", "--config", str(cfg)])
    row = next(line for line in r.stdout.splitlines() if "llama" in line)
    assert r.exit_code == 0 and "re-adopted" in row and f"fast-start {fast_start.__version__}, pid" in r.stdout
    cache = fast_start.fetch(spec, socket_dir=str(tmp_path / "run"), fallback=False)
    assert cache.fingerprint == disk.fingerprint
    for name in disk:
        assert torch.equal(raw(cache[name]), raw(disk[name])), name


def test_changed_config_drops_the_stored_arena_and_refills(tmp_path, llama, daemons):
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", [model(llama)])
    first = daemons(cfg)
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(30)
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", [model(llama, engine_version="new")])
    second = daemons(cfg, listen=dict(first.listener.store))
    log = second.log.read_text()
    assert "the config changed its engine_version" in log
    assert second.listener.texts("STATUS=filling llama")
    assert len(second.listener.texts("FDSTOREREMOVE=1")) == 2      # the manifest and the arena
    w = fast_start.fetch(fast_start.WeightSpec(str(llama), engine_version="new"),
                         socket_dir=str(tmp_path / "run"), fallback=False)
    assert w.source == "cache"


def test_eviction_removes_the_model_from_the_store(tmp_path, llama, daemons):
    from fast_start import protocol
    from fast_start.transport import connect, request
    d = daemons(write_config(tmp_path / "fs.toml", tmp_path / "run", [model(llama)]))
    assert len(d.listener.store) == 2
    with connect(d.socket, 5) as conn:
        request(conn, protocol.Hello(protocol.VERSION))
        request(conn, protocol.Evict("llama"))
    deadline = time.monotonic() + 5
    while d.listener.store and time.monotonic() < deadline:
        time.sleep(0.05)
    assert d.listener.store == {}


def test_two_models_of_one_fingerprint_are_stored_and_readopted_apart(tmp_path, llama, daemons):
    """Two entries for one checkpoint (an engine upgrade's second entry, before the engines move)
    have one fingerprint: their fd store names differ, so both come back after a crash, and the
    eviction of one leaves the other's."""
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", [model(llama), {**model(llama), "name": "next"}])
    first = daemons(cfg)
    assert len(first.listener.store) == 4
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(30)
    second = daemons(cfg, listen=dict(first.listener.store))
    log = second.log.read_text()
    assert "re-adopted llama rank 0" in log and "re-adopted next rank 0" in log and "cached" not in log


def test_a_restart_with_one_model_folder_removed_keeps_every_models_cache(tmp_path, llama, small, daemons):
    """`rm -rf` of one served model's folder, then a crash: the restart re-adopts the healthy
    model and what was filled from the removed folder (engines must still present the fill's
    files to be served), instead of failing the start and losing the GPU's whole cache."""
    victim = shutil.copytree(small, tmp_path / "victim")
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", [model(llama), {**model(victim), "name": "victim"}])
    first = daemons(cfg)
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(30)
    shutil.rmtree(victim)
    second = daemons(cfg, listen=dict(first.listener.store))
    log = second.log.read_text()
    assert "re-adopted llama rank 0" in log and "re-adopted victim rank 0" in log and "cached" not in log, log
    w = fast_start.fetch(fast_start.WeightSpec(str(llama), engine_version="test"), socket_dir=str(second.socket_dir),
                         fallback=False)
    assert w.source == "cache"

"""The daemon's life around serving: one per GPU, failures that say why, reload, clean stops."""
from __future__ import annotations

import json
import os
import re
import resource
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import torch
from typer.testing import CliRunner

from probe import evictions, status, wait_until

import fast_start
from fast_start.cli import app
from devtools.harness import write_config

runner = CliRunner()


def model(name, path, **kw):
    return {"name": name, "path": str(path), "gpus": [0], "engine_version": "test", **kw}




def test_a_second_daemon_for_the_same_gpu_fails_at_once_naming_the_first(tmp_path, small, daemons):
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", [model("small", small)])
    first = daemons(cfg)
    state = (tmp_path / "run" / "gpu0.state").read_text()
    second = daemons(cfg, wait=False)
    assert second.proc.wait(30) == 2       # a start it names: the unit does not restart it
    log = second.log.read_text()
    assert "Traceback" not in log
    assert [line for line in log.splitlines() if line.startswith("error")] == [f"error: GPU 0's daemon already runs (pid {first.proc.pid}, lock {tmp_path}/run/gpu0.lock) "
                     "(fix: stop it first (systemctl stop fast-start@0), or serve another GPU)"]
    assert (tmp_path / "run" / "gpu0.state").read_text() == state and first.socket.is_socket()
    assert status(first)["state"] == "ready"


def test_a_start_that_fails_on_the_budget_says_so_in_status(tmp_path, small, daemons):
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", [model("small", small)], memory_budget="1MB")
    d = daemons(cfg, wait=False)
    assert d.proc.wait(60) == 2       # a config error: the unit's RestartPreventExitStatus=2 ends it failed
    log = d.log.read_text()
    assert re.search(r"models need \d+\.\d\d MiB, more than memory_budget '1MB' \(976\.56 KiB\)", log), log
    assert "Traceback" not in log
    r = runner.invoke(app, ["status", "--config", str(cfg), "--json"])
    assert r.exit_code == 1
    s = json.loads(r.stdout)[0]
    assert s["state"] == "failed" and "more than memory_budget" in s["error"]


def test_shutdown_is_clean_when_the_service_manager_is_gone(tmp_path, small, daemons):
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", [model("small", small)])
    d = daemons(cfg)
    d.listener.close()                          # NOTIFY_SOCKET now points at nothing
    os.unlink(d.listener.path)
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(30) == 0, d.log.read_text()
    assert not d.socket.exists() and not (tmp_path / "run" / "gpu0.state").exists()
    assert "Traceback" not in d.log.read_text()


def test_sighup_reloads_the_config_adding_changing_and_removing_models(tmp_path, small, llama_tied, daemons):
    run = tmp_path / "run"
    cfg = write_config(tmp_path / "fs.toml", run, [model("small", small), model("keep", llama_tied)])
    d = daemons(cfg)
    kept_at = {m["name"]: m["filled_at"] for m in status(d)["models"]}["keep"]
    write_config(tmp_path / "fs.toml", run, [model("keep", llama_tied), model("new", small, engine_version="v2")])
    d.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: sorted(m["name"] for m in status(d)["models"]) == ["keep", "new"], what="the reload")
    assert d.proc.poll() is None
    models = {m["name"]: m for m in status(d)["models"]}
    assert models["keep"]["filled_at"] == kept_at                      # untouched
    w = fast_start.fetch(fast_start.WeightSpec(str(small), engine_version="v2"), socket_dir=str(run), fallback=False)
    assert w.source == "cache"
    assert evictions(d) == [("small", "config change")]
    d.listener.wait_for("RELOADING=1")
    (tmp_path / "fs.toml").write_text("[daemon]\ncolour = 1\n")          # a bad config: keep running
    d.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: "reload failed, keeping the running config" in d.log.read_text(), what="the failed reload")
    assert status(d)["state"] == "ready" and len(status(d)["models"]) == 2


def test_a_reload_rotating_to_a_folder_of_the_same_shapes_refills_and_a_renamed_one_is_kept(tmp_path, daemons):
    """Headers alone do not tell two checkpoints apart: a folder of the same shapes and config.json
    but other weights, rotated in by a reload, is refilled (status, engines and evictions agree);
    the same files under a new path (a renamed folder) are the same checkpoint, served from there."""
    from devtools import synth
    shape = synth.Shape(num_layers=1)
    old, new = synth.write_checkpoint(tmp_path / "old", shape, seed=1), synth.write_checkpoint(tmp_path / "new", shape, seed=2)
    assert (old / "config.json").read_bytes() == (new / "config.json").read_bytes()
    run = tmp_path / "run"
    cfg = write_config(tmp_path / "fs.toml", run, [model("small", old)])
    d = daemons(cfg)
    write_config(tmp_path / "fs.toml", run, [model("small", new)])
    assert runner.invoke(app, ["reload", "--gpu", "0", "--config", str(cfg)]).exit_code == 0
    wait_until(lambda: [m["path"] for m in status(d)["models"]] == [str(new)], what="the new folder filled")
    assert evictions(d) == [("small", "config change")]
    assert re.search(r"reload: small changed its files \(.*/old -> .*/new: config\.json is another file\)",
                     d.log.read_text())
    spec = fast_start.WeightSpec(str(new), engine_version="test")
    w = fast_start.fetch(spec, socket_dir=str(run), fallback=False)
    disk = fast_start.fetch(spec, socket_dir=str(tmp_path / "none"))
    assert w.source == "cache" and all(torch.equal(w[n], disk[n]) for n in disk)
    assert runner.invoke(app, ["verify", "--model", "small", "--config", str(cfg)]).exit_code == 0

    filled_at = status(d)["models"][0]["filled_at"]
    renamed = new.rename(tmp_path / "renamed")
    write_config(tmp_path / "fs.toml", run, [model("small", renamed)])
    assert runner.invoke(app, ["reload", "--gpu", "0", "--config", str(cfg)]).exit_code == 0
    (m,) = status(d)["models"]
    assert (m["path"], m["filled_at"]) == (str(renamed), filled_at) and len(evictions(d)) == 1
    assert fast_start.fetch(fast_start.WeightSpec(str(renamed), engine_version="test"), socket_dir=str(run),
                            fallback=False).source == "cache"


def test_fast_start_reload_returns_once_the_daemon_has_read_the_config_and_fails_on_a_refused_one(
        tmp_path, small, llama_tied, daemons):
    """What the unit's ExecReload runs: a SIGHUP alone returns before the daemon reads the config,
    so a `status` right after would still see the old one. `fast-start reload` returns after."""
    run = tmp_path / "run"
    cfg = write_config(tmp_path / "fs.toml", run, [model("small", small)])
    d = daemons(cfg)
    assert status(d)["reloads"] == 0
    write_config(tmp_path / "fs.toml", run, [model("small", small), model("new", llama_tied)])
    r = runner.invoke(app, ["reload", "--gpu", "0", "--config", str(cfg), "--json"])
    assert r.exit_code == 0, r.stdout + r.stderr
    assert json.loads(r.stdout) == {"gpu": 0, "reloaded": True, "error": "", "configured": ["small", "new"]}
    now = status(d)         # at once: the new model is configured (cached or being filled)
    assert now["reloads"] == 1 and {m["name"] for m in now["models"] + now["missing"]} == {"small", "new"}
    cli = shutil.copy(cfg, tmp_path / "cli.toml")           # where the CLI finds the socket
    (tmp_path / "fs.toml").write_text("[daemon]\ncolour = 1\n")          # refused: the running config stays
    r = runner.invoke(app, ["reload", "--gpu", "0", "--config", str(cli)])
    assert r.exit_code == 1 and "reload refused, the running config kept" in r.stdout and "colour" in r.stdout
    assert status(d)["reloads"] == 2 and d.proc.poll() is None


def test_a_reload_names_the_settings_that_need_a_restart_and_applies_the_rest(tmp_path, small, daemons):
    """device cannot change under a running daemon: the reload says so at warning, keeps the
    running value and applies the rest, here engines of another uid (socket and folder opened)."""
    run = tmp_path / "run"
    cfg = write_config(tmp_path / "fs.toml", run, [model("small", small)])
    d = daemons(cfg)
    assert stat.S_IMODE(os.stat(d.socket).st_mode) == 0o600
    write_config(tmp_path / "fs.toml", run, [model("small", small)], device="cuda", allowed_uids=[4242])
    d.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: "reloaded" in d.log.read_text(), what="the reload")
    line = next(ln for ln in d.log.read_text().splitlines() if "take effect at a restart" in ln)
    assert line.startswith("WARNING") and "device changed in" in line and "keeps device = 'cpu'" in line
    assert stat.S_IMODE(os.stat(d.socket).st_mode) == 0o666 and stat.S_IMODE(os.stat(run).st_mode) == 0o755
    assert status(d)["state"] == "ready" and [m["name"] for m in status(d)["models"]] == ["small"]
    d.listener.wait_for("STATUS=ready: reloaded, 1 model(s) configured; restart to apply device")


def test_status_evictions_and_evict_work_while_the_model_folder_is_away(tmp_path, small, daemons):
    folder = shutil.copytree(small, tmp_path / "model")
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", [model("small", folder)])
    daemons(cfg)
    folder.rename(tmp_path / "away")                 # NFS down: the folder is gone, the cache is not
    r = runner.invoke(app, ["status", "--config", str(cfg)])
    assert r.exit_code == 0 and "ready" in r.stdout, r.stdout + r.stderr
    assert runner.invoke(app, ["evictions", "--config", str(cfg)]).exit_code == 0
    r = runner.invoke(app, ["evict", "--gpu", "0", "--model", "small", "--config", str(cfg)])
    assert r.exit_code == 0 and "evicted small" in r.stdout
    r = runner.invoke(app, ["status", "--config", str(cfg)])
    assert r.exit_code == 1 and "evicted" in r.stdout            # configured, not cached


def test_a_socket_directory_problem_exits_2(tmp_path, small, daemons):
    run = tmp_path / "run"
    run.mkdir(mode=0o777)
    os.chmod(run, 0o777)
    d = daemons(write_config(tmp_path / "fs.toml", run, [model("small", small)]), wait=False)
    assert d.proc.wait(60) == 2
    assert "group- or world-writable" in d.log.read_text()


def test_an_unknown_group_is_a_config_error_naming_the_key(tmp_path, small):
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", [model("small", small)],
                       allowed_groups=["no-such-group"])
    p = subprocess.run([Path(sys.executable).parent / "fast-start", "daemon", "--gpu", "0", "--config", cfg],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1] == (
        f"error: {cfg}: [daemon] key 'allowed_groups' names group 'no-such-group', which does not exist on this "
        "host (fix: create it (groupadd no-such-group) or remove it from allowed_groups)")


def test_a_memory_limit_the_worker_cannot_live_with_fails_the_start_in_one_line(tmp_path, small, daemons):
    # Enough for the daemon (no torch), too little for a worker to map torch's libraries.
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", [model("small", small)])
    d = daemons(cfg, wait=False, rlimits={resource.RLIMIT_AS: 600 * 2**20})
    assert d.proc.wait(120) == 2
    log = d.log.read_text()
    errors = [line for line in log.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "cannot load torch" in errors[0] and "LimitAS=" in errors[0], log
    assert "Traceback" not in log
    r = runner.invoke(app, ["status", "--config", str(cfg), "--json"])
    assert r.exit_code == 1 and json.loads(r.stdout)[0]["state"] == "failed"


def test_the_eviction_history_survives_a_restart_in_the_state_directory(tmp_path, small, daemons):
    """Under systemd's StateDirectory= ($STATE_DIRECTORY) the evictions outlive the process; a
    damaged history file is named in the log and set aside, and the daemon starts all the same."""
    state = tmp_path / "state"
    state.mkdir()
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", [model("small", small)])
    env = {"STATE_DIRECTORY": str(state)}
    d = daemons(cfg, env=env)
    assert runner.invoke(app, ["evict", "--gpu", "0", "--model", "small", "--config", str(cfg)]).exit_code == 0
    d.stop()
    saved = json.loads((state / "gpu0.evictions.json").read_text())
    assert [(e["model"], e["reason"]) for e in saved] == [("small", "manual")]
    d = daemons(cfg, env=env)                                    # a new process: the history is back
    assert evictions(d) == [("small", "manual")]
    for damaged in ('[{"model": 1}, ', "[" + " " * (16 << 20) + "]"):      # not JSON; over the read cap
        d.stop()
        (state / "gpu0.evictions.json").write_text(damaged)
        d = daemons(cfg, env=env)
        assert evictions(d) == [] and "cannot read the eviction history" in d.log.read_text()
        (aside,) = state.glob("gpu0.evictions.json.unreadable-*")          # kept for a person to look at
        assert aside.read_text() == damaged and f"set aside as {aside}" in d.log.read_text()
        aside.unlink()
        assert runner.invoke(app, ["evict", "--gpu", "0", "--model", "small", "--config", str(cfg)]).exit_code == 0
        assert [e["reason"] for e in json.loads((state / "gpu0.evictions.json").read_text())] == ["manual"]


def test_a_start_with_one_model_folder_unusable_serves_the_others_and_names_it(tmp_path, small, llama_tied, daemons):
    """A model whose folder is gone or holds a truncated shard fails alone: the daemon is ready with
    the others cached, the broken one failed in status with the reason, one line at error naming
    it, and it is filled once its folder is usable again."""
    gone, truncated = tmp_path / "gone", shutil.copytree(small, tmp_path / "truncated")
    with open(truncated / "model.safetensors", "r+b") as f:
        f.truncate(f.seek(0, 2) - 1000)
    run = tmp_path / "run"
    cfg = write_config(tmp_path / "fs.toml", run, [model("good", llama_tied), model("gone", gone),
                                                   model("truncated", truncated)])
    d = daemons(cfg)
    s = status(d)
    assert [m["name"] for m in s["models"]] == ["good"]
    assert {m["name"]: m["state"] for m in s["missing"]} == {"gone": "failed", "truncated": "failed"}
    details = {m["name"]: m["detail"] for m in s["missing"]}
    assert "is not a folder" in details["gone"] and "truncated" in details["truncated"], details
    errors = [line for line in d.log.read_text().splitlines() if line.startswith("ERROR")]
    assert len(errors) == 2 and all("cannot be filled" in e and "the other models are served (fix:" in e
                                    for e in errors), errors
    r = runner.invoke(app, ["status", "--config", str(cfg)], env={"COLUMNS": "200"})
    assert r.exit_code == 1 and "failed" in r.stdout
    shutil.copytree(small, gone)
    wait_until(lambda: "gone" in [m["name"] for m in status(d)["models"]], what="the folder back and filled")
    assert fast_start.fetch(fast_start.WeightSpec(str(gone), engine_version="test"), socket_dir=str(run),
                            fallback=False).source == "cache"


def test_a_fifo_where_a_checkpoint_file_belongs_fails_that_model_at_once(tmp_path, small, llama_tied, daemons):
    """A FIFO config.json (or shard) is never opened blocking: the daemon, check-config and the
    keeper go on, the model failed with the reason, another model's refill not held up."""
    fifo = shutil.copytree(small, tmp_path / "fifo")
    (fifo / "config.json").unlink()
    os.mkfifo(fifo / "config.json")
    other = shutil.copytree(llama_tied, tmp_path / "other")
    run = tmp_path / "run"
    cfg = write_config(tmp_path / "fs.toml", run, [model("fifo", fifo), model("other", other)])
    r = runner.invoke(app, ["check-config", "--config", str(cfg)])
    assert r.exit_code != 0 and f"{fifo}/config.json is not a regular file" in r.stdout + r.stderr, r.stdout
    d = daemons(cfg)
    (missing,) = status(d)["missing"]
    assert missing["state"] == "failed" and f"{fifo}/config.json is not a regular file" in missing["detail"]
    filled_at = status(d)["models"][0]["filled_at"]
    (other / "config.json").write_text((other / "config.json").read_text())      # a rewrite: refilled
    wait_until(lambda: [m["filled_at"] for m in status(d)["models"] if m["name"] == "other"] not in ([filled_at], []),
               what="the other model refilled")


def test_a_reload_asked_while_another_runs_waits_for_its_own(tmp_path, small, llama_tied, daemons, monkeypatch):
    """`fast-start reload` returns once a reload that began after its signal is done: one asked
    while another is under way (that one read the file before this change) waits for the next.
    The worker interpreter waits while a hold file exists, which keeps the first reload going."""
    import threading
    hold = tmp_path / "hold"
    gate = tmp_path / "python"
    gate.write_text(f"#!/bin/sh\nwhile [ -e {hold} ]; do sleep 0.05; done\nexec {sys.executable} \"$@\"\n")
    gate.chmod(0o755)
    run = tmp_path / "run"
    cfg = write_config(tmp_path / "fs.toml", run, [model("small", small)], worker_python=str(gate))
    d = daemons(cfg)
    hold.touch()
    write_config(tmp_path / "fs.toml", run, [model("small", small), model("first", llama_tied)],
                 worker_python=str(gate))
    d.proc.send_signal(signal.SIGHUP)           # another operator's reload, not waited for

    def children() -> str:      # of any of the daemon's threads: the keeper's start the workers
        return "".join(f.read_text() for f in Path(f"/proc/{d.proc.pid}/task").glob("*/children")).strip()
    wait_until(children, 60, "the first reload's worker (the file was read before it)")
    write_config(tmp_path / "fs.toml", run, [model("small", small), model("first", llama_tied),
                                             model("second", small, engine_version="v2")], worker_python=str(gate))
    signalled, kill = threading.Event(), os.kill
    monkeypatch.setattr(os, "kill", lambda pid, sig: (kill(pid, sig), signalled.set()))
    result = {}
    ours = threading.Thread(target=lambda: result.update(r=runner.invoke(
        app, ["reload", "--gpu", "0", "--config", str(cfg), "--json"])))
    ours.start()
    assert signalled.wait(60)
    hold.unlink()               # the first reload goes on, and ends
    ours.join(120)
    r = result["r"]
    assert r.exit_code == 0, r.stdout + r.stderr
    assert sorted(json.loads(r.stdout)["configured"]) == ["first", "second", "small"], r.stdout

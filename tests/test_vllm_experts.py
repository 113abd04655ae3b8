"""vLLM's expert layouts: round-robin expert placement, TP x DP with experts, and an
expert-parallel engine where the daemons hold ranks without it, all served by four daemons.

The engines and reports are those of test_vllm.py (tests/vllm_support.py); these tests need
none of its module-wide cache, so they run apart from it (`make test` runs modules in parallel).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from vllm_support import (PLUGINS, assert_same_weights, checkpoints, engines, run_data_parallel,  # noqa: F401
                          run_engine, vllm_model, work)    # (fixtures: checkpoints, engines, work)

from devtools.harness import Daemon, serving, write_config

pytestmark = pytest.mark.slow      # each test runs vLLM engines and four daemons


def grouped_moe(folder: Path) -> Path:
    """A GLM-4-MoE-shaped checkpoint: experts in two groups (as DeepSeek's), the only models vLLM
    places round-robin. Written by transformers from a random tiny model of that architecture."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM
    torch.manual_seed(6)
    config = Glm4MoeConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                           n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                           first_k_dense_replace=0, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
                           pad_token_id=0)
    Glm4MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    return folder


ROUND_ROBIN = {"enable_expert_parallel": True, "expert_placement_strategy": "round_robin"}


@pytest.fixture(scope="module")
def four_daemons(work, checkpoints):
    """Four daemons (GPU slots 0-3) holding Qwen3-MoE twice: TP 2 x DP 2 with expert parallelism
    over all four, and TP 2 without it on slots 0 and 1; and on slots 0 and 1 GLM-4-MoE at TP 2
    with its experts placed round-robin. (The socket folder, and GLM-4-MoE's checkpoint.)"""
    run, glm = work / "run-experts", grouped_moe(work / "glm4-moe")
    config = write_config(work / "experts.toml", run, [
        vllm_model("moe-tp2-dp2-ep", checkpoints["qwen3-moe"], [0, 1, 2, 3], tensor_parallel_size=2,
                   data_parallel_size=2, enable_expert_parallel=True),
        vllm_model("moe-tp2", checkpoints["qwen3-moe"], [0, 1], tensor_parallel_size=2),
        vllm_model("glm-ep2-rr", glm, [0, 1], tensor_parallel_size=2, **ROUND_ROBIN)])
    with serving(*(Daemon(work, config, g, env=PLUGINS) for g in range(4))):
        yield run, glm


def test_round_robin_experts_of_a_grouped_model_are_served_and_linear_misses(tmp_path, four_daemons):
    """GLM-4-MoE (expert groups) at TP 2 with EP placed round-robin: rank r holds experts r, r+2, …
    Both ranks come from the cache with the default loader's weights and tokens. An engine that
    places them linearly misses naming `expert_parallel` (other experts per rank) and loads with
    vLLM's default loader. The engine that loads from the cache spawns its workers, as vLLM's CPU
    build does (the others fork theirs): each imports the loader and the test plugins afresh."""
    run, model = four_daemons
    want, default_log = run_engine(tmp_path / "default-rr.log", model, 2, env=PLUGINS, engine=ROUND_ROBIN)
    got, log = run_engine(tmp_path / "fs-rr.log", model, 2, "fast_start", {"socket_dir": str(run), "fallback": False},
                          env=PLUGINS, engine=ROUND_ROBIN, workers="spawn")
    linear, linear_log = run_engine(tmp_path / "fs-linear.log", model, 2, "fast_start", {"socket_dir": str(run)},
                                    env=PLUGINS, engine={"enable_expert_parallel": True})
    want_linear, _ = run_engine(tmp_path / "default-linear.log", model, 2, env=PLUGINS,
                                engine={"enable_expert_parallel": True})
    assert "Expert placement strategy: round_robin" in default_log and "Expert placement strategy: round_robin" in log
    spawned = re.findall(r"\((VllmWorker-\d) pid=\d+\) .*Registered model loader .*FastStartLoader", log)
    assert set(spawned) == {"VllmWorker-0", "VllmWorker-1"}       # each worker registered the loader itself
    assert_same_weights(got, want)
    assert [r["source"] for r in got["ranks"]] == ["cache"] * 2
    assert_same_weights(linear, want_linear)
    assert [r["source"] for r in linear["ranks"]] == [None] * 2      # vLLM's default loader built them
    assert "differing fields: expert_parallel); loading with vLLM's default loader" in linear_log
    experts = [{n: d for n, d in r["as_loaded"].items() if ".experts." in n} for r in (*got["ranks"], *linear["ranks"])]
    assert experts[0] != experts[1] and experts[0] != experts[2]      # each rank its own; placements differ


def test_tp2_dp2_expert_ranks_are_served_by_four_daemons(tmp_path, checkpoints, four_daemons):
    """Qwen3-MoE at TP 2 × DP 2 with expert parallelism: two engine processes of two workers each,
    each of the four ranks served by its own daemon (GPU slot k: DP rank k // 2, TP rank k % 2)
    and holding a quarter of the experts; every rank and the tokens equal the default loader's."""
    engine = {"enable_expert_parallel": True}
    want = run_data_parallel(tmp_path, "default", checkpoints["qwen3-moe"], engine=engine, tp=2)
    got = run_data_parallel(tmp_path, "fs", checkpoints["qwen3-moe"], "fast_start",
                            {"socket_dir": str(four_daemons[0]), "fallback": False}, engine, tp=2)
    for g, w in zip(got, want):
        assert_same_weights(g, w)
        assert [r["source"] for r in g["ranks"]] == ["cache", "cache"]
    experts = [{n: d for n, d in r["as_loaded"].items() if ".experts." in n} for g in got for r in g["ranks"]]
    assert len({json.dumps(e, sort_keys=True) for e in experts}) == 4      # each rank its own quarter
    assert "for rank 1 of 2 (DP rank 1 of 2) from the cache" in got[1]["log"]


def test_an_expert_parallel_engine_where_the_cache_holds_ranks_without_it_misses_naming_the_field(tmp_path,
                                                                                                     checkpoints,
                                                                                                     four_daemons):
    """The other way round: the daemons hold Qwen3-MoE's TP-2 ranks without expert parallelism
    (each rank a slice of every expert), and the engine runs with it (whole experts per rank)."""
    engine = {"enable_expert_parallel": True}
    want, _ = run_engine(tmp_path / "default-ep2.log", checkpoints["qwen3-moe"], 2, env=PLUGINS, engine=engine)
    got, log = run_engine(tmp_path / "fs-ep2.log", checkpoints["qwen3-moe"], 2, "fast_start",
                          {"socket_dir": str(four_daemons[0])}, env=PLUGINS, engine=engine)
    assert_same_weights(got, want)
    assert [r["source"] for r in got["ranks"]] == [None] * 2
    assert "differing fields: expert_parallel); loading with vLLM's default loader" in log

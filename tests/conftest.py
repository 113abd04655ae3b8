"""Shared fixtures: real safetensors checkpoints generated once per test session."""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from devtools import synth

# Shaped so that every method works at TP 1, 2 and 4: shards are multiples of 128 rows and
# columns (fp8-block), and TP 4 > 2 KV heads exercises GQA replication.
LLAMA = synth.Shape(hidden_size=512, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=128,
                    intermediate_size=1024, vocab_size=1024)


def pytest_collection_modifyitems(config, items):
    # Modules marked slow first (a stable sort): `make test` hands whole modules to its workers in
    # this order, and a long one handed out last would run alone at the end.
    items.sort(key=lambda item: "slow" not in item.keywords)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def vllm_ipc_dir():
    """vLLM binds its ZeroMQ sockets in VLLM_RPC_BASE_PATH (the temp dir by default), and an engine
    that ends without closing them leaves them behind: hundreds a session. This session's go in a
    directory of its own, removed at its end."""
    path = tempfile.mkdtemp(prefix="fast-start-ipc-")
    os.environ["VLLM_RPC_BASE_PATH"] = path
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def session_engines(tmp_path_factory):
    """One process that imported vLLM, forking the engines of every vLLM test module of this
    session (tests/vllm_engine.py; the modules use it through vllm_support's `engines`)."""
    import engine_server as server
    engines = server.Engines(tmp_path_factory.mktemp("engines"), {**os.environ, **server.ENV})
    yield engines
    engines.close()


@pytest.fixture(autouse=True)
def private_socket_dir(tmp_path, monkeypatch):
    """No test sees the host's daemons: without a socket_dir, fetch and the CLI look here."""
    monkeypatch.setenv("FAST_START_SOCKET_DIR", str(tmp_path / "no-daemons-here"))


@pytest.fixture(scope="session")
def llama(tmp_path_factory):
    """Llama-shaped, three shards with an index, untied embeddings."""
    return synth.write_checkpoint(tmp_path_factory.mktemp("llama"), LLAMA, files=3)


@pytest.fixture(scope="session")
def llama_tied(tmp_path_factory):
    shape = synth.Shape(**{**LLAMA.__dict__, "tie_word_embeddings": True})
    return synth.write_checkpoint(tmp_path_factory.mktemp("llama-tied"), shape, files=2, seed=1)


@pytest.fixture(scope="session", params=["tensor", "channel", "block"])
def llama_fp8(request, tmp_path_factory):
    """Pre-quantized FP8 checkpoints, one per scale scheme."""
    return synth.write_checkpoint(tmp_path_factory.mktemp(f"llama-fp8-{request.param}"), LLAMA,
                                  files=2, fp8=request.param, seed=2)


@pytest.fixture
def small(tmp_path):
    """A tiny single-file Llama checkpoint in a fresh folder the test may break."""
    return synth.write_checkpoint(tmp_path / "small", synth.Shape(num_layers=1))


@pytest.fixture
def daemons(tmp_path):
    """Start real daemons: `daemons(config, gpu)`; all are stopped at the end of the test."""
    from devtools.harness import Daemon
    started = []

    def start(config, gpu=0, env=None, wait=True, listen=None, rlimits=None, python=sys.executable, wrap=()):
        d = Daemon(tmp_path, config, gpu, env, listen=listen, rlimits=rlimits, python=python, wrap=wrap)
        started.append(d)
        return d.wait_ready() if wait else d
    yield start
    for d in started:
        d.stop()


@pytest.fixture
def open_dir():
    """A directory another uid can traverse (pytest's own tmp folders are private)."""
    d = tempfile.mkdtemp(prefix="fast-start-test-")
    os.chmod(d, 0o711)
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)

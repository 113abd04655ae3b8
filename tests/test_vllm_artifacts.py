"""vLLM (CPU build) at its defaults, torch.compile on, with `$HOME` not writable: the artifacts it
compiles are kept by the daemon, handed to the next engine, a changed setting misses naming it,
and a corrupted set is refused and rebuilt; the tokens are the default loader's every time."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import vllm_support
from vllm_support import checkpoints, engines, run_engine, vllm, work  # noqa: F401  (fixtures)
from devtools.harness import write_config
from fast_start import artifacts

pytestmark = pytest.mark.slow      # compiled vLLM engines: minutes in all

# A file, so that nothing can be made under it, even by root (`make test` runs as root in CI).
UNWRITABLE_HOME = {"HOME": "/dev/null"}
# vLLM 0.32's CPU build cannot load its own AOT-compiled functions back ("has no attribute
# 'finalize_loading'") and compiles again; its other cache (Inductor's graphs) it loads.
COMPILE = {"VLLM_USE_AOT_COMPILE": "0"}


def reboot() -> None:
    """The engines' temp dir emptied (a reboot): the next engine unpacks the daemon's set."""
    for folder in Path(vllm_support.SERVER[0].tmp).glob(f"{artifacts.PREFIX}*"):
        shutil.rmtree(folder)


def test_compiled_engines_start_from_the_artifacts_the_daemon_kept(tmp_path, checkpoints, daemons):
    run, state = tmp_path / "run", tmp_path / "state"
    state.mkdir(mode=0o700)
    daemons(write_config(tmp_path / "fs.toml", run, [
        {"name": "llama", "path": str(checkpoints["llama"]), "gpus": [0], "layout": "vllm",
         "engine_version": vllm.__version__}]), env={"STATE_DIRECTORY": str(state)})
    reference, _ = run_engine(tmp_path / "default.log", checkpoints["llama"], eager=False,
                              env={**COMPILE, "VLLM_CACHE_ROOT": str(tmp_path / "default-cache")})

    def engine(tag: str, **more):
        got, log = run_engine(tmp_path / f"{tag}.log", checkpoints["llama"], load_format="fast_start",
                              extra={"socket_dir": str(run), "fallback": False}, eager=False,
                              env={**COMPILE, **UNWRITABLE_HOME}, **more)
        assert got["tokens"] == reference["tokens"] and got["ranks"][0]["source"] == "cache"
        return log

    first = engine("first")
    assert "no artifacts kept for these settings (no artifacts of llama are kept for this user yet)" in first
    assert "the daemon keeps this engine's artifacts" in first
    [kept] = state.glob("artifacts/gpu0/*/*.tar")

    second = engine("second")
    assert "vLLM starts from the artifacts the daemon kept for these settings" in second
    assert "vLLM added to the kept artifacts" not in second         # it compiled nothing: every graph was there

    other = engine("other", engine={"max_num_seqs": 8})
    assert "made with other settings:" in other and "scheduler.max_num_seqs: kept 256, now 8" in other

    data = bytearray(kept.read_bytes())
    data[len(data) // 2] ^= 0xFF
    kept.write_bytes(bytes(data))
    reboot()
    rebuilt = engine("rebuilt")
    assert "the artifacts the daemon kept are refused: the archive is not the bytes the daemon kept" in rebuilt
    assert "the daemon keeps this engine's artifacts" in rebuilt
    reboot()
    assert "vLLM starts from the artifacts the daemon kept" in engine("after")


def test_an_engine_with_a_warm_cache_of_its_own_uses_it_and_an_emptied_one_gets_the_set(tmp_path, checkpoints,
                                                                                       daemons):
    """Where vLLM's own cache folder is writable, fast-start leaves it vLLM's: a cache warmed
    without fast-start is used at the first start with fast-start (the daemon keeps this engine's
    part of it), and the cache emptied (a container) gets it back. The CPU build compiles through
    Inductor, whose cache this user keeps inside vLLM's folder."""
    run, state, own = tmp_path / "run", tmp_path / "state", tmp_path / "vllm-cache"
    state.mkdir(mode=0o700)
    daemons(write_config(tmp_path / "fs.toml", run, [
        {"name": "llama", "path": str(checkpoints["llama"]), "gpus": [0], "layout": "vllm",
         "engine_version": vllm.__version__}]), env={"STATE_DIRECTORY": str(state)})
    caches = {**COMPILE, "VLLM_CACHE_ROOT": str(own), "TORCHINDUCTOR_CACHE_DIR": str(own / "inductor"),
              "TRITON_CACHE_DIR": str(own / "triton")}
    reference, _ = run_engine(tmp_path / "default.log", checkpoints["llama"], eager=False, env=caches)
    warm = artifacts._listing(own)
    assert any(name.startswith("inductor/") for name in warm)

    def engine(tag: str) -> str:
        got, log = run_engine(tmp_path / f"{tag}.log", checkpoints["llama"], load_format="fast_start",
                              extra={"socket_dir": str(run), "fallback": False}, eager=False, env=caches)
        assert got["tokens"] == reference["tokens"] and got["ranks"][0]["source"] == "cache"
        return log

    first = engine("first")
    assert ("no artifacts kept for these settings (no artifacts of llama are kept for this user yet); vLLM "
            f"uses its own cache folder {own} as it finds it") in first
    assert "the daemon keeps this engine's artifacts" in first
    assert {n: s for n, s in artifacts._listing(own).items() if n.startswith("inductor/")} == {
        n: s for n, s in warm.items() if n.startswith("inductor/")}         # it compiled nothing new
    shutil.rmtree(own)
    emptied = engine("emptied")
    assert "vLLM starts from the artifacts the daemon kept for these settings" in emptied and str(own) in emptied
    assert "vLLM added to the kept artifacts" not in emptied
    assert {n for n in artifacts._listing(own) if n.startswith("inductor/")} == {
        n for n in warm if n.startswith("inductor/")}


def test_each_tp_rank_keeps_its_artifacts_with_its_own_gpus_daemon(tmp_path, checkpoints, daemons):
    """TP 2: each rank's worker process has its own folder and talks to its own GPU's daemon."""
    run, state = tmp_path / "run", tmp_path / "state"
    state.mkdir(mode=0o700)
    config = write_config(tmp_path / "fs.toml", run, [
        {"name": "llama", "path": str(checkpoints["llama"]), "gpus": [0, 1], "tensor_parallel_size": 2,
         "layout": "vllm", "engine_version": vllm.__version__}])
    for gpu in (0, 1):
        daemons(config, gpu, env={"STATE_DIRECTORY": str(state)})
    reference, _ = run_engine(tmp_path / "default.log", checkpoints["llama"], tp=2, eager=False,
                              env={**COMPILE, "VLLM_CACHE_ROOT": str(tmp_path / "default-cache")})
    logs = []
    for tag in ("first", "second"):
        got, log = run_engine(tmp_path / f"{tag}.log", checkpoints["llama"], tp=2, load_format="fast_start",
                              extra={"socket_dir": str(run), "fallback": False}, eager=False,
                              env={**COMPILE, **UNWRITABLE_HOME})
        assert got["tokens"] == reference["tokens"] and {r["source"] for r in got["ranks"]} == {"cache"}
        logs.append(log)
    assert logs[0].count("the daemon keeps this engine's artifacts") == 2
    assert logs[1].count("vLLM starts from the artifacts the daemon kept") == 2
    assert "vLLM added to the kept artifacts" not in logs[1]
    assert sorted(p.parent.parent.name for p in state.glob("artifacts/*/*/*.tar")) == ["gpu0", "gpu1"]

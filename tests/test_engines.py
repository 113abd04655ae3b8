"""An engine from another package, registered through the `fast_start.engines` entry point, runs
end to end: config, fill in the daemon's worker, fingerprint, fetch, and a miss naming a
changed field. Nothing of fast-start knows it: its module (tests/plugins/toy_engine.py) and the
package metadata this test writes are all there is."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
from devtools.harness import write_config
from safetensors.torch import load_file

import fast_start
from fast_start import config as configs
from fast_start import engines
from fast_start.engines.vllm import Settings
from fast_start.errors import CacheMiss, ConfigError

PLUGINS = Path(__file__).resolve().parent / "plugins"


@pytest.fixture
def toy_site(tmp_path, monkeypatch):
    """The toy engine's package metadata (what installing it would leave), on this process's
    path and in the daemon's environment."""
    site = tmp_path / "site"
    info = site / "fast_start_test_toy-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fast-start-test-toy\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[{engines.GROUP}]\ntoy = toy_engine:ENGINE\n")
    for path in (PLUGINS, site):
        monkeypatch.syspath_prepend(str(path))
    yield {"PYTHONPATH": os.pathsep.join([str(site), str(PLUGINS), os.environ.get("PYTHONPATH", "")])}
    engines.REGISTRY.pop("toy", None)


def toy_model(path, **kw):
    return {"name": "small", "path": str(path), "gpus": [0], "engine": "toy", "engine_version": "auto",
            "toy": {"mode": "a", "passes": 2}, **kw}


def test_an_engine_another_package_registers_fills_fetches_and_misses_on_a_changed_setting(tmp_path, small, daemons,
                                                                                            toy_site):
    """Its own typed [model.toy] table is read, fingerprinted and, changed, a miss naming the field."""
    run = tmp_path / "run"
    cfg = write_config(tmp_path / "fs.toml", run, [toy_model(small)])
    daemons(cfg, env=toy_site)
    model = configs.load(cfg).models[0]
    assert (model.settings.mode, model.settings.passes) == ("a", 2)
    spec = model.spec(0)._replace(engine_version="1.0")   # "auto": the worker's

    weights = fast_start.fetch(spec, socket_dir=str(run), fallback=False)
    want = load_file(str(small / "model.safetensors"))
    assert weights.source == "cache"
    assert sorted(weights.tensors) == sorted(want)
    for name, t in want.items():
        assert torch.equal(weights[name], t * 2), name      # the toy's own rule, applied in its fill

    changed = dataclasses.replace(model, settings=dataclasses.replace(model.settings, mode="b"))
    other = spec._replace(engine_options=changed.spec(0).engine_options)
    with pytest.raises(CacheMiss, match="engine_options"):
        fast_start.fetch(other, socket_dir=str(run), fallback=False)


@pytest.mark.parametrize("table,named", [
    ({"mode": "c"}, r"\[model.toy\] key 'mode' is 'c'.*use \"a\" or \"b\""),
    ({"passes": "2"}, r"\[model.toy\] key 'passes' is '2', not an integer"),
    ({"speed": 1}, r"\[model.toy\] has unknown key 'speed'.*use one of mode, passes"),
])
def test_an_engines_own_settings_and_rules_are_named_when_the_config_loads(tmp_path, small, toy_site, table, named):
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", [toy_model(small, toy=table)])
    with pytest.raises(ConfigError, match=named):
        configs.load(cfg)


def test_an_engine_nobody_registered_is_named_with_the_known_ones(tmp_path, small):
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", [toy_model(small, engine="nosuch")])
    with pytest.raises(ConfigError, match="engine' is 'nosuch'.*use one of vllm, or leave it out"):
        configs.load(cfg)
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", [toy_model(small, engine="", layout="nosuch")])
    with pytest.raises(ConfigError, match="layout' is 'nosuch'.*use one of hf, vllm"):
        configs.load(cfg)


def test_a_fill_record_this_version_cannot_read_is_a_miss_naming_what():
    """The vLLM fill's record (the manifest's `engine`) round-trips through JSON, and one this
    version cannot read is a miss that names the key, before anything is installed."""
    import json

    from fast_start.engines.vllm.record import FillRecord
    table = {"table": [], "modules": {}}
    record = FillRecord("vllm", "processed", table, [], ("b",), ("r",), table, {"gpu": "x"}, None)
    d = json.loads(json.dumps(record.to_dict()))
    assert FillRecord.from_dict(d) == record
    for bad, what in (({**d, "future": 1}, "keys this version does not know: future"),
                      ({k: v for k, v in d.items() if k != "plan"}, "lacks plan"),
                      ({**d, "stage": "half"}, "stage 'half' without"),
                      ({**d, "signature": None}, "stage 'processed' without"),
                      ({**d, "attention": "x"}, "attention of type str, not list"),
                      ([], "is not a table")):
        with pytest.raises(CacheMiss, match=what):
            FillRecord.from_dict(bad)


def test_vllms_engine_options_are_one_record_written_and_read_back_alike():
    """What steers vLLM's bytes, as the config says it, as a running engine's config says it, and
    as the fill gives it back to vLLM: one record, whose JSON is what fingerprints held before."""
    from types import SimpleNamespace

    from fast_start.engines.vllm.rules import Options
    environ = {"VLLM_USE_DEEP_GEMM": "0", "HOME": "/root"}
    auto, chosen = Options.of(environ, "auto", 2), Options.of(environ, "fp8", 1, "marlin")
    assert auto.encoded() == '{"env":{"VLLM_USE_DEEP_GEMM":"0"},"kv_cache_dtype":"auto","pp":2}'
    assert chosen.encoded() == '{"env":{"VLLM_USE_DEEP_GEMM":"0"},"kv_cache_dtype":"fp8","moe_backend":"marlin","pp":1}'
    assert Options.decoded(chosen.encoded()) == chosen and Options.decoded("") == Options({})
    assert auto.engine_args() == {"kv_cache_dtype": "auto"}
    assert chosen.engine_args() == {"kv_cache_dtype": "fp8", "moe_backend": "marlin"}
    running = SimpleNamespace(cache_config=SimpleNamespace(cache_dtype="fp8"),
                              kernel_config=SimpleNamespace(moe_backend="marlin"))
    assert Settings.of_engine(running, environ) == Settings("fp8", "marlin", ("VLLM_USE_DEEP_GEMM=0",))
    assert Settings.of_engine(SimpleNamespace(cache_config=running.cache_config), environ).moe_backend == "auto"


def test_a_running_vllm_engine_described_as_a_model_gets_the_configs_spec_for_each_slot(small, tmp_path,
                                                                                        monkeypatch):
    """The vLLM loader describes its engine as a [[model]] (its settings from its config and
    environment, `Settings.of_engine`) and asks `slot_spec`, the config's own builder: each rank
    gets what the daemon's config gives the GPU of that slot."""
    from types import SimpleNamespace
    monkeypatch.setenv("VLLM_USE_DEEP_GEMM", "0")
    cfg = configs.load(write_config(tmp_path / "fs.toml", tmp_path / "run", [
        {"name": "m", "path": str(small), "gpus": [4, 5, 6, 7, 0, 1, 2, 3], "tensor_parallel_size": 2,
         "pipeline_parallel_size": 2, "data_parallel_size": 2, "engine": "vllm", "enable_expert_parallel": True,
         "vllm": {"kv_cache_dtype": "fp8", "moe_backend": "marlin"}}]))
    running = SimpleNamespace(cache_config=SimpleNamespace(cache_dtype="fp8"),
                              kernel_config=SimpleNamespace(moe_backend="marlin"))
    configured = cfg.models[0]
    engine = configs.ModelConfig(name="m", path=str(small), gpus=(), tensor_parallel_size=2, pipeline_parallel_size=2,
                                 data_parallel_size=2, engine="vllm", enable_expert_parallel=True,
                                 settings=Settings.of_engine(running, os.environ))
    assert [engine.slot_spec(slot) for slot in range(8)] == [configured.spec(gpu) for gpu in configured.gpus]
    assert len({configured.spec(gpu) for gpu in configured.gpus}) == 8

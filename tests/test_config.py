"""The TOML config: the example validates, and every mistake names the file, the key and the fix."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fast_start import config as configs, engines
from fast_start.config import ConfigError

EXAMPLE = Path(__file__).parent.parent / "etc" / "fast-start" / "fast-start.toml"


def example_with(path) -> str:
    return re.sub(r'^path = "[^"]*"', f'path = "{path}"', EXAMPLE.read_text(), flags=re.M)


def test_example_config_validates(small, tmp_path):
    f = tmp_path / "fast-start.toml"
    f.write_text(example_with(small))
    cfg = configs.load(f)
    assert cfg.daemon.device == "cuda" and cfg.models[0].layout == "vllm" and cfg.models[0].engine_version == "auto"
    assert cfg.models[0].spec(1).rank == 1 and cfg.models_on(0) == cfg.models and cfg.models_on(2) == ()


@pytest.mark.parametrize("edit,message", [
    (("[daemon]", "[daemon]\ncolour = 1"), "[daemon] has unknown key 'colour'"),
    (("name = ", "nmae = "), "unknown key 'nmae'"),
    (("tensor_parallel_size = 2", 'tensor_parallel_size = "2"'), "key 'tensor_parallel_size' is '2', not an integer"),
    (("gpus = [0, 1]", "gpus = [0, 0]"), "key 'gpus' [0, 0] lists a GPU twice"),
    (("rank_offset = 0", "rank_offset = 1"), "key 'rank_offset' 1 with 2 GPUs serves ranks beyond 1"),
    (('quantization = "none"', 'quantization = "int3"'), "key 'quantization' is 'int3'"),
    (('quantization = "none"', 'quantization = "fp8_per_block"'), "'fp8_per_block' is refused: online block FP8"),
    (('engine = "vllm"', 'engine = ""'), "key 'engine_version' is \"auto\", which only an engine's model (engine = \"vllm\")"),
    (('engine = "vllm"', 'engine = ""\nexpert_placement_strategy = "bogus"'),
     "key 'expert_placement_strategy' is 'bogus' for a model no engine fills"),
    (('engine = "vllm"', 'engine = "toy"'), "key 'engine' is 'toy'"),
    (('engine = "vllm"', 'engine = ""\nlayout = "toy"'), "key 'layout' is 'toy'"),
    (('engine = "vllm"', 'engine = "vllm"\nlayout = "other"'), "key 'layout' is 'other' with engine 'vllm'"),
    (('# worker_python = "/opt', 'worker_python = "opt'), "key 'worker_python' is 'opt"),
    (('# python = "/opt', 'python = "opt'), "key 'python' is 'opt"),
    (('device = "cuda"', 'device = "tpu"'), "key 'device' is 'tpu'"),
    (('on_release = "keep"', 'on_release = "host"'), "the host-memory tier is not built yet"),
    (('memory_budget = "95%"', 'memory_budget = "lots"'), "key 'memory_budget' is 'lots'"),
    (('dtype = "bfloat16"', 'dtype = "int8"'), "key 'dtype' is 'int8'"),
    (('[[model]]', 'model = 3\n[[modelx]]'), "unknown section or key"),
    (('socket_dir = "/run/fast-start"', 'socket_dir = "run"'), "not an absolute path"),
    (('metrics_file = ""', 'metrics_file = "/run/fast-start/gpu{gpu}.sock"'),
     "key 'metrics_file' is '/run/fast-start/gpu{gpu}.sock', inside socket_dir '/run/fast-start'"),
    (('name = "qwen3-8b"', 'name = "qwen3-8b"\n[broken'), "is not valid TOML"),
])
def test_bad_config_names_file_key_and_fix(small, tmp_path, edit, message):
    f = tmp_path / "fs.toml"
    text = example_with(small).replace(*edit, 1)
    if 'engine = ""' in edit[1]:      # a model no engine fills has no [model.vllm] table: cut it
        text = text[:text.index("[model.vllm]")]
    f.write_text(text)
    with pytest.raises(ConfigError) as err:
        configs.load(f)
    assert message in str(err.value) and str(f) in str(err.value) and err.value.fix


def test_model_path_without_safetensors(tmp_path):
    f = tmp_path / "fs.toml"
    f.write_text(example_with(tmp_path))
    with pytest.raises(ConfigError, match="is not a folder holding \\*.safetensors"):
        configs.load(f)


def test_missing_required_key_and_missing_file(small, tmp_path):
    f = tmp_path / "fs.toml"
    f.write_text(re.sub(r"^gpus = .*$", "", example_with(small), flags=re.M))
    with pytest.raises(ConfigError, match="lacks key 'gpus'"):
        configs.load(f)
    with pytest.raises(ConfigError, match="does not exist"):
        configs.load(tmp_path / "nope.toml")


def test_duplicate_model_names(small, tmp_path):
    text = example_with(small)
    f = tmp_path / "fs.toml"
    f.write_text(text + "\n" + text[text.index("[[model]]"):].replace("gpus = [0, 1]", "gpus = [2, 3]"))
    with pytest.raises(ConfigError, match="name 'qwen3-8b' is used twice"):
        configs.load(f)


@pytest.mark.parametrize("text,total,want", [("120GiB", None, 120 * 2**30), ("500MB", None, 500 * 10**6),
                                             ("95%", 1000, 950), ("1048576", None, 2**20)])
def test_parse_bytes(text, total, want):
    assert configs.parse_bytes(text, total) == want


@pytest.mark.parametrize("model,message", [
    ({"pipeline_parallel_size": 2, "layout": "hf"}, "key 'pipeline_parallel_size' is 2 for a model no engine fills"),
    ({"data_parallel_size": 2, "layout": "hf"}, "key 'data_parallel_size' is 2 for a model no engine fills"),
    ({"enable_expert_parallel": True, "layout": "hf"}, "key 'enable_expert_parallel' is True for a model no engine fills"),
    ({"expert_placement_strategy": "random"}, "key 'expert_placement_strategy' is 'random'"),
    ({"pipeline_parallel_size": 0}, "key 'pipeline_parallel_size' is 0"),
    ({"data_parallel_size": 0}, "key 'data_parallel_size' is 0"),
    ({"gpus": [0, 1, 2], "pipeline_parallel_size": 1}, "serves ranks beyond 1"),
    ({"gpus": [0, 1, 2, 3, 4], "data_parallel_size": 2}, "serves ranks beyond 3"),
    ({"vllm": {"env": ["CUDA_VISIBLE_DEVICES=0"]}}, "is not NAME=VALUE with a kernel-selecting variable"),
    ({"vllm": {"env": ["VLLM_USE_DEEP_GEMM"]}}, "[model.vllm] key 'env' is ['VLLM_USE_DEEP_GEMM']: "),
    ({"quantization": "gptq"}, "vLLM quantization 'gptq' is not verified for caching"),
    ({"vllm": {"moe_backend": "Marlin"}}, "[model.vllm] key 'moe_backend' is 'Marlin'"),
    ({"moe_backend": "Marlin"}, "[model.vllm] key 'moe_backend' is 'Marlin'"),       # as older configs wrote it
    ({"moe_backend": "marlin", "layout": "hf"}, "key 'moe_backend' is 'marlin' for a model no engine fills"),
    ({"kv_cache_dtype": "fp8", "layout": "hf"}, "key 'kv_cache_dtype' is 'fp8' for a model no engine fills"),
    ({"engine_env": ["VLLM_USE_DEEP_GEMM=0"], "layout": "hf"},
     "key 'engine_env' is ['VLLM_USE_DEEP_GEMM=0'] for a model no engine fills"),
    ({"vllm": {"kv_cache_dtype": "FP8"}}, "[model.vllm] key 'kv_cache_dtype' is 'FP8'"),
    ({"vllm": {"kv_cache_dtype": "fp8"}, "layout": "hf"}, "has a table [model.vllm], but no engine fills the model"),
    ({"toy": {"mode": "a"}}, "has a table [model.toy], but engine 'vllm' fills the model"),
    ({"vllm": {"kv_cache": "fp8"}}, "[[model]] #1 [model.vllm] has unknown key 'kv_cache'"),
    ({"vllm": {"env": "VLLM_USE_DEEP_GEMM=0"}}, "[model.vllm] key 'env' is 'VLLM_USE_DEEP_GEMM=0', not a list"),
    ({"vllm": {"moe_backend": "marlin"}, "moe_backend": "triton"}, "sets 'moe_backend' and [model.vllm] moe_backend"),
])
def test_vllm_model_keys_are_checked(small, tmp_path, model, message):
    """A vLLM model's PP, DP and EP settings, ranks, kernel variables and quantization are refused with the fix."""
    from devtools.harness import write_config
    entry = {"name": "m", "path": str(small), "gpus": [0, 1], "tensor_parallel_size": 2, "layout": "vllm", **model}
    with pytest.raises(ConfigError) as err:
        configs.load(write_config(tmp_path / "fs.toml", tmp_path / "run", [entry]))
    assert message in str(err.value) and err.value.fix


def test_vllm_spec_carries_pipeline_rank_and_kernel_variables(small, tmp_path, monkeypatch):
    """GPU i serves global rank gpus.index(i) + rank_offset; [model.vllm] env and the daemon's own
    kernel variables both enter the fingerprint's engine_options."""
    from devtools.harness import write_config
    monkeypatch.setenv("VLLM_DISABLED_KERNELS", "X")
    monkeypatch.setenv("VLLM_NOT_A_KERNEL_SWITCH", "1")
    cfg = configs.load(write_config(tmp_path / "fs.toml", tmp_path / "run", [
        {"name": "m", "path": str(small), "gpus": [3], "tensor_parallel_size": 2, "pipeline_parallel_size": 2,
         "rank_offset": 2, "layout": "vllm", "vllm": {"env": ["VLLM_USE_DEEP_GEMM=0"]}}]))
    spec = cfg.models[0].spec(3)
    assert (spec.rank, spec.pipeline_parallel_size) == (2, 2)
    assert json.loads(spec.engine_options) == {"env": {"VLLM_DISABLED_KERNELS": "X", "VLLM_USE_DEEP_GEMM": "0"},
                                               "kv_cache_dtype": "auto", "pp": 2}


def test_replicas_split_gpus_into_engines_that_each_serve_every_rank(small, tmp_path):
    """`replicas = R`: gpus lists R engines' GPUs, replica by replica; each engine's GPUs serve its
    ranks from 0, and the same rank is the same spec (so one fingerprint) on every replica."""
    from devtools.harness import write_config
    cfg = configs.load(write_config(tmp_path / "fs.toml", tmp_path / "run", [
        {"name": "tp2", "path": str(small), "gpus": [0, 4, 1, 5], "tensor_parallel_size": 2, "replicas": 2},
        {"name": "one", "path": str(small), "gpus": [0, 1, 2], "replicas": 3}]))
    tp2, one = cfg.models
    assert [tp2.spec(g).rank for g in (0, 4, 1, 5)] == [0, 1, 0, 1]
    assert tp2.spec(0) == tp2.spec(1) and tp2.spec(4) == tp2.spec(5) and tp2.spec(0) != tp2.spec(4)
    assert one.spec(0) == one.spec(1) == one.spec(2) and one.spec(2).tensor_parallel_size == 1


@pytest.mark.parametrize("model,message,fix", [
    ({"gpus": [0, 1, 2, 3]}, "key 'gpus' lists 4 GPUs, more than the 1 rank(s) of one engine",
     "for 4 engines of 1 GPU(s) each, set replicas = 4"),
    ({"gpus": [0, 1, 2, 3], "tensor_parallel_size": 2, "replicas": 1},
     "key 'gpus' lists 4 GPUs, more than the 2 rank(s)", "set replicas = 2"),
    ({"gpus": [0, 1, 2], "replicas": 2}, "key 'replicas' is 2 with gpus = [0, 1, 2]", "as many GPUs for each replica"),
    ({"gpus": [0], "replicas": 0}, "key 'replicas' is 0 with gpus = [0]", "for each replica"),
    ({"gpus": [0, 1, 2, 3], "tensor_parallel_size": 2, "replicas": 2, "rank_offset": 1},
     "key 'rank_offset' 1 with 2 GPUs for each of 2 replicas serves ranks beyond 1", "fix gpus, replicas or rank_offset"),
])
def test_more_gpus_than_one_engine_has_ranks_names_replicas(small, tmp_path, model, message, fix):
    """The fleet's common case, one TP-1 engine on each GPU, written as gpus = [0, 1, 2, 3]: the
    error says how to write it, and how to write one engine over all of them."""
    from devtools.harness import write_config
    with pytest.raises(ConfigError) as err:
        configs.load(write_config(tmp_path / "fs.toml", tmp_path / "run", [{"name": "m", "path": str(small), **model}]))
    assert message in str(err.value) and fix in err.value.fix


def test_engine_names_who_fills_a_model_and_the_older_layout_key_means_the_same(small, tmp_path):
    """`engine = "vllm"` says vLLM fills the model, which is then cached in vLLM's layout; configs
    of earlier versions said `layout = "vllm"`, which names the same engine and fingerprint."""
    from devtools.harness import write_config
    cfg = configs.load(write_config(tmp_path / "fs.toml", tmp_path / "run", [
        {"name": "new", "path": str(small), "gpus": [0], "engine": "vllm"},
        {"name": "old", "path": str(small), "gpus": [0], "layout": "vllm"},
        {"name": "own", "path": str(small), "gpus": [0]}]))
    new, old, own = cfg.models
    assert new.filler is old.filler is engines.get("vllm") and own.filler is None
    assert new.spec(0) == old.spec(0) and new.spec(0).layout == "vllm" and own.spec(0).layout == "hf"


def test_a_chosen_moe_backend_enters_the_fingerprint_and_auto_leaves_it_as_before(small, tmp_path):
    """[model.vllm] `moe_backend` picks how vLLM lays out processed MoE weights: a model that names one is
    fingerprinted with it; "auto" (the default) adds nothing, so caches filled before stay valid."""
    from devtools.harness import write_config
    cfg = configs.load(write_config(tmp_path / "fs.toml", tmp_path / "run", [
        {"name": "auto", "path": str(small), "gpus": [0], "layout": "vllm"},
        {"name": "marlin", "path": str(small), "gpus": [0], "layout": "vllm", "vllm": {"moe_backend": "marlin"}}]))
    auto, marlin = (json.loads(m.spec(0).engine_options) for m in cfg.models)
    assert "moe_backend" not in auto and marlin == {**auto, "moe_backend": "marlin"}


def test_vllm_settings_older_configs_wrote_in_the_model_read_the_same_with_a_note_naming_the_new_key(small, tmp_path):
    """`kv_cache_dtype`, `moe_backend` and `engine_env` in the [[model]] itself (before the
    [model.vllm] table) give the same model and fingerprint, each with one note naming its new key."""
    from devtools.harness import write_config
    old = {"name": "m", "path": str(small), "gpus": [0], "engine": "vllm", "kv_cache_dtype": "fp8",
           "moe_backend": "marlin", "engine_env": ["VLLM_USE_DEEP_GEMM=0"]}
    new = {"name": "m", "path": str(small), "gpus": [0], "engine": "vllm",
           "vllm": {"kv_cache_dtype": "fp8", "moe_backend": "marlin", "env": ["VLLM_USE_DEEP_GEMM=0"]}}
    was, now = (configs.load(write_config(tmp_path / f"{n}.toml", tmp_path / "run", [m])) for n, m in
                (("old", old), ("new", new)))
    assert was.models == now.models and was.models[0].spec(0) == now.models[0].spec(0) and not now.deprecated
    assert [re.sub(r".*\): ", "", note) for note in was.deprecated] == [
        f"key {k!r} is [model.vllm] {v} now; move it there (it is read as if it were)"
        for k, v in (("kv_cache_dtype", "kv_cache_dtype"), ("moe_backend", "moe_backend"), ("engine_env", "env"))]
    # The older example's values in a model no engine fills: left, each with a note (others are refused).
    hf = configs.load(write_config(tmp_path / "hf.toml", tmp_path / "run", [
        {"name": "h", "path": str(small), "gpus": [0], "kv_cache_dtype": "auto", "engine_env": []}]))
    assert hf.models[0].settings is None and [re.sub(r".*\): ", "", n) for n in hf.deprecated] == [
        f"key {k!r} is vLLM's setting, and no engine fills this model; remove it" for k in ("kv_cache_dtype", "engine_env")]


def test_vllm_spec_counts_slots_dp_rank_by_dp_rank_and_names_the_expert_placement(small, tmp_path):
    """Slot gpus.index(i) + rank_offset is DP rank slot // (TP × PP), rank slot % (TP × PP); expert
    parallelism is in the fingerprint only where vLLM places whole experts (TP × DP above 1)."""
    from devtools.harness import write_config
    entries = [{"name": "dp", "path": str(small), "gpus": [4, 5, 6, 7], "tensor_parallel_size": 2,
                "data_parallel_size": 4, "rank_offset": 2, "layout": "vllm", "enable_expert_parallel": True,
                "expert_placement_strategy": "round_robin"},
               {"name": "one", "path": str(small), "gpus": [0], "layout": "vllm", "enable_expert_parallel": True}]
    cfg = configs.load(write_config(tmp_path / "fs.toml", tmp_path / "run", entries))
    got = [(s.data_parallel_size, s.data_parallel_rank, s.rank, s.expert_parallel)
           for s in (cfg.models[0].spec(g) for g in (4, 5, 6, 7))]
    assert got == [(4, 1, 0, "round_robin"), (4, 1, 1, "round_robin"), (4, 2, 0, "round_robin"),
                   (4, 2, 1, "round_robin")]
    assert cfg.models[1].spec(0).expert_parallel == ""


def test_a_daemon_logs_each_key_an_older_config_wrote_once_as_it_starts(small, tmp_path, daemons):
    from devtools.harness import write_config
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", [
        {"name": "h", "path": str(small), "gpus": [0], "engine_version": "test", "kv_cache_dtype": "auto"}])
    d = daemons(cfg)
    line = "[[model]] #1 ('h'): key 'kv_cache_dtype' is vLLM's setting, and no engine fills this model; remove it"
    assert d.log.read_text().count(line) == 1, d.log.read_text()[-2000:]

"""fast_start.transformers.load: a ready PreTrainedModel from the cache, same tokens as from_pretrained."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fast_start import WeightSpec  # noqa: E402
from devtools.harness import write_config  # noqa: E402
from fast_start.transformers import load  # noqa: E402

IDS = torch.tensor([[1, 5, 9, 200, 17, 3]])


def greedy(model) -> list[int]:
    with torch.no_grad():
        return model.generate(IDS.to(model.device), max_new_tokens=12, do_sample=False)[0].tolist()


@pytest.mark.parametrize("fixture", ["llama", "llama_tied"])
@pytest.mark.parametrize("mode", ["zero_copy", "copy"])
def test_load_from_cache_gives_the_tokens_of_from_pretrained(request, tmp_path, daemons, fixture, mode):
    folder = request.getfixturevalue(fixture)
    version = transformers.__version__
    daemons(write_config(tmp_path / "fs.toml", tmp_path / "run",
                         [{"name": "m", "path": str(folder), "gpus": [0], "engine_version": version}]))
    spec = WeightSpec(str(folder), engine_version=version)
    model = load(str(folder), spec, mode=mode, socket_dir=str(tmp_path / "run"), fallback=False)
    assert model.fast_start_source == "cache"
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).eval()
    assert greedy(model) == greedy(reference)
    if fixture == "llama_tied":
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_load_without_a_daemon_reads_the_disk(tmp_path, small):
    model = load(str(small), socket_dir=str(tmp_path))
    assert model.fast_start_source == "disk"
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(small), dtype=torch.bfloat16).eval()
    assert greedy(model) == greedy(reference)

"""load_into: a module built on `meta` gets every tensor and computes what an ordinary load does."""
from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

import fast_start
from fast_start.client import from_arenas
from fast_start.errors import LoadError
from fast_start.materialize import materialize
from tiny_llama import TinyLlama, config

IDS = torch.tensor([[1, 5, 9, 200, 17, 3, 77, 1000]])


def ordinary(folder) -> TinyLlama:
    model = TinyLlama(config(folder)).to(torch.bfloat16)
    state = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            state.update(load_file(os.path.join(folder, f)))
    model.load_state_dict(state, strict=not config(folder)["tie_word_embeddings"])
    return model.eval()


def on_meta(folder) -> TinyLlama:
    with torch.device("meta"):
        return TinyLlama(config(folder)).to(torch.bfloat16)


@pytest.mark.parametrize("fixture", ["llama", "llama_tied"])
@pytest.mark.parametrize("source", ["disk", "cache"])
def test_meta_module_loaded_from_fetch_matches_ordinary_load(request, fixture, source):
    folder = request.getfixturevalue(fixture)
    spec = fast_start.WeightSpec(str(folder))
    if source == "disk":
        weights = fast_start.fetch(spec)
    else:
        manifest, fds = materialize(spec)
        weights = from_arenas(manifest, fds)
        for fd in fds:
            os.close(fd)
    model = fast_start.load_into(on_meta(folder), weights).eval()
    assert not any(t.is_meta for t in model.state_dict().values())
    with torch.no_grad():
        assert torch.equal(model(IDS), ordinary(folder)(IDS))
    if config(folder)["tie_word_embeddings"]:
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_untied_module_takes_tied_checkpoint_through_the_alias(llama_tied):
    cfg = {**config(llama_tied), "tie_word_embeddings": False}
    with torch.device("meta"):
        model = TinyLlama(cfg).to(torch.bfloat16)
    fast_start.load_into(model, fast_start.fetch(fast_start.WeightSpec(str(llama_tied))))
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_mismatches_are_named_and_nothing_is_replaced(llama):
    weights = dict(fast_start.fetch(fast_start.WeightSpec(str(llama))).tensors)
    weights.pop("model.norm.weight")
    weights["model.extra.weight"] = torch.zeros(3)
    weights["model.layers.0.mlp.up_proj.weight"] = weights["model.layers.0.mlp.up_proj.weight"][:10]
    model = on_meta(llama)
    with pytest.raises(LoadError) as err:
        fast_start.load_into(model, weights)
    msg = str(err.value)
    assert "missing ['model.norm.weight']" in msg and "unexpected ['model.extra.weight']" in msg
    assert "model.layers.0.mlp.up_proj.weight: got torch.bfloat16 (10, 512)" in msg
    assert all(t.is_meta for t in model.state_dict().values())


def test_wrong_dtype_is_a_mismatch(llama):
    weights = fast_start.fetch(fast_start.WeightSpec(str(llama), dtype="float16"))
    with pytest.raises(LoadError, match="got torch.float16"):
        fast_start.load_into(on_meta(llama), weights)

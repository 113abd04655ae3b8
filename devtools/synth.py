"""Synthetic checkpoints: real safetensors folders of a given architecture and size.

Used by the demo, the benchmarks and the tests. The tensors are random but shaped, named,
sharded and indexed as the real models of each family are, with a config.json that
transformers and vLLM read.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

from fast_start import fp8, quant
from fast_start.headers import INDEX, ModelDims, required_tensors

MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
               "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe", "MixtralForCausalLM": "mixtral",
               "GptOssForCausalLM": "gpt_oss"}
FP8_SCHEMES = {"tensor": (fp8.to_fp8, "_scale"), "channel": (fp8.to_fp8_channel, "_scale"),
               "block": (fp8.to_fp8_block, "_scale_inv")}
# NVFP4 checkpoints as their producers write them: compressed-tensors weight-only ("ct-w4a16") or
# with activations ("ct-w4a4"), and NVIDIA ModelOpt ("modelopt").
FP4_FORMATS = ("ct-w4a16", "ct-w4a4", "modelopt")
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


@dataclass(frozen=True)
class Shape:
    architecture: str = "LlamaForCausalLM"
    hidden_size: int = 256
    num_layers: int = 2
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 512
    vocab_size: int = 1024
    tie_word_embeddings: bool = False
    num_experts: int = 0
    moe_intermediate_size: int = 0

    def dims(self) -> ModelDims:
        sparse = tuple(range(self.num_layers)) if self.num_experts else ()
        return ModelDims(self.architecture, self.num_layers, self.hidden_size, self.num_heads, self.num_kv_heads,
                         self.head_dim, self.intermediate_size, self.vocab_size, self.tie_word_embeddings,
                         self.num_experts, self.moe_intermediate_size or self.intermediate_size, sparse)

    def config(self, fp8: str | None = None, fp4: str | None = None) -> dict:
        c = {"architectures": [self.architecture], "model_type": MODEL_TYPES[self.architecture],
             "hidden_size": self.hidden_size, "num_hidden_layers": self.num_layers,
             "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
             "head_dim": self.head_dim, "intermediate_size": self.intermediate_size,
             "vocab_size": self.vocab_size, "tie_word_embeddings": self.tie_word_embeddings,
             "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
             "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}
        if self.architecture == "Qwen3MoeForCausalLM":
            c.update(num_experts=self.num_experts, moe_intermediate_size=self.moe_intermediate_size,
                     num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
        if self.architecture == "MixtralForCausalLM":
            c.update(num_local_experts=self.num_experts, num_experts_per_tok=2)
        if fp8:
            c["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                        **({"weight_block_size": [128, 128]} if fp8 == "block" else {})}
            if self.num_experts:    # routers stay in the model dtype (as real FP8 MoE checkpoints say)
                c["quantization_config"]["ignored_layers"] = self._router_names()
        if fp4:
            c["quantization_config"] = fp4_config(fp4, self._router_names())
        return c

    def _router_names(self) -> list[str]:
        if not self.num_experts:
            return []
        gate = "mlp.gate" if self.architecture == "Qwen3MoeForCausalLM" else "block_sparse_moe.gate"
        return [f"model.layers.{i}.{gate}" for i in range(self.num_layers)]

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        ffn = self.moe_intermediate_size or self.intermediate_size
        table = (
            (r"embed_tokens|lm_head", (self.vocab_size, h)),
            (r"q_proj\.weight", (q, h)), (r"[kv]_proj\.weight", (kv, h)), (r"o_proj\.weight", (h, q)),
            (r"q_proj\.bias", (q,)), (r"[kv]_proj\.bias", (kv,)), (r"[qk]_norm", (self.head_dim,)),
            (r"norm", (h,)),
            (r"experts\.\d+\.(gate_proj|up_proj|w1|w3)", (ffn, h)), (r"experts\.\d+\.(down_proj|w2)", (h, ffn)),
            (r"(gate|up)_proj", (self.intermediate_size, h)), (r"down_proj", (h, self.intermediate_size)),
            (r"\.gate\.weight", (self.num_experts, h)),
        )
        return next(shape for pattern, shape in table if re.search(pattern, name))

    def nbytes(self, dtype: torch.dtype = torch.bfloat16) -> int:
        total = 0
        for name in required_tensors(self.dims()):
            n = 1
            for s in self.tensor_shape(name):
                n *= s
            total += n * dtype.itemsize
        return total


def llama_of_size(nbytes: int, hidden_size: int = 2048) -> Shape:
    """A Llama-shaped bf16 model of about `nbytes`, growing by layers."""
    base = Shape(hidden_size=hidden_size, num_heads=hidden_size // 128, num_kv_heads=max(hidden_size // 512, 1),
                 head_dim=128, intermediate_size=hidden_size * 4 - hidden_size // 2, vocab_size=32000, num_layers=1)
    per_layer = base.nbytes() - Shape(**{**base.__dict__, "num_layers": 0}).nbytes()
    layers = max(1, round((nbytes - (base.nbytes() - per_layer)) / per_layer))
    return Shape(**{**base.__dict__, "num_layers": layers})


def write_checkpoint(folder: str | Path, shape: Shape = Shape(), *, files: int = 1, fp8: str | None = None,
                     fp4: str | None = None, seed: int = 0, progress: Callable[[int, int], None] | None = None,
                     reuse: bool = False) -> Path:
    """Write config.json and `files` safetensors shards (with an index when more than one).
    `fp8` (a FP8_SCHEMES key) or `fp4` (one of FP4_FORMATS) quantizes the linear weights.

    `reuse` draws one random tensor per distinct shape and repeats it in every layer: much faster
    for benchmark-sized models, whose speed does not depend on the values.
    A gpt-oss shape is written as gpt-oss ships, its experts in MXFP4 (`write_gpt_oss`).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if shape.architecture == "GptOssForCausalLM":
        return write_gpt_oss(folder, shape, seed=seed)
    names = required_tensors(shape.dims())
    gen = torch.Generator().manual_seed(seed)
    per_file = -(-len(names) // files)
    weight_map, done, total, drawn = {}, 0, shape.nbytes(), {}
    for i in range(files):
        fname = "model.safetensors" if files == 1 else f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        tensors = {}
        for name in names[i * per_file:(i + 1) * per_file]:
            quantized = bool(fp8 or fp4) and quant.is_quantized(name)
            key = (shape.tensor_shape(name), name.endswith("norm.weight"), quantized)
            made = drawn.get(key)
            if made is None:
                t = _random(key[0], name, gen)
                if not quantized:
                    made = {"": t}
                elif fp8:
                    q, scale = FP8_SCHEMES[fp8][0](t)
                    made = {"": q, FP8_SCHEMES[fp8][1]: scale}
                else:
                    made = nvfp4_tensors(t, fp4)
                if reuse:
                    drawn[key] = made
            else:       # a reused tensor: safetensors refuses tensors that share memory
                made = {k: x.clone() for k, x in made.items()}
            done += math.prod(key[0]) * 2
            base = name.removesuffix("weight") if quantized and fp4 else name
            tensors.update({base + suffix: x for suffix, x in made.items()})
        save_file(tensors, str(folder / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in tensors})
        if progress:
            progress(done, total)
    if files > 1:
        (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    (folder / "config.json").write_text(json.dumps(shape.config(fp8, fp4), indent=1))
    return folder


def nvfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 of a 2-D weight: (E2M1 codes packed two per byte, low nibble first: uint8 [o, i/2];
    e4m3 scales of each block of 16: [o, i/16]; the global scale 448·6 / amax, f32 [1]), with
    `w ≈ E2M1[code] · scale / global`."""
    w = w.float()
    o, i = w.shape
    blocks = w.reshape(o, i // 16, 16)
    amax = blocks.abs().amax(-1).clamp(min=1e-8)
    global_scale = 448.0 * 6.0 / w.abs().max().clamp(min=1e-8)
    scale = (amax / 6.0 * global_scale).clamp(max=448.0).to(torch.float8_e4m3fn)
    x = blocks / (scale.float() / global_scale).clamp(min=1e-12).unsqueeze(-1)
    code = (x.abs().unsqueeze(-1) - E2M1).abs().argmin(-1) | ((x < 0).to(torch.int64) << 3)
    code = code.reshape(o, i).to(torch.uint8)
    return code[:, 0::2] | (code[:, 1::2] << 4), scale, global_scale.reshape(1)


def nvfp4_tensors(w: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint of format `fmt` stores for linear weight `w`, by suffix of its
    module's name ("weight_packed", "weight_scale", ...)."""
    packed, scale, global_scale = nvfp4(w)
    input_global = torch.tensor([448.0 * 6.0 / 4.0])    # activations of amax 4
    if fmt == "modelopt":     # ModelOpt stores the dequantization multipliers (1 / global scale)
        return {"weight": packed, "weight_scale": scale, "weight_scale_2": (1.0 / global_scale).reshape(()),
                "input_scale": (1.0 / input_global).reshape(())}
    out = {"weight_packed": packed, "weight_scale": scale, "weight_global_scale": global_scale}
    if fmt == "ct-w4a4":
        out["input_global_scale"] = input_global
    return out


def fp4_config(fmt: str, ignored: list[str]) -> dict:
    """config.json's `quantization_config` for an FP4 format (lm_head and routers left unquantized)."""
    if fmt not in FP4_FORMATS:
        raise ValueError(f"unknown FP4 format {fmt!r}: use one of {', '.join(FP4_FORMATS)}")
    if fmt == "modelopt":
        return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                "ignore": ["lm_head", *ignored]}     # config.json's key ("exclude_modules" in hf_quant_config.json)
    tensor_group = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
                    "symmetric": True, "dynamic": False, "observer": "minmax", "actorder": None,
                    "block_structure": None}
    activations = {**tensor_group, "dynamic": "local"} if fmt == "ct-w4a4" else None
    return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": tensor_group,
                                          "input_activations": activations, "output_activations": None}},
            "ignore": ["lm_head", *ignored], "quantization_status": "compressed", "kv_cache_scheme": None}


def write_gpt_oss(folder: Path, shape: Shape, *, seed: int = 0) -> Path:
    """A gpt-oss checkpoint with the tensor names and config.json OpenAI ships: attention (with
    biases and a sink per head), router, embeddings and norms in bf16; each layer's experts in
    MXFP4 (`*_blocks`: E2M1 codes two per byte, a group of 32 in 16 bytes; `*_scales`: a
    power-of-two scale per group as its e8m0 exponent byte; `*_bias`). `intermediate_size` is
    each expert's; random codes are random FP4 weights."""
    gen = torch.Generator().manual_seed(seed)
    h, e, ffn = shape.hidden_size, shape.num_experts, shape.intermediate_size
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim

    def normal(*size: int, std: float = 0.05) -> torch.Tensor:
        return (std * torch.randn(size, generator=gen)).to(torch.bfloat16)

    def mxfp4(rows: int, cols: int) -> dict[str, torch.Tensor]:
        return {"blocks": torch.randint(0, 256, (e, rows, cols // 32, 16), generator=gen, dtype=torch.uint8),
                "scales": torch.randint(118, 123, (e, rows, cols // 32), generator=gen, dtype=torch.uint8),
                "bias": normal(e, rows)}

    tensors = {"model.embed_tokens.weight": normal(shape.vocab_size, h), "lm_head.weight": normal(shape.vocab_size, h),
               "model.norm.weight": 1 + normal(h, std=0.1)}
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        tensors |= {p + "input_layernorm.weight": 1 + normal(h, std=0.1),
                    p + "post_attention_layernorm.weight": 1 + normal(h, std=0.1), p + "self_attn.sinks": normal(
                        shape.num_heads, std=1.0), p + "mlp.router.weight": normal(e, h), p + "mlp.router.bias": normal(e)}
        for proj, (rows, cols) in {"q": (q, h), "k": (kv, h), "v": (kv, h), "o": (h, q)}.items():
            tensors |= {f"{p}self_attn.{proj}_proj.weight": normal(rows, cols), f"{p}self_attn.{proj}_proj.bias": normal(rows)}
        for proj, (rows, cols) in {"gate_up_proj": (2 * ffn, h), "down_proj": (h, ffn)}.items():
            tensors |= {f"{p}mlp.experts.{proj}_{k}": t for k, t in mxfp4(rows, cols).items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": h,
              "intermediate_size": ffn, "num_hidden_layers": shape.num_layers, "num_attention_heads": shape.num_heads,
              "num_key_value_heads": shape.num_kv_heads, "head_dim": shape.head_dim, "num_local_experts": e,
              "num_experts_per_tok": 2, "experts_per_token": 2, "vocab_size": shape.vocab_size, "sliding_window": 128,
              "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(shape.num_layers)],
              "rope_theta": 150000.0, "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                                       "beta_slow": 1.0, "original_max_position_embeddings": 4096,
                                                       "truncate": False},
              "max_position_embeddings": 131072, "initial_context_length": 4096, "rms_norm_eps": 1e-5,
              "attention_bias": True, "attention_dropout": 0.0, "swiglu_limit": 7.0, "hidden_act": "silu",
              "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
              "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
                  "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def cached(root: str | Path, shape: Shape, name: str | None = None, **kw) -> Path:
    """A synthetic checkpoint kept under `root` between runs (benchmarks, the demo), written once.

    It is written under a temporary name and renamed when complete, so an interrupted write is
    never taken for a checkpoint. `kw` goes to `write_checkpoint`.
    """
    folder = Path(root) / (name or f"{MODEL_TYPES[shape.architecture]}-{shape.num_layers}L-{shape.hidden_size}h")
    if not (folder / "config.json").exists():
        partial = folder.with_name(folder.name + ".partial")
        write_checkpoint(partial, shape, **kw)
        partial.rename(folder)
    return folder


def _random(shape: tuple[int, ...], name: str, gen: torch.Generator) -> torch.Tensor:
    t = torch.randn(shape, generator=gen, dtype=torch.float32)
    if name.endswith("norm.weight"):
        return (1 + 0.1 * t).to(torch.bfloat16)
    return (0.05 * t).to(torch.bfloat16)


def write_tokenizer(folder: str | Path, vocab_size: int) -> Path:
    """A word-level tokenizer for a synthetic checkpoint: token i is the word "t<i>", but for 0, 1
    and 2 ("<unk>", "<s>", "</s>": BOS and EOS as `Shape.config` says), so that an engine's server
    takes text ("t17 t230 t45") and answers text. transformers loads it as a fast tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    folder = Path(folder)
    special = ["<unk>", "<s>", "</s>"]
    vocab = {**{t: i for i, t in enumerate(special)}, **{f"t{i}": i for i in range(len(special), vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>",
        "model_max_length": 2048, "clean_up_tokenization_spaces": False}))
    return folder

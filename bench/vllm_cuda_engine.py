"""One vLLM engine on a GPU, for bench/vllm_cuda.py: writes what it loaded as JSON.

    python -m bench.vllm_cuda_engine '{"model": PATH, "load_format": "auto", "extra": {}, "out": FILE}'

Reports greedy tokens for fixed prompts, a digest of every parameter and buffer, the parameters
whose memory lies inside PyTorch's CUDA allocator (`torch.cuda.memory_snapshot` segments: a
zero-copy parameter lies in a mapped arena instead), the weights' source and the loader's stage.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")     # apply_model sends a function

import torch
from vllm import LLM, SamplingParams

PROMPTS = [[1, 17, 230, 45, 901, 3], [1, 500, 501, 502], [1, 7]]


def report(model: torch.nn.Module) -> dict:
    segments = [(s["address"], s["address"] + s["total_size"]) for s in torch.cuda.memory_snapshot()]
    inside = [n for n, p in model.named_parameters()
              if p.numel() and any(lo <= p.data_ptr() < hi for lo, hi in segments)]
    h = hashlib.sha256()
    for n, t in sorted([*model.named_parameters(), *model.named_buffers()]):
        h.update(n.encode())
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
    return {"digest": h.hexdigest()[:24], "inside_allocator": inside[:20], "inside_count": len(inside),
            "params": sum(1 for _ in model.parameters()), "source": getattr(model, "fast_start_source", None)}


def main() -> None:
    args = json.loads(sys.argv[1])
    llm = LLM(args["model"], load_format=args.get("load_format", "auto"),
              model_loader_extra_config=args.get("extra") or {}, dtype="bfloat16", skip_tokenizer_init=True,
              max_model_len=512, enforce_eager=True, gpu_memory_utilization=0.3, seed=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           SamplingParams(temperature=0.0, max_tokens=16, detokenize=False))
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outputs], **llm.apply_model(report)[0]}
    with open(args["out"], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()

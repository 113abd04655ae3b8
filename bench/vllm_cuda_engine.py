"""One vLLM engine on a GPU, for bench/vllm_cuda.py: writes what it loaded as JSON.

    python -m bench.vllm_cuda_engine '{"model": PATH, "load_format": "auto", "extra": {}, "out": FILE}'
    ("engine": {...}: more keyword arguments of LLM(), e.g. {"moe_backend": "marlin"})

Reports greedy tokens for fixed prompts, a digest of every parameter and buffer, the parameters
whose memory lies inside PyTorch's CUDA allocator (`torch.cuda.memory_snapshot` segments: a
zero-copy parameter lies in a mapped arena instead), the weights' source, the loader's stage and
the attention backend modules the engine imported, and the seconds vLLM's
`process_weights_after_loading` took (`processing_s`, the GPU synchronized around it; with
FAST_START_BENCH_INPROC=1, which runs the engine core in this process). `"sleep": 1` or `2`
runs the engine with `enable_sleep_mode`, then sleeps and wakes it at that level (level 2 reloads the weights with
`reload_weights` between waking them and the KV cache), `"reload": true` runs `reload_weights`:
the tokens and the digest are then taken again (`after`). `"standby": true` starts the engine as
the standby's supervisor starts a standby (its KV cache light, FAST_START_STARTS_AS=standby),
sleeps and wakes it before it generates, and reports the GPU's free bytes at each step (`free`:
started, asleep, awake; with a `socket_dir`, the daemon's leases while asleep as `status` shows
them: `leases_asleep`). `"gpu_memory_utilization"` (default 0.3).
`"wait_for": FILE` keeps the engine generating (`meanwhile`) until FILE exists, then once more
(`again`); OUT.up is written once it serves. `"engine"` overrides the defaults here (eager, bf16,
0.3); `"gpu_memory_utilization": null` leaves vLLM's own default.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")     # apply_model sends a function
if json.loads(sys.argv[1]).get("profile") or os.environ.get("FAST_START_BENCH_INPROC") == "1":
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"     # the engine core here: its loading is profiled, timed

import torch
from vllm import LLM, SamplingParams
from vllm.model_executor.model_loader import base_loader, utils as loader_utils

PROMPTS = [[1, 17, 230, 45, 901, 3], [1, 500, 501, 502], [1, 7]]
PROCESSING: list[float] = []     # seconds each call of vLLM's process_weights_after_loading took, synchronized


def timed(process):
    def run(model, model_config, target_device):
        torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            return process(model, model_config, target_device)
        finally:
            torch.cuda.synchronize()
            PROCESSING.append(time.perf_counter() - start)
    return run


# Module level: an engine core spawned as a process imports this file again (as __mp_main__).
loader_utils.process_weights_after_loading = base_loader.process_weights_after_loading = timed(
    loader_utils.process_weights_after_loading)


def report(model: torch.nn.Module) -> dict:
    segments = [(s["address"], s["address"] + s["total_size"]) for s in torch.cuda.memory_snapshot()]
    inside = [n for n, p in model.named_parameters()
              if p.numel() and any(lo <= p.data_ptr() < hi for lo, hi in segments)]
    from fast_start.arena import checksum     # on the GPU: a 16 GB model's bytes need not cross to the host
    tensors = {n: f"{t.dtype} {tuple(t.shape)} {checksum(t)}"
               for n, t in sorted([*model.named_parameters(), *model.named_buffers()])}
    h = hashlib.sha256()
    for n, t in tensors.items():
        h.update(f"{n}\0{t}\0".encode())
    # Which of vLLM's attention backends the engine imported: vLLM's own choice imports every candidate.
    backends = sorted(m for m in sys.modules if m.startswith("vllm.v1.attention.backends."))
    return {"digest": h.hexdigest()[:24], "tensors": tensors, "inside_allocator": inside[:20], "inside_count": len(inside),
            "attention_modules": backends,
            "params": sum(1 for _ in model.parameters()), "source": getattr(model, "fast_start_source", None),
            "processing_s": round(sum(PROCESSING), 4) if PROCESSING else None}


def profiled(out: str) -> None:
    """cProfile vLLM's whole "Model loading" window (GPUModelRunner.load_model) into `out`; the
    engine core then runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set before vLLM's import)."""
    import cProfile
    import importlib
    import io
    import pstats

    def wrap(load):
        def load_model(self, *a, **kw):
            profile = cProfile.Profile()
            result = profile.runcall(load, self, *a, **kw)
            profile.dump_stats(out.removesuffix(".txt") + ".prof")     # for pstats' callers/callees
            text = io.StringIO()
            pstats.Stats(profile, stream=text).strip_dirs().sort_stats("cumulative").print_stats(120)
            with open(out, "w") as f:
                f.write(text.getvalue())
            return result
        return load_model
    for module in ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner"):   # 0.26 runs the second
        try:
            runner = importlib.import_module(module).GPUModelRunner
        except (ImportError, AttributeError):
            continue
        runner.load_model = wrap(runner.load_model)


def free_bytes(model: torch.nn.Module) -> int:
    """The GPU's free bytes, as the engine's worker sees them."""
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def leases(socket_dir: str) -> list[dict]:
    """GPU 0's daemon's leases as `fast-start status` shows them: pid, role, GPU memory."""
    from fast_start import protocol, reports
    from fast_start.cli import ask_report
    status = ask_report(socket_dir, 0, protocol.Status(), reports.Status)
    return [{"pid": l.pid, "role": l.role, "gpu_bytes": l.gpu_bytes} for l in status.leases]


def _margin(step: dict) -> float:
    """The top log-probability minus the second (vLLM's logprobs of one generated step)."""
    top = sorted((p.logprob for p in step.values()), reverse=True)
    return top[0] - top[1] if len(top) > 1 else float("inf")


def main() -> None:
    args = json.loads(sys.argv[1])
    if args.get("profile"):
        profiled(args["profile"])
    start = time.perf_counter()
    level = args.get("sleep", 0)
    kwargs = dict(load_format=args.get("load_format", "auto"), model_loader_extra_config=args.get("extra") or {},
                  dtype="bfloat16", skip_tokenizer_init=True, max_model_len=512, enforce_eager=True,
                  gpu_memory_utilization=args.get("gpu_memory_utilization", 0.3), seed=0,
                  **({"enable_sleep_mode": True} if level else {}))
    kwargs.update(args.get("engine", {}))       # e.g. {"enforce_eager": false}: compiled, CUDA graphs
    if kwargs["gpu_memory_utilization"] is None:
        del kwargs["gpu_memory_utilization"]    # vLLM's own default
    if args.get("standby"):
        os.environ["FAST_START_STARTS_AS"] = "standby"      # the engine core, a process of its own, reads it
    llm = LLM(args["model"], **kwargs)
    llm_s = time.perf_counter() - start
    free = {}
    if args.get("standby"):     # a standby is woken before it is asked anything
        free["started"] = llm.apply_model(free_bytes)[0]
        llm.sleep(level=1)
        free["asleep"] = llm.apply_model(free_bytes)[0]
        if "socket_dir" in kwargs["model_loader_extra_config"]:
            free["leases_asleep"] = leases(kwargs["model_loader_extra_config"]["socket_dir"])
        llm.wake_up()
        free["awake"] = llm.apply_model(free_bytes)[0]
    params = SamplingParams(temperature=0.0, max_tokens=16, detokenize=False, logprobs=2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    # Per step, how far the chosen token's log-probability lies above the runner-up's: where two
    # engines' tokens part, a margin near zero there says a rounding difference decided a near tie.
    margins = [[round(_margin(step), 5) for step in o.outputs[0].logprobs or []] for o in outputs]
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outputs], "margins": margins, "llm_s": round(llm_s, 3),
              "free": free, **llm.apply_model(report)[0]}
    if args.get("wait_for"):       # keep serving: generate again once told to (e.g. after a daemon's reload)
        with open(args["out"] + ".up", "w") as f:
            json.dump(result, f)
        while not os.path.exists(args["wait_for"]):
            outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
            result.setdefault("meanwhile", []).append([list(o.outputs[0].token_ids) for o in outputs])
            time.sleep(0.5)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        result["again"] = [list(o.outputs[0].token_ids) for o in outputs]
    if level or args.get("reload"):
        if level:
            llm.sleep(level=level)
            if level == 2:      # the weights were discarded: vLLM's recipe is wake them, reload, wake the rest
                llm.wake_up(tags=["weights"])
                llm.collective_rpc("reload_weights")
                llm.wake_up(tags=["kv_cache"])
            else:
                llm.wake_up()
        else:
            llm.collective_rpc("reload_weights")
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        result["after"] = {"tokens": [list(o.outputs[0].token_ids) for o in outputs], **llm.apply_model(report)[0]}
    with open(args["out"], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()

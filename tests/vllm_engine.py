"""Run one real vLLM engine (CPU) and write what it loaded as JSON to the file `out`.

    python vllm_engine.py '{"model": PATH, "tp": 1, "load_format": "fast_start", "extra": {...}, "out": FILE}'

Reports, per TP rank: a SHA-256 of every parameter as loaded (just before vLLM's
`process_weights_after_loading`, recorded by wrapping it) and of every parameter, buffer and
tensor attribute after it; what vLLM recorded of each module for `reload_weights`; the
parameters that, as loaded and at the end, lie outside every fast-start arena mapped into the
process (their data pointers against the `memfd:fast-start:` mappings in /proc/self/maps); where the
fast-start loader set it, `fast_start_source`; the external weight bytes the loader announces;
and the greedy tokens for fixed prompts. `"engine"`: more of `LLM`'s arguments (e.g.
`enable_expert_parallel`; with a `speculative_config` the draft model is reported too, as
`draft`). With `"reload": true`, vLLM's `reload_weights` then
runs and the tokens and the report are taken again (`reloaded`). `"sleep": [1, 2]`: vLLM's sleep at
each level, then a wake and the tokens again (`woken`, or `refused` with the error's text).
`"workers": "spawn"`: a
multi-rank engine's workers spawned, as vLLM's CPU build does (by default they are forked).
`"eager": false`: torch.compile and
CUDA graphs on, as vLLM's defaults have them (the tests run eager unless they say so).
`{"api_server": ARGS}`: `python -m vllm.entrypoints.openai.api_server ARGS` instead, its engine
core forked, until it is sent SIGTERM.

    python vllm_engine.py --serve SOCKET

imports vLLM once and forks one engine per request on SOCKET (engine_server.py is the client):
the tests start dozens of engines, and a fresh interpreter spends most of an engine's start
importing torch and vLLM. The server holds one thread (it checks), so each fork is a clean copy
of an interpreter that has imported and run nothing else; its workers fork from it in turn.
"""
from __future__ import annotations

import atexit
import functools
import gc
import hashlib
import json
import os
import runpy
import signal
import socket
import sys
import traceback

import torch

DEFAULTS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}    # apply_model sends a function
for _key, _value in DEFAULTS.items():
    os.environ.setdefault(_key, _value)
# The KV cache each rank allocates (and the report digests): room for far more than the 256
# tokens these models need. VLLM_CPU_KVCACHE_SPACE (whole GiB) would override it.
KV_CACHE_BYTES = 64 << 20

from vllm import LLM, SamplingParams
from vllm.model_executor.model_loader import base_loader, get_model_loader
from vllm.model_executor.model_loader import utils as loader_utils
from vllm.platforms.cpu import CpuPlatform

PROMPTS = [[1, 17, 230, 45, 901, 3], [1, 500, 501, 502], [1, 7]]


def digest(t: torch.Tensor) -> str:
    flat = t.detach().cpu().contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy()).hexdigest()[:24] + f":{t.dtype}{tuple(t.shape)}"


def arenas() -> list[tuple[int, int]]:
    """Address ranges of the fast-start arenas (memfds) mapped into this process."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            if "memfd:fast-start:" in line:
                lo, hi = line.split()[0].split("-")
                out.append((int(lo, 16), int(hi, 16)))
    return out


AS_LOADED = {}    # id(model) -> (digests, parameters outside every arena); kept off the model, whose
                  # attributes the fast-start loader compares with the fill's


def record_as_loaded(original):
    def wrapped(model, model_config, target_device):
        mapped = arenas()
        AS_LOADED[id(model)] = ({n: digest(p) for n, p in model.named_parameters()},
                                [n for n, p in model.named_parameters()
                                 if not any(lo <= p.data_ptr() and p.data_ptr() + p.nbytes <= hi for lo, hi in mapped)])
        return original(model, model_config, target_device)
    return wrapped


# Module level: a spawned vLLM worker imports this file again as `__mp_main__`.
_wrapped = record_as_loaded(loader_utils.process_weights_after_loading)
loader_utils.process_weights_after_loading = base_loader.process_weights_after_loading = _wrapped


def start_workers_with(method: str) -> None:
    """Have this engine start its workers with `method` ("fork" or "spawn"). vLLM's CPU platform
    sets `spawn` as it checks the config: each worker imports torch and vLLM again, seconds per
    worker for each of the suite's dozens of multi-rank engines. vLLM on CUDA forks its workers
    where it can, so the tests fork them, but for those that keep the spawned path covered."""
    check = CpuPlatform.check_and_update_config.__func__

    def check_then_choose(cls, vllm_config) -> None:
        check(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = method
    CpuPlatform.check_and_update_config = classmethod(check_then_choose)


def reload_record(model: torch.nn.Module) -> dict:
    """What vLLM recorded of each module for `reload_weights`: its device and its tensors' shapes."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    out = {}
    for name, module in model.named_modules():
        info = LAYERWISE_INFO.get(module)
        if info is not None:
            params, buffers = info.restore_metadata
            out[name] = [info.restore_device.type, *({k: f"{t.dtype}{tuple(t.shape)}" for k, t in sorted(group.items())}
                                                     for group in (params, buffers))]
    return out


def tensor_attrs(model: torch.nn.Module) -> dict:
    """Every tensor or device a module holds as a plain attribute (not a parameter or buffer)."""
    out = {}
    for name, module in model.named_modules():
        for key, value in vars(module).items():
            if isinstance(value, torch.Tensor):
                out[f"{name}.{key}"] = digest(value)
            elif isinstance(value, torch.device):
                out[f"{name}.{key}"] = value.type
    return out


def report(config, model: torch.nn.Module) -> dict:
    from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank
    rank = get_pp_group().rank_in_group * config.parallel_config.tensor_parallel_size + get_tensor_model_parallel_rank()
    external = get_model_loader(config.load_config).get_external_weight_memory(config)
    final = {n: digest(t) for n, t in [*model.named_parameters(), *model.named_buffers()]}
    as_loaded, outside = AS_LOADED[id(model)]
    mapped = arenas()
    now_outside = [n for n, p in model.named_parameters()
                   if not any(lo <= p.data_ptr() and p.data_ptr() + p.nbytes <= hi for lo, hi in mapped)]
    attrs_mapped = [f"{name}.{key}" for name, module in model.named_modules() for key, v in vars(module).items()
                    if isinstance(v, torch.Tensor) and v.numel()
                    and any(lo <= v.data_ptr() < hi for lo, hi in mapped)]
    return {"rank": rank, "as_loaded": as_loaded, "final": final, "outside_arena": outside,
            "final_outside_arena": now_outside, "attrs_in_arena": attrs_mapped,
            "attrs": tensor_attrs(model), "reload": reload_record(model),
            "source": getattr(model, "fast_start_source", None), "external_bytes": external}


def draft_report(worker, config) -> dict:
    """`report` of a speculative engine's draft model (the worker's drafter holds it)."""
    return report(config, worker.model_runner.drafter.model)


def main() -> None:
    args = json.loads(sys.argv[1])
    start_workers_with(args.get("workers", "fork"))
    if "api_server" in args:    # `python -m vllm.entrypoints.openai.api_server ARGS` until it is stopped
        sys.argv = ["api_server", *args["api_server"]]
        runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)
        return
    if not args.get("eager", True):     # the engine server's interpreter has Dynamo off (engine_server.ENV)
        os.environ.pop("TORCHDYNAMO_DISABLE", None)
        torch._dynamo.config.disable = False
    ranks = args["tp"] * args.get("pp", 1)
    if ranks > 1:       # one CPU list per rank; with data parallelism vLLM takes its DP rank's share of them
        ranks *= int(os.environ.get("VLLM_DP_SIZE", "1"))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % os.cpu_count()) for i in range(ranks)))
    llm = LLM(args["model"], load_format=args.get("load_format", "auto"), tensor_parallel_size=args["tp"],
              pipeline_parallel_size=args.get("pp", 1), quantization=args.get("quantization"),
              model_loader_extra_config=args.get("extra") or {}, dtype=args.get("dtype", "bfloat16"),
              skip_tokenizer_init=True, max_model_len=256, enforce_eager=args.get("eager", True), seed=0,
              kv_cache_memory_bytes=KV_CACHE_BYTES, hf_overrides=args.get("hf_overrides") or {}, **args.get("engine", {}))
    params = SamplingParams(temperature=0.0, max_tokens=12, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    ranks = sorted(llm.apply_model(functools.partial(report, llm.llm_engine.vllm_config)), key=lambda r: r["rank"])
    result = {"prompts": PROMPTS, "tokens": [list(o.outputs[0].token_ids) for o in outputs], "ranks": ranks}
    if args.get("engine", {}).get("speculative_config"):
        result["draft"] = sorted(llm.collective_rpc(draft_report, args=(llm.llm_engine.vllm_config,)),
                                 key=lambda r: r["rank"])
    if args.get("reload"):      # vLLM's in-place reload from the checkpoint, then the same prompts again
        llm.collective_rpc("reload_weights")
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        result["reloaded"] = {"tokens": [list(o.outputs[0].token_ids) for o in outputs],
                              "ranks": sorted(llm.apply_model(functools.partial(report, llm.llm_engine.vllm_config)),
                                              key=lambda r: r["rank"])}
    for level in args.get("sleep", ()):     # vLLM's sleep at each level, then a wake and the prompts again
        try:
            llm.sleep(level=level)
        except Exception as e:
            result.setdefault("refused", {})[level] = str(e)
            continue
        llm.wake_up()
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        result.setdefault("woken", {})[level] = [list(o.outputs[0].token_ids) for o in outputs]
    with open(args["out"], "w") as f:
        json.dump(result, f)


def serve(path: str) -> None:
    """Accept requests (one JSON line: `args`, `env`, `log`) on the Unix socket `path`; for each,
    a child forks the engine, answers `{"pid": N}`, waits for it and answers `{"rc": N}`."""
    threads = os.listdir("/proc/self/task")
    assert len(threads) == 1, f"the engine server must fork from one thread, has {len(threads)}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)       # reaps the children that wait for engines
    # What the server imported stays out of every collection in its engines (vLLM collects as
    # each rank shuts down): scanning it costs each forked process a copy of its heap.
    gc.collect()
    gc.freeze()
    sys.stdout.flush()
    sys.stderr.flush()
    while True:
        conn, _ = listener.accept()
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            request = json.loads(conn.makefile().readline())
            pid = os.fork()
            if pid == 0:
                conn.close()
                engine(request)         # exits
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            _, status = os.waitpid(pid, 0)
            conn.sendall(json.dumps({"rc": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
            os._exit(0)
        conn.close()


def engine(request: dict) -> None:
    """In a forked child: become what `python vllm_engine.py ARGS` with `env` would be, output to
    `log`, run the engine and exit as that interpreter would, its exit handlers (vLLM's shutdown)
    run, less the teardown of every module (seconds, with torch and vLLM loaded)."""
    fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.environ.clear()
    os.environ.update({**DEFAULTS, **request["env"]})
    sys.path[1:1] = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.argv = [sys.argv[0], json.dumps(request["args"])]
    code = 0
    try:
        main()
    except SystemExit as e:     # as the interpreter reads it
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        serve(sys.argv[2])
    else:
        main()

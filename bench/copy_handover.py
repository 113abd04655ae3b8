"""Copy hand-overs on a GPU after zero_copy engines, and beside a model that fills most of it.

    python -m bench.copy_handover OUTDIR served
    python -m bench.copy_handover OUTDIR big

served: a Qwen3-8B-shaped bf16 model (16.4 GB), the daemon dropping its cache for a copy
(`on_release = "drop"`): vLLM's default loader at vLLM's defaults (torch.compile and CUDA graphs,
its default gpu_memory_utilization) for the reference tokens, then three zero_copy engines (two
compiled, one eager), then a copy engine at the defaults, each a fresh process; then whether the
daemon still serves, and how long it takes to exit on SIGTERM.

big: a Qwen3-32B-shaped checkpoint of 29 layers served as float32 (58.5 GiB, about 74 % of an
H100): the default loader's tokens (eager, 0.9), a fill, a zero_copy engine then a copy engine at
0.9 (eager), the same checks.

Each step's result is written to OUTDIR/<phase>.json as it comes (a run cut short keeps them).
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.big_model import OUT, SHAPE, WORK, Daemon, Sampler, checkpoint, env, finish, model_entry
from devtools import synth
from fast_start import memory

BIG = synth.Shape(architecture="Qwen3ForCausalLM", hidden_size=5120, num_layers=29, num_heads=64, num_kv_heads=8,
                  head_dim=128, intermediate_size=25600, vocab_size=151936)
COMPILED = {"enforce_eager": False}


def engine(name: str, model: Path, load_format: str = "auto", extra: dict | None = None, util: float | None = None,
           settings: dict | None = None) -> dict:
    """A fresh vLLM process (bench.vllm_cuda_engine); its result, wall time and fast-start lines."""
    out, log = WORK / f"{name}.json", OUT / f"{name}.log"
    out.unlink(missing_ok=True)
    args = {"model": str(model), "load_format": load_format, "extra": extra or {}, "out": str(out),
            "gpu_memory_utilization": util, "engine": settings or {}}
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "bench.vllm_cuda_engine", json.dumps(args)], env=env(), cwd=WORK,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    r = finish(proc, out, log)
    r["wall_s"] = round(time.monotonic() - start, 1)
    return r


def cached(d: Daemon) -> list[str]:
    s = d.cli("status")
    return [m["name"] for m in s[0]["models"]] if isinstance(s, list) else [f"status failed: {s}"]


def stop_seconds(d: Daemon) -> float | None:
    start = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)
    try:
        d.proc.wait(60)
    except subprocess.TimeoutExpired:
        d.proc.kill()
        return None
    return round(time.monotonic() - start, 2)


def judged(r: dict, reference: dict) -> dict:
    r["same_tokens"] = r.get("tokens") is not None and r["tokens"] == reference.get("tokens")
    return r


def served(save) -> dict:
    path = checkpoint()
    r: dict = {"model_gb": SHAPE.nbytes() / 1e9}
    r["default"] = engine("default", path, settings=COMPILED)
    save(r)
    d = Daemon("served", [model_entry("qwen3-8b", path)], on_release="drop")
    r["ready_s"] = d.wait_ready()
    steps = [("zero_copy-compiled-1", {}, None, COMPILED), ("zero_copy-compiled-2", {}, None, COMPILED),
             ("zero_copy-eager", {}, None, {}), ("copy", {"mode": "copy"}, None, COMPILED)]
    return engines_then_stop(d, path, r, save, steps)


def big(save) -> dict:
    path = WORK / "qwen3-32b-29l"
    if not (path / "config.json").exists():
        synth.write_checkpoint(path, BIG, seed=7, files=8, reuse=True)
    fp32 = {"dtype": "float32"}
    r: dict = {"model_gib_served": BIG.nbytes(torch.float32) / 2**30}
    r["default"] = engine("big-default", path, util=0.9, settings=fp32)
    save(r)
    sampler = Sampler()
    d = Daemon("big", [model_entry("big", path, dtype="float32")], on_release="drop")
    r["ready_s"] = d.wait_ready(900)
    now = memory.of(sampler.uuid)
    r.update(total_gib=now.total / 2**30, used_after_fill_gib=(now.total - now.free) / 2**30)
    steps = [("zero_copy", {}, 0.9, fp32), ("copy", {"mode": "copy"}, 0.9, fp32)]
    return engines_then_stop(d, path, r, save, steps, prefix="big-")


def engines_then_stop(d: Daemon, path: Path, r: dict, save, steps: list, prefix: str = "") -> dict:
    """Each (name, loader options, gpu_memory_utilization, engine settings) engine in turn on
    `d`'s cache, judged against r["default"]; then what is cached and evicted, and how long the
    daemon takes to exit on SIGTERM."""
    opts = {"socket_dir": str(d.run_dir), "fallback": False}
    try:
        for name, more, util, settings in steps:
            r[name] = judged(engine(prefix + name, path, "fast_start", {**opts, **more}, util=util, settings=settings),
                             r["default"])
            save(r)
        r["cached_after_copy"], r["evictions"] = cached(d), d.cli("evictions")
        save(r)
    finally:
        r["sigterm_exit_s"] = stop_seconds(d)
    return r


def main() -> None:
    phase = sys.argv[2]
    WORK.mkdir(parents=True, exist_ok=True)
    OUT.mkdir(parents=True, exist_ok=True)

    def save(result: dict) -> None:
        (OUT / f"{phase}.json").write_text(json.dumps(result, indent=1))
    save({"served": served, "big": big}[phase](save))


if __name__ == "__main__":
    main()

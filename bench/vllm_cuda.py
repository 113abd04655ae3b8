"""vLLM's CUDA build on one GPU: the default loader against fast-start's cache, side by side.

    python -m bench.vllm_cuda OUTDIR [MODEL ...]      (models: MODELS' keys)

For each model: a CUDA daemon filled by vLLM itself (engine "vllm", engine_version "auto"), then
engines as fresh processes: vLLM's default loader, `fast_start` zero_copy and copy. Writes
OUTDIR/summary.json (tokens equal, parameters inside PyTorch's allocator, digests, vLLM's
"Model loading took" and "Available KV cache memory" lines, the seconds vLLM's
`process_weights_after_loading` took) and every process's log, and prints each model's engines
by loader (medians of `Model loading took`, of the processing and of `LLM(...)`, the default
loader's median over each).
Needs vLLM's CUDA build importable.
"""
from __future__ import annotations

import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from devtools import synth

OUT = Path(sys.argv[1])
WORK = Path(os.environ.get("FAST_START_BENCH_WORK", "/tmp/fast-start-vllm-cuda"))
DENSE = synth.Shape(architecture="Qwen3ForCausalLM", hidden_size=1024, num_layers=4, num_heads=8, num_kv_heads=2,
                    head_dim=128, intermediate_size=3072, vocab_size=4096)
MOE = synth.Shape(architecture="Qwen3MoeForCausalLM", hidden_size=1024, num_layers=4, num_heads=8, num_kv_heads=2,
                  head_dim=128, intermediate_size=3072, vocab_size=4096, num_experts=8, moe_intermediate_size=768)
# The shape of Qwen3-8B (16.4 GB in bf16), random weights.
QWEN3_8B = synth.Shape(architecture="Qwen3ForCausalLM", hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8,
                       head_dim=128, intermediate_size=12288, vocab_size=151936)
# The shape of Qwen3-14B: 10.5 GB as NVFP4 (linear layers 4 bits and a scale per 16, embeddings bf16).
QWEN3_14B = synth.Shape(architecture="Qwen3ForCausalLM", hidden_size=5120, num_layers=40, num_heads=40, num_kv_heads=8,
                        head_dim=128, intermediate_size=17408, vocab_size=151936)
# gpt-oss-shaped (its MXFP4 experts, attention with sinks and biases), small: hidden 1024, 8 experts.
GPT_OSS = synth.Shape(architecture="GptOssForCausalLM", hidden_size=1024, num_layers=4, num_heads=16, num_kv_heads=4,
                      head_dim=64, intermediate_size=1024, vocab_size=4096, num_experts=8)
MODELS = {"qwen3-bf16": (DENSE, {}), "qwen3-fp8": (DENSE, {"fp8": "block"}), "moe-fp8": (MOE, {"fp8": "block"}),
          "qwen3-8b": (QWEN3_8B, {}), "qwen3-nvfp4": (DENSE, {"fp4": "ct-w4a16"}),
          "moe-nvfp4": (MOE, {"fp4": "ct-w4a16"}), "qwen3-nvfp4-a4": (DENSE, {"fp4": "ct-w4a4"}),
          "qwen3-nvfp4-modelopt": (DENSE, {"fp4": "modelopt"}), "qwen3-14b-nvfp4": (QWEN3_14B, {"fp4": "ct-w4a16"}),
          "gpt-oss-mxfp4": (GPT_OSS, {})}
# Engine settings a model is served with, by its engines and its [model.vllm] alike (vLLM's default
# MXFP4 MoE backend on Hopper, Triton, keeps its processed scales outside the layer: not cached).
SERVED = {"gpt-oss-mxfp4": {"moe_backend": "marlin"}}
# FAST_START_BENCH_PROFILE=1: each engine with vLLM's model loading under cProfile
# (OUT/<engine>.profile.txt; the engine core then runs in-process).
PROFILE = os.environ.get("FAST_START_BENCH_PROFILE") == "1"
# FAST_START_BENCH_RUNS=N: every engine N times (the default loader's runs 2..N compared with its
# first: how much greedy tokens vary between runs of one loader).
RUNS = int(os.environ.get("FAST_START_BENCH_RUNS", "1"))
# FAST_START_BENCH_DEFAULT_RUNS=M: the default loader's engines M times instead (each takes longer
# than a cached one: more cached engines in the same time).
DEFAULT_RUNS = int(os.environ.get("FAST_START_BENCH_DEFAULT_RUNS", str(RUNS)))
# FAST_START_BENCH_MODES=zero_copy: only these cached modes (an engine takes 20-35 s on the H200:
# ten of one mode fit in a run where ten of both do not).
CACHED_MODES = os.environ.get("FAST_START_BENCH_MODES", "zero_copy,copy").split(",")
# FAST_START_BENCH_UNDEFINED=1: uninitialized memory filled in every process (bench/undefined/).
if os.environ.get("FAST_START_BENCH_UNDEFINED") == "1":
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).parent / "undefined"), *filter(None, [os.environ.get("PYTHONPATH")])])
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
if not set(CACHED_MODES) <= {"zero_copy", "copy"}:
    raise SystemExit(f"FAST_START_BENCH_MODES={','.join(CACHED_MODES)}: use zero_copy, copy or both, comma-separated")


def run(name: str, args: list[str], log: Path, timeout: float = 300) -> int:
    with open(log, "w") as f:
        try:
            return subprocess.run([sys.executable, *args], stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return -1


def engine(name: str, model: Path, load_format: str = "auto", extra: dict | None = None, profile: bool = False) -> dict:
    out, log = WORK / f"{name}.json", OUT / f"{name}.log"
    out.unlink(missing_ok=True)
    start = time.monotonic()
    rc = run(name, ["-m", "bench.vllm_cuda_engine", json.dumps(
        {"model": str(model), "load_format": load_format, "extra": extra or {}, "out": str(out),
         "engine": SERVED.get(model.name, {}),
         "profile": str(OUT / f"{name}.profile.txt") if profile else ""})], log)
    text = log.read_text(errors="replace")
    r = json.loads(out.read_text()) if out.exists() else {}
    r.update(rc=rc, wall_s=round(time.monotonic() - start, 1),
             loading=re.findall(r"Model loading took [^\n]*", text)[-1:],
             kv_cache=re.findall(r"Available KV cache memory: [^\n]*", text)[-1:],
             fast_start=[ln[-300:] for ln in text.splitlines() if "fast-start" in ln][-3:],
             errors=[ln[-300:] for ln in text.splitlines() if "Error" in ln][-3:])
    return r


def compared(r: dict, e: dict) -> dict:
    """Engine result `e` with its tokens and digest compared with the default loader's first run."""
    e.update(same_tokens=e.get("tokens") == r["default"].get("tokens"),
             first_difference=first_difference(r["default"], e),
             same_digest=e.get("digest") == r["default"].get("digest"),
             differing=differing(r["default"].get("tensors", {}), e.get("tensors", {})))
    return e


def differing(a: dict, b: dict) -> list[str]:
    """The first tensors (by name) whose dtype, shape or checksum differ between two engines, or
    that one of them lacks, each with both sides."""
    return [f"{n}: {a.get(n, 'absent')} | {b.get(n, 'absent')}"
            for n in sorted(a.keys() | b.keys()) if a.get(n) != b.get(n)][:20]


def first_difference(a: dict, b: dict) -> dict | None:
    """Where two engines' greedy tokens first part: prompt, step, and each engine's margin there
    (top log-probability minus the runner-up's)."""
    for p, (x, y) in enumerate(zip(a.get("tokens", []), b.get("tokens", []))):
        for step, (s, t) in enumerate(zip(x, y)):
            if s != t:
                margin = [e.get("margins", [[]] * (p + 1))[p][step:step + 1] for e in (a, b)]
                return {"prompt": p, "step": step, "margins": margin}
    return None


def seconds(line: list[str]) -> float | None:
    """The seconds of vLLM's "Model loading took X GiB and S seconds" line."""
    m = re.search(r"and ([\d.]+) seconds", line[0]) if line else None
    return float(m.group(1)) if m else None


def table(name: str, r: dict) -> Table:
    """One model's engines by loader: `Model loading took` and `LLM(...)` (medians, ranges), the
    default loader's median over each loader's, and how many engines matched its tokens and digest."""
    out = Table(title=f"{name}: vLLM {r.get('vllm', '')} engines, fresh processes")
    for col in ("loader", "engines", "Model loading took s", "range s", "default / this", "processing s",
                "LLM(...) s", "same tokens", "same digest"):
        out.add_column(col, justify="right")
    by = {}
    for label, e in r.items():
        if isinstance(e, dict) and "rc" in e:
            by.setdefault(re.sub(r"-\d+$", "", label), []).append(e)
    base = statistics.median([x for e in by.get("default", []) if (x := seconds(e["loading"])) is not None] or [0])
    for loader, engines in by.items():
        took = [x for e in engines if (x := seconds(e["loading"])) is not None]
        llm = [e["llm_s"] for e in engines if "llm_s" in e]
        processing = [e["processing_s"] for e in engines if e.get("processing_s") is not None]
        if not took:
            out.add_row(loader, str(len(engines)), "failed", "", "", "", "", "", "")
            continue
        mid, failed = statistics.median(took), len(engines) - len(took)
        out.add_row(loader, f"{len(took)}" + (f" ({failed} failed)" if failed else ""), f"{mid:.3f}",
                    f"{min(took):.3f}-{max(took):.3f}",
                    f"{base / mid:.1f}x" if base else "",
                    f"{statistics.median(processing):.3f}" if processing else "",
                    f"{statistics.median(llm):.2f}" if llm else "",
                    "" if loader == "default" else f"{sum(bool(e.get('same_tokens')) for e in engines)}/{len(engines)}",
                    "" if loader == "default" else f"{sum(bool(e.get('same_digest')) for e in engines)}/{len(engines)}")
    return out


def daemon(models: dict[str, Path]):
    run_dir = WORK / "run"
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    lines = ["[daemon]", f'socket_dir = "{run_dir}"', 'device = "cuda"', f'worker_python = "{sys.executable}"']
    for name, path in models.items():
        lines += ["", "[[model]]", f'name = "{name}"', f'path = "{path}"', "gpus = [0]", 'engine = "vllm"',
                  'engine_version = "auto"', "[model.vllm]", *(f'{k} = "{v}"' for k, v in SERVED.get(name, {}).items())]
    config = WORK / "fs.toml"
    config.write_text("\n".join(lines) + "\n")
    listen = WORK / "notify.sock"
    listen.unlink(missing_ok=True)
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(listen))
    notify.settimeout(1.0)
    proc = subprocess.Popen([sys.executable, "-m", "fast_start.cli", "daemon", "--gpu", "0", "--config", str(config)],
                            env={**os.environ, "NOTIFY_SOCKET": str(listen)},
                            stdout=open(OUT / "daemon.log", "w"), stderr=subprocess.STDOUT)
    start = time.monotonic()
    while time.monotonic() - start < 400 and proc.poll() is None:
        try:
            if b"READY=1" in notify.recv(65536):
                return proc, run_dir, round(time.monotonic() - start, 1)
        except socket.timeout:
            pass
    return proc, None, None


def main() -> None:
    import torch
    import vllm
    OUT.mkdir(parents=True, exist_ok=True)
    WORK.mkdir(parents=True, exist_ok=True)
    chosen = sys.argv[2:] or list(MODELS)
    paths = {}
    for name in chosen:
        shape, quantized = MODELS[name]
        paths[name] = WORK / name
        if not (paths[name] / "config.json").exists():
            big = shape in (QWEN3_8B, QWEN3_14B)
            synth.write_checkpoint(paths[name], shape, seed=7, files=4 if big else 1, reuse=big, **quantized)
    summary = {"vllm": vllm.__version__, "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0),
               "env": {k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "FAST_START_BENCH_"))}}
    warm = WORK / "warmup"
    if not (warm / "config.json").exists():
        synth.write_checkpoint(warm, DENSE, seed=7)
    engine("warmup", warm)                     # the first engine on a machine pays kernel warm-up
    proc, run_dir, ready_s = daemon(paths)
    summary["daemon_ready_s"] = ready_s
    try:
        for name in chosen:
            r = summary[name] = {"default": engine(f"{name}-default", paths[name], profile=PROFILE)}
            for i in range(2, DEFAULT_RUNS + 1):    # the default loader against itself: run-to-run variation
                r[f"default-{i}"] = compared(r, engine(f"{name}-default-{i}", paths[name]))
                (OUT / "summary.json").write_text(json.dumps(summary, indent=1))
            if run_dir is None:
                continue
            options = {"socket_dir": str(run_dir), "fallback": False}
            for i in range(1, RUNS + 1):
                for mode in CACHED_MODES:
                    label = mode if i == 1 else f"{mode}-{i}"
                    r[label] = compared(r, engine(f"{name}-{label}", paths[name], "fast_start",
                                                  {**options, "mode": mode}, PROFILE))
                    (OUT / "summary.json").write_text(json.dumps(summary, indent=1))
            (OUT / "summary.json").write_text(json.dumps(summary, indent=1))
    finally:
        proc.terminate()
        proc.wait(60)
        (OUT / "summary.json").write_text(json.dumps(summary, indent=1))
        for name in chosen:
            if name in summary:
                Console(width=140).print(table(name, {"vllm": summary["vllm"], **summary[name]}))


if __name__ == "__main__":
    main()

"""The restart benchmark on a GPU (`python -m bench.restart --device cuda`): every figure from
fresh engine processes.

One daemon caches four models on GPU 0 (it is the multi-model daemon: each engine fetches one of
them): Llama-shaped bf16 checkpoints of 4 and 16 GiB (hidden 4096), the 16 GiB one again served
as float32 (a 32 GiB shard), and a Qwen3-MoE-shaped bf16 checkpoint in the `hf` layout with
128 experts in each of 24 layers (9,435 tensors). Each engine is a new process (forked from one
that has imported torch and nothing else: no CUDA context, no fast_start) that initialises CUDA,
then times `import fast_start` (+ `fast_start.fetch`, the engine side) and its first
`fetch(spec, device="cuda:0")` + `torch.cuda.synchronize()`: medians of `--repeat`.

Side by side in the same run:
- `--baseline DIR`: a fast-start tree of an earlier revision (its own daemon and engines, run
  from DIR) on the same checkpoints, for before/after;
- the legacy mechanism: a producer process holds the same tensors (`safetensors` to the GPU)
  and publishes one CUDA IPC handle per tensor; a fresh consumer process rebuilds them all;
- a device-to-device clone of the 16 GiB shard's bytes into newly allocated memory (what `copy`
  mode is measured against);
- `safetensors.torch.load_file` of the 16 GiB checkpoint to the GPU in a fresh process.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from devtools import synth
from devtools.harness import Daemon, write_config

# One engine restart: CUDA is up before the clock starts, as in an engine that fetches its weights.
ENGINE = """
import json, sys, time, torch
device = sys.argv[5]
sync = torch.cuda.synchronize if device != "cpu" else lambda: None
if device != "cpu":
    torch.zeros(1, device=device); sync()
t0 = time.perf_counter()
import fast_start
fast_start.fetch
t1 = time.perf_counter()
spec = fast_start.WeightSpec(sys.argv[1], dtype=sys.argv[4], engine_version="bench")
w = fast_start.fetch(spec, device=device, mode=sys.argv[3], socket_dir=sys.argv[2], fallback=False)
sync()
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "fetch_s": t2 - t1, "source": w.source, "tensors": len(w),
                  "bytes": sum(t.nbytes for t in w.tensors.values())}))
"""
# The same restart once more under cProfile: where a fetch's milliseconds go (the top 20 by own time:
# own ms, cumulative ms, calls, function; file names without their folders).
PROFILED = ENGINE.replace(
    "w = fast_start.fetch(spec", "import cProfile, io, pstats\nprofile = cProfile.Profile()\n"
    "w = profile.runcall(fast_start.fetch, spec").replace(
    'print(json.dumps({"import_s"', 'text = io.StringIO()\n'
    'stats = pstats.Stats(profile).stats\n'
    'for (f, line, fn), (_, n, own, cum, _) in sorted(stats.items(), key=lambda kv: -kv[1][2])[:20]:\n'
    '    text.write(f"{own * 1e3:8.3f} {cum * 1e3:8.3f} {n:6d}  {f.rsplit(\'/\', 1)[-1]}:{line}({fn})\\n")\n'
    'print(json.dumps({"profile": text.getvalue(), "import_s"')

# The legacy mechanism's producer: the tensors on the GPU, one CUDA IPC handle per tensor.
IPC_PRODUCER = """
import pickle, sys, torch
from pathlib import Path
from safetensors.torch import load_file
from torch.multiprocessing.reductions import reduce_tensor
tensors = {}
for f in sorted(Path(sys.argv[1]).glob("*.safetensors")):
    tensors.update(load_file(str(f), device="cuda:0"))
torch.cuda.synchronize()
with open(sys.argv[2], "wb") as out:
    pickle.dump([(n, reduce_tensor(t)) for n, t in tensors.items()], out)
print("ready", flush=True)
sys.stdin.readline()
"""

# ... and a fresh consumer process that rebuilds every tensor from its handle.
IPC_CONSUMER = """
import json, pickle, sys, time, torch
torch.zeros(1, device="cuda:0"); torch.cuda.synchronize()
t0 = time.perf_counter()
with open(sys.argv[1], "rb") as f:
    items = pickle.load(f)
tensors = {n: fn(*args) for n, (fn, args) in items}
torch.cuda.synchronize()
print(json.dumps({"fetch_s": time.perf_counter() - t0, "tensors": len(tensors)}))
"""

LOAD_FILE = """
import json, sys, time, torch
from pathlib import Path
from safetensors.torch import load_file
torch.zeros(1, device="cuda:0"); torch.cuda.synchronize()
t0 = time.perf_counter()
tensors = {}
for f in sorted(Path(sys.argv[1]).glob("*.safetensors")):
    tensors.update(load_file(str(f), device="cuda:0"))
torch.cuda.synchronize()
print(json.dumps({"fetch_s": time.perf_counter() - t0, "tensors": len(tensors)}))
"""

MOE = synth.Shape(architecture="Qwen3MoeForCausalLM", hidden_size=2048, num_layers=24, num_heads=16, num_kv_heads=4,
                  head_dim=128, intermediate_size=6144, vocab_size=32000, num_experts=128, moe_intermediate_size=256)
# case -> (checkpoint, dtype); copy mode is measured for the cases in COPY
CASES = {"dense-4GiB": ("dense4", "bfloat16"), "dense-16GiB": ("dense16", "bfloat16"),
         "dense-32GiB": ("dense16", "float32"), "moe-hf-9435": ("moe", "bfloat16")}
COPY = ("dense-16GiB", "moe-hf-9435")


# On the CPU (`--device cpu`): the same tensor counts with tiny tensors, for the per-tensor and
# fixed costs of a fresh process on any machine.
TINY = {"dense4": synth.Shape(hidden_size=256, num_layers=9, num_heads=8, num_kv_heads=2, head_dim=32),
        "dense16": synth.Shape(hidden_size=256, num_layers=38, num_heads=8, num_kv_heads=2, head_dim=32),
        "moe": synth.Shape(architecture="Qwen3MoeForCausalLM", hidden_size=128, num_layers=24, num_heads=4,
                           num_kv_heads=2, head_dim=32, intermediate_size=256, vocab_size=1024, num_experts=128,
                           moe_intermediate_size=64)}


def checkpoints(root: Path, device: str) -> dict[str, Path]:
    if device == "cpu":
        return {name: synth.cached(root, shape, files=4) for name, shape in TINY.items()}
    return {"dense4": synth.cached(root, synth.llama_of_size(4 << 30, hidden_size=4096), files=1, reuse=True),
            "dense16": synth.cached(root, synth.llama_of_size(16 << 30, hidden_size=4096), files=4, reuse=True),
            "moe": synth.cached(root, MOE, files=4, reuse=True)}


# Engines are forked from a process that has imported torch and nothing else (no CUDA context,
# no fast_start): each child is a new process with its own CUDA context and its first `import
# fast_start`, as a restarted engine is, without paying torch's import (seconds) for every sample.
SPAWNER = """
import json, os, sys, traceback
import torch
assert not torch.cuda.is_initialized() and "fast_start" not in sys.modules
for line in sys.stdin:
    job = json.loads(line)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        sys.argv = ["engine", *job["args"]]
        sys.stdout = os.fdopen(w, "w")
        try:
            exec(compile(job["script"], "<engine>", "exec"), {"__name__": "__main__"})
            sys.stdout.flush()
            os._exit(0)
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
    os.close(w)
    with os.fdopen(r) as f:
        out = f.read()
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"status": status, "out": out}), flush=True)
"""
_spawners: dict[Path, subprocess.Popen] = {}


# --exec: every engine a new interpreter (`python -c`), as an operator's restart is: slower to
# run (it imports torch each time), and free of what a forked child pays that a new process does
# not (copy-on-write faults on the spawner's heap: on the development machine they made a fork's
# `import fast_start` 2x and its 9,435-tensor fetch 1.7x slower).
EXEC = False


def fresh(script: str, *args: str, cwd: Path | None = None) -> dict:
    """Run `script` with `args` in a fresh process forked in `cwd` (whose fast_start it imports),
    or with EXEC a new interpreter there; the JSON object its last line prints."""
    cwd = (cwd or Path.cwd()).resolve()
    if EXEC:
        done = subprocess.run([sys.executable, "-c", script, *args], cwd=cwd, text=True, stdout=subprocess.PIPE)
        if done.returncode:
            raise RuntimeError(f"engine failed (rc {done.returncode}); its traceback is on stderr")
        return json.loads(done.stdout.strip().splitlines()[-1])
    spawner = _spawners.get(cwd)
    if spawner is None:
        spawner = _spawners[cwd] = subprocess.Popen([sys.executable, "-c", SPAWNER], cwd=cwd, text=True,
                                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    spawner.stdin.write(json.dumps({"script": script, "args": list(args)}) + "\n")
    spawner.stdin.flush()
    line = spawner.stdout.readline()
    if not line:
        raise RuntimeError(f"the engine spawner in {cwd} exited (rc {spawner.poll()})")
    reply = json.loads(line)
    if reply["status"]:
        raise RuntimeError(f"engine failed (status {reply['status']}); its traceback is on stderr")
    return json.loads(reply["out"].strip().splitlines()[-1])


def close_spawners() -> None:
    for spawner in _spawners.values():
        spawner.stdin.close()
        spawner.wait(60)
    _spawners.clear()


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def side(tree: Path, folders: dict[str, Path], tmp: Path, repeat: int, label: str, results: dict,
         out: Path, device: str) -> dict:
    """One fast-start tree: its daemon caches every case, then fresh engines fetch each, round by
    round; the results go into `results[label]` and `out`."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(tree / "fast_start")], check=True)  # as installed
    run = tmp / f"run-{label}"
    models = [{"name": case, "path": str(folders[ckpt]), "gpus": [0], "dtype": dtype, "engine_version": "bench"}
              for case, (ckpt, dtype) in CASES.items()]
    cfg = write_config(tmp / f"{label}.toml", run, models, device="cpu" if device == "cpu" else "cuda")
    t0 = time.perf_counter()
    # The tree's fast_start first on the path: its fill workers run from "/" (fill.py).
    path = os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])
    daemon = Daemon(tmp, cfg, cwd=tree, env={"PYTHONPATH": path}).wait_ready(600)
    r = results[label] = {"ready_s": round(time.perf_counter() - t0, 1),
                          "daemon_gpu_bytes": gpu_memory_of(daemon.proc.pid) if device != "cpu" else 0, "cases": {}}
    print(f"[{label}] daemon READY in {r['ready_s']} s", flush=True)
    # Round robin: every round restarts each case (and mode) once, so a drift of the machine
    # over the run (clocks, other tenants) touches every case alike, not the last ones only.
    jobs = [(case, mode) for case in CASES
            for mode in (("zero_copy", "copy") if case in COPY and not EXEC else ("zero_copy",))]
    runs: dict[tuple[str, str], list[dict]] = {job: [] for job in jobs}
    try:
        for _ in range(repeat):
            for case, mode in jobs:
                ckpt, dtype = CASES[case]
                x = fresh(ENGINE, str(folders[ckpt]), str(run), mode, dtype, device, cwd=tree)
                assert x["source"] == "cache", x
                runs[case, mode].append(x)
        for case, (ckpt, dtype) in CASES.items():
            c = r["cases"][case] = {}
            done = [(mode, got) for (name, mode), got in runs.items() if name == case]
            c.update(tensors=done[0][1][0]["tensors"], bytes=done[0][1][0]["bytes"])
            for mode, got in done:
                c[f"{mode}_s"] = median_of(got, "fetch_s")
                c[f"{mode}_all_s"] = [round(x["fetch_s"], 5) for x in got]
            c["import_s"] = statistics.median(x["import_s"] for _, got in done for x in got)
            if label == "after" and not EXEC:      # where the milliseconds go, one cProfile'd fetch per case
                c["profile"] = fresh(PROFILED, str(folders[ckpt]), str(run), "zero_copy", dtype, device,
                                     cwd=tree)["profile"]
            out.write_text(json.dumps(results, indent=1))
            print(f"[{label}] {case}: {c['tensors']} tensors, zero_copy {c['zero_copy_s'] * 1e3:.2f} ms"
                  + (f", copy {c['copy_s'] * 1e3:.2f} ms" if "copy_s" in c else ""), flush=True)
    finally:
        daemon.stop()
    return r


def legacy_ipc(folder: Path, tmp: Path, repeat: int) -> float:
    handles = tmp / "ipc.pickle"
    producer = subprocess.Popen([sys.executable, "-c", IPC_PRODUCER, str(folder), str(handles)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert producer.stdout.readline().strip() == "ready"
        return median_of([fresh(IPC_CONSUMER, str(handles)) for _ in range(repeat)], "fetch_s")
    finally:
        producer.communicate("done\n", timeout=300)


def d2d_clone_s(nbytes: int, repeat: int = 5) -> float:
    block = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    times = []
    for _ in range(repeat):
        torch.cuda.empty_cache()        # each clone allocates its memory, as a fresh engine's copy does
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        copy = block.clone()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        del copy
    del block
    torch.cuda.empty_cache()
    return statistics.median(times)


def gpu_memory_of(pid: int) -> int:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout
    used = {int(p): int(m) for p, m in (line.split(",") for line in out.strip().splitlines() if line)}
    return used.get(pid, 0) * 2**20


def report(r: dict) -> list[str]:
    now, before = r["after"]["cases"], (r.get("before") or {}).get("cases", {})

    def ms(x: float | None) -> str:
        return f"{x * 1e3:9.2f}" if x is not None else "        —"
    lines = [f"fresh engine processes, medians of {r['repeat']} (before: {r.get('baseline_repeat', '—')}); "
             f"times in ms; before = {r.get('baseline', 'none')}",
             f"{'case':13} {'tensors':>7} {'GB':>6} | {'import':>9} {'before':>9} | {'zero_copy':>9} {'before':>9} | "
             f"{'copy':>9} {'before':>9} | {'IPC':>9}"]
    for case, c in now.items():
        b = before.get(case, {})
        lines.append(f"{case:13} {c['tensors']:7d} {c['bytes'] / 1e9:6.2f} | {ms(c['import_s'])} {ms(b.get('import_s'))} | "
                     f"{ms(c['zero_copy_s'])} {ms(b.get('zero_copy_s'))} | {ms(c.get('copy_s'))} {ms(b.get('copy_s'))} | "
                     f"{ms(r.get('legacy_ipc_s', {}).get(case))}")
    if "legacy_ipc_s" not in r:         # the CPU variant: the table is all
        return lines
    ipc = r["legacy_ipc_s"]
    d16, d4, d32, moe = (now.get(case) for case in ("dense-16GiB", "dense-4GiB", "dense-32GiB", "moe-hf-9435"))
    if "d2d_clone_s" in r:              # measured with the 16 GiB case only
        clone_gbs = d16["bytes"] / r["d2d_clone_s"] / 1e9
        copy_gbs = d16["bytes"] / d16["copy_s"] / 1e9
        lines += [f"safetensors load_file, 16 GiB checkpoint, fresh process: {r['load_file_s']:.3f} s "
                  f"({r['load_file_s'] / d16['zero_copy_s']:.0f}x the zero_copy fetch)",
                  f"copy 16 GiB {copy_gbs:.0f} GB/s = {copy_gbs / clone_gbs:.0%} of the d2d clone's {clone_gbs:.0f} "
                  f"GB/s (target >= 60%)"]
    if d16:
        lines.append(f"zero_copy 16 GiB dense {d16['zero_copy_s'] * 1e3:.2f} ms (target <= 10)")
    if moe:
        lines.append(f"zero_copy MoE {moe['tensors']} tensors {moe['zero_copy_s'] * 1e3:.2f} ms (target <= 20)")
    if d4 and d32:
        lines.append(f"flat: 32 GiB / 4 GiB = {d32['zero_copy_s'] / d4['zero_copy_s']:.2f} (target <= 1.3)")
    if ipc:
        lines.append("legacy per-tensor CUDA IPC / zero_copy: " + ", ".join(
            f"{case} {ipc[case] / now[case]['zero_copy_s']:.1f}x" for case in ipc) + " (target >= 5)")
    lines += [
        f"import fast_start on top of torch: {max(c['import_s'] for c in now.values()) * 1e3:.1f} ms, the largest "
        f"median (target <= 20)",
        f"daemon: READY in {r['after']['ready_s']} s holding {r['after']['daemon_gpu_bytes'] / 2**20:.0f} MiB of GPU memory"]
    return lines


def main(root: Path, out: Path, repeat: int, baseline: Path | None, baseline_repeat: int, device: str = "cuda:0") -> None:
    r: dict = {"date": time.strftime("%Y-%m-%d"), "device": device, "torch": torch.__version__,
               "python": sys.version.split()[0], "repeat": repeat, "engines": "exec" if EXEC else "fork"}
    if device != "cpu":
        r.update(gpu=torch.cuda.get_device_properties(0).name, cuda=torch.version.cuda, driver=subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True).stdout.split("\n")[0])
    try:
        run_all(r, root, out, repeat, baseline, baseline_repeat, device)
    finally:
        close_spawners()
    print(f"{r.get('gpu', 'CPU')}, driver {r.get('driver', '-')}, torch {r['torch']}, CUDA {r.get('cuda', '-')}, "
          f"Python {r['python']}; wrote {out}")


def run_all(r: dict, root: Path, out: Path, repeat: int, baseline: Path | None, baseline_repeat: int,
            device: str) -> None:
    t0 = time.perf_counter()
    folders = checkpoints(root, device)
    print(f"checkpoints ready in {time.perf_counter() - t0:.0f} s", flush=True)
    with tempfile.TemporaryDirectory(prefix="fast-start-bench-") as tmp:
        tmp = Path(tmp)
        side(Path.cwd(), folders, tmp, repeat, "after", r, out, device)
        out.write_text(json.dumps(r, indent=1))
        if device != "cpu":
            r["legacy_ipc_s"] = {case: legacy_ipc(folders[CASES[case][0]], tmp, repeat)
                                 for case in (COPY[:1] if EXEC else COPY) if case in CASES}
            if not EXEC and "dense-16GiB" in CASES:
                r["d2d_clone_s"] = d2d_clone_s(r["after"]["cases"]["dense-16GiB"]["bytes"])
                r["load_file_s"] = fresh(LOAD_FILE, str(folders["dense16"]))["fetch_s"]
            out.write_text(json.dumps(r, indent=1))
        if baseline is not None:
            r.update(baseline=str(baseline), baseline_repeat=baseline_repeat)
            side(baseline.resolve(), folders, tmp, baseline_repeat, "before", r, out, device)
    out.write_text(json.dumps(r, indent=1))
    print("\n".join(report(r)))

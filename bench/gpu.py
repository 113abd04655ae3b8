"""The restart benchmark on a GPU (`python -m bench.restart --device cuda`).

For each size (default 4 GiB and 16 GiB Llama-shaped bf16 checkpoints, page cache hot) it
measures in one run: `safetensors.torch.load_file(device="cuda")`; fast-start's disk path (bf16
and fp8); a daemon's fill (bf16 and fp8, in its worker); `fetch` in `zero_copy` and `copy` mode
(connect → weights ready, median of `--repeat`); a device-to-device clone of the same bytes
(the bandwidth reference); and per-tensor legacy CUDA IPC (`reduce_tensor` per parameter,
rebuilt in this process), the mechanism other weight-sharing daemons use. It also reads the
serving daemon's own GPU memory from nvidia-smi.
"""
from __future__ import annotations

import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

import fast_start

from fast_start import protocol
from devtools import synth
from fast_start.checkpoint import shard_files
from fast_start.transport import connect, request
from devtools.harness import Daemon, write_config

# Producer for the legacy mechanism: weights on the GPU, one CUDA IPC handle per tensor.
IPC_PRODUCER = """
import pickle, sys, torch, fast_start
from torch.multiprocessing.reductions import reduce_tensor
w = fast_start.fetch(fast_start.WeightSpec(sys.argv[1]), device="cuda:0", socket_dir=sys.argv[3])
with open(sys.argv[2], "wb") as f:
    pickle.dump([(n, reduce_tensor(t)) for n, t in w.tensors.items()], f)
print("ready", flush=True)
sys.stdin.readline()
"""


def sync_time(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    del out
    gc.collect()
    return elapsed


def median(fn, n: int) -> float:
    return statistics.median(sync_time(fn) for _ in range(n))


def gpu_memory_of(pid: int) -> int:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout
    used = {int(p): int(m) for p, m in (line.split(",") for line in out.strip().splitlines() if line)}
    return used.get(pid, 0) * 2**20


def legacy_ipc(folder: Path, tmp: Path, repeat: int) -> float:
    handles = tmp / "ipc.pickle"
    producer = subprocess.Popen([sys.executable, "-c", IPC_PRODUCER, str(folder), str(handles), str(tmp / "none")],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert producer.stdout.readline().strip() == "ready"
        import pickle     # the peers' mechanism is pickle-based; fast-start's own protocol is not
        items = pickle.loads(handles.read_bytes())

        def rebuild():
            return {n: fn(*args) for n, (fn, args) in items}
        return median(rebuild, repeat)
    finally:
        producer.communicate("done\n", timeout=120)


def measure(size: int, root: Path, repeat: int) -> dict:
    shape = synth.llama_of_size(size, hidden_size=4096)
    folder = synth.cached(root, shape, files=max(1, size // 2**32), reuse=True)
    files = [folder / f for f in shard_files(folder)]
    nbytes = sum(f.stat().st_size for f in files)
    r = {"checkpoint_bytes": nbytes, "tensors": len(synth.required_tensors(shape.dims()))}
    for f in files:
        load_file(str(f), device="cuda:0")                     # warm the page cache
    r["load_file_s"] = median(lambda: [load_file(str(f), device="cuda:0") for f in files], 3)
    with tempfile.TemporaryDirectory(prefix="fast-start-bench-") as tmp:
        tmp = Path(tmp)
        none = str(tmp / "none")
        for q in ("none", "fp8"):
            spec = fast_start.WeightSpec(str(folder), quantization=q, engine_version="bench")
            r[f"disk_{q}_s"] = median(lambda: fast_start.fetch(spec, device="cuda:0", socket_dir=none), 3)
        models = [{"name": q, "path": str(folder), "gpus": [0], "quantization": q, "engine_version": "bench"}
                  for q in ("none", "fp8")]
        cfg = write_config(tmp / "fs.toml", tmp / "run", models, device="cuda")
        daemon = Daemon(tmp, cfg).wait_ready(900)
        try:
            with connect(daemon.socket, 10) as conn:
                request(conn, protocol.Hello(protocol.VERSION))
                models = {m["name"]: m for m in request(conn, protocol.Status()).body["models"]}
            r["fill_none_s"], r["fill_fp8_s"] = models["none"]["fill_seconds"], models["fp8"]["fill_seconds"]
            r["daemon_gpu_bytes"] = gpu_memory_of(daemon.proc.pid)
            spec = fast_start.WeightSpec(str(folder), engine_version="bench")
            run = str(tmp / "run")
            for mode in ("zero_copy", "copy"):
                r[f"{mode}_s"] = median(lambda: fast_start.fetch(spec, device="cuda:0", mode=mode, socket_dir=run,
                                                                 fallback=False), repeat)
            r["weights_bytes"] = models["none"]["bytes"]
        finally:
            daemon.stop()
        block = torch.empty(r["weights_bytes"], dtype=torch.uint8, device="cuda:0")
        r["d2d_clone_s"] = median(block.clone, 5)
        del block
        r["legacy_ipc_s"] = legacy_ipc(folder, tmp, 3)
    return r


def report(results: dict) -> list[str]:
    lines = []
    for size, r in results["sizes"].items():
        gb = r["checkpoint_bytes"] / 1e9
        lines += [f"== {size}: {gb:.2f} GB checkpoint, {r['tensors']} tensors ==",
                  f"safetensors load_file (hot)   {r['load_file_s']:8.3f} s  {gb / r['load_file_s']:6.2f} GB/s",
                  f"fast-start disk path bf16     {r['disk_none_s']:8.3f} s  {gb / r['disk_none_s']:6.2f} GB/s",
                  f"fast-start disk path fp8      {r['disk_fp8_s']:8.3f} s  {gb / r['disk_fp8_s']:6.2f} GB/s",
                  f"daemon fill bf16              {r['fill_none_s']:8.3f} s  {gb / r['fill_none_s']:6.2f} GB/s"
                  f"  ({r['load_file_s'] / r['fill_none_s']:.0%} of load_file throughput)",
                  f"daemon fill fp8               {r['fill_fp8_s']:8.3f} s  {gb / r['fill_fp8_s']:6.2f} GB/s"
                  f"  ({r['load_file_s'] / r['fill_fp8_s']:.0%} of load_file throughput)",
                  f"fetch zero_copy (median)      {r['zero_copy_s'] * 1e3:8.2f} ms  "
                  f"{r['load_file_s'] / r['zero_copy_s']:6.0f}x vs load_file, "
                  f"{r['legacy_ipc_s'] / r['zero_copy_s']:.1f}x vs legacy IPC",
                  f"fetch copy (median)           {r['copy_s'] * 1e3:8.2f} ms  "
                  f"{r['weights_bytes'] / r['copy_s'] / 1e9:6.0f} GB/s = "
                  f"{r['d2d_clone_s'] / r['copy_s']:.0%} of the d2d clone",
                  f"d2d clone of the same bytes   {r['d2d_clone_s'] * 1e3:8.2f} ms  "
                  f"{r['weights_bytes'] / r['d2d_clone_s'] / 1e9:6.0f} GB/s",
                  f"legacy per-tensor CUDA IPC    {r['legacy_ipc_s'] * 1e3:8.2f} ms",
                  f"serving daemon's GPU memory   {r['daemon_gpu_bytes'] / 2**20:8.0f} MiB"]
    return lines


def main(sizes: list[int], repeat: int, root: Path, out: Path) -> None:
    props = torch.cuda.get_device_properties(0)
    driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                            capture_output=True, text=True).stdout.split("\n")[0]
    results = {"date": time.strftime("%Y-%m-%d"), "gpu": props.name, "driver": driver, "torch": torch.__version__,
               "cuda": torch.version.cuda, "repeat": repeat, "sizes": {}}
    for size in sizes:
        results["sizes"][f"{size / 2**30:g}GiB"] = measure(size, root, repeat)
        print("\n".join(report({"sizes": {f"{size / 2**30:g}GiB": results["sizes"][f"{size / 2**30:g}GiB"]}})),
              flush=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"{results['gpu']}, driver {driver}, torch {results['torch']}, CUDA {results['cuda']}; wrote {out}")

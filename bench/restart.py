"""`python -m bench.restart`: disk fetch vs cache fetch, measured side by side in one run.

Builds (once) a Llama-shaped checkpoint of `--size`, restarts an engine (a fresh process, as a
real restart is) `--repeat` times with no daemon (disk), starts a real daemon and times it to
READY, then restarts the engine from the cache in zero_copy and copy mode. Each restart reports
its `fetch` time and, since a zero-copy map does not touch the pages, the time of one read per
page of every weight after it: what the first forward pass pays on top.
Prints a table with ratios and writes JSON.

With `--device cuda` (or `--fresh` on the CPU) it runs `bench/gpu.py` instead: every engine a
new process, `import fast_start` and the first fetch timed apart, several models in one daemon,
and with `--baseline TREE` an earlier revision side by side in the same run.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from devtools import synth
from fast_start.config import parse_bytes
from devtools.harness import Daemon, write_config

console = Console()


# One engine restart: a fresh process that imports torch (as every engine does), then fast-start,
# fetches its weights, then reads one byte per page of every tensor (what the first forward pass
# costs on top: a zero-copy map has not touched them). `import fast_start` alone does not import
# torch (the CLI's path): `fast_start.fetch` does, which is why torch comes first and apart.
ENGINE = """
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import fast_start
fast_start.fetch
t2 = time.perf_counter()
w = fast_start.fetch(fast_start.WeightSpec(sys.argv[1], engine_version=sys.argv[4]), socket_dir=sys.argv[2],
                     mode=sys.argv[3])
t3 = time.perf_counter()
for t in w.tensors.values():
    t.reshape(-1)[::max(1, 4096 // t.element_size())].float().sum()
t4 = time.perf_counter()
print(json.dumps({"source": w.source, "torch_s": t1 - t0, "import_s": t2 - t1, "fetch_s": t3 - t2,
                  "pass_s": t4 - t3, "bytes": sum(t.nbytes for t in w.tensors.values())}))
"""


def restart(folder: Path, socket_dir: Path, mode: str = "zero_copy", engine_version: str = "bench") -> dict:
    """One engine restart in a fresh process; its timings."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", ENGINE, str(folder), str(socket_dir), mode, engine_version],
                         capture_output=True, text=True, check=True).stdout
    return {**json.loads(out), "process_s": time.perf_counter() - t0}


def median_restart(folder: Path, socket_dir: Path, mode: str, repeat: int, source: str) -> dict:
    runs = [restart(folder, socket_dir, mode) for _ in range(repeat)]
    assert all(r["source"] == source for r in runs), f"expected every {mode} fetch from {source}"
    return {k: statistics.median(r[k] for r in runs) for k in ("fetch_s", "pass_s", "process_s")}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="1GiB", help="checkpoint size (bf16)")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--dir", default=str(Path(tempfile.gettempdir()) / "fast-start-bench"),
                    help="where the synthetic checkpoint is kept between runs")
    ap.add_argument("--json", default="bench.json", help="where to write the results")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--fresh", action="store_true",
                    help="with --device cpu: bench/gpu.py's fresh-process benchmark on CPU arenas (its tensor "
                         "counts, tiny tensors); always so with --device cuda")
    ap.add_argument("--baseline", help="with --fresh or --device cuda: an earlier fast-start tree, side by side")
    ap.add_argument("--baseline-repeat", type=int, default=5)
    ap.add_argument("--exec", action="store_true",
                    help="with --fresh or --device cuda: each engine a new interpreter (python -c) instead of a "
                         "fork of a torch-only process; zero_copy and the IPC baseline only (each sample imports torch)")
    ap.add_argument("--cases", help="with --fresh or --device cuda: a comma-separated subset of bench/gpu.py's "
                                    "CASES (default: all)")
    args = ap.parse_args(argv)
    if args.device == "cuda" or args.fresh:
        from bench import gpu as bench_gpu
        bench_gpu.EXEC = args.exec
        if args.cases:
            chosen = set(args.cases.split(","))
            unknown = sorted(chosen - set(bench_gpu.CASES))
            if unknown:
                ap.error(f"unknown cases {unknown}; choose from {', '.join(bench_gpu.CASES)}")
            bench_gpu.CASES = {c: v for c, v in bench_gpu.CASES.items() if c in chosen}
        bench_gpu.main(Path(args.dir), Path(args.json), args.repeat, args.baseline and Path(args.baseline),
                       args.baseline_repeat, "cuda:0" if args.device == "cuda" else "cpu")
        return
    shape = synth.llama_of_size(parse_bytes(args.size))
    folder = synth.cached(args.dir, shape, files=4)
    results = {"date": time.strftime("%Y-%m-%d"), "machine": platform.node(), "torch": torch.__version__,
               "device": "cpu", "checkpoint_bytes": shape.nbytes(), "repeat": args.repeat}
    with tempfile.TemporaryDirectory(prefix="fast-start-bench-") as tmp:
        tmp = Path(tmp)
        run = tmp / "run"
        results["disk"] = median_restart(folder, run, "zero_copy", args.repeat, "disk")
        config = write_config(tmp / "fs.toml", run, [{"name": "bench", "path": str(folder), "gpus": [0],
                                                      "engine_version": "bench"}])
        t0 = time.perf_counter()
        daemon = Daemon(tmp, config).wait_ready(600)
        results["ready_s"] = time.perf_counter() - t0
        try:
            for mode in ("zero_copy", "copy"):
                results[mode] = median_restart(folder, run, mode, args.repeat, "cache")
        finally:
            daemon.stop()
    report(results)
    Path(args.json).write_text(json.dumps(results, indent=1))
    console.print(f"wrote {args.json}")


def report(r: dict) -> None:
    gib = r["checkpoint_bytes"] / 2**30
    table = Table(title=f"engine restart, {gib:.2f} GiB bf16 Llama on {r['device']}: fresh process each,"
                        f" median of {r['repeat']}")
    for col in ("path", "fetch s", "x vs disk", "+ first pass s", "fetch + pass x vs disk"):
        table.add_column(col, justify="right")
    disk = r["disk"]
    for key in ("disk", "zero_copy", "copy"):
        x = r[key]
        table.add_row(key, f"{x['fetch_s']:.4f}", f"{disk['fetch_s'] / x['fetch_s']:.0f}", f"{x['pass_s']:.4f}",
                      f"{(disk['fetch_s'] + disk['pass_s']) / (x['fetch_s'] + x['pass_s']):.1f}")
    console.print(table)
    console.print(f"daemon start to READY (fill in a worker process): {r['ready_s']:.1f} s")


if __name__ == "__main__":
    main()

"""The control plane's cost: `fast-start --help`, `fast-start status --json` against a running CPU
daemon (fresh processes, medians), and the serving daemon's memory with a 1 GiB cache.

    python -m bench.control_plane [--repeat 10] [--against REV] [--json out.json]

`--against REV` measures the same things for another revision of this checkout (a git worktree,
its package on PYTHONPATH) in the same run, side by side.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from devtools import synth
from devtools.harness import Daemon, write_config

REPO = Path(__file__).resolve().parent.parent
TARGETS = {"help_s": 0.3, "status_s": 0.5, "daemon_rss_mb": 80}


def timed(command: list[str], env: dict, repeat: int) -> float:
    """Median wall time of `command` as a fresh process."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        subprocess.run(command, env=env, capture_output=True, check=False)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def memory(pid: int) -> dict[str, float]:
    """The process's resident memory in MB: all, its own (anonymous), files, shared memory."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    mb = {k: int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "RssAnon", "RssFile", "RssShmem")}
    return {"rss_mb": mb["VmRSS"], "anon_mb": mb["RssAnon"], "file_mb": mb["RssFile"], "shmem_mb": mb["RssShmem"]}


def measure(package_root: Path, model: Path, work: Path, repeat: int) -> dict:
    os.chdir(work)      # `python -m` looks in the working directory first: not in this checkout
    env = {**os.environ, "PYTHONPATH": str(package_root)}
    cli = [sys.executable, "-m", "fast_start.cli"]
    cfg = write_config(work / "fs.toml", work / "run", [{"name": "bench", "path": str(model), "gpus": [0],
                                                         "engine_version": "bench"}])
    imports = subprocess.run([sys.executable, "-X", "importtime", "-c", "import fast_start.cli"], env=env,
                             capture_output=True, text=True).stderr
    loaded = {line.split("|")[-1].strip().split(".")[0] for line in imports.splitlines() if "|" in line}
    d = Daemon(work, cfg, env={"PYTHONPATH": str(package_root)}).wait_ready(600)
    try:
        result = {"help_s": timed(cli + ["--help"], env, repeat),
                  "status_s": timed(cli + ["status", "--json", "--config", str(cfg)], env, repeat),
                  "cli_imports_torch": "torch" in loaded, **memory(d.proc.pid)}
        daemon_maps = Path(f"/proc/{d.proc.pid}/maps").read_text()
        result["daemon_loads_torch"] = "libtorch" in daemon_maps
        result["daemon_rss_mb"] = result["rss_mb"] - result["shmem_mb"]
    finally:
        d.stop()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--against", help="another git revision to measure side by side")
    parser.add_argument("--dir", type=Path, default=Path.home() / ".cache" / "fast-start" / "bench",
                        help="where the 1 GiB synthetic checkpoint is kept between runs")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    args.json = args.json and args.json.resolve()        # measure() works in temporary folders
    folder = synth.cached(args.dir, synth.llama_of_size(2**30), files=4, reuse=True)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.against:
            tree = tmp / "against"
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), args.against],
                           check=True, capture_output=True)
            try:
                root = tree / "src" if (tree / "src" / "fast_start").is_dir() else tree
                (tmp / "a").mkdir()
                rows[args.against] = measure(root, folder, tmp / "a", args.repeat)
            finally:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)
        (tmp / "b").mkdir()
        rows["this checkout"] = measure(REPO, folder, tmp / "b", args.repeat)
    keys = ["help_s", "status_s", "daemon_rss_mb", "anon_mb", "file_mb", "shmem_mb", "cli_imports_torch",
            "daemon_loads_torch"]
    print(f"{'':24}" + "".join(f"{k:>20}" for k in keys))
    for name, r in rows.items():
        print(f"{name:24}" + "".join(f"{r[k]:>20.3f}" if isinstance(r[k], float) else f"{r[k]!s:>20}" for k in keys))
    mine = rows["this checkout"]
    for key, target in TARGETS.items():
        print(f"{key}: {mine[key]:.3f} (target <= {target}: {'met' if mine[key] <= target else 'MISSED'})"
              + "".join(f"; {name}: {r[key]:.3f} ({r[key] / mine[key]:.1f}x)" for name, r in rows.items()
                        if name != "this checkout"))
    if args.json:
        args.json.write_text(json.dumps({"python": sys.version, "repeat": args.repeat, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

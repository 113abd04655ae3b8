"""The control plane's cost: `fast-start --help`, `fast-start status --json` against a running CPU
daemon (fresh processes, medians), and the serving daemon's memory with a 1 GiB cache.

    python -m bench.control_plane [--repeat 10] [--against REV] [--json out.json]

`--against REV` measures the same things for another revision of this checkout (its files as
`git archive` writes them, its package on PYTHONPATH) in the same run, side by side: both daemons
run at once and each sample of one tree is followed by the other's.
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


def memory(pid: int) -> dict[str, float]:
    """The process's resident memory in MB: all, its own (anonymous), files, shared memory."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    mb = {k: int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "RssAnon", "RssFile", "RssShmem")}
    return {"rss_mb": mb["VmRSS"], "anon_mb": mb["RssAnon"], "file_mb": mb["RssFile"], "shmem_mb": mb["RssShmem"]}


class Tree:
    """One tree's CLI and its daemon serving the 1 GiB checkpoint, in a folder of its own."""

    def __init__(self, package_root: Path, model: Path, work: Path):
        work.mkdir()
        self.work, self.env = work, {**os.environ, "PYTHONPATH": str(package_root)}
        self.cfg = write_config(work / "fs.toml", work / "run", [{"name": "bench", "path": str(model),
                                                                  "gpus": [0], "engine_version": "bench"}])
        self.times = {"help_s": [], "status_s": []}
        self.daemon = Daemon(work, self.cfg, env={"PYTHONPATH": str(package_root)}, cwd=work).wait_ready(600)

    def run(self, *args: str) -> subprocess.CompletedProcess:
        # `python -m` looks in the working directory first: the tree's own folder, not this checkout
        return subprocess.run([sys.executable, *args], env=self.env, cwd=self.work, capture_output=True, text=True)

    def time_once(self) -> None:
        """One fresh `--help` and one `status --json`, each timed from exec to exit."""
        for key, args in (("help_s", ["--help"]), ("status_s", ["status", "--json", "--config", str(self.cfg)])):
            t0 = time.perf_counter()
            self.run("-m", "fast_start.cli", *args)
            self.times[key].append(time.perf_counter() - t0)

    def result(self) -> dict:
        imports = self.run("-X", "importtime", "-c", "import fast_start.cli").stderr
        loaded = {line.split("|")[-1].strip().split(".")[0] for line in imports.splitlines() if "|" in line}
        result = {key: statistics.median(times) for key, times in self.times.items()}
        result.update(cli_imports_torch="torch" in loaded, **memory(self.daemon.proc.pid))
        result["daemon_loads_torch"] = "libtorch" in Path(f"/proc/{self.daemon.proc.pid}/maps").read_text()
        result["daemon_rss_mb"] = result["rss_mb"] - result["shmem_mb"]
        return result


def measure(roots: dict[str, Path], model: Path, tmp: Path, repeat: int) -> dict[str, dict]:
    """Each tree's figures, its daemon running beside the others' and its samples taken in turn
    with theirs, so that the machine's drift falls on all alike."""
    trees = {}
    try:
        for i, (name, root) in enumerate(roots.items()):
            trees[name] = Tree(root, model, tmp / f"tree{i}")
        for _ in range(repeat):
            for tree in trees.values():
                tree.time_once()
        return {name: tree.result() for name, tree in trees.items()}
    finally:
        for tree in trees.values():
            tree.daemon.stop()


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
    with tempfile.TemporaryDirectory() as tmp:
        tmp, roots = Path(tmp), {}
        if args.against:
            tree, files = tmp / "against", subprocess.run(["git", "-C", str(REPO), "archive", args.against],
                                                         check=True, capture_output=True).stdout
            tree.mkdir()
            subprocess.run(["tar", "-x", "-C", str(tree)], input=files, check=True)
            roots[args.against] = tree / "src" if (tree / "src" / "fast_start").is_dir() else tree
        roots["this checkout"] = REPO
        rows = measure(roots, folder, tmp, args.repeat)
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

"""Fetch-and-exit soak: many short-lived engines against one daemon, as health checks and warm-up
scripts are.

    python -m bench.soak [--cycles 1000] [--modes zero_copy,copy] [--device cpu|cuda] [--size 64MiB]

One real daemon holds a synthetic Llama-shaped model. For each mode an engine driver (torch and
fast-start imported once) forks one child per cycle; the child fetches the model from the cache
and leaves through the interpreter's normal end, every child's exit status and stderr checked.
The daemon's open fds and RSS are read after a warm-up and at the end of each mode. Exit status 1
if any engine failed or the daemon's fds or RSS grew (`--rss-slack`), else 0.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from devtools import synth
from fast_start.config import parse_bytes
from devtools.harness import Daemon, write_config

WARM_UP = 20
# The engine driver: a child per cycle, forked after torch and fast-start are imported. A child
# returns to the loop's end and leaves the script like any engine (SystemExit, finalization).
DRIVE = """
import gc, os, sys, torch, fast_start
gc.freeze()     # a child's exit then does not fault in the driver's heap: 0.3 s a cycle instead of 0.8
socket_dir, model, device, mode, cycles = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
spec = fast_start.WeightSpec(model, engine_version="soak")
failed = []
for i in range(cycles):
    pid = os.fork()
    if pid == 0:
        w = fast_start.fetch(spec, device=device, mode=mode, fallback=False, socket_dir=socket_dir)
        sys.exit(0 if w.source == "cache" else 3)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if code:
        failed.append((i, code))
    if i + 1 == int(sys.argv[6]):
        print("warm", flush=True)
        sys.stdin.readline()            # the soak reads the daemon's fds and RSS meanwhile
print("failed", len(failed), failed[:5], flush=True)
"""


def daemon_usage(pid: int) -> tuple[int, int]:
    """The daemon's open fds and its RSS in kB."""
    fds = len(list(Path(f"/proc/{pid}/fd").iterdir()))
    rss = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
               if line.startswith("VmRSS:"))
    return fds, rss


def soak(d: Daemon, model: Path, device: str, mode: str, cycles: int) -> dict:
    driver = subprocess.Popen([sys.executable, "-c", DRIVE, str(d.socket_dir), str(model), device, mode,
                               str(cycles), str(min(WARM_UP, cycles))],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert driver.stdout.readline().strip() == "warm", driver.stderr.read()
    warm = daemon_usage(d.proc.pid)
    started = time.monotonic()
    out, err = driver.communicate("\n", timeout=3600)
    took = time.monotonic() - started
    end = daemon_usage(d.proc.pid)
    failed = int(out.split()[1]) if out.startswith("failed") else cycles
    fatal = [line for line in err.splitlines() if line.strip()]
    return {"mode": mode, "cycles": cycles, "failed": failed, "stderr_lines": len(fatal), "stderr": fatal[:5],
            "fds": [warm[0], end[0]], "rss_kb": [warm[1], end[1]], "s_per_cycle": took / max(1, cycles - WARM_UP),
            "driver_exit": driver.returncode}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cycles", type=int, default=1000)
    p.add_argument("--modes", default="zero_copy,copy")
    p.add_argument("--device", default="cpu")
    p.add_argument("--size", default="64MiB", help="the model's size, e.g. 4GiB")
    p.add_argument("--dir", default=None, help="where the checkpoint goes (default: a temporary folder)")
    p.add_argument("--rss-slack-kb", type=int, default=1024, help="RSS growth allowed after the warm-up")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        tmp = Path(tmp)
        nbytes = parse_bytes(args.size)
        shape = synth.llama_of_size(nbytes, hidden_size=512 if nbytes < 1 << 30 else 2048)
        model = synth.write_checkpoint(tmp / "model", shape, reuse=True)
        cfg = write_config(tmp / "fs.toml", tmp / "run", [{"name": "soak", "path": str(model), "gpus": [0],
                                                           "engine_version": "soak"}],
                           device="cuda" if args.device.startswith("cuda") else "cpu")
        d = Daemon(tmp, cfg, 0).wait_ready(600)
        try:
            results = [soak(d, model, args.device, mode, args.cycles) for mode in args.modes.split(",")]
        finally:
            d.stop()
    ok = True
    for r in results:
        good = (r["failed"] == 0 and r["stderr_lines"] == 0 and r["driver_exit"] == 0 and r["fds"][1] <= r["fds"][0]
                and r["rss_kb"][1] - r["rss_kb"][0] <= args.rss_slack_kb)
        ok &= good
        print(f"{r['mode']:>9}: {r['cycles']} engines, {r['failed']} failed, {r['stderr_lines']} stderr lines; "
              f"daemon fds {r['fds'][0]} -> {r['fds'][1]}, RSS {r['rss_kb'][0]} -> {r['rss_kb'][1]} kB; "
              f"{r['s_per_cycle'] * 1e3:.1f} ms a cycle  {'ok' if good else 'FAILED'}")
        for line in r["stderr"]:
            print("   ", line)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

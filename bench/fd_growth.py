"""`python -m bench.fd_growth OUT CHUNK [CHUNK ...]`: a fetch's cost against the engine's fd table.

A daemon caches a 16 GiB dense bf16 model (Llama-shaped, on GPU 0) in arenas of each CHUNK
(`arena_chunk`, e.g. 512MiB: 36 arenas); fresh engine processes fetch it in zero_copy and copy
mode, each reporting its fetch time and its fd table (`FDSize`, threads and open fds from
/proc/self) before and after. "pregrow" engines grew their fd table to 256 before the clock
started, "plain" ones did not: a process with threads that receives more fds than its table
holds waits for the kernel to grow it. Lines of JSON on stdout; with `--trace` per-function
timers (bench/trace/sitecustomize.py) in the daemon and the engines, written under OUT.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from devtools import synth
from devtools.harness import Daemon, write_config

ENGINE = r"""
import json, os, sys, time, torch
torch.zeros(1, device="cuda:0"); torch.cuda.synchronize()
import fast_start
fast_start.fetch


def table():
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
    return {"FDSize": int(status["FDSize"]), "Threads": int(status["Threads"]), "open": len(os.listdir("/proc/self/fd"))}


spec = fast_start.WeightSpec(sys.argv[1], dtype="bfloat16", engine_version="bench")
if sys.argv[4] == "pregrow":
    os.dup2(0, 250)
    os.close(250)
before = table()
t0 = time.monotonic_ns()
w = fast_start.fetch(spec, device="cuda:0", mode=sys.argv[3], socket_dir=sys.argv[2], fallback=False)
torch.cuda.synchronize()
t1 = time.monotonic_ns()
print(json.dumps({"fetch_ms": (t1 - t0) / 1e6, "pid": os.getpid(), "before": before, "after": table(), "how": sys.argv[4]}))
"""


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--trace"]
    out, chunks = Path(args[0]), args[1:]
    ckpt = synth.cached(Path(tempfile.gettempdir()) / "fast-start-bench", synth.llama_of_size(16 << 30, hidden_size=4096),
                        files=4, reuse=True)
    for chunk in chunks:
        tmp = Path(tempfile.mkdtemp())
        run, trace = tmp / "run", out / f"trace-{chunk}"
        trace.mkdir(parents=True)
        env = {}
        if "--trace" in sys.argv:
            site = str(Path(__file__).with_name("trace"))
            env = {"PYTHONPATH": os.pathsep.join([site, *filter(None, [os.environ.get("PYTHONPATH")])]),
                   "PROBE_DIR": str(trace)}
        cfg = write_config(tmp / "fs.toml", run, [{"name": "dense16", "path": str(ckpt), "dtype": "bfloat16",
                                                   "gpus": [0], "engine_version": "bench"}],
                           device="cuda", arena_chunk=chunk)
        t0 = time.perf_counter()
        daemon = Daemon(tmp, cfg, env=env, log=trace / "daemon.log").wait_ready(600)
        print(chunk, "ready", round(time.perf_counter() - t0, 1), flush=True)
        try:
            for mode, how in (("zero_copy", "plain"), ("zero_copy", "pregrow")) * 2 + (("copy", "plain"), ("copy", "pregrow")):
                done = subprocess.run([sys.executable, "-c", ENGINE, str(ckpt), str(run), mode, how], env={**os.environ, **env},
                                      capture_output=True, text=True, check=True)
                print(chunk, mode, done.stdout.strip().splitlines()[-1], flush=True)
        finally:
            daemon.stop()


if __name__ == "__main__":
    main()

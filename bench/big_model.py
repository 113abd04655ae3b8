"""Models that fill the GPU: the fill's peak, a copy beside the cache, vLLM at its default memory settings.

    python -m bench.big_model OUTDIR before_after [BASELINE_TREE]
    python -m bench.big_model OUTDIR near_full
    python -m bench.big_model OUTDIR hf_fill

The GPU's used memory (every process counted, NVML) is sampled every 20 ms in this process;
a peak is reported above what was used just before the step. The model is Qwen3-8B-shaped,
bf16 (16.4 GB), filled by vLLM itself (engine "vllm"). Writes OUTDIR/<phase>.json and every
process's log.

before_after: on an empty GPU, vLLM's default loader at gpu_memory_utilization 0.9; then for
BASELINE_TREE (a checkout of the code before, first on PYTHONPATH) and for this tree: the
daemon's fill (peak, time to READY) and a zero_copy engine at 0.9 (`Model loading took`, the KV
cache), and for this tree a copy engine (tokens).

near_full: vLLM's default loader at 0.9 on the empty GPU; then a ballast process holds the GPU
until the model is at least 75 % of its free memory; the daemon (on_release "drop") fills
(peak); a copy engine beside it, at the most the ballast leaves (the peak of engine and daemon
together while it loads); a refill; then the ballast goes: a copy engine at 0.9 (its KV cache
against the default loader's), a refill, and a zero_copy engine at 0.9 that keeps generating
while a reload adds a second model that cannot fit. OUTDIR/near_full.json is written after
each step.

hf_fill: the same checkpoint filled in the `hf` layout (fast-start's own streaming pipeline, no
engine), as bf16 and as float32 (twice the bytes): the fill's peak against the weights it caches.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from devtools import synth
from fast_start import memory
from fast_start.gpus import device_uuid

WORK = Path(os.environ.get("FAST_START_BENCH_WORK", "/tmp/fast-start-big"))
# The running benchmark's OUTDIR (its first argument; those that import this module take theirs
# alike); WORK where there is none, so that importing it for its checkpoint works anywhere.
OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else WORK
SHAPE = synth.Shape(architecture="Qwen3ForCausalLM", hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8,
                    head_dim=128, intermediate_size=12288, vocab_size=151936)
GB = 1e9


class Sampler:
    """The GPU's used bytes every 20 ms, on a thread of this (benchmark) process."""

    def __init__(self):
        self.uuid, self.points, self.done = device_uuid(0), [], threading.Event()
        threading.Thread(target=self._run, daemon=True).start()
        time.sleep(0.1)

    def _run(self):
        while not self.done.is_set():
            m = memory.of(self.uuid)
            self.points.append((time.monotonic(), m.total - m.free))
            time.sleep(0.02)

    def now(self) -> int:
        """Used bytes read now (not the last sample: a base is taken after a step has settled)."""
        time.sleep(0.5)
        m = memory.of(self.uuid)
        return m.total - m.free

    def peak(self, since: float, until: float = float("inf")) -> int:
        return max(u for t, u in self.points if since <= t <= until)


def log_lines(text: str, pattern: str) -> list[str]:
    return re.findall(pattern + r"[^\n]*", text)[-1:]


def engine(name: str, model: Path, load_format: str = "auto", extra: dict | None = None, util: float = 0.9,
           tree: str = "", wait_for: str = "", background: bool = False):
    out, log = WORK / f"{name}.json", OUT / f"{name}.log"
    out.unlink(missing_ok=True)
    Path(f"{out}.up").unlink(missing_ok=True)
    args = {"model": str(model), "load_format": load_format, "extra": extra or {}, "out": str(out),
            "gpu_memory_utilization": util, **({"wait_for": wait_for} if wait_for else {})}
    proc = subprocess.Popen([sys.executable, "-m", "bench.vllm_cuda_engine", json.dumps(args)], env=env(tree),
                            cwd=WORK, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    if background:
        return proc, out, log
    return finish(proc, out, log)


def finish(proc, out: Path, log: Path) -> dict:
    rc = proc.wait(480)
    text = log.read_text(errors="replace")
    r = json.loads(out.read_text()) if out.exists() else {}
    return {"rc": rc, "tokens": r.get("tokens"), "margins": r.get("margins"), "again": r.get("again"),
            "meanwhile": len(r.get("meanwhile", [])),
            "digest": r.get("digest"), "source": r.get("source"),
            "loading": log_lines(text, "Model loading took"), "kv_cache": log_lines(text, "Available KV cache memory"),
            "fast_start": [ln[-300:] for ln in text.splitlines() if "fast-start" in ln][-4:],
            "errors": [ln[-400:] for ln in text.splitlines() if "Error" in ln][-3:]}


def env(tree: str = "") -> dict:
    """This process's environment, with `tree` first on PYTHONPATH (children run in WORK: `python -m`
    puts the working folder before PYTHONPATH)."""
    path = os.pathsep.join(p for p in (tree, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


class Daemon:
    """A CUDA daemon of `tree` (this one if empty) with a NOTIFY_SOCKET listener that drains."""

    def __init__(self, name: str, models: list[dict], tree: str = "", **daemon):
        self.run_dir = WORK / "run"
        self.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.config = WORK / f"{name}.toml"
        self.write(models, **daemon)
        listen = WORK / f"{name}.notify"
        listen.unlink(missing_ok=True)
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(str(listen))
        self.notify.settimeout(0.5)
        self.ready, self.texts = threading.Event(), []
        self.start = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "fast_start.cli", "daemon", "--gpu", "0", "--config",
                                      str(self.config)], env={**env(tree), "NOTIFY_SOCKET": str(listen)}, cwd=WORK,
                                     stdout=open(OUT / f"{name}-daemon.log", "w"), stderr=subprocess.STDOUT)
        threading.Thread(target=self._drain, daemon=True).start()

    def write(self, models: list[dict], **daemon) -> None:
        settings = {"socket_dir": str(self.run_dir), "device": "cuda", "worker_python": sys.executable, **daemon}
        lines = ["[daemon]", *(f"{k} = {json.dumps(v)}" for k, v in settings.items())]
        for m in models:
            lines += ["", "[[model]]", *(f"{k} = {json.dumps(v)}" for k, v in m.items())]
        self.config.write_text("\n".join(lines) + "\n")

    def _drain(self):       # recv() drops the fds a message carries: no fd store here
        while self.proc.poll() is None:
            try:
                text = self.notify.recv(65536).decode(errors="replace")
            except socket.timeout:
                continue
            self.texts.append(text)
            if "READY=1" in text and not self.ready.is_set():
                self.ready_s = round(time.monotonic() - self.start, 1)
                self.ready.set()

    def wait_ready(self, timeout: float = 420) -> float | None:
        deadline = time.monotonic() + timeout
        while not self.ready.wait(0.5):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                return None
        return self.ready_s

    def cli(self, *args: str) -> dict | list:
        done = subprocess.run([sys.executable, "-m", "fast_start.cli", *args, "--config", str(self.config), "--json"],
                              capture_output=True, text=True, env=env())
        return json.loads(done.stdout) if done.stdout.strip() else {"rc": done.returncode, "stderr": done.stderr[-500:]}

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def model_entry(name: str, path: Path, **more) -> dict:
    return {"name": name, "path": str(path), "gpus": [0], "engine": "vllm", "engine_version": "auto", **more}


def checkpoint() -> Path:
    path = WORK / "qwen3-8b"
    if not (path / "config.json").exists():
        synth.write_checkpoint(path, SHAPE, seed=7, files=4, reuse=True)
    return path


def fill(sampler: Sampler, name: str, models: list[dict], tree: str = "", **daemon) -> tuple[Daemon, dict]:
    base = sampler.now()
    since = time.monotonic()
    d = Daemon(name, models, tree, **daemon)
    ready = d.wait_ready()
    return d, {"ready_s": ready, "used_before_gb": base / GB, "peak_above_gb": (sampler.peak(since) - base) / GB,
               "held_after_gb": (sampler.now() - base) / GB}


def copy_engine(sampler: Sampler, name: str, path: Path, run_dir: Path, util: float) -> dict:
    """A vLLM engine in copy mode, its daemon dropping the cache for it: the peak of the GPU's use
    while it starts and loads (until its `Model loading took` line, read every 20 ms), above what
    was used before it started: its CUDA context, and the model moving from the daemon to it."""
    base, since = sampler.now(), time.monotonic()
    proc, out, log = engine(name, path, "fast_start", {"socket_dir": str(run_dir), "fallback": False, "mode": "copy"},
                            util=util, background=True)
    deadline = since + 400
    while proc.poll() is None and time.monotonic() < deadline and \
            "Model loading took" not in log.read_text(errors="replace"):
        time.sleep(0.02)
    loaded = time.monotonic()
    r = finish(proc, out, log)
    r.update(gpu_memory_utilization=util, used_before_gb=base / GB,
             load_peak_above_gb=(sampler.peak(since, loaded) - base) / GB, used_after_exit_gb=sampler.now() / GB)
    return r


def before_after(sampler: Sampler, baseline: str) -> dict:
    path = checkpoint()
    r = {"model_gb": SHAPE.nbytes() / GB, "total_gb": memory.of(sampler.uuid).total / GB}
    r["default"] = engine("default-0.9", path)
    for label, tree in (("before", baseline), ("after", "")):
        d, r[f"{label}_fill"] = fill(sampler, f"{label}", [model_entry("qwen3-8b", path)], tree)
        try:
            opts = {"socket_dir": str(d.run_dir), "fallback": False}
            r[f"{label}_zero_copy"] = engine(f"{label}-zero_copy-0.9", path, "fast_start", opts, tree=tree)
            if label == "after":
                r["after_status"] = d.cli("status")
                r["after_copy"] = engine("after-copy-0.3", path, "fast_start", {**opts, "mode": "copy"}, util=0.3)
        finally:
            d.stop()
    for key in ("before_zero_copy", "after_zero_copy", "after_copy"):
        r[key]["same_tokens"] = r[key]["tokens"] == r["default"]["tokens"]
    return r


def near_full(sampler: Sampler, save) -> dict:
    path = checkpoint()
    weights = SHAPE.nbytes()
    r = {"model_gb": weights / GB}
    r["default"] = engine("default-0.9", path)      # on the empty GPU: the KV cache an engine at 0.9 gets
    save(r)
    free = memory.of(sampler.uuid).free
    ballast_bytes = free - int(weights / 0.75)
    r.update(free_before_ballast_gb=free / GB, ballast_gb=ballast_bytes / GB)
    ballast = subprocess.Popen([sys.executable, "-c", "import sys, torch; x = torch.empty(int(sys.argv[1]), "
                                "dtype=torch.uint8, device='cuda:0'); print('up', flush=True); sys.stdin.read()",
                                str(ballast_bytes)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert ballast.stdout.readline().strip() == "up"
    free = memory.of(sampler.uuid).free
    r.update(free_with_ballast_gb=free / GB, model_share_of_free=weights / free)
    d, r["fill"] = fill(sampler, "near-full", [model_entry("qwen3-8b", path)], on_release="drop")
    try:
        r["fill"]["peak_over_weights"] = r["fill"]["peak_above_gb"] * GB / weights
        save(r)
        # The most a copy engine beside the ballast may ask for: the free memory with the cache
        # handed over, less its CUDA context (0.55 GB) and a margin.
        total = memory.of(sampler.uuid).total
        r["copy_beside_ballast"] = copy_engine(sampler, "near-full-copy", path, d.run_dir,
                                               int((free - 1.5 * GB) / total * 100) / 100)
        r["copy_beside_ballast"]["evictions"] = d.cli("evictions")
        save(r)
        r["refill"] = refill(sampler, d, weights)
        ballast.stdin.close()
        ballast.wait(60)
        r["free_without_ballast_gb"] = memory.of(sampler.uuid).free / GB
        r["copy_0.9"] = copy_engine(sampler, "copy-0.9", path, d.run_dir, 0.9)
        save(r)
        r["refill_2"] = refill(sampler, d, weights)
        opts = {"socket_dir": str(d.run_dir), "fallback": False}
        stop_file = WORK / "stop-serving"
        stop_file.unlink(missing_ok=True)
        proc, out, log = engine("near-full-zero_copy-0.9", path, "fast_start", opts, wait_for=str(stop_file),
                                background=True)
        up = Path(str(out) + ".up")
        deadline = time.monotonic() + 400
        while not up.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(1)
        r["free_while_serving_gb"] = memory.of(sampler.uuid).free / GB
        d.write([model_entry("qwen3-8b", path), model_entry("second", path, dtype="float16")], on_release="drop")
        d.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            s = d.cli("status")[0]
            if any(m["state"] == "no_room" for m in s.get("missing", [])):
                break
            time.sleep(1)
        r["reload_status"] = s
        r["reload_log"] = [ln for ln in (OUT / "near-full-daemon.log").read_text().splitlines() if "room" in ln][-3:]
        time.sleep(2)
        stop_file.touch()
        r["serving"] = finish(proc, out, log)
        r["evictions_after_reload"] = d.cli("evictions")
    finally:
        if ballast.poll() is None:
            ballast.kill()
        d.stop()
    for key in ("copy_beside_ballast", "copy_0.9", "serving"):
        if key in r:
            r[key]["same_tokens"] = r[key]["tokens"] == r["default"]["tokens"]
            r[key]["same_digest"] = r[key]["digest"] == r["default"]["digest"]
    return r


def hf_fill(sampler: Sampler, save) -> dict:
    path = checkpoint()
    r = {}
    for dtype in ("bfloat16", "float32"):
        entry = {"name": "qwen3-8b", "path": str(path), "gpus": [0], "layout": "hf", "dtype": dtype,
                 "engine_version": "bench"}
        d, r[dtype] = fill(sampler, f"hf-{dtype}", [entry])
        try:
            status = d.cli("status")[0]
        finally:
            d.stop()
        weights = sum(m["bytes"] for m in status.get("models", []))
        r[dtype].update(weights_gb=weights / GB, arenas=[m["arenas"] for m in status.get("models", [])],
                        peak_over_weights=r[dtype]["peak_above_gb"] * GB / weights if weights else None)
        save(r)
    return r


def refill(sampler: Sampler, d: Daemon, weights: int) -> dict:
    """`fast-start fill` after a copy took the cache: time until the model is back, and the peak."""
    since, base = time.monotonic(), sampler.now()
    subprocess.run([sys.executable, "-m", "fast_start.cli", "fill", "--gpu", "0", "--config", str(d.config)],
                   env=env(), capture_output=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not [m for m in d.cli("status")[0].get("models", [])]:
        time.sleep(1)
    r = {"s": round(time.monotonic() - since, 1), "peak_above_gb": (sampler.peak(since) - base) / GB}
    r["peak_over_weights"] = r["peak_above_gb"] * GB / weights
    return r


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    WORK.mkdir(parents=True, exist_ok=True)
    phase = sys.argv[2]
    sampler = Sampler()

    def save(result: dict) -> None:       # after each step: a run cut short still reports what it did
        (OUT / f"{phase}.json").write_text(json.dumps(result, indent=1, default=str))
    if phase == "before_after":
        result = before_after(sampler, sys.argv[3])
    else:
        result = {"near_full": near_full, "hf_fill": hf_fill}[phase](sampler, save)
    sampler.done.set()
    save(result)
    print(json.dumps(result, indent=1, default=str)[-6000:])


if __name__ == "__main__":
    main()

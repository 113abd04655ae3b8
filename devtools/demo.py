"""`make demo`: the main job on an embedded default, on the CPU.

Generates a Llama-shaped checkpoint of about 1 GiB (once, in a cache folder), starts a daemon
under a real NOTIFY_SOCKET listener, waits for READY, shows `fast-start status`, then restarts an
"engine" process twice, once with no daemon (disk) and once with it (cache), and prints the
times side by side. The daemon is stopped at the end.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn
from rich.table import Table

from devtools import synth
from bench.restart import restart
from devtools.harness import Daemon, write_config

SIZE = 1 << 30
console = Console()

def bar(label: str) -> Progress:
    return Progress(TextColumn(f"[bold]{label}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    console=console, transient=False)


def demo_checkpoint(root: Path) -> Path:
    """The demo model, generated on first use and kept (`FAST_START_DEMO_DIR` moves it)."""
    shown = {}      # the bar appears only if the checkpoint is written now

    def progress(done: int, total: int) -> None:
        if not shown:
            shown["bar"] = bar("generating checkpoint")
            shown["bar"].start()
            shown["task"] = shown["bar"].add_task("", total=total)
        shown["bar"].update(shown["task"], completed=done)
    try:
        return synth.cached(root, synth.llama_of_size(SIZE), files=2, progress=progress)
    finally:
        if shown:
            shown["bar"].stop()


def wait_ready(daemon: Daemon) -> float:
    """Follow the daemon's STATUS= progress on a bar until READY=1; returns seconds to READY."""
    start, seen = time.monotonic(), 0
    with bar("daemon filling cache") as progress:
        task = progress.add_task("", total=None)
        while not daemon.listener.texts("READY=1"):
            if daemon.proc.poll() is not None:
                raise SystemExit(f"daemon exited:\n{daemon.log.read_text()}")
            for text in daemon.listener.texts("STATUS=filling")[seen:]:
                m = re.search(r"([\d.]+) / ([\d.]+) GiB", text)
                if m:
                    progress.update(task, completed=float(m[1]) * 2**30, total=float(m[2]) * 2**30)
                seen += 1
            time.sleep(0.05)
    return time.monotonic() - start


def main() -> None:
    root = Path(os.environ.get("FAST_START_DEMO_DIR", Path.home() / ".cache" / "fast-start" / "demo"))
    folder = demo_checkpoint(root)
    console.print(f"model: {folder}")
    with tempfile.TemporaryDirectory(prefix="fast-start-demo-") as tmp:
        tmp = Path(tmp)
        config = write_config(tmp / "fast-start.toml", tmp / "run",
                              [{"name": "demo-llama", "path": str(folder), "gpus": [0], "engine_version": "demo"}])
        disk = restart(folder, tmp / "run", engine_version="demo")   # no daemon yet: the ordinary disk load
        daemon = Daemon(tmp, config, gpu=0)
        try:
            ready_s = wait_ready(daemon)
            console.print(f"READY=1 after {ready_s:.1f} s; `fast-start status`:")
            subprocess.run([sys.executable, "-m", "fast_start.cli", "status", "--config", str(config)])
            cache = restart(folder, tmp / "run", engine_version="demo")
        finally:
            daemon.stop()
    table = Table(title="engine restart: time until the weights are ready")
    for col in ("restart", "source", "fetch s", "whole process s"):
        table.add_column(col, justify="right")
    table.add_row("1: no daemon", disk["source"], f"{disk['fetch_s']:.3f}", f"{disk['process_s']:.2f}")
    table.add_row("2: daemon ready", cache["source"], f"{cache['fetch_s']:.4f}", f"{cache['process_s']:.2f}")
    console.print(table)
    console.print(f"{disk['bytes'] / 2**30:.2f} GiB of weights: the cache fetch is "
                  f"{disk['fetch_s'] / cache['fetch_s']:.0f}x faster than the disk fetch "
                  f"(both processes also pay {cache['torch_s']:.1f} s to import torch).")


if __name__ == "__main__":
    main()

"""`make demo`: the main job on an embedded default, on the CPU.

Generates a Llama-shaped checkpoint of about 1 GiB (once, in a cache folder), fills an arena
from it the way a daemon's worker does, then restarts an "engine" twice: once from disk, once
from the arena, and prints the times side by side.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn
from rich.table import Table

import fast_start
from fast_start import synth
from fast_start.checkpoint import open_checkpoint
from fast_start.client import from_arenas
from fast_start.materialize import materialize

SIZE = 1 << 30
console = Console()


def demo_checkpoint(root: Path) -> Path:
    """The demo model, generated on first use and kept (`FAST_START_DEMO_DIR` moves it)."""
    shape = synth.llama_of_size(SIZE)
    folder = root / f"llama-{shape.num_layers}L-{shape.hidden_size}h"
    if (folder / "config.json").exists():
        return folder
    with _bar("generating checkpoint") as (progress, task):
        synth.write_checkpoint(folder.with_suffix(".tmp"), shape, files=2,
                               progress=lambda done, total: progress.update(task, completed=done, total=total))
    folder.with_suffix(".tmp").rename(folder)
    return folder


def _bar(label: str):
    progress = Progress(TextColumn(f"[bold]{label}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                        console=console)

    class Ctx:
        def __enter__(self):
            progress.__enter__()
            return progress, progress.add_task(label, total=None)

        def __exit__(self, *exc):
            return progress.__exit__(*exc)
    return Ctx()


def main() -> None:
    root = Path(os.environ.get("FAST_START_DEMO_DIR", Path.home() / ".cache" / "fast-start" / "demo"))
    folder = demo_checkpoint(root)
    spec = fast_start.WeightSpec(str(folder), engine_version="demo")
    ckpt = open_checkpoint(folder)
    console.print(f"model: {folder} ({ckpt.dims.architecture}, {ckpt.dims.num_layers} layers)")
    with _bar("filling arena") as (progress, task):
        t0 = time.perf_counter()
        manifest, fds = materialize(spec, progress=lambda d, t: progress.update(task, completed=d, total=t))
        fill = time.perf_counter() - t0
    t0 = time.perf_counter()
    disk = fast_start.fetch(spec)
    t_disk = time.perf_counter() - t0
    t0 = time.perf_counter()
    cache = from_arenas(manifest, fds)
    t_cache = time.perf_counter() - t0
    assert disk.keys() == cache.keys()
    table = Table(title="engine restart: weights ready")
    for col in ("path", "seconds", "bytes"):
        table.add_column(col, justify="right")
    size = sum(e.nbytes for e in manifest.tensors)
    table.add_row("fill (once)", f"{fill:.3f}", f"{size / 2**30:.2f} GiB")
    table.add_row("disk", f"{t_disk:.3f}", f"{size / 2**30:.2f} GiB")
    table.add_row("arena (zero_copy)", f"{t_cache:.4f}", f"{size / 2**30:.2f} GiB")
    console.print(table)
    console.print(f"arena is {t_disk / t_cache:.0f}x faster than disk")


if __name__ == "__main__":
    main()

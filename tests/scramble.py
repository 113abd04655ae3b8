"""Prove that a daemon read no tensor data: scramble it where only a read would see.

`scramble(folder)` inverts every byte of every shard's tensor data in place and puts back each
file's size and mtime, so that the checkpoint's headers (the fingerprint) and its files'
identity (what a daemon compares with its fill's) are unchanged while any tensor read from disk
comes out wrong. Only while no daemon runs: a running daemon's inotify watch sees the write.
A rewrite that restores the mtime is the window the README names. Applying it twice restores the
original bytes.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from fast_start.checkpoint import shard_files


def scramble(folder: Path) -> None:
    for name in shard_files(Path(folder)):
        path = Path(folder) / name
        st = os.stat(path)
        with open(path, "r+b") as f:
            start = 8 + int.from_bytes(f.read(8), "little")
            f.seek(start)
            data = f.read()
            f.seek(start)
            f.write(np.invert(np.frombuffer(data, np.uint8)).tobytes())
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert os.stat(path).st_size == st.st_size


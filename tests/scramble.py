"""Prove that a daemon read no tensor data: scramble it where only a read would see.

`scramble(folder)` inverts every byte of every shard's tensor data in place and puts back each
file's size and mtime, so that the checkpoint's headers (the fingerprint) and its files'
identity (what a daemon compares with its fill's) are unchanged while any tensor read from disk
comes out wrong. Only while no daemon runs: a running daemon's inotify watch sees the write.
A rewrite that restores the mtime is the window the README names. Applying it twice restores the
original bytes.

`swap_names_unseen(shard, elsewhere, a, b)` swaps two tensor names of equal length in a shard's
header where a daemon's inotify watch does not see it (through a hard link in the folder
`elsewhere`, as a change on another NFS client would be), its size and mtime put back.
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


def swap_names_unseen(shard: Path, elsewhere: Path, a: bytes, b: bytes) -> None:
    elsewhere.mkdir(exist_ok=True)
    link = elsewhere / shard.name
    os.link(shard, link)
    st = os.stat(link)
    with open(link, "r+b") as f:
        header = f.read(int.from_bytes(f.read(8), "little"))
        swapped = header.replace(a, b"\0").replace(b, a).replace(b"\0", b)
        assert swapped != header and len(a) == len(b)
        f.seek(8)
        f.write(swapped)
    os.utime(link, ns=(st.st_atime_ns, st.st_mtime_ns))
    link.unlink()

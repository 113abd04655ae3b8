"""Is a cached model still what its checkpoint holds? File identities and an inotify watch.

The fingerprint hashes the shards' headers only, and a fine-tune saved over a folder keeps its
header byte for byte. So the daemon also records, at each fill, the *identity* of every file
the tensors came from (the shards, the index, config.json): device, inode, size and mtime.

- At every acquire the engine sends the identity of the files it would read; anything but the
  identity recorded at the fill is a miss. A rewrite in place changes size or mtime, a new file
  moved over the old one changes the inode, another copy of the model has other inodes.
- `Watch` is an inotify watch on each model's folder (and on the folders its files resolve
  into, e.g. a Hugging Face cache's blobs): a write to one of its files marks the model stale
  the moment it happens, and the daemon refills it.

If the kernel's event queue overflows, events were lost and any file may have been written:
every watched model then counts as written. What this cannot see: a rewrite that keeps the size
and restores the mtime (`touch -d`) where no inotify event arrives (a change made on another NFS
client); docs/operations.md says so.
Stdlib only: the daemon's serving process never imports torch for this.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import struct
import threading
from pathlib import Path

from .errors import CheckpointError
from .headers import INDEX, file_identity, weight_files

log = logging.getLogger("fast_start.daemon")

Identity = dict[str, list[int]]     # file name -> [st_dev, st_ino, st_size, st_mtime_ns]


def checkpoint_files(folder: Path) -> list[str]:
    """Names of the files a checkpoint's tensors come from: every *.safetensors file (the
    fingerprint's `weight_files`), the index, config.json."""
    try:
        names = set(weight_files(folder))
    except CheckpointError:
        names = set()                   # none or unreadable now: the recorded ones then read as removed
    if os.path.exists(folder / INDEX):
        names.add(INDEX)
    return sorted(names | {"config.json"})


def identity(folder: str | Path) -> Identity:
    """The identity of every checkpoint file in `folder`; a missing file is [0, 0, -1, 0]."""
    folder = Path(folder)
    out = {}
    for name in checkpoint_files(folder):
        try:
            out[name] = file_identity(os.stat(folder / name))
        except OSError:
            out[name] = [0, 0, -1, 0]
    return out


def differs(recorded: Identity, current: Identity, gone_is_change: bool = True) -> str | None:
    """What differs between two identities, in words; None when they are the same.

    With `gone_is_change=False` files that cannot be seen now (storage unmounted or down) count
    as unchanged: the cache keeps what they held, and any engine must still present the files
    of the fill to be served.
    """
    for name in sorted(set(recorded) | set(current)):
        a, b = recorded.get(name), current.get(name)
        if a == b:
            continue
        if b is None or b[2] < 0:
            if gone_is_change:
                return f"{name} was removed"
            continue
        if a is None:
            return f"{name} was added"
        if a[:2] != b[:2]:
            return f"{name} is another file"
        return f"{name} was rewritten ({'size' if a[2] != b[2] else 'mtime'} changed)"
    return None


# inotify(7)
IN_MODIFY, IN_ATTRIB, IN_CLOSE_WRITE = 0x2, 0x4, 0x8
IN_MOVED_FROM, IN_MOVED_TO, IN_CREATE, IN_DELETE = 0x40, 0x80, 0x100, 0x200
IN_DELETE_SELF, IN_MOVE_SELF, IN_Q_OVERFLOW, IN_IGNORED = 0x400, 0x800, 0x4000, 0x8000
IN_NONBLOCK, IN_CLOEXEC = 0o4000, 0o2000000
_MASK = (IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
         | IN_DELETE_SELF | IN_MOVE_SELF)
_WRITES = IN_MODIFY | IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
_EVENT = struct.Struct("iIII")


class Watch:
    """inotify on model folders: `fd` becomes readable on a change; `changed()` names the models.

    A checkpoint file written, created, moved or deleted makes its model stale whatever the
    files' identity says afterwards (a same-size rewrite within one mtime tick keeps it); any
    other event in a watched folder only asks for the identity to be compared. `writes(model)`
    counts the writes seen, so that a fill can tell whether one came while it read. The serving
    loop reads events while the keeper adds and removes models: a lock keeps the tables whole.
    """

    def __init__(self):
        self._libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        self.fd = self._libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if self.fd < 0:     # out of inotify instances: changes are still caught by the file checks
            log.warning("cannot watch model folders (inotify_init1: %s); checkpoint changes are noticed at the "
                        "next acquire or within 30 s", os.strerror(ctypes.get_errno()))
        self._models: dict[int, set[str]] = {}     # watch descriptor -> models it covers
        self._files: dict[str, set[str]] = {}      # model -> names of its files (and of their link targets)
        self._writes: dict[str, int] = {}          # model -> writes seen to its files
        self._lock = threading.Lock()

    def add(self, model: str, folder: str | Path) -> None:
        """Watch `folder` and the folders its checkpoint files resolve into (symlinked blobs)."""
        files = {Path(folder) / n for n in checkpoint_files(Path(folder))}
        targets = {p.resolve() for p in files}
        with self._lock:
            self._remove(model)
            self._files[model] = {p.name for p in files | targets}
            for f in {str(folder)} | {str(p.parent) for p in targets} if self.fd >= 0 else ():
                wd = self._libc.inotify_add_watch(self.fd, os.fsencode(f), _MASK)
                if wd >= 0:         # a folder that is gone now is caught by the identity check
                    self._models.setdefault(wd, set()).add(model)

    def remove(self, model: str) -> None:
        with self._lock:
            self._remove(model)

    def _remove(self, model: str) -> None:
        self._files.pop(model, None)
        for models in self._models.values():
            models.discard(model)

    def writes(self, model: str) -> int:
        return self._writes.get(model, 0)

    def changed(self) -> dict[str, str | None]:
        """Models whose folders saw events since the last call (drains the fd): "<file> was
        written" where one of its files was (or events were lost), else None (compare the identity)."""
        hit: dict[str, str | None] = {}
        while self.fd >= 0:
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                return hit
            with self._lock:
                for wd, mask, _, raw in _events(data):
                    if mask & IN_Q_OVERFLOW:
                        log.warning("the inotify queue overflowed: events were lost, so every watched model's "
                                    "checkpoint counts as written and is filled again")
                        for model in self._files:
                            self._wrote(hit, model, "inotify lost events (queue overflow)")
                        continue
                    models = self._models.pop(wd, set()) if mask & IN_IGNORED else self._models.get(wd, set())
                    name = os.fsdecode(raw.rstrip(b"\0"))
                    for model in models:
                        if mask & _WRITES and name in self._files.get(model, ()):
                            self._wrote(hit, model, f"{name} was written")
                        else:
                            hit.setdefault(model, None)
        return hit

    def _wrote(self, hit: dict[str, str | None], model: str, what: str) -> None:
        hit[model] = what
        self._writes[model] = self._writes.get(model, 0) + 1

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)


def _events(data: bytes):
    pos = 0
    while pos + _EVENT.size <= len(data):
        wd, mask, cookie, length = _EVENT.unpack_from(data, pos)
        yield wd, mask, cookie, data[pos + _EVENT.size:pos + _EVENT.size + length]
        pos += _EVENT.size + length

"""The daemon's small files (state, eviction history, the metrics textfile): written atomically,
read with bounds; and the seal of a memfd written once (`seal`). Stdlib only.

Their folders may be writable by others (a node_exporter textfile folder often is), so neither
side trusts a name: a write goes to a new file with an unpredictable name, created exclusively
(`mkstemp`: `O_EXCL | O_NOFOLLOW`, so a symlink or FIFO planted anywhere is never opened), and
is renamed over the target, which replaces a link there instead of following it; a write that
fails removes its file. A read opens without following a last-component symlink and without
blocking (a FIFO answers at once), refuses anything but a regular file, and reads at most
`MAX_READ` bytes; what it returns is JSON already parsed, however deeply nested the text was.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
import tempfile
import time
from pathlib import Path

MAX_READ = 16 << 20
SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL
SEAL_WAIT_S = 10.0      # how long `seal` tries again while the kernel refuses it (EBUSY)
MEMFD_NAME_MAX = 249    # memfd_create(2): bytes of a name, not counting its "memfd:" prefix


def memfd(label: str) -> int:
    """A new sealable, close-on-exec memfd. `label` only names it in /proc (a model's name, a
    folder's): cut to the kernel's limit on a character boundary, without NULs, it never fails
    the call, however long the name an operator chose."""
    name = label.replace("\0", "").encode()[:MEMFD_NAME_MAX].decode(errors="ignore")
    return os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)


class Unreadable(ValueError):
    """A file is not one this process can read as JSON; the message names why."""


def write_atomic(path: str | Path, text: str, mode: int = 0o644) -> None:
    """Replace `path` with `text`: a reader sees the old file or the new, never half of one."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fchmod(f.fileno(), mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def seal(fd: int) -> None:
    """Seal a written memfd: no write, grow or shrink, and no further seal. The kernel refuses the
    write seal (EBUSY) while the memfd has a writable shared map, or while a page of it holds a
    reference the kernel still sees after waiting ~150 ms for it to drop. A fill met that once
    with nothing mapping the memfd, so the seal is tried again for up to SEAL_WAIT_S before the
    OSError is raised."""
    deadline, pause = time.monotonic() + SEAL_WAIT_S, 0.01
    while True:
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            return
        except OSError as e:
            if e.errno != errno.EBUSY or time.monotonic() + pause > deadline:
                raise
        time.sleep(pause)
        pause = min(2 * pause, 1.0)


def sealed(fd: int) -> bool:
    """Whether the memfd `fd` carries every seal `seal` sets."""
    return fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS == SEALS


def read_json(path: str | Path):
    """The JSON value in `path`. FileNotFoundError if there is none; `Unreadable` for a
    non-regular file, an oversized, undecodable or too deeply nested one; other OSErrors as raised."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:      # O_NOFOLLOW on a symlink
            raise Unreadable(f"{path} is a symlink") from None
        raise
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Unreadable(f"{path} is not a regular file")
        data = f.read(MAX_READ + 1)
    if len(data) > MAX_READ:
        raise Unreadable(f"{path} is larger than {MAX_READ} bytes")
    try:
        return json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise Unreadable(f"{path} is not JSON ({type(e).__name__}: {str(e)[:80]})") from None

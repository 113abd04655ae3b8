"""The eviction history: the last `MAX_EVICTIONS` evictions, kept across restarts in a file.

`fast-start evictions` shows it. The file (under systemd's StateDirectory=) is read back when
the daemon starts and rewritten atomically at each eviction; one that cannot be read is set
aside with a warning, never a failed start.
"""
from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time
from pathlib import Path

from . import files, reports
from .protocol import ProtocolError
from .reports import Eviction

log = logging.getLogger("fast_start.daemon")
MAX_EVICTIONS = 200


class History:
    def __init__(self):
        self.evictions: collections.deque[Eviction] = collections.deque(maxlen=MAX_EVICTIONS)
        self.path: Path | None = None       # where they are kept across restarts; None: in memory only
        self.lock = threading.Lock()

    def keep(self, path: Path) -> None:
        """Keep the history in `path`: read back now, rewritten atomically at each eviction. A
        file that cannot be read (not a regular file, not JSON, entries of the wrong shape) is
        set aside with a warning."""
        self.path = path
        try:
            saved = files.read_json(path)
        except FileNotFoundError:
            return
        except (OSError, files.Unreadable) as e:
            log.warning("cannot read the eviction history %s (%s); %s", path, e, _set_aside(path))
            return
        kept, damaged = [], []
        for each in saved if isinstance(saved, list) else []:
            try:
                kept.append(reports.read(Eviction, each, "an entry"))
            except ProtocolError as e:
                damaged.append(e.what)
        if damaged or not isinstance(saved, list):
            log.warning("the eviction history %s is damaged (%s); keeping the %d readable entries", path,
                        damaged[0] if damaged else "not a list", len(kept))
        with self.lock:
            self.evictions.extendleft(reversed(kept[-MAX_EVICTIONS:]))

    def add(self, eviction: Eviction) -> None:
        """Record `eviction` and rewrite the file."""
        with self.lock:
            self.evictions.append(eviction)
            snapshot = [e._asdict() for e in self.evictions]
        if self.path is None:
            return
        try:
            files.write_atomic(self.path, json.dumps(snapshot), 0o600)
        except OSError as e:
            log.warning("cannot write the eviction history %s: %s", self.path, e.strerror or e)

    def listed(self) -> list[Eviction]:
        with self.lock:
            return list(self.evictions)


def _set_aside(path: Path) -> str:
    """Move an unreadable history out of the way, kept for a person to look at; says where."""
    aside = path.with_name(f"{path.name}.unreadable-{int(time.time())}")
    try:
        os.rename(path, aside)
    except OSError as e:
        return f"it could not be set aside ({e.strerror or e}): the next eviction replaces it"
    return f"set aside as {aside}, starting a new one"

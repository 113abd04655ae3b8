"""The eviction history: the last `MAX_EVICTIONS` evictions, kept across restarts in a file.

`fast-start evictions` shows it. The file (under systemd's StateDirectory=) is read back when
the daemon starts and rewritten atomically at each eviction; one that cannot be read is set
aside with a warning, never a failed start.
"""
from __future__ import annotations

import collections
import json
import logging
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

from . import files

log = logging.getLogger("fast_start.daemon")
MAX_EVICTIONS = 200


@dataclass(frozen=True)
class Eviction:
    """One eviction as `fast-start evictions` shows it and the history file keeps it."""
    time: float
    model: str
    reason: str
    bytes: int
    leases: int

    @classmethod
    def from_json(cls, obj) -> "Eviction":
        """An entry of the history file; ValueError naming what is wrong with it."""
        want = cls.__annotations__         # field -> type name
        if not isinstance(obj, dict) or set(obj) != set(want):
            raise ValueError(f"an entry has fields {sorted(obj) if isinstance(obj, dict) else type(obj).__name__}")
        for name, kind in want.items():
            ok = isinstance(obj[name], (int, float) if kind == "float" else int if kind == "int" else str)
            if not ok or isinstance(obj[name], bool):
                raise ValueError(f"an entry's {name} is {obj[name]!r}, not {kind}")
        return cls(**obj)


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
            log.warning("cannot read the eviction history %s (%s); starting a new one", path, e)
            return
        kept, damaged = [], []
        for each in saved if isinstance(saved, list) else []:
            try:
                kept.append(Eviction.from_json(each))
            except ValueError as e:
                damaged.append(str(e))
        if damaged or not isinstance(saved, list):
            log.warning("the eviction history %s is damaged (%s); keeping the %d readable entries", path,
                        damaged[0] if damaged else "not a list", len(kept))
        with self.lock:
            self.evictions.extendleft(reversed(kept[-MAX_EVICTIONS:]))

    def add(self, eviction: Eviction) -> None:
        """Record `eviction` and rewrite the file."""
        with self.lock:
            self.evictions.append(eviction)
            snapshot = [asdict(e) for e in self.evictions]
        if self.path is None:
            return
        try:
            files.write_atomic(self.path, json.dumps(snapshot), 0o600)
        except OSError as e:
            log.warning("cannot write the eviction history %s: %s", self.path, e.strerror or e)

    def listed(self) -> list[dict]:
        with self.lock:
            return [asdict(e) for e in self.evictions]

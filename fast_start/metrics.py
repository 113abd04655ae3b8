"""Metrics in Prometheus' text format (0.0.4); the standard library only.

Each daemon counts into a `Metrics` registry (counters since its start, gauges read off its cache
when asked). `fast-start metrics` asks every daemon for its samples and prints them as one
exposition; with `[daemon] metrics_file` each daemon also writes its own file for
node_exporter's textfile collector (`files.write_atomic`).
"""
from __future__ import annotations

import errno
import grp
import logging
import os
import threading
from typing import Callable

from . import files

log = logging.getLogger("fast_start.daemon")

# name -> (type, help, label names)
FAMILIES = {
    "fast_start_up": ("gauge", "1 while the daemon runs (its textfile is removed when it stops).", ("gpu",)),
    "fast_start_build_info": ("gauge", "Always 1; the daemon's fast-start version.", ("gpu", "version")),
    "fast_start_cache_hits_total": ("counter", "Fetches served from the cache.", ("gpu", "model", "mode")),
    "fast_start_cache_misses_total": ("counter", "Fetches the cache could not serve, by reason (model: the closest one "
                                      "cached or configured, empty when there is none).", ("gpu", "model", "reason")),
    "fast_start_fills_total": ("counter", "Fills of a model into the cache.", ("gpu", "model")),
    "fast_start_filled_bytes_total": ("counter", "Bytes written into the cache by fills.", ("gpu", "model")),
    "fast_start_fill_seconds": ("gauge", "Duration of the model's last fill.", ("gpu", "model")),
    "fast_start_readoptions_total": ("counter", "Models re-adopted from systemd's fd store at a start.",
                                     ("gpu", "model")),
    "fast_start_evictions_total": ("counter", "Models dropped from the cache, by reason.", ("gpu", "model", "reason")),
    "fast_start_artifacts_total": ("counter", "Engines' artifacts (compiled graphs, kernels) handed over (hit), not "
                                   "kept for their settings (miss) and kept.", ("gpu", "model", "event")),
    "fast_start_failovers_total": ("counter", "Standby engines woken to serve after the serving engine of their "
                                   "model died.", ("gpu", "model")),
    "fast_start_refused_peers_total": ("counter", "Connections refused (credentials or limits).", ("gpu",)),
    "fast_start_cached_bytes": ("gauge", "Bytes of the model held in the cache.", ("gpu", "model")),
    "fast_start_leases": ("gauge", "Leases engines hold on the model.", ("gpu", "model")),
    "fast_start_device_memory_bytes": ("gauge", "The device's memory: total, free (every process counted) and held "
                                       "by the daemon's cache.", ("gpu", "kind")),
    "fast_start_fill_shortfall_bytes": ("gauge", "Free device memory a waiting fill lacks (0 once it fits).",
                                        ("gpu", "model")),
    "fast_start_model_state": ("gauge", "1 for the configured model's state (cached, filling, no_room, stale, failed, "
                               "evicted, missing), 0 for the others.", ("gpu", "model", "state")),
}


class Metrics:
    """One daemon's counters and last-value gauges, by family and labels (`gpu` is added)."""

    def __init__(self, gpu: int):
        self.gpu = gpu
        self.values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self.lock = threading.Lock()

    def _key(self, name: str, labels: dict) -> tuple:
        if name not in FAMILIES or set(labels) | {"gpu"} != set(FAMILIES[name][2]):
            raise ValueError(f"metric {name} with labels {sorted(labels)} is not defined")
        return name, tuple(sorted({"gpu": str(self.gpu), **{k: str(v) for k, v in labels.items()}}.items()))

    def inc(self, name: str, value: float = 1, **labels) -> None:
        key = self._key(name, labels)
        with self.lock:
            self.values[key] = self.values.get(key, 0) + value

    def zero(self, name: str, **labels) -> None:
        """A counter at 0 unless it has counted already."""
        key = self._key(name, labels)
        with self.lock:
            self.values.setdefault(key, 0)

    def set(self, name: str, value: float, **labels) -> None:
        key = self._key(name, labels)
        with self.lock:
            self.values[key] = value

    def samples(self) -> list[list]:
        """[name, {label: value}, value] of every sample (JSON-able: the daemon sends them)."""
        with self.lock:
            return [[name, dict(labels), value] for (name, labels), value in self.values.items()]

    def sample(self, name: str, value: float, **labels) -> list:
        """A sample computed when asked (a gauge read off the cache)."""
        return [name, dict(self._key(name, labels)[1]), value]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    """A sample's value exactly: whole numbers as integers (a byte count runs past the six digits
    of `:g`, which would write 212875264 as 2.12875e+08), others as Python's shortest repr."""
    v = float(value)
    return str(int(v)) if v.is_integer() and abs(v) < 2**53 else repr(v)


def render(samples: list[list]) -> str:
    """Samples of one or more daemons as one exposition: each family's HELP and TYPE once."""
    by_family: dict[str, list[list]] = {}
    for name, labels, value in samples:
        by_family.setdefault(name, []).append([labels, value])
    lines = []
    for name, (kind, text, _) in FAMILIES.items():
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
        for labels, value in sorted(by_family.get(name, []), key=lambda s: sorted(s[0].items())):
            tags = ",".join(f'{k}="{_escape(str(v))}"' for k, v in sorted(labels.items()))
            lines.append(f"{name}{{{tags}}} {_number(value)}" if tags else f"{name} {_number(value)}")
    return "\n".join(lines) + "\n"



def keep_textfile(path_of: Callable[[], str], samples: Callable[[], list[list]], stop: threading.Event,
                  every_s: float) -> None:
    """Write `samples()` for node_exporter to `path_of()` (re-read each time: a reload may change
    it; "" = none) every `every_s` until `stop`, then remove it: a stopped daemon exports nothing,
    not its last figures. Run on a thread of its own, so that a hung filesystem stalls it alone;
    a failing write is logged once per path, with the fix for its cause."""
    failing = written = ""
    while True:
        path = path_of()
        if written and written != path:
            _unlink(written)
            written = ""
        if path:
            try:
                files.write_atomic(path, render(samples()))
                failing, written = "", path
            except OSError as e:
                if failing != path:
                    log.warning("cannot write the metrics file %s: %s (fix: %s)", path, e.strerror or e,
                                textfile_fix(e, os.path.dirname(path)))
                failing = path
        if stop.wait(every_s):
            if written:
                _unlink(written)
            return


def textfile_fix(e: OSError, folder: str) -> str:
    """What makes `folder` writable for the metrics file, by why the write failed."""
    if e.errno == errno.EROFS:
        return (f"the unit sees {folder} read-only (ProtectSystem=strict): add a drop-in with "
                f"ReadWritePaths={folder} (systemctl edit fast-start@.service)")
    if e.errno in (errno.EACCES, errno.EPERM):
        group = grp.getgrgid(os.getegid()).gr_name
        return (f"the daemon's user may not write {folder}: give its group the folder, e.g. "
                f"chgrp {group} {folder} && chmod g+w {folder}")
    if e.errno == errno.ENOENT:
        return f"create {folder}, writable by the daemon's user"
    return "check the folder and its file system"


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("cannot remove %s: %s", path, e.strerror or e)

"""Metrics in Prometheus' text format (0.0.4); the standard library only.

Each daemon counts into a `Metrics` registry (counters since its start, gauges read off its cache
when asked). `fast-start metrics` asks every daemon for its samples and prints them as one
exposition; with `[daemon] metrics_file` each daemon also writes its own file for
node_exporter's textfile collector (`files.write_atomic`).
"""
from __future__ import annotations

import threading

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


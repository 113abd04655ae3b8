"""Per-function timers for `bench.fd_growth --trace` (this folder first on PYTHONPATH, PROBE_DIR set).

Every Python process that starts with it (daemon, fill worker, engines) wraps fast-start's
protocol, cache and fetch-path functions: each call's monotonic start and end (`stamp`) or only
its count and total time, and the fd table around each `fetch`. A process appends what it has
to PROBE_DIR/all.log after each fetch and when it exits.
"""
import os
import time

if os.environ.get("PROBE_DIR"):
    import atexit
    import importlib

    _log, _totals = [], {}
    WRAPPED = (("fast_start.protocol", "send", True), ("fast_start.protocol", "recv", True),
               ("fast_start.cache", "Cache.handle", True), ("fast_start.client", "request", True),
               ("fast_start.client", "fetch", True), ("fast_start.client", "_use", True),
               ("fast_start.arena", "map_arenas", True), ("fast_start.arena", "from_table", True),
               ("fast_start.arena", "map_readonly", False), ("fast_start.cudadrv", "map_fd", False),
               ("fast_start.cudadrv", "set_access", False), ("fast_start.cudadrv", "device_uuid", False))

    def _table() -> str:
        status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
        return f"FDSize={status['FDSize'].strip()},Threads={status['Threads'].strip()},open={len(os.listdir('/proc/self/fd'))}"

    def _dump() -> None:
        with open(os.path.join(os.environ["PROBE_DIR"], "all.log"), "a") as f:
            f.write(f"== pid {os.getpid()}\n")
            for row in _log:
                f.write(" ".join(map(str, row)) + "\n")
            for key, (n, ns) in sorted(_totals.items()):
                f.write(f"total {key} n={n} ms={ns / 1e6:.3f}\n")
        _log.clear()
        _totals.clear()

    def _wrap(module: str, name: str, stamp: bool) -> None:
        owner = importlib.import_module(module)
        attr = name
        if "." in name:
            cls, attr = name.split(".")
            owner = getattr(owner, cls)
        original = getattr(owner, attr)

        def timed(*args, **kwargs):
            if name == "fetch":
                _log.append(("table-before", _table()))
            t0 = time.monotonic_ns()
            try:
                return original(*args, **kwargs)
            finally:
                t1 = time.monotonic_ns()
                n, ns = _totals.get(f"{module}.{name}", (0, 0))
                _totals[f"{module}.{name}"] = (n + 1, ns + t1 - t0)
                if stamp:
                    _log.append((name, t0, t1))
                if name == "fetch":         # vLLM's engine processes end without running atexit
                    _log.append(("table-after", _table()))
                    _dump()
        setattr(owner, attr, timed)

    for module, name, stamp in WRAPPED:
        _wrap(module, name, stamp)
    atexit.register(_dump)

"""The fill worker: the data plane, a child process that touches tensor bytes and exits.

It runs with the engine's interpreter (`worker_python`, or a model's `python`), so a model is
materialized by the engine's own torch, CUDA and engine version. It holds the compute context
(on CUDA, the only process that ever does), reads checkpoints, casts, quantizes and shards them
into arenas, and sends each model's manifest with its arena fds back over a socketpair. The
daemon keeps nothing but those fds, so a crash in here costs a fill, never the serving process.

Run as `python -m fast_start.worker FD`. Its first frame on the socket FD is `WorkerHello`
(sent before torch is imported, so a version mismatch is told in milliseconds); then it answers
jobs one at a time until the daemon closes its side: `CheckJob` (headers and TP rules validated,
arenas sized: `Checked`), `FillJob` (`Progress` frames, then `Filled` with the arena fds) and
`VerifyJob` (the arena fds ride on the job; `Verified` lists tensors whose checksum differs).
A job that fails answers `Error` and the worker takes the next one.
"""
from __future__ import annotations

import importlib
import os
import socket
import sys
import time
import traceback

from . import __version__, engines, journal, protocol
from .errors import CheckpointError, FastStartError, is_config
from .fingerprint import WeightSpec

PROGRESS_EVERY = 0.2   # seconds between progress frames


def data_plane():
    """The modules that touch tensors; a clear error when this environment cannot load them."""
    try:
        from . import arena, materialize
        from .checkpoint import open_checkpoint
    except (ImportError, MemoryError, OSError) as e:
        why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        raise FastStartError(f"the fill worker ({sys.executable}) cannot load torch: {why}",
                             "install torch there, or raise the memory limit (LimitAS=, ulimit -v)") from None
    return arena, materialize, open_checkpoint


def filling_engine(spec: WeightSpec) -> engines.Engine | None:
    """The engine that fills this model itself: the one its `layout` names (its config's
    `engine`), where this environment has it installed (else fast-start's own tables build that
    engine's as-loaded layout)."""
    engine = engines.get(spec.layout)
    return engine if engine is not None and engine.name in engines.installed() else None


def check(sock: socket.socket, job: protocol.CheckJob, fds) -> None:
    spec = WeightSpec(**job.spec)
    engine = filling_engine(spec)
    if engine is not None:
        protocol.send(sock, protocol.Checked(job.model, engine.estimate(spec)))
        return
    _, materialize, open_checkpoint = data_plane()
    from .manifest import pack
    _, sizes = pack(materialize.plan(open_checkpoint(spec.path), spec))
    protocol.send(sock, protocol.Checked(job.model, sum(sizes)))


def fill(sock: socket.socket, job: protocol.FillJob, fds) -> None:
    _, materialize, _ = data_plane()
    use_device(job.device)
    spec = WeightSpec(**job.spec)
    progress = _Progress(sock, job.model, spec.rank, bandwidth=job.bandwidth).at
    start = time.monotonic()
    engine = filling_engine(spec)
    if engine is not None:
        module, _, function = engine.filler.partition(":")
        filler = getattr(importlib.import_module(module), function)
        manifest, arena_fds = filler(spec, job.device, progress, job.chunk)
    else:
        manifest, arena_fds = materialize.materialize(spec, job.device, job.chunk, progress)
    try:
        protocol.send(sock, protocol.Filled(job.model, manifest.to_dict(), time.monotonic() - start), arena_fds)
    finally:
        for fd in arena_fds:
            os.close(fd)


def verify(sock: socket.socket, job: protocol.VerifyJob, fds) -> None:
    """Checksums of arenas (re-adopted from the fd store, or mapped for `verify --deep`) against
    their manifest; with a spec, also the bytes derived from disk, one tensor at a time (not for a
    model an engine filled: its processed bytes come from the engine's kernels, so the checksums
    recorded at its fill are what it is checked against)."""
    arena, materialize, open_checkpoint = data_plane()
    import torch
    from .manifest import Manifest
    manifest = Manifest.from_dict(job.manifest)
    device = local_device(manifest.arenas[0].device) if manifest.arenas else "cpu"
    use_device(device)
    cached = arena.tensors(manifest, fds, "zero_copy", torch.device(device))
    want = {e.name: e.checksum for e in manifest.tensors}
    disk = bool(job.spec) and engines.get(manifest.engine.get("engine", "")) is None
    rank, size = manifest.fingerprint.rank, sum(e.nbytes for e in manifest.tensors)
    progress = _Progress(sock, job.model, rank, size * (2 if disk else 1))    # the cache's bytes, then the disk's
    bad = []
    for e in manifest.tensors:
        if arena.checksum(cached[e.name]) != e.checksum:
            bad.append(e.name)
        progress.add(e.nbytes)
    if disk:
        spec = WeightSpec(**job.spec)
        ckpt = open_checkpoint(spec.path)
        seen = set()
        with materialize.tensor_reader(ckpt) as read:
            for name, t in materialize.derive(ckpt, spec, read, device):
                seen.add(name)
                if want.get(name) != arena.checksum(t) and name not in bad:
                    bad.append(name)
                progress.add(t.nbytes)
        bad += [n for n in want if n not in seen and n not in bad]
    protocol.send(sock, protocol.Verified(job.model, bad))


class _Progress:
    """A job's progress frames, at most one each PROGRESS_EVERY (and the last one). With a
    `bandwidth` (bytes/s: an operator's cap on reads, for shared storage and many daemons at
    once), the job is slowed to it."""

    def __init__(self, sock: socket.socket, model: str, rank: int, total: int = 0, bandwidth: int = 0):
        self.sock, self.model, self.rank, self.total, self.bandwidth = sock, model, rank, total, bandwidth
        self.done, self.sent, self.start = 0, 0.0, time.monotonic()

    def add(self, nbytes: int) -> None:
        self.at(self.done + nbytes, self.total)

    def at(self, done: int, total: int) -> None:
        """`done` of `total` bytes (a filler's `progress`)."""
        self.done, self.total = done, total
        if self.bandwidth:
            time.sleep(max(0.0, done / self.bandwidth - (time.monotonic() - self.start)))
        if time.monotonic() - self.sent >= PROGRESS_EVERY or done >= total:
            protocol.send(self.sock, protocol.Progress(self.model, self.rank, done, total))
            self.sent = time.monotonic()


def use_device(device: str) -> None:
    if device.startswith("cuda"):
        import torch
        torch.cuda.set_device(device)     # the context lives here, never in the daemon


def local_device(arena_device: str) -> str:
    """This process's name for the device an arena lives on ("cpu", or the GPU with that UUID)."""
    if arena_device == "cpu":
        return "cpu"
    import torch
    from .gpus import device_uuid
    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == arena_device:
            return f"cuda:{i}"
    raise FastStartError(f"GPU {arena_device} is not visible to the fill worker", "unset CUDA_VISIBLE_DEVICES")


HANDLERS = {"check_job": check, "fill_job": fill, "verify_job": verify}


def main(argv: list[str]) -> int:
    journal.setup()         # its output is the daemon's: records (an engine's too) keep their priority
    sock = socket.socket(fileno=int(argv[0]))
    protocol.send(sock, protocol.WorkerHello(protocol.VERSION, __version__, sys.executable, sys.prefix, engines.installed()))
    while True:
        msg, fds = protocol.recv(sock, allowed=protocol.JOBS)
        if msg is None:
            return 0
        try:
            HANDLERS[msg.kind](sock, msg, fds)
        except FastStartError as e:
            protocol.send(sock, protocol.Error(e.what, e.fix, is_config(e), isinstance(e, CheckpointError)))
        except MemoryError:
            protocol.send(sock, protocol.Error(f"the fill worker ran out of memory on {msg.model!r}",
                                               "raise its memory limit (LimitAS=, ulimit -v) or free host memory"))
            return 1
        except Exception as e:     # a bug: report it to the daemon, keep the traceback in the journal
            traceback.print_exc()
            protocol.send(sock, protocol.Error(f"fill worker failed: {type(e).__name__}: {e}",
                                               "see the daemon's log for the traceback"))
            return 1
        finally:
            for fd in fds:
                os.close(fd)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

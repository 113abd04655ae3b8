"""The fill worker: a child process of the daemon that materializes arenas and exits.

It holds the compute context (on CUDA, the only process that ever does), reads the checkpoints,
casts, quantizes and shards them into arenas, and sends each model's manifest with its arena
fds back over a socketpair. The daemon keeps nothing but those fds, so a crash in here costs
a fill, never the serving process.

Run as `python -m fast_start.worker FD`: the daemon sends typed jobs over the socket FD
(`FillJob`: materialize a model shard; `VerifyJob`: checksum arenas re-adopted from systemd's
fd store, whose fds the worker inherited) and closes its side; the worker answers each job with
`Progress` frames and one `Filled` (with the arena fds) or `Verified`.
"""
from __future__ import annotations

import os
import socket
import sys
import time
import traceback

from . import protocol
from .errors import FastStartError
from .fingerprint import WeightSpec
from .client import from_arenas
from .manifest import Manifest, checksum
from .materialize import materialize

PROGRESS_EVERY = 0.2   # seconds between progress frames


def fill(sock: socket.socket, job: protocol.FillJob) -> None:
    spec = WeightSpec(**job.spec)
    bandwidth, start, last = job.bandwidth, time.monotonic(), [0.0]

    def progress(done: int, total: int) -> None:
        if bandwidth:   # an operator's cap on read bandwidth (shared storage, many daemons at once)
            time.sleep(max(0.0, done / bandwidth - (time.monotonic() - start)))
        now = time.monotonic()
        if now - last[0] >= PROGRESS_EVERY or done == total:
            last[0] = now
            protocol.send(sock, protocol.Progress(job.model, spec.rank, done, total))

    manifest, fds = materialize(spec, job.device, progress=progress)
    try:
        protocol.send(sock, protocol.Filled(job.model, manifest.to_dict(),
                                            time.monotonic() - start), fds)
    finally:
        for fd in fds:
            os.close(fd)


def verify(sock: socket.socket, job: protocol.VerifyJob) -> None:
    """Recompute the checksums of arenas the daemon re-adopted from systemd's fd store."""
    manifest = Manifest.from_dict(job.manifest)
    weights = from_arenas(manifest, job.fds, "zero_copy", job.device)
    bad = [e.name for e in manifest.tensors if checksum(weights.tensors[e.name]) != e.checksum]
    protocol.send(sock, protocol.Verified(job.model, bad))


def jobs(sock: socket.socket) -> list:
    """Every job the daemon sent, up to its end of the stream."""
    out = []
    while True:
        msg, _ = protocol.recv(sock, allowed=("fill_job", "verify_job"), accept_fds=False)
        if msg is None:
            return out
        out.append(msg)


def main(argv: list[str]) -> int:
    sock = socket.socket(fileno=int(argv[0]))
    try:
        for job in jobs(sock):
            if job.device.startswith("cuda"):
                import torch
                torch.cuda.set_device(job.device)     # the context lives here, never in the daemon
            (verify if isinstance(job, protocol.VerifyJob) else fill)(sock, job)
    except FastStartError as e:
        protocol.send(sock, protocol.Error(e.what, e.fix))
        return 1
    except Exception as e:     # a bug: report it to the daemon, keep the traceback in the journal
        traceback.print_exc()
        protocol.send(sock, protocol.Error(f"fill worker failed: {type(e).__name__}: {e}",
                                           "see the daemon's log for the traceback"))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

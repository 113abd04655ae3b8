"""`python -m bench.fd_pass`: what an engine pays per arena fd it receives, kind by kind.

A fetch of a model in 36 arenas waited 15 ms in `recvmsg` for the daemon's reply where one arena
took a fraction of a millisecond (BENCHMARKS.md, Big models). This separates the steps: the
parent makes N arenas (CUDA VMM allocations exported as fds, or sealed memfds) and sends their
fds in one `SCM_RIGHTS` message to a fresh interpreter that has its CUDA context already; the
child reads the message only once it has arrived, so its `recvmsg` is the kernel's receipt of
the fds alone, then imports and maps each (`cudadrv`), sets the access and closes the fds.
Medians of three fresh children per case, milliseconds; JSON on stdout.

    python -m bench.fd_pass [memfd[:SIZE]] [vmm[:SIZE]]      (SIZE of each arena, default 2MiB)
"""
from __future__ import annotations

import array
import json
import os
import socket
import statistics
import subprocess
import sys
import time

CHILD = r"""
import array, json, os, socket, sys, time
import torch
n, size, kind = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if kind == "vmm":
    torch.zeros(1, device="cuda:0"); torch.cuda.synchronize()
from fast_start import cudadrv
sock = socket.socket(fileno=int(sys.argv[1]))
sock.send(b"r")
time.sleep(0.3)                              # the message is there before the read starts
t0 = time.perf_counter()
data, anc, _, _ = sock.recvmsg(16, socket.CMSG_SPACE(n * 4))
t1 = time.perf_counter()
fds = list(array.array("i", anc[0][2][:n * 4]))
out = {"recvmsg_ms": (t1 - t0) * 1e3}
if kind == "vmm":
    ptrs = []
    t2 = time.perf_counter()
    for fd in fds:
        ptrs.append(cudadrv.map_fd(fd, size, 0))
    t3 = time.perf_counter()
    for p in ptrs:
        cudadrv.set_access(p, size, 0, True)
    t4 = time.perf_counter()
    out.update(map_ms=(t3 - t2) * 1e3, access_ms=(t4 - t3) * 1e3)
t5 = time.perf_counter()
for fd in fds:
    os.close(fd)
out["close_ms"] = (time.perf_counter() - t5) * 1e3
print(json.dumps(out), flush=True)
"""


def arenas(kind: str, n: int, size: int) -> list[int]:
    if kind == "memfd":
        from fast_start.arena import MemfdWriter
        return [MemfdWriter(size, f"probe{i}").finish() for i in range(n)]
    from fast_start.vmm import VmmWriter
    return [VmmWriter(size, 0, f"probe{i}").finish() for i in range(n)]


def once(kind: str, fds: list[int], size: int) -> dict:
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(child.fileno()), str(len(fds)), str(size), kind],
                            pass_fds=[child.fileno()], stdout=subprocess.PIPE, text=True)
    child.close()
    assert parent.recv(1) == b"r"
    t0 = time.perf_counter()
    parent.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())])
    send_ms = (time.perf_counter() - t0) * 1e3
    out, _ = proc.communicate(timeout=120)
    parent.close()
    return {"sendmsg_ms": send_ms, **json.loads(out.strip().splitlines()[-1])}


def main() -> None:
    from fast_start.config import parse_bytes
    results = {}
    for case in sys.argv[1:] or ("memfd", "vmm"):
        kind, _, size = case.partition(":")
        size = parse_bytes(size or "2MiB")
        for n in (1, 8, 36, 128) if size <= 64 << 20 else (1, 8, 36):
            fds = arenas(kind, n, size)
            runs = [once(kind, fds, size) for _ in range(3)]
            results[f"{case}-{n}"] = {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}
            for fd in fds:
                os.close(fd)
            print(kind, n, results[f"{case}-{n}"], file=sys.stderr, flush=True)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

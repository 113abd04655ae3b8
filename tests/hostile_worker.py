"""A broken fill worker, for the daemon's side of the worker protocol to be tested against.

`python tests/hostile_worker.py MODE FD` says a proper hello on the socket FD, then per job:
- `stall`: the first 2 bytes of a frame, then nothing;
- `repeat`: the same Progress frame ten times a second, for ever;
- `other`: a Progress frame on another model, then nothing;
- `fds`: the real worker's answers, with a descriptor of /dev/null on every Progress and Checked;
- `count`: the real worker's answers, but `Filled` without its arena descriptors.
"""
import os
import socket
import sys
import time

from fast_start import __version__, protocol, worker

mode, fd = sys.argv[1], int(sys.argv[2])
if mode in ("fds", "count"):
    send = protocol.send

    def hostile_send(sock, msg, fds=()):
        if mode == "fds" and isinstance(msg, (protocol.Progress, protocol.Checked)):
            fds = [os.open(os.devnull, os.O_RDONLY)]
        if mode == "count" and isinstance(msg, protocol.Filled):
            fds = []
        send(sock, msg, fds)
    protocol.send = hostile_send
    sys.exit(worker.main([str(fd)]))

sock = socket.socket(fileno=fd)
protocol.send(sock, protocol.WorkerHello(protocol.VERSION, __version__, sys.executable, sys.prefix, {}))
job, _ = protocol.recv(sock, allowed=protocol.JOBS)
if mode == "stall":
    sock.sendall(protocol.encode(protocol.Progress(job.model, 0, 1, 2))[:2])
    time.sleep(3600)
if mode == "other":
    protocol.send(sock, protocol.Progress("another", 0, 1, 2))
    time.sleep(3600)
while mode == "repeat":
    protocol.send(sock, protocol.Progress(job.model, 0, 5, 10))
    time.sleep(0.1)

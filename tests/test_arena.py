"""Arenas: sealed memfds, sent to another process with SCM_RIGHTS and mapped read-only there."""
from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

import fast_start
from fast_start.client import from_arenas
from fast_start.manifest import Manifest
from fast_start.materialize import materialize

# The producer: materializes rank 1 of a TP=2 fp8 model, sends manifest + fds, then exits.
PRODUCER = textwrap.dedent("""
    import socket, sys
    import fast_start
    from fast_start.materialize import materialize
    spec = fast_start.WeightSpec(sys.argv[1], tensor_parallel_size=2, rank=1, quantization="fp8")
    manifest, fds = materialize(spec)
    sock = socket.socket(fileno=int(sys.argv[2]))
    data = manifest.to_json()
    socket.send_fds(sock, [len(data).to_bytes(8, "little") + data], fds)
""")


def receive(sock: socket.socket) -> tuple[Manifest, list[int]]:
    buf, fds = b"", []
    while True:
        msg, got, _, _ = socket.recv_fds(sock, 1 << 20, 16)
        buf, fds = buf + msg, fds + got
        if not msg or len(buf) >= 8 and len(buf) - 8 >= int.from_bytes(buf[:8], "little"):
            return Manifest.from_json(buf[8:]), fds


def data_mapping(ptr: int) -> str:
    """The /proc/self/maps line whose range holds `ptr`."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= ptr < hi:
                return line
    return ""


def test_fds_sent_to_another_process_map_read_only_without_copying(llama):
    parent, child = socket.socketpair()
    proc = subprocess.run([sys.executable, "-c", PRODUCER, str(llama), str(child.fileno())],
                          pass_fds=[child.fileno()], capture_output=True, text=True, timeout=120)
    child.close()
    assert proc.returncode == 0, proc.stderr
    manifest, fds = receive(parent)            # the producer has exited: only our fds keep the memory
    weights = from_arenas(manifest, fds)
    disk = fast_start.fetch(fast_start.WeightSpec(str(llama), tensor_parallel_size=2, rank=1, quantization="fp8"))
    for name, t in disk.tensors.items():
        assert torch.equal(t.reshape(-1).view(torch.uint8), weights[name].reshape(-1).view(torch.uint8)), name
    mapping = data_mapping(weights["model.norm.weight"].data_ptr())
    assert "/memfd:fast-start:" in mapping and mapping.split()[1].startswith("r--s"), mapping
    with pytest.raises(OSError) as err:
        os.pwrite(fds[0], b"x", 0)             # sealed: not even the fd's holder can change the bytes
    assert err.value.errno == errno.EPERM
    for fd in fds:
        os.close(fd)


# Maps an arena read-only and writes through the tensor: must fault, not change the arena.
WRITER = textwrap.dedent("""
    import socket, sys
    from fast_start.client import from_arenas
    from fast_start.manifest import Manifest
    sock = socket.socket(fileno=int(sys.argv[1]))
    msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 16)
    weights = from_arenas(Manifest.from_json(msg), fds)
    weights["model.norm.weight"].fill_(7)
    print("write went through")
""")


def test_write_through_zero_copy_tensor_faults_and_cache_stays_intact(small):
    spec = fast_start.WeightSpec(str(small))
    manifest, fds = materialize(spec)
    parent, child = socket.socketpair()
    socket.send_fds(parent, [manifest.to_json()], fds)
    proc = subprocess.run([sys.executable, "-c", WRITER, str(child.fileno())], pass_fds=[child.fileno()],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -11 and "went through" not in proc.stdout      # SIGSEGV
    weights = from_arenas(manifest, fds)
    assert torch.equal(weights["model.norm.weight"], fast_start.fetch(spec)["model.norm.weight"])
    for fd in fds:
        os.close(fd)


def test_copy_mode_owns_its_memory(small):
    manifest, fds = materialize(fast_start.WeightSpec(str(small)))
    weights = from_arenas(manifest, fds, mode="copy")
    for fd in fds:
        os.close(fd)
    t = weights["model.norm.weight"]
    assert "/memfd:" not in data_mapping(t.data_ptr())
    t.fill_(3)                                  # private memory: writable
    assert (t == 3).all()


def test_manifest_pointing_outside_its_arena_is_rejected(small):
    manifest, fds = materialize(fast_start.WeightSpec(str(small)))
    for fd in fds:
        os.close(fd)
    d = json.loads(manifest.to_json())
    d["tensors"][0]["offset"] = d["arenas"][0]["size"]
    with pytest.raises(fast_start.FastStartError, match="outside arena"):
        Manifest.from_json(json.dumps(d))
    d = json.loads(manifest.to_json())
    d["tensors"][1]["shape"] = [10**9]
    with pytest.raises(fast_start.FastStartError, match="does not match"):
        Manifest.from_json(json.dumps(d))


def test_checksum_catches_a_flipped_bit_and_ignores_alignment():
    from fast_start.arena import checksum
    t = torch.randn(10_001).to(torch.bfloat16)
    flipped = t.clone()
    flipped.view(torch.uint8)[5000] ^= 1
    assert checksum(t) != checksum(flipped)
    unaligned = torch.cat([torch.zeros(1, dtype=torch.bfloat16), t])[1:]   # data_ptr % 8 == 2
    assert checksum(unaligned) == checksum(t)



def test_a_seal_refused_while_the_memfd_is_held_is_tried_again(monkeypatch):
    """The write seal fails (EBUSY) while a page of the memfd is held, here by a writable shared
    map: it is tried again and lands once the map is gone; held past SEAL_WAIT_S, the fill fails
    with an error naming the arena."""
    import fcntl
    import mmap
    import threading
    from fast_start import arena, files
    writer = arena.MemfdWriter(1 << 16, "held")
    writer.write(0, torch.arange(16, dtype=torch.int32))
    held = mmap.mmap(writer.fd, 1 << 16)            # shared and writable
    threading.Timer(0.3, held.close).start()
    fd = writer.finish()
    try:
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) == files.SEALS
    finally:
        os.close(fd)
    monkeypatch.setattr(files, "SEAL_WAIT_S", 0.2)
    writer = arena.MemfdWriter(1 << 16, "held")
    held = mmap.mmap(writer.fd, 1 << 16)
    try:
        with pytest.raises(fast_start.FastStartError, match="cannot seal the arena of held: Device or resource busy"):
            writer.finish()
    finally:
        held.close()
        writer.abort()


def test_detach_makes_a_zero_copy_map_the_engines_own_at_the_same_addresses(tmp_path, small, daemons):
    """What vLLM's reload_weights gets on a zero_copy engine: its weights writable where they were,
    the daemon's sealed memfd unwritten (a write before the detach would fault)."""
    from devtools.harness import write_config
    from fast_start.detach import detach
    daemons(write_config(tmp_path / "fs.toml", tmp_path / "run",
                         [{"name": "small", "path": str(small), "gpus": [0], "engine_version": "test"}]))
    spec = fast_start.WeightSpec(str(small), engine_version="test")
    w = fast_start.fetch(spec, socket_dir=str(tmp_path / "run"), fallback=False)
    before = {n: (t.data_ptr(), t.clone()) for n, t in w.items()}
    assert detach(list(w.values())[:1]) >= w[next(iter(w))].nbytes     # the map of the first tensor, whole
    assert detach(w.values()) == 0                                        # one arena: nothing else to detach
    for n, t in w.items():
        assert t.data_ptr() == before[n][0] and torch.equal(t, before[n][1])
        t.view(torch.uint8).add_(1)
    again = fast_start.fetch(spec, socket_dir=str(tmp_path / "run"), fallback=False)
    for n, t in again.items():
        assert torch.equal(t, before[n][1]) and not torch.equal(w[n], before[n][1]), n

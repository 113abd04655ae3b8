"""The tensor table and the one-round-trip acquire: what a fresh engine process parses and maps."""
from __future__ import annotations

import dataclasses
import os
import socket
import struct
import subprocess
import sys
import zlib

import pytest
import torch

import fast_start
from fast_start import arena, protocol, table
from fast_start.arena import from_table
from fast_start.errors import ArenaError
from fast_start.fingerprint import WeightSpec
from fast_start.manifest import ArenaEntry, Manifest, TensorEntry, pack
from fast_start.transport import connect, request
from fast_start.watch import identity
from devtools.harness import write_config


def manifest_of(outputs, fp) -> Manifest:
    entries, sizes = pack(outputs)
    return Manifest(fp, tuple(ArenaEntry(s, "cpu") for s in sizes), tuple(entries), {})


@pytest.fixture(scope="module")
def fp(llama):
    from fast_start.fingerprint import fingerprint
    return fingerprint(WeightSpec(str(llama)))


def moe_outputs(layers: int = 4, experts: int = 16) -> list:
    """The names, dtypes and shapes of an MoE rank in the `hf` layout, in name order."""
    out = []
    for layer in range(layers):
        for e in range(experts):
            for proj, shape in (("down_proj", (64, 32)), ("gate_proj", (32, 64)), ("up_proj", (32, 64))):
                out.append((f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight", "bfloat16", shape))
        out.append((f"model.layers.{layer}.input_layernorm.weight", "bfloat16", (64,)))
    return out


def test_tensors_of_a_shape_are_one_run_and_come_back_bit_for_bit(fp):
    m = manifest_of(moe_outputs(), fp)
    data = table.encode(m)
    d, rows, names = table.parse(data)
    runs = len(rows) // (table.FIXED + 2 * d)
    assert len(names) == len(m.tensors) == 196 and runs == 3     # down, gate+up, norms
    arena = torch.arange(m.arenas[0].size, dtype=torch.int64).to(torch.uint8)
    got = from_table(data, [arena])
    flat = arena.view(torch.bfloat16)
    for e in m.tensors:
        want = flat[e.offset // 2:(e.offset + e.nbytes) // 2].view(e.shape)
        assert got[e.name].shape == e.shape and got[e.name].dtype == torch.bfloat16
        assert got[e.name].data_ptr() == want.data_ptr()
        assert torch.equal(got[e.name].view(torch.int16), want.view(torch.int16))


def test_every_dtype_of_the_table_comes_back_as_itself(fp):
    # float8_e8m0fnu: MXFP4's block scales as vLLM's Marlin holds them after processing
    from fast_start import dtypes
    outputs = [(f"t.{d.name}", d.name, (4, 8)) for d in dtypes.TABLE]
    m = manifest_of(outputs, fp)
    m.validate()
    arena = torch.arange(m.arenas[0].size, dtype=torch.int64).to(torch.uint8)
    got = from_table(table.encode(m), [arena])
    for e in m.tensors:
        assert got[e.name].dtype == dtypes.torch_dtype(e.dtype) and got[e.name].shape == (4, 8)
        assert torch.equal(got[e.name].view(torch.uint8).flatten(), arena[e.offset:e.offset + e.nbytes])


def test_a_manifest_naming_a_dtype_fast_start_does_not_know_says_which(fp):
    m = manifest_of([("w", "bfloat16", (4,))], fp)
    bad = Manifest(m.fingerprint, m.arenas, (dataclasses.replace(m.tensors[0], dtype="float4_e2m1fn_x2"),), {})
    with pytest.raises(ArenaError, match="'w' has dtype float4_e2m1fn_x2, which this fast-start does not know"):
        bad.validate()


def test_table_tensors_are_normal_tensors_an_engine_may_make_parameters_of_and_write(fp):
    """Views are made in inference mode (cheaper); they must still behave as ordinary tensors."""
    m = manifest_of(moe_outputs(layers=1, experts=2), fp)
    arena = torch.zeros(m.arenas[0].size, dtype=torch.uint8)          # a copy-mode arena: the engine's own
    got = from_table(table.encode(m), [arena])
    assert not any(t.is_inference() for t in got.values())
    name = "model.layers.0.mlp.experts.1.up_proj.weight"
    weight = torch.nn.Parameter(got[name], requires_grad=False)
    weight.add_(1)
    norm = got["model.layers.0.input_layernorm.weight"]
    norm.mul_(0).add_(2)
    assert weight.data_ptr() == got[name].data_ptr() and got[name].eq(1).all() and norm.eq(2).all()
    assert int(arena.sum()) > 0         # written through to the arena
    assert torch.nn.Parameter(got[name].clone()).requires_grad     # trainable where an engine wants it


def test_strided_entries_that_share_bytes_keep_their_strides(fp):
    """vLLM's transposed FP8 weights: views with strides, two of them over one storage."""
    entries = (TensorEntry("w", "float8_e4m3fn", (8, 4), 0, 0, 32, "", (1, 8)),
               TensorEntry("w_t", "float8_e4m3fn", (4, 8), 0, 0, 32, ""),
               TensorEntry("scale", "float32", (4,), 0, 256, 16, ""))
    m = Manifest(fp, (ArenaEntry(512, "cpu"),), entries, {})
    arena = torch.arange(512, dtype=torch.int64).to(torch.uint8)
    got = from_table(table.encode(m), [arena])
    base = arena[:32].view(torch.float8_e4m3fn)
    assert got["w"].stride() == (1, 8) and got["w"].view(torch.uint8).equal(base.view(4, 8).t().view(torch.uint8))
    assert got["w_t"].data_ptr() == got["w"].data_ptr()
    assert got["scale"].equal(arena[256:272].view(torch.float32))


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "wrong magic"])
def test_a_damaged_table_is_refused(fp, damage):
    data = bytearray(table.encode(manifest_of(moe_outputs(1, 2), fp)))
    if damage == "flipped byte":
        data[-3] ^= 1
    elif damage == "truncated":
        del data[-8:]
    else:
        data[:4] = b"FST9"
    with pytest.raises(ArenaError, match="tensor table is damaged"):
        from_table(data, [torch.zeros(1 << 16, dtype=torch.uint8)])


def forged(rows: list[list[int]], names: list[str], d: int) -> bytes:
    """A table with a valid checksum around rows an attacker chose."""
    body = struct.pack(f"<{sum(len(r) for r in rows)}q", *[x for r in rows for x in r]) + "\0".join(names).encode()
    n = sum(r[0] for r in rows)
    return table.HEADER.pack(table.MAGIC, n, len(rows), d, len("\0".join(names).encode()), zlib.crc32(body), 0) + body


BF16 = table.CODES["bfloat16"]


@pytest.mark.parametrize("row,why", [
    ([1, 0, 4096, 2048, 0, BF16, 2, 32, 32, 32, 1], "past the arena's end"),
    ([3, 1024, 2048, 2048, 0, BF16, 2, 32, 32, 32, 1], "a run whose last tensor ends past the arena"),
    ([1, 0, 0, 2048, 1, BF16, 2, 32, 32, 32, 1], "an arena that was not sent"),
    ([1, 0, 0, 2048, 0, 99, 2, 32, 32, 32, 1], "an unknown dtype"),
    ([1, 0, 0, 4096, 0, BF16, 2, 32, 32, 32, 1], "nbytes that do not match the shape"),
    ([1, 0, 1, 2048, 0, BF16, 2, 32, 32, 32, 1], "a misaligned offset"),
    ([1, 0, 0, 2048, 0, BF16, 2, 32, 32, 2**62, 1], "a stride reaching past the end (no overflow)"),
    ([1, 0, 0, 2048, 0, BF16, 2, -32, -32, 32, 1], "negative sizes"),
    ([2, 0, 0, 2048, 0, BF16, 2, 32, 32, 32, 1], "a run with no step"),
])
def test_a_hostile_table_never_yields_a_view_outside_its_arena(row, why):
    arena = torch.zeros(4096, dtype=torch.uint8)
    names = [f"t{i}" for i in range(row[0])]
    with pytest.raises(ArenaError):
        from_table(forged([row], names, 2), [arena])


def test_runs_whose_counts_do_not_add_up_to_the_names_are_refused():
    rows = [[5, 256, 0, 256, 0, BF16, 1, 128, 0, 1, 0], [-2, 256, 0, 256, 0, BF16, 1, 128, 0, 1, 0]]
    with pytest.raises(ArenaError, match="names for 3 tensors"):
        from_table(forged(rows, ["a", "b", "c"], 2), [torch.zeros(4096, dtype=torch.uint8)])


def test_a_table_naming_a_tensor_twice_is_refused():
    row = [2, 2048, 0, 2048, 0, BF16, 2, 32, 32, 32, 1]
    with pytest.raises(ArenaError, match="names a tensor twice"):
        from_table(forged([row], ["a", "a"], 2), [torch.zeros(4096, dtype=torch.uint8)])


def test_one_round_trip_gives_lease_fds_and_table_and_answers_other_devices_with_a_miss(tmp_path, small, daemons):
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run",
                       [{"name": "small", "path": str(small), "gpus": [0], "engine_version": "test"}])
    d = daemons(cfg)
    from fast_start.fingerprint import fingerprint
    want = fingerprint(WeightSpec(str(small), engine_version="test")).to_dict()
    with connect(d.socket, 5) as conn:          # no Hello: the acquire says the protocol and the device
        reply, fds = request(conn, protocol.Acquire(want, "zero_copy", identity(small), protocol.VERSION, "cpu"),
                             with_fds=True)
        assert isinstance(reply, protocol.Acquired) and len(reply.attachment) == reply.table > 0
        assert "tensors" not in reply.manifest and reply.manifest["fingerprint"] == want
        tensors = from_table(reply.attachment, [torch.frombuffer(bytearray(a["size"]), dtype=torch.uint8)
                                                for a in reply.manifest["arenas"]])
        for fd in fds:
            os.close(fd)
        other = request(conn, protocol.Acquire(want, "zero_copy", identity(small), protocol.VERSION, "GPU-other"))
        assert isinstance(other, protocol.Miss) and other.fields == ["device"] and "serves cpu" in other.reason
        with pytest.raises(fast_start.FastStartError, match="protocol version 2 is not spoken here"):
            request(conn, protocol.Acquire(want, "zero_copy", identity(small), 2, "cpu"))
        whole, fds = request(conn, protocol.Acquire(want, "copy", identity(small), manifest="json"), with_fds=True)
        assert whole.table == 0 and len(whole.manifest["tensors"]) == len(tensors)
        for fd in fds:
            os.close(fd)
    w = fast_start.fetch(WeightSpec(str(small), engine_version="test"), socket_dir=str(d.socket_dir), fallback=False)
    disk = fast_start.fetch(WeightSpec(str(small), engine_version="test"), socket_dir=str(tmp_path / "none"))
    assert w.source == "cache" and set(w) == set(disk) and all(torch.equal(w[n], disk[n]) for n in disk)


def test_an_attachment_over_the_limit_closes_the_stream():
    a, b = socket.socketpair()
    with a, b:
        msg = protocol.Acquired(1, "m", {}, 400).attach(b"x" * 400)
        protocol.send(a, msg)
        with pytest.raises(protocol.FramingError, match="announces 400 attached bytes"):
            protocol.recv(b, max_size=200)
        with pytest.raises(ValueError):
            protocol.Acquired(1, "m", {}, 10).attach(b"short")


def pipes(n: int) -> list[int]:
    """`n` fds, each the read end of a pipe whose write end says its number."""
    fds = []
    for i in range(n):
        r, w = os.pipe()
        os.write(w, str(i).encode())
        os.close(w)
        fds.append(r)
    return fds


def test_an_acquired_replys_fds_come_a_batch_at_a_time_in_order():
    a, b = socket.socketpair()
    sent = pipes(2 * protocol.FD_BATCH + 1)
    with a, b:
        protocol.send(a, protocol.Acquired(1, "m", {}, fds=len(sent)), sent)
        reply, first = protocol.recv(b)
        assert reply.fds == len(sent) and len(first) == protocol.FD_BATCH
        got = list(protocol.fd_batches(b, reply, first))
        assert [len(batch) for batch in got] == [protocol.FD_BATCH, protocol.FD_BATCH, 1]
        assert [os.read(fd, 8) for batch in got for fd in batch] == [str(i).encode() for i in range(len(sent))]
        protocol.send(a, protocol.Status())             # the stream is in step after them
        assert protocol.recv(b)[0] == protocol.Status()
        with pytest.raises(ValueError, match="announces 3 fds, not 2"):
            protocol.send(a, protocol.Acquired(1, "m", {}, fds=3), sent[:2])
    for fd in sent + [fd for batch in got for fd in batch]:
        os.close(fd)


def test_a_batch_out_of_order_breaks_the_reply_and_leaks_no_fd():
    a, b = socket.socketpair()
    sent = pipes(protocol.FD_BATCH + 2)
    with a, b:
        protocol._send(a, protocol.Acquired(1, "m", {}, fds=len(sent)), sent[:protocol.FD_BATCH])
        protocol._send(a, protocol.Fds(protocol.FD_BATCH + 1), sent[protocol.FD_BATCH:])     # should be FD_BATCH
        before = set(os.listdir("/proc/self/fd"))
        reply, first = protocol.recv(b)
        with pytest.raises(protocol.FramingError, match=f"broke off at {protocol.FD_BATCH} of {len(sent)}"):
            protocol.all_fds(b, reply, first)
        assert set(os.listdir("/proc/self/fd")) == before
    for fd in sent:
        os.close(fd)


def test_a_request_that_takes_no_fds_still_reads_every_batch_of_its_reply():
    a, b = socket.socketpair()
    sent = pipes(protocol.FD_BATCH + 1)
    with a, b:
        protocol.send(b, protocol.Acquired(1, "m", {}, fds=len(sent)), sent)
        protocol.send(b, protocol.Report({"next": 1}))
        before = set(os.listdir("/proc/self/fd"))
        assert isinstance(request(a, protocol.Status()), protocol.Acquired)
        assert set(os.listdir("/proc/self/fd")) == before          # read and closed
        assert protocol.recv(a)[0].body == {"next": 1}       # the frame after them, in step
    for fd in sent:
        os.close(fd)


def test_the_engine_side_imports_torch_and_the_client_only():
    code = ("import sys, torch; before = set(sys.modules); import fast_start; fast_start.fetch; "
            "print(' '.join(sorted(set(sys.modules) - before)))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    heavy = [m for m in loaded if m.split(".")[0] in ("typer", "rich", "safetensors", "click", "tomllib", "tomli")
             or m.split(".")[:2] == ["cuda", "bindings"]
             or m in ("fast_start.daemon", "fast_start.config", "fast_start.cli", "fast_start.materialize",
                      "fast_start.manifest", "fast_start.checkpoint", "fast_start.cache")]
    assert "fast_start.client" in loaded and heavy == [], heavy

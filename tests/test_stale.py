"""Never stale: a checkpoint changed under the cache is noticed, never served, and refilled.

A fine-tune saved over a folder keeps the safetensors header byte for byte, so the fingerprint
alone cannot tell; the daemon compares the files' identity (device, inode, size, mtime) with the
fill's at every acquire and watches the folders with inotify.
"""
from __future__ import annotations

import os
import shutil
import signal

import pytest
import torch
from safetensors.torch import load_file, save_file

from probe import evictions, status, wait_until
from scramble import scramble, swap_names_unseen

import fast_start
from fast_start import protocol, watch
from fast_start.cache import Cache, Events
from fast_start.entry import Entry
from fast_start.config import ModelConfig
from fast_start.errors import CacheMiss
from devtools.harness import write_config
from fast_start.materialize import materialize
from fast_start.trust import Peer


def model(path, **kw):
    return {"name": "small", "path": str(path), "gpus": [0], "engine_version": "test", **kw}


def spec(path):
    return fast_start.WeightSpec(str(path), engine_version="test")




def fine_tune(folder, how: str) -> dict[str, torch.Tensor]:
    """Save new values under the very same header: in place, or as a new file moved over the old."""
    path = folder / "model.safetensors"
    header = path.read_bytes()[:8 + int.from_bytes(path.read_bytes()[:8], "little")]
    tensors = {n: (t.float() * 1.5).to(t.dtype) for n, t in load_file(path).items()}
    target = path if how == "in place" else folder / "new.tmp"
    save_file(tensors, target, metadata={"format": "pt"})
    if how == "renamed":
        os.replace(target, path)
    assert path.read_bytes()[:len(header)] == header          # the fingerprint cannot see it
    return tensors


def same(weights, tensors) -> bool:
    return all(torch.equal(weights[n].contiguous().view(torch.uint8), t.contiguous().view(torch.uint8))
               for n, t in tensors.items())


@pytest.mark.parametrize("how", ["in place", "renamed"])
def test_a_fine_tune_saved_under_the_same_header_is_never_served_stale(tmp_path, small, daemons, how):
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", [model(small)], refill_on_change=False)
    d = daemons(cfg)
    run = str(tmp_path / "run")
    old = fast_start.fetch(spec(small), socket_dir=run, fallback=False)
    new = fine_tune(small, how)
    with pytest.raises(CacheMiss, match="checkpoint changed since the fill") as miss:
        fast_start.fetch(spec(small), socket_dir=run, fallback=False)
    assert miss.value.fields == ("files",)
    disk = fast_start.fetch(spec(small), socket_dir=run)               # falls back to the new bytes
    assert disk.source == "disk" and same(disk, new) and not same(old, new)
    s = status(d)
    assert s["state"] == "incomplete" and s["missing"][0]["state"] == "stale"
    from typer.testing import CliRunner
    from fast_start.cli import app
    r = CliRunner().invoke(app, ["status", "--config", str(cfg)])
    assert r.exit_code == 1 and "stale" in r.stdout
    assert evictions(d) == [("small", "checkpoint changed")]


def test_a_changed_checkpoint_is_refilled_and_swapped_in_while_old_mappings_stay(tmp_path, small, daemons):
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", [model(small)])
    d = daemons(cfg)
    run = str(tmp_path / "run")
    old = fast_start.fetch(spec(small), socket_dir=run, fallback=False)
    before = {n: t.clone() for n, t in old.items()}
    filled_at = status(d)["models"][0]["filled_at"]
    new = fine_tune(small, "in place")
    wait_until(lambda: [m["filled_at"] for m in status(d)["models"]] not in ([], [filled_at]), what="the refill")
    w = fast_start.fetch(spec(small), socket_dir=run, fallback=False)
    assert w.source == "cache" and same(w, new)
    assert all(torch.equal(old[n], t) for n, t in before.items())      # the old mapping is untouched
    assert status(d)["state"] == "ready"


def test_a_checkpoint_replaced_with_another_header_is_refilled_with_its_fingerprint(tmp_path, small, daemons):
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", [model(small)])
    d = daemons(cfg)
    run = str(tmp_path / "run")
    digest = status(d)["models"][0]["fingerprint"]
    path = small / "model.safetensors"
    tensors = load_file(path)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].float()     # the header changes
    save_file(tensors, path)
    wait_until(lambda: [m["fingerprint"] for m in status(d)["models"]] not in ([], [digest]), what="the refill")
    w = fast_start.fetch(spec(small), socket_dir=run, fallback=False)
    assert w.source == "cache" and w["model.norm.weight"].dtype == torch.bfloat16   # cast as configured
    assert torch.equal(w["model.norm.weight"], tensors["model.norm.weight"].bfloat16())


def test_another_copy_of_the_model_is_a_miss_that_says_so(tmp_path, small, daemons):
    d = daemons(write_config(tmp_path / "fs.toml", tmp_path / "run", [model(small)]))
    copy = shutil.copytree(small, tmp_path / "copy")                   # same headers, other files
    with pytest.raises(CacheMiss, match="not those the daemon cached from .* is another file"):
        fast_start.fetch(spec(copy), socket_dir=str(tmp_path / "run"), fallback=False)
    assert status(d)["state"] == "ready"                                # the cache itself is fine


def test_a_change_while_the_daemon_was_down_drops_the_stored_arena(tmp_path, small, daemons):
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", [model(small)])
    first = daemons(cfg)
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(30)
    new = fine_tune(small, "renamed")
    second = daemons(cfg, listen=dict(first.listener.store))
    assert "the checkpoint changed since the fill (model.safetensors is another file)" in second.log.read_text()
    w = fast_start.fetch(spec(small), socket_dir=str(tmp_path / "run"), fallback=False)
    assert w.source == "cache" and same(w, new)


def test_acquire_compares_the_files_and_marks_the_model_stale(tmp_path, small):
    """The check at acquire, which catches what inotify cannot see (a change on another NFS client)."""
    manifest, fds = materialize(spec(small), "cpu")
    stale = []
    class Told(Events):
        def stale(self, model, why):
            stale.append((model, why))
    cache = Cache(0, "cpu", "keep", events=Told())
    cfg = ModelConfig("small", str(small), (0,), engine_version="test")
    cache.add(Entry(cfg, manifest, fds, 0.0, watch.identity(small)))
    peer = Peer(os.getpid(), os.getuid(), os.getgid(), admin=True)
    ask = protocol.Acquire(manifest.fingerprint.to_dict(), "zero_copy", watch.identity(small))
    reply, _, done = cache.handle(ask, peer)
    assert isinstance(reply, protocol.Acquired)
    done(True)
    st = os.stat(small / "model.safetensors")
    os.utime(small / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1))   # no data written
    ask = protocol.Acquire(manifest.fingerprint.to_dict(), "zero_copy", watch.identity(small))
    reply, fds_out, _ = cache.handle(ask, peer)
    assert isinstance(reply, protocol.Miss) and reply.fields == ["files"] and not fds_out
    assert "checkpoint changed since the fill (model.safetensors was rewritten (mtime changed))" in reply.reason
    assert stale == [("small", "model.safetensors was rewritten (mtime changed)")]
    cache.close()


def test_a_header_rewritten_where_neither_identity_nor_watch_sees_it_is_a_miss(tmp_path, small, daemons):
    """The window the identities leave: a rewrite that keeps size and mtime, made where the
    daemon's inotify watch cannot see it (here through a hard link in another folder, as a change
    on another NFS client would be). A changed header (k_proj and v_proj swapped) still changes
    the fingerprint the engine reads while the daemon answers: the reply to its partial request is
    not its model, so it gives that lease back and asks with the whole fingerprint, which is a
    miss on the checkpoint field; no lease is left, and the disk gives the new tensors."""
    d = daemons(write_config(tmp_path / "fs.toml", tmp_path / "run", [model(small)], refill_on_change=False,
                             arena_chunk="64KiB"))        # many fds in the reply given back
    run = str(tmp_path / "run")
    old = fast_start.fetch(spec(small), socket_dir=run, mode="copy", fallback=False)
    files = watch.identity(small)
    swap_names_unseen(small / "model.safetensors", tmp_path / "elsewhere", b"self_attn.k_proj.weight",
                      b"self_attn.v_proj.weight")
    assert watch.identity(small) == files               # what the daemon compares is unchanged
    with pytest.raises(CacheMiss, match="fingerprint differs") as miss:
        fast_start.fetch(spec(small), socket_dir=run, fallback=False)
    assert miss.value.fields == ("checkpoint",)
    s = status(d)
    assert s["leases"] == [] and s["state"] == "ready"
    disk = fast_start.fetch(spec(small), socket_dir=run)
    name = "model.layers.0.self_attn.{}_proj.weight"
    assert disk.source == "disk" and torch.equal(disk[name.format("k")], old[name.format("v")])


def test_a_rewrite_that_keeps_size_and_mtime_is_caught_by_the_watch(tmp_path, small, daemons):
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", [model(small)], refill_on_change=False)
    d = daemons(cfg)
    files = watch.identity(small)
    scramble(small)                                  # every data byte changed, size and mtime put back
    assert watch.identity(small) == files            # what the identity alone cannot see
    wait_until(lambda: [m["state"] for m in status(d)["missing"]] == ["stale"], what="the watch")
    assert "model.safetensors was written" in status(d)["missing"][0]["detail"]
    with pytest.raises(CacheMiss, match="checkpoint changed since the fill"):
        fast_start.fetch(spec(small), socket_dir=str(tmp_path / "run"), fallback=False)

"""Engines' artifacts kept by real daemons (CPU): handed over to the uid that kept them, keyed,
checked, bounded, kept across a daemon's restart; a hostile or broken upload costs one reply."""
from __future__ import annotations

import io
import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

from devtools import synth
from devtools.harness import write_config
from fast_start import artifacts, protocol
from fast_start.transport import connect, request

SETTINGS = {"vllm": "0.26.0", "scheduler.max_num_seqs": "256", "compilation.cudagraph_capture_sizes": "[1, 2, 4]"}
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")


@pytest.fixture
def daemon(tmp_path, daemons):
    """A daemon with a state directory (as its unit gives it) serving one model, "small"."""
    folder = synth.write_checkpoint(tmp_path / "small", synth.Shape(num_layers=1))
    state = tmp_path / "state"
    state.mkdir(mode=0o700)

    def start(**daemon_keys):
        cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", [
            {"name": "small", "path": str(folder), "gpus": [0], "engine_version": "test"}], **daemon_keys)
        return daemons(cfg, env={"STATE_DIRECTORY": str(state)})
    start.state = state
    return start


def built(folder: artifacts.Folder, files: dict[str, bytes]) -> artifacts.Folder:
    """What an engine's compile writes into its folder."""
    for name, data in files.items():
        path = folder.path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return folder


def contents(folder: artifacts.Folder) -> dict[str, bytes]:
    return {name: (folder.path / name).read_bytes() for name in folder.listing}


@pytest.fixture(autouse=True)
def temp_dir(monkeypatch):
    """The engine's temp dir, where its artifact folders are: this test's own (others may traverse it)."""
    folder = tempfile.mkdtemp(prefix="fast-start-test-tmp-")
    os.chmod(folder, 0o711)
    monkeypatch.setattr(tempfile, "tempdir", folder)
    yield
    shutil.rmtree(folder, ignore_errors=True)


def rebooted() -> None:
    """The temp dir emptied (a reboot, another machine): the engine's folders are gone."""
    shutil.rmtree(artifacts.users_folder())


COMPILED = {"vllm/torch_compile_cache/ab12/rank_0_0/backbone/model.py": b"graph" * 1000,
            "triton/XYZ/kernel.cubin": os.urandom(4096)}


def test_a_set_kept_after_a_first_start_is_handed_to_the_next_start_and_not_sent_again(daemon):
    d = daemon()
    first = artifacts.hand_over(str(d.socket), "small", "k1", SETTINGS)
    assert first.outcome == "miss: no artifacts of small are kept for this user yet" and not first.listing
    assert built(first, COMPILED).keep()
    assert "kept uid" in d.log.read_text()
    second = artifacts.hand_over(str(d.socket), "small", "k1", SETTINGS)
    assert second.outcome == "hit" and contents(second) == COMPILED
    assert second.path == first.path and second.keep() == []       # nothing new: nothing sent
    assert d.log.read_text().count("handed uid") == 1
    rebooted()
    third = artifacts.hand_over(str(d.socket), "small", "k1", SETTINGS)
    assert third.outcome == "hit" and contents(third) == COMPILED and third.path == first.path


def test_the_folder_is_the_same_at_every_start_and_filled_again_where_a_file_went(daemon):
    """vLLM's compile cache names its files by absolute path: each start of a key finds the set
    at the path it was made in. A file removed underneath (a temp cleaner) is brought back."""
    d = daemon()
    first = built(artifacts.hand_over(str(d.socket), "small", "k1", SETTINGS), COMPILED)
    first.keep()
    (first.path / "triton/XYZ/kernel.cubin").unlink()
    again = artifacts.hand_over(str(d.socket), "small", "k1", SETTINGS)
    assert again.path == first.path and again.outcome == "hit" and contents(again) == COMPILED
    other_key = artifacts.hand_over(str(d.socket), "small", "k2", SETTINGS)
    assert other_key.path != first.path and not any(other_key.path.iterdir())


def test_a_start_that_rewrites_its_files_as_they_were_sends_nothing_and_a_new_file_is_named(daemon):
    """vLLM on a GPU touches its cache's files at every start (a lock opened, an entry written
    again as it was): that is no rebuild. A file of a new name, or of another size, is."""
    d = daemon()
    built(artifacts.hand_over(str(d.socket), "small", "k1", SETTINGS), {**COMPILED, "inductor/locks/a.lock": b""})
    artifacts.hand_over(str(d.socket), "small", "k1", SETTINGS).keep()
    again = artifacts.hand_over(str(d.socket), "small", "k1", SETTINGS)
    assert again.outcome == "hit"
    for name in built(again, {**COMPILED, "inductor/locks/a.lock": b""}).listing:
        st = os.stat(again.path / name)
        os.utime(again.path / name, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))      # later, whatever the clock
    assert again.keep() == []
    assert built(again, {"triton/NEW/kernel.cubin": b"k"}).keep() == ["triton/NEW/kernel.cubin"]
    assert d.log.read_text().count("kept uid") == 2


def test_a_kernel_an_engine_compiled_while_it_served_is_kept_by_the_next_start_as_found(daemon):
    """vLLM JIT-compiles some kernels at the first request, after its set was kept (Triton's
    `_topk_log_softmax_kernel` on vLLM 0.26): the next start finds the file in the folder and sends
    it with the set, as found rather than rebuilt; the start after that sends nothing."""
    d = daemon()
    first = built(artifacts.hand_over(str(d.socket), "small", "k1", SETTINGS), COMPILED)
    first.keep()
    late = {"triton/LATE/_topk_log_softmax_kernel.cubin": b"late"}
    built(first, late)                                  # the first engine serves
    second = artifacts.hand_over(str(d.socket), "small", "k1", SETTINGS)
    assert second.outcome == "hit"
    new = second.keep()
    assert new == list(late) and second.made(new) == []
    third = artifacts.hand_over(str(d.socket), "small", "k1", SETTINGS)
    assert third.outcome == "hit" and contents(third) == {**COMPILED, **late} and third.keep() == []
    new = built(third, {"triton/NEW/kernel.cubin": b"k", **dict.fromkeys(late, b"longer")}).keep()
    assert third.made(new) == new == ["triton/LATE/_topk_log_softmax_kernel.cubin", "triton/NEW/kernel.cubin"]


def test_a_folder_of_its_name_made_by_another_user_is_not_used(daemon):
    d = daemon()
    taken = Path(tempfile.gettempdir()) / f"{artifacts.PREFIX}{os.geteuid()}"
    taken.mkdir(mode=0o777)
    taken.chmod(0o777)          # as another user's would be: open to others
    with pytest.raises(artifacts.Unkept, match=f"{taken} is not a folder of this user's closed to others; remove it"):
        artifacts.hand_over(str(d.socket), "small", "k1", SETTINGS)


def test_another_setting_is_a_miss_that_names_it_and_both_sets_stay_kept(daemon):
    d = daemon()
    built(artifacts.hand_over(str(d.socket), "small", "k1", SETTINGS), COMPILED).keep()
    other = {**SETTINGS, "scheduler.max_num_seqs": "128"}
    miss = artifacts.hand_over(str(d.socket), "small", "k2", other)
    assert miss.outcome == ("miss: the artifacts kept of small were made with other settings: "
                            "scheduler.max_num_seqs: kept 256, now 128")
    built(miss, {"vllm/other.py": b"other"}).keep()
    assert artifacts.hand_over(str(d.socket), "small", "k1", SETTINGS).outcome == "hit"
    assert contents(artifacts.hand_over(str(d.socket), "small", "k2", other)) == {"vllm/other.py": b"other"}


def test_a_corrupted_set_is_refused_rebuilt_and_kept_anew(daemon):
    d = daemon()
    built(artifacts.hand_over(str(d.socket), "small", "k1", SETTINGS), COMPILED).keep()
    [tar] = daemon.state.glob("artifacts/gpu0/*/*.tar")
    data = bytearray(tar.read_bytes())
    data[len(data) // 3] ^= 0xFF                   # a flipped bit on the daemon's disk
    tar.write_bytes(bytes(data))
    rebooted()
    refused = artifacts.hand_over(str(d.socket), "small", "k1", SETTINGS)
    assert refused.outcome == "refused: the archive is not the bytes the daemon kept (its SHA-256 differs)"
    assert not any(refused.path.iterdir())                          # nothing of it is used
    assert built(refused, COMPILED).keep()                      # the rebuild replaces it
    rebooted()
    assert contents(artifacts.hand_over(str(d.socket), "small", "k1", SETTINGS)) == COMPILED


OTHERS = {"torch_compile_cache/other-model/rank_0_0/model.py": b"another model's graph",
          "modelinfos/other.json": b"{}"}
MINE = "torch_compile_cache/ab12"


def own_start(d, own: Path, key: str = "k1") -> artifacts.Folder:
    return artifacts.hand_over(str(d.socket), "small", key, SETTINGS, own)


def test_an_engines_own_cache_is_used_as_it_is_and_an_emptied_one_gets_the_set_back(daemon, tmp_path):
    """Where the engine can write its own cache folder (vLLM's `~/.cache/vllm`), a warm one starts
    as it would without fast-start; the set keeps this engine's compile folder and what its start
    added, not other models' files; an emptied one (a container, a reboot) gets the set back,
    and a file the folder has of its own is left as it is."""
    d, own = daemon(), tmp_path / "home-cache-vllm"
    warm = {f"{MINE}/rank_0_0/backbone/model.py": b"graph" * 1000, **OTHERS}
    built(artifacts.Folder("", "", "", {}, own), warm)          # compiled before fast-start was installed
    first = own_start(d, own)
    assert first.path == own and first.outcome == "miss: no artifacts of small are kept for this user yet"
    assert built(first, {"startup_plan/plan.json": b"plan"}).keep((str(own / MINE),)) == [
        "startup_plan/plan.json", f"{MINE}/rank_0_0/backbone/model.py"]
    assert own_start(d, own).outcome == "hit" and own_start(d, own).keep((str(own / MINE),)) == []

    shutil.rmtree(own)
    built(artifacts.Folder("", "", "", {}, own), {"startup_plan/plan.json": b"the engine's own plan"})
    emptied = own_start(d, own)
    assert emptied.outcome == "hit" and sorted(emptied.listing) == ["startup_plan/plan.json",
                                                                     f"{MINE}/rank_0_0/backbone/model.py"]
    assert (own / MINE / "rank_0_0/backbone/model.py").read_bytes() == b"graph" * 1000
    assert (own / "startup_plan/plan.json").read_bytes() == b"the engine's own plan"
    assert not (own / "modelinfos").exists() and sorted(p.name for p in own.iterdir()) == [
        "startup_plan", "torch_compile_cache"]


def test_a_set_kept_in_one_folder_is_a_named_miss_in_another(daemon, tmp_path):
    """vLLM's files name their folder: a set made in one cache folder is not put in another."""
    d = daemon()
    built(own_start(d, tmp_path / "a"), {f"{MINE}/model.py": b"graph"}).keep((str(tmp_path / "a" / MINE),))
    other = own_start(d, tmp_path / "b")
    assert other.outcome.startswith("miss: the artifacts kept of small were made with other settings: cache folder: kept")
    assert other.outcome.endswith(f"{str(tmp_path)[-31:]}/a, now {str(tmp_path)[:24]}...{str(tmp_path)[-31:]}/b")
    assert not any(other.path.iterdir())


def test_a_corrupted_set_adds_nothing_to_an_own_folder(daemon, tmp_path):
    d, own = daemon(), tmp_path / "cache"
    built(own_start(d, own), {f"{MINE}/model.py": b"graph" * 100}).keep((str(own / MINE),))
    [tar] = daemon.state.glob("artifacts/gpu0/*/*.tar")
    data = bytearray(tar.read_bytes())
    data[len(data) // 2] ^= 0xFF
    tar.write_bytes(bytes(data))
    shutil.rmtree(own)
    built(artifacts.Folder("", "", "", {}, own), OTHERS)
    refused = own_start(d, own)
    assert refused.outcome == "refused: the archive is not the bytes the daemon kept (its SHA-256 differs)"
    assert sorted(artifacts._listing(own)) == sorted(OTHERS) and sorted(p.name for p in own.iterdir()) == [
        "modelinfos", "torch_compile_cache"]            # nothing added, nothing left of the unpacking


def test_a_set_whose_archive_is_gone_or_cut_is_dropped_and_the_miss_says_so(daemon):
    d = daemon()
    built(artifacts.hand_over(str(d.socket), "small", "k1", SETTINGS), COMPILED).keep()
    built(artifacts.hand_over(str(d.socket), "small", "k2", SETTINGS), COMPILED).keep()
    first, second = sorted(daemon.state.glob("artifacts/gpu0/*/*.tar"))
    first.unlink()
    os.truncate(second, 100)
    for key in ("k1", "k2"):
        assert artifacts.hand_over(str(d.socket), "small", key, SETTINGS).outcome == \
            "miss: the artifacts kept of small for these settings were damaged and dropped (see the daemon's log)"
    assert list(daemon.state.glob("artifacts/gpu0/*/*")) == []
    assert d.log.read_text().count("dropped uid") == 2


def test_an_archive_reaching_outside_its_folder_is_refused(daemon, tmp_path):
    d = daemon()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("../../escaped")
        info.size = 4
        tar.addfile(info, io.BytesIO(b"evil"))
    keep_raw(d.socket, "k1", buf.getvalue())
    refused = artifacts.hand_over(str(d.socket), "small", "k1", SETTINGS)
    assert refused.outcome == "refused: the archive holds '../../escaped', which is not a file or folder inside it"
    assert not (refused.path.parent.parent / "escaped").exists() and not any(refused.path.iterdir())


def keep_raw(sock: Path, key: str, data: bytes, sha256: str | None = None, send: bytes | None = None):
    """A Keep as a hostile client may send it: its reply (None if the daemon closed instead)."""
    import hashlib
    with connect(sock, 5) as conn:
        protocol.send(conn, protocol.Keep("small", key, SETTINGS, len(data), sha256 or hashlib.sha256(data).hexdigest()))
        try:
            conn.sendall(data if send is None else send)
            if send is not None:
                conn.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        reply, _ = protocol.recv(conn, accept_fds=False)
        return reply


def test_bad_uploads_cost_one_reply_and_leave_no_file(daemon):
    d = daemon(artifacts="1MiB")
    wrong = keep_raw(d.socket, "k1", b"x" * 1000, sha256="0" * 64)
    assert wrong.kind == "error" and "not the bytes their SHA-256 names" in wrong.what
    big = keep_raw(d.socket, "k1", b"x" * (2 << 20))
    assert big.kind == "error" and "up to 1048576 bytes" in big.what
    cut = keep_raw(d.socket, "k1", b"x" * 100_000, send=b"x" * 10)      # stops early, closes its side
    assert cut is None
    assert request(connect(d.socket, 5), protocol.Hello(protocol.VERSION)).kind == "welcome"
    assert list(daemon.state.glob("artifacts/gpu0/*/*")) == []          # no set, no part file
    with pytest.raises(artifacts.Unkept, match="model 'unknown' is not configured here"):
        artifacts.hand_over(str(d.socket), "unknown", "k1", SETTINGS)


def test_the_least_recently_used_sets_go_when_a_user_s_budget_is_full(daemon):
    d = daemon(artifacts="100KiB")
    for key in ("k1", "k2", "k3"):
        built(artifacts.hand_over(str(d.socket), "small", key, SETTINGS), {"a.bin": os.urandom(40 << 10)}).keep()
    assert [artifacts.hand_over(str(d.socket), "small", k, SETTINGS).outcome == "hit"
            for k in ("k1", "k2", "k3")] == [False, True, True]
    assert "dropped 1 set(s) used less recently to stay within 102400 bytes" in d.log.read_text()


def test_sets_survive_the_daemon_and_one_without_a_state_directory_keeps_none(daemon, daemons, tmp_path):
    d = daemon()
    built(artifacts.hand_over(str(d.socket), "small", "k1", SETTINGS), COMPILED).keep()
    d.stop()
    [user] = daemon.state.glob("artifacts/gpu0/*")
    broken_off = [user / ".upload.part", user / "renamed-then-stopped.tar"]     # a stop mid-Keep leaves these
    for path in broken_off:
        path.write_bytes(b"x" * 100)
    d = daemon()
    assert contents(artifacts.hand_over(str(d.socket), "small", "k1", SETTINGS)) == COMPILED
    assert not any(p.exists() for p in broken_off)
    d.stop()
    cfg = write_config(tmp_path / "plain.toml", tmp_path / "run2", [
        {"name": "small", "path": str(tmp_path / "small"), "gpus": [0], "engine_version": "test"}])
    plain = daemons(cfg, env={"STATE_DIRECTORY": ""})
    with pytest.raises(artifacts.Unkept, match="this daemon keeps no artifacts"):
        artifacts.hand_over(str(plain.socket), "small", "k1", SETTINGS)


NOBODY_HANDS_OVER = """
import json, os, sys
from fast_start import artifacts
os.setgroups([]); os.setgid(65534); os.setuid(65534)
folder = artifacts.hand_over(sys.argv[1], "small", "k1", json.loads(sys.argv[2]))
print(folder.outcome)
"""


@root_only
def test_a_set_goes_only_to_the_uid_that_kept_it(tmp_path, daemons, open_dir):
    folder = synth.write_checkpoint(open_dir / "small", synth.Shape(num_layers=1))
    state = tmp_path / "state"
    cfg = write_config(tmp_path / "fs.toml", open_dir / "run", [
        {"name": "small", "path": str(folder), "gpus": [0], "engine_version": "test"}],
        allowed_uids=[pwd.getpwnam("nobody").pw_uid])
    d = daemons(cfg, env={"STATE_DIRECTORY": str(state)})
    built(artifacts.hand_over(str(d.socket), "small", "k1", SETTINGS), COMPILED).keep()      # root's
    out = subprocess.run([sys.executable, "-c", NOBODY_HANDS_OVER, str(d.socket), json.dumps(SETTINGS)],
                         capture_output=True, text=True, env={**ENV, "TMPDIR": str(open_dir)}, timeout=60, cwd="/")
    assert out.stdout.strip() == "miss: no artifacts of small are kept for this user yet", out.stderr


def test_status_says_which_sets_are_kept_and_why_the_last_start_missed(daemon):
    d = daemon()
    built(artifacts.hand_over(str(d.socket), "small", "k1", SETTINGS), COMPILED).keep()
    artifacts.hand_over(str(d.socket), "small", "k2", {**SETTINGS, "vllm": "0.27.0"})
    out = subprocess.run([sys.executable, "-m", "fast_start.cli", "status", "--gpu", "0", "--config", str(d.config)],
                         capture_output=True, text=True, env=ENV, timeout=60)
    assert out.returncode == 0, out.stderr
    line = next(l for l in out.stdout.splitlines() if "kept artifacts" in l)
    assert line.startswith(f"GPU 0 small: uid {os.geteuid()}'s kept artifacts: 1 set(s), ") and \
        "last engine start: missed (the artifacts kept of small were made with other settings: vllm: kept 0.26.0, " \
        "now 0.27.0)" in line, line


def test_status_of_a_daemon_that_kept_nothing_yet_lists_no_sets(daemon, daemons, tmp_path, open_dir):
    d = daemon()
    body = request(connect(d.socket, 5), protocol.Status()).body
    assert body["state"] == "ready" and body["artifacts"] == []
    d.stop()
    cfg = write_config(tmp_path / "plain.toml", open_dir / "run", [
        {"name": "small", "path": str(tmp_path / "small"), "gpus": [0], "engine_version": "test"}],
        allowed_uids=[NOBODY])
    plain = daemons(cfg, env={"STATE_DIRECTORY": ""})
    assert as_nobody_status(plain.socket) == []         # an engine user's status, where nothing can be kept


NOBODY = pwd.getpwnam("nobody").pw_uid
STATUS_AS_NOBODY = """
import json, os, sys
from fast_start import protocol
from fast_start.transport import connect, request
os.setgroups([]); os.setgid(65534); os.setuid(65534)
print(json.dumps(request(connect(sys.argv[1], 5), protocol.Status()).body["artifacts"]))
"""


def as_nobody_status(sock: Path):
    if os.geteuid() != 0:
        pytest.skip("needs root to act as another uid")
    out = subprocess.run([sys.executable, "-c", STATUS_AS_NOBODY, str(sock)], capture_output=True, text=True,
                         env=ENV, timeout=60, cwd="/")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_an_engine_without_a_writable_temp_folder_keeps_its_own_caches(daemon, monkeypatch, tmp_path):
    d = daemon()
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "gone"))
    with pytest.raises(artifacts.Unkept, match="no folder for the artifacts can be made in .*gone"):
        artifacts.hand_over(str(d.socket), "small", "k1", SETTINGS)

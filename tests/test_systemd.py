"""fast-start@.service under a real systemd (PID 1 of a container): readiness, the fd store
across crashes and restarts, config errors, two instances. Needs root and systemd-nspawn."""
from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

import fast_start
from container import Container, available
from fast_start.manifest import checksum

REPO = Path(__file__).resolve().parent.parent
UNIT = REPO / "packaging" / "systemd" / "fast-start@.service"
VENV_BIN = Path(sys.executable).parent
ENGINE = """
import json, sys, fast_start
from fast_start.manifest import checksum
w = fast_start.fetch(fast_start.WeightSpec("/srv/model", engine_version="test"), socket_dir="/run/fast-start")
print(json.dumps({"source": w.source, "sums": {n: checksum(t) for n, t in w.tensors.items()}}))
"""


def installed_unit(tmp: Path) -> Path:
    """The shipped unit with ExecStart pointing at this checkout's entry point."""
    text = UNIT.read_text().replace("/usr/local/bin/fast-start", str(VENV_BIN / "fast-start"))
    path = tmp / "fast-start@.service"
    path.write_text(text)
    return path


def test_unit_verifies_cleanly_and_scores_at_most_1_5(tmp_path):
    if not shutil.which("systemd-analyze"):
        pytest.skip("needs systemd-analyze")
    unit = installed_unit(tmp_path)
    p = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout == "" and p.stderr == "", p.stdout + p.stderr
    p = subprocess.run(["systemd-analyze", "security", "--offline=true", "--threshold=15", str(unit)],
                       capture_output=True, text=True, timeout=120)
    score = float(re.search(r"Overall exposure level for \S+: ([\d.]+)", p.stdout).group(1))
    assert p.returncode == 0 and score <= 1.5, p.stdout[-2000:]


def config_text(bandwidth: str = "0", extra: str = "") -> str:
    return f"""[daemon]
socket_dir = "/run/fast-start"
device = "cpu"
allowed_uids = [0]
fill_bandwidth = "{bandwidth}"
{extra}
[[model]]
name = "llama"
path = "/srv/model"
gpus = [0, 1]
tensor_parallel_size = 2
engine_version = "test"
"""


@pytest.fixture(scope="module")
def box(tmp_path_factory, llama):
    why = available()
    if why:     # in CI these tests must run: a skip there would hide a missing install step
        (pytest.fail if os.environ.get("CI") else pytest.skip)(why)
    tmp = tmp_path_factory.mktemp("systemd")
    model = shutil.copytree(llama, tmp / "model")
    for f in model.iterdir():
        f.chmod(0o644)          # as a download leaves them; safetensors writes 0600
    model.chmod(0o755)          # pytest makes its folders private
    (tmp / "etc").mkdir()
    config = tmp / "etc" / "fast-start.toml"
    config.write_text(config_text())
    dropin = tmp / "dropin"
    dropin.mkdir()
    binds = {str(REPO): str(REPO), str(model): "/srv/model", str(config): "/etc/fast-start/fast-start.toml",
             str(installed_unit(tmp)): "/etc/systemd/system/fast-start@.service",
             str(dropin): "/etc/systemd/system/fast-start@.service.d",
             str(REPO / "packaging" / "sysusers.d" / "fast-start.conf"): "/etc/sysusers.d/fast-start.conf"}
    venv, base = Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve()
    if REPO not in venv.parents:
        binds[str(venv)] = str(venv)        # the environment the tests run in
    if not str(base).startswith("/usr"):
        binds[str(base)] = str(base)        # the interpreter it points at
    # The checkout may live under /tmp, which PrivateTmp= hides from the service: bind it back.
    under_tmp = [p for p in (str(REPO), str(venv), str(base)) if p.startswith("/tmp/")]
    (dropin / "test.conf").write_text("[Service]\nRestartSec=1\n"
                                      + (f"BindReadOnlyPaths={' '.join(under_tmp)}\n" if under_tmp else ""))
    c = Container(tmp, binds)
    c.run("chmod", "755", "/root")          # the service user must reach an interpreter under /root
    c.run("systemd-sysusers")
    c.run("systemctl", "daemon-reload")
    c.tmp, c.model, c.config = tmp, model, config
    yield c
    c.close()


def engine(c) -> dict:
    return json.loads(c.run(sys.executable, "-c", ENGINE).stdout)


def wait_for(cond, timeout=60.0, box=None):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            log = journal(box, "fast-start@0")[-3000:] if box else ""
            raise AssertionError(f"timed out; journal of fast-start@0:\n{log}")
        time.sleep(0.2)


def journal(c, unit) -> str:
    return c.run("journalctl", "-u", unit, "--no-pager", "-o", "cat").stdout


def strip_data(folder: Path) -> dict[str, bytes]:
    """Keep each shard's header, drop its data (returns the originals to put back)."""
    saved = {}
    for f in folder.glob("*.safetensors"):
        saved[f.name] = f.read_bytes()
        n = struct.unpack("<Q", saved[f.name][:8])[0]
        with open(f, "r+b") as fh:
            fh.truncate(8 + n)
    return saved


def restore(folder: Path, saved: dict[str, bytes]) -> None:
    for name, data in saved.items():
        with open(folder / name, "r+b") as fh:
            fh.write(data)


def test_start_waits_for_ready_and_shows_progress(box):
    box.config.write_text(config_text(bandwidth="1MB"))            # rank 0 of the model: ~7 s
    box.run("systemctl", "start", "--no-block", "fast-start@0")
    seen = []
    wait_for(lambda: seen.append(box.show("fast-start@0", "StatusText")) or "filling llama rank 0" in seen[-1], 60, box)
    assert box.show("fast-start@0", "ActiveState") == "activating"
    t0 = time.monotonic()
    box.run("systemctl", "start", "fast-start@0", timeout=180)       # returns once READY=1 arrived
    assert box.show("fast-start@0", "ActiveState") == "active" and time.monotonic() - t0 > 1
    assert box.show("fast-start@0", "StatusText").startswith("ready: 1 model(s)")
    status = json.loads(box.run(str(VENV_BIN / "fast-start"), "status", "--gpu", "0", "--json").stdout)
    assert status[0]["state"] == "ready" and status[0]["models"][0]["name"] == "llama"
    box.config.write_text(config_text())


def test_engine_in_the_container_fetches_from_the_cache(box):
    spec = fast_start.WeightSpec(str(box.model), tensor_parallel_size=2, rank=0, engine_version="test")
    want = {n: checksum(t) for n, t in fast_start.fetch(spec, socket_dir="/nonexistent").tensors.items()}
    got = engine_tp(box)
    assert got["source"] == "cache" and got["sums"] == want
    box.want = want


def engine_tp(c) -> dict:
    code = ENGINE.replace('engine_version="test"', 'tensor_parallel_size=2, rank=0, engine_version="test"')
    return json.loads(c.run(sys.executable, "-c", code).stdout)


def digest(c) -> str:
    out = c.run(str(VENV_BIN / "fast-start"), "fingerprints", "--gpu", "0", "--json").stdout
    return json.loads(out)[0]["models"][0]["digest"]


@pytest.mark.parametrize("how", ["kill -9", "systemctl restart"])
def test_restart_readopts_the_fd_store_without_the_checkpoint(box, how):
    before, pid = digest(box), box.show("fast-start@0", "MainPID")
    assert int(box.show("fast-start@0", "NFileDescriptorStore")) == 2
    saved = strip_data(box.model)                    # reading any tensor would now fail
    try:
        if how == "kill -9":
            restarts = int(box.show("fast-start@0", "NRestarts"))
            box.run("kill", "-9", pid)
            wait_for(lambda: int(box.show("fast-start@0", "NRestarts")) == restarts + 1
                     and box.show("fast-start@0", "ActiveState") == "active", 60, box)
        else:
            box.run("systemctl", "restart", "fast-start@0", timeout=120)
        assert box.show("fast-start@0", "MainPID") != pid
        assert "re-adopted llama rank 0" in journal(box, "fast-start@0")
        assert digest(box) == before
        got = engine_tp(box)
        assert got["source"] == "cache" and got["sums"] == box.want
    finally:
        restore(box.model, saved)


def test_stop_then_start_fills_from_disk(box):
    box.run("systemctl", "stop", "fast-start@0")
    assert int(box.show("fast-start@0", "NFileDescriptorStore")) == 0
    box.run("journalctl", "--rotate", check=False)
    since = box.run("date", "+%Y-%m-%d %H:%M:%S").stdout.strip()
    time.sleep(1)
    box.run("systemctl", "start", "fast-start@0", timeout=180)
    log = box.run("journalctl", "-u", "fast-start@0", "--since", since, "--no-pager", "-o", "cat").stdout
    assert "cached llama rank 0" in log and "re-adopted" not in log
    assert engine_tp(box)["source"] == "cache"


def test_config_error_fails_start_quickly_with_the_error_in_the_journal(box):
    box.config.write_text(config_text(extra="colour = 3"))
    try:
        t0 = time.monotonic()
        p = box.run("systemctl", "start", "fast-start@1", check=False, timeout=120)
        assert p.returncode != 0 and time.monotonic() - t0 < 30
        assert "[daemon] has unknown key 'colour'" in journal(box, "fast-start@1")
    finally:
        box.config.write_text(config_text())
        box.run("systemctl", "reset-failed", "fast-start@1", check=False)


def test_two_instances_side_by_side_and_stopping_one_keeps_the_other(box):
    box.run("systemctl", "start", "fast-start@0", "fast-start@1", timeout=180)
    assert box.run("test", "-S", "/run/fast-start/gpu1.sock", check=False).returncode == 0
    box.run("systemctl", "stop", "fast-start@1")
    assert box.run("test", "-S", "/run/fast-start/gpu0.sock", check=False).returncode == 0
    assert box.run("test", "-e", "/run/fast-start/gpu1.sock", check=False).returncode != 0
    assert engine_tp(box)["source"] == "cache"

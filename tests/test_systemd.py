"""fast-start@.service under a real systemd (PID 1 of a container): readiness, the fd store
across crashes and restarts (a 5 MB manifest set included), engines of another user, reload,
config errors, two instances. Needs root and systemd-nspawn. Each test puts the unit into the
state it needs, so any one of them runs alone."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import fast_start
from container import Container, RunEnv, available
from devtools import synth
from fast_start.arena import checksum

pytestmark = pytest.mark.slow      # boots systemd in containers

REPO = Path(__file__).resolve().parent.parent
UNIT = REPO / "packaging" / "systemd" / "fast-start@.service"
VENV_BIN = Path(sys.executable).parent
FAST_START = str(VENV_BIN / "fast-start")
# Prints where the weights came from and every tensor's checksum (or the error).
ENGINE = """
import json, sys, fast_start
from fast_start.arena import checksum
path, tp, rank = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
try:
    w = fast_start.fetch(fast_start.WeightSpec(path, tensor_parallel_size=tp, rank=rank, engine_version="test"),
                         socket_dir="/run/fast-start", fallback=sys.argv[4] == "fallback")
except fast_start.FastStartError as e:
    print(json.dumps({"error": str(e)}))
else:
    print(json.dumps({"source": w.source, "sums": {n: checksum(t) for n, t in w.tensors.items()}}))
"""
# The size of the manifest the daemon sends for a model (what re-adoption hands its worker).
MANIFEST_SIZE = """
import json, sys
from fast_start import protocol
from fast_start.transport import connect, request
from fast_start.fingerprint import WeightSpec, fingerprint
from fast_start.watch import identity
with connect("/run/fast-start/gpu0.sock", 10) as conn:
    request(conn, protocol.Hello(protocol.VERSION))
    reply, fds = request(conn, protocol.Acquire(fingerprint(WeightSpec(sys.argv[1], engine_version="test")).to_dict(),
                                                "copy", identity(sys.argv[1]), manifest="json"), with_fds=True)
print(len(json.dumps(reply.manifest)))
"""
# A Qwen3-MoE of 128 experts in 76 layers, tiny tensors: 29,000 of them, a 5.4 MB manifest.
MOE = synth.Shape(architecture="Qwen3MoeForCausalLM", hidden_size=64, num_layers=76, num_heads=2, num_kv_heads=1,
                  head_dim=32, intermediate_size=64, vocab_size=256, num_experts=128, moe_intermediate_size=32)
# Users for engines: one listed in allowed_uids, one not.
TEST_USERS = 'u engine - "an engine"\nu stranger - "someone else"\n'


def installed_unit(tmp: Path) -> Path:
    """The shipped unit with ExecStart pointing at this checkout's entry point."""
    text = UNIT.read_text().replace("/usr/local/bin/fast-start", FAST_START)
    path = tmp / "fast-start@.service"
    path.write_text(text)
    return path


def test_unit_verifies_cleanly_and_scores_at_most_1_5(tmp_path):
    if not shutil.which("systemd-analyze"):
        pytest.skip("needs systemd-analyze")
    unit = installed_unit(tmp_path)
    # --man=no: Documentation= names fast-start(8), which the Debian package installs (test_deb reads it)
    p = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and p.stdout == "" and p.stderr == "", p.stdout + p.stderr
    p = subprocess.run(["systemd-analyze", "security", "--offline=true", "--threshold=15", str(unit)],
                       capture_output=True, text=True, timeout=120)
    score = float(re.search(r"Overall exposure level for \S+: ([\d.]+)", p.stdout).group(1))
    assert p.returncode == 0 and score <= 1.5, p.stdout[-2000:]


LLAMA = """
[[model]]
name = "llama"
path = "/srv/model"
gpus = [0, 1]
tensor_parallel_size = 2
engine_version = "test"
"""
MOE_MODEL = """
[[model]]
name = "moe"
path = "/srv/moe"
gpus = [0]
engine_version = "test"
"""


def config_text(bandwidth: str = "0", extra: str = "", models: str = LLAMA) -> str:
    return f"""[daemon]
socket_dir = "/run/fast-start"
device = "cpu"
fill_bandwidth = "{bandwidth}"
{extra}
{models}"""


def readable(folder: Path) -> Path:
    for f in folder.iterdir():
        f.chmod(0o644)          # as a download leaves them; safetensors writes 0600
    folder.chmod(0o755)         # pytest makes its folders private
    return folder


@pytest.fixture(scope="module")
def box(tmp_path_factory, llama):
    why = available()
    if why:     # in CI these tests must run: a skip there would hide a missing install step
        (pytest.fail if os.environ.get("CI") else pytest.skip)(why)
    tmp = tmp_path_factory.mktemp("systemd")
    model = readable(shutil.copytree(llama, tmp / "model"))
    moe = readable(synth.write_checkpoint(tmp / "moe", MOE, files=4, reuse=True))
    (tmp / "etc").mkdir()
    config = tmp / "etc" / "fast-start.toml"
    config.write_text(config_text())
    users = tmp / "etc" / "test-users.conf"
    users.write_text(TEST_USERS)
    dropin = tmp / "dropin"
    dropin.mkdir()
    binds = {str(model): "/srv/model", str(moe): "/srv/moe",
             str(config): "/etc/fast-start/fast-start.toml",
             str(installed_unit(tmp)): "/etc/systemd/system/fast-start@.service",
             str(dropin): "/etc/systemd/system/fast-start@.service.d",
             str(REPO / "packaging" / "sysusers.d" / "fast-start.conf"): "/etc/sysusers.d/fast-start.conf",
             str(users): "/etc/sysusers.d/test-users.conf"}
    env = RunEnv(REPO)
    binds.update(env.binds)
    (dropin / "test.conf").write_text("[Service]\nRestartSec=1\n" + env.service_dropin)
    c = Container(tmp, binds)
    env.open_to_others(c)
    c.run("systemd-sysusers")
    c.run("systemctl", "daemon-reload")
    c.tmp, c.model, c.moe, c.config, c.run_env = tmp, model, moe, config, env
    spec = fast_start.WeightSpec(str(model), tensor_parallel_size=2, rank=0, engine_version="test")
    c.want = sums(fast_start.fetch(spec, socket_dir="/nonexistent"))
    yield c
    c.close()


def sums(weights) -> dict[str, str]:
    return {n: checksum(t) for n, t in weights.tensors.items()}


def ready(c, text: str | None = None) -> None:
    """fast-start@0 active with the config `text` (the default one when left out)."""
    text = text or config_text()
    if c.config.read_text() != text or c.show("fast-start@0", "ActiveState") != "active":
        c.config.write_text(text)
        c.run("systemctl", "restart", "fast-start@0", timeout=300)
    assert c.show("fast-start@0", "ActiveState") == "active", journal(c, "fast-start@0")[-3000:]


def engine(c, path: str = "/srv/model", tp: int = 2, user: str | None = None, fallback: bool = False) -> dict:
    run_as = ["setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups"] if user else []
    out = c.run(*run_as, sys.executable, "-c", ENGINE, path, str(tp), "0", "fallback" if fallback else "strict",
                timeout=300).stdout
    return json.loads(out)


def wait_for(cond, timeout=60.0, box=None):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            log = journal(box, "fast-start@0")[-3000:] if box else ""
            raise AssertionError(f"timed out; journal of fast-start@0:\n{log}")
        time.sleep(0.2)


def journal(c, unit) -> str:
    return c.run("journalctl", "-u", unit, "--no-pager", "-o", "cat").stdout


def journal_since(c, unit, cursor: str) -> str:
    return c.run("journalctl", "-u", unit, f"--after-cursor={cursor}", "--no-pager", "-o", "cat").stdout


def now(c) -> str:
    """The journal's cursor now: what `journal_since` reads after."""
    out = c.run("journalctl", "-n", "1", "--show-cursor", "--no-pager").stdout
    return out.strip().rsplit("-- cursor: ", 1)[1]


def status(c) -> dict:
    return json.loads(c.run(FAST_START, "status", "--gpu", "0", "--json", check=False).stdout)[0]


def digest(c) -> str:
    out = c.run(FAST_START, "fingerprints", "--gpu", "0", "--json").stdout
    return json.loads(out)[0]["models"][0]["digest"]


def crash_or_restart(c, how: str) -> None:
    pid = c.show("fast-start@0", "MainPID")
    if how == "kill -9":
        restarts = int(c.show("fast-start@0", "NRestarts"))
        c.run("kill", "-9", pid)
        wait_for(lambda: int(c.show("fast-start@0", "NRestarts")) == restarts + 1
                 and c.show("fast-start@0", "ActiveState") == "active", 120, c)
    else:
        c.run("systemctl", "restart", "fast-start@0", timeout=300)
    assert c.show("fast-start@0", "MainPID") != pid


def test_start_waits_for_ready_and_shows_progress(box):
    box.run("systemctl", "stop", "fast-start@0")
    box.config.write_text(config_text(bandwidth="1MB"))            # rank 0 of the model: ~7 s
    box.run("systemctl", "start", "--no-block", "fast-start@0")
    seen = []
    wait_for(lambda: seen.append(box.show("fast-start@0", "StatusText")) or "filling llama rank 0" in seen[-1], 60, box)
    assert box.show("fast-start@0", "ActiveState") == "activating"
    t0 = time.monotonic()
    box.run("systemctl", "start", "fast-start@0", timeout=180)       # returns once READY=1 arrived
    assert box.show("fast-start@0", "ActiveState") == "active" and time.monotonic() - t0 > 1
    assert box.show("fast-start@0", "StatusText").startswith("ready: 1 model(s)")
    s = status(box)
    assert s["state"] == "ready" and s["models"][0]["name"] == "llama"
    box.config.write_text(config_text())


def test_engine_in_the_container_fetches_from_the_cache(box):
    ready(box)
    got = engine(box)
    assert got["source"] == "cache" and got["sums"] == box.want


# A fill at this rate would take hours: a unit that is active again within the test's timeout
# re-adopted its cache without reading the checkpoint (changing it changes no fingerprint).
CRAWL = "1KB"


@pytest.mark.parametrize("how", ["kill -9", "systemctl restart"])
def test_restart_readopts_the_fd_store_without_reading_the_checkpoint(box, how):
    ready(box)
    before = digest(box)
    assert int(box.show("fast-start@0", "NFileDescriptorStore")) == 2
    since = now(box)
    box.config.write_text(config_text(bandwidth=CRAWL))
    try:
        crash_or_restart(box, how)
        log = journal_since(box, "fast-start@0", since)
        assert "re-adopted llama rank 0" in log and "cached llama" not in log
        assert digest(box) == before
        got = engine(box)
        assert got["source"] == "cache" and got["sums"] == box.want
    finally:
        ready(box)


def test_kill_9_readopts_a_5_mb_manifest_set(box):
    try:
        ready(box, config_text(models=LLAMA + MOE_MODEL))
        size = int(box.run(sys.executable, "-c", MANIFEST_SIZE, "/srv/moe").stdout)
        assert size >= 5_000_000
        want = sums(fast_start.fetch(fast_start.WeightSpec(str(box.moe), engine_version="test"),
                                     socket_dir="/nonexistent"))
        assert len(want) > 29_000
        since = now(box)
        box.config.write_text(config_text(bandwidth=CRAWL, models=LLAMA + MOE_MODEL))
        crash_or_restart(box, "kill -9")
        log = journal_since(box, "fast-start@0", since)
        assert "re-adopted moe rank 0" in log and "cached moe" not in log, log[-3000:]
        got = engine(box, "/srv/moe", tp=1)
        assert got["source"] == "cache" and got["sums"] == want
    finally:
        ready(box)


def test_stop_then_start_fills_from_disk(box):
    ready(box)
    box.run("systemctl", "stop", "fast-start@0")
    assert int(box.show("fast-start@0", "NFileDescriptorStore")) == 0
    since = now(box)
    box.run("systemctl", "start", "fast-start@0", timeout=180)
    log = journal_since(box, "fast-start@0", since)
    assert "cached llama rank 0" in log and "re-adopted" not in log
    assert engine(box)["source"] == "cache"


def test_an_engine_of_another_user_fetches_under_the_shipped_unit(box):
    uid = int(box.run("id", "-u", "engine").stdout)
    stranger = int(box.run("id", "-u", "stranger").stdout)
    try:
        ready(box, config_text(extra=f"allowed_uids = [{uid}]"))
        assert box.run("stat", "-c", "%a %U", "/run/fast-start").stdout.split() == ["755", "fast-start"]
        assert box.run("stat", "-c", "%a", "/run/fast-start/gpu0.sock").stdout.strip() == "666"
        got = engine(box, user="engine")
        assert got["source"] == "cache" and got["sums"] == box.want
        refused = engine(box, user="stranger")
        assert f"uid {stranger} may not use this daemon" in refused["error"]
        p = box.run("setpriv", "--reuid=engine", "--regid=engine", "--init-groups", FAST_START, "evict", "--gpu",
                    "0", "--all", check=False)
        assert p.returncode == 1 and f"uid {uid} may not evict" in p.stderr
        assert "refused connection from pid" in journal(box, "fast-start@0")
    finally:
        ready(box)


def test_systemctl_reload_adds_and_removes_models_without_a_restart(box):
    ready(box)
    pid, before = box.show("fast-start@0", "MainPID"), status(box)
    second = LLAMA.replace('"llama"', '"llama-v2"').replace('"test"', '"v2"')
    try:
        box.config.write_text(config_text(models=LLAMA + second))
        box.run("systemctl", "reload", "fast-start@0")
        # The reload has been read when systemctl returns (ExecReload waits): llama-v2 is configured.
        now = status(box)
        assert {m["name"] for m in now["models"] + now["missing"]} == {"llama", "llama-v2"}, now
        assert now["reloads"] == 1 + before["reloads"]
        wait_for(lambda: len(status(box).get("models", [])) == 2, 120, box)
        assert box.show("fast-start@0", "MainPID") == pid
        assert engine(box)["source"] == "cache"
    finally:
        box.config.write_text(config_text())
        box.run("systemctl", "reload", "fast-start@0")
    wait_for(lambda: [m["name"] for m in status(box).get("models", [])] == ["llama"], 60, box)
    assert box.show("fast-start@0", "MainPID") == pid


def test_a_reload_with_a_rejected_config_fails_and_the_running_one_keeps_serving(box):
    ready(box)
    pid = box.show("fast-start@0", "MainPID")
    try:
        box.config.write_text(config_text(extra="colour = 3"))
        p = box.run("systemctl", "reload", "fast-start@0", check=False, timeout=120)
        assert p.returncode != 0
        assert box.show("fast-start@0", "ActiveState") == "active" and box.show("fast-start@0", "MainPID") == pid
        errors = box.run("journalctl", "-p", "err", "-u", "fast-start@0", "--no-pager", "-o", "cat").stdout
        assert "[daemon] has unknown key 'colour'" in errors, errors[-2000:]
        assert engine(box)["source"] == "cache"
    finally:
        box.config.write_text(config_text())
    assert box.run("systemctl", "reload", "fast-start@0", check=False).returncode == 0


def test_check_config_as_root_also_checks_as_the_unit_would(box):
    """Run as root outside the unit, check-config passes for what root can reach, and also checks
    as fast-start@0 and @1 would: a checkpoint only root can read (0600) fails as the unit's
    User=, and a worker interpreter under /tmp is named hidden by the unit's PrivateTmp=."""
    def check() -> tuple[int, dict[str, dict]]:
        p = box.run(FAST_START, "check-config", "--json", "--config", "/etc/fast-start/fast-start.toml",
                    check=False, timeout=300)
        return p.returncode, {r["check"]: r for r in json.loads(p.stdout)}

    code, rows = check()
    assert code == 0, rows
    assert rows["fast-start@0.service"]["detail"] == "models and workers readable as User=fast-start"
    box.run("cp", "-r", "/srv/model", "/srv/secret")
    box.run("sh", "-c", "chmod 0600 /srv/secret/*")
    box.run("sh", "-c", f"printf '#!/bin/sh\\nexec {sys.executable} \"$@\"\\n' > /tmp/engine-python")
    box.run("chmod", "755", "/tmp/engine-python")
    secret = LLAMA.replace('"llama"', '"secret"').replace("/srv/model", "/srv/secret")
    box.config.write_text(config_text(extra='worker_python = "/tmp/engine-python"', models=LLAMA + secret))
    try:
        code, rows = check()
        assert code == 2
        assert rows["model secret"]["ok"] and rows["worker /tmp/engine-python"]["ok"]     # as root
        unreadable = rows["fast-start@0.service: model secret"]
        assert not unreadable["ok"] and unreadable["detail"].startswith("as User=fast-start: ")
        assert "Permission denied" in unreadable["detail"] and "/srv/secret" in unreadable["detail"]
        for gpu, name in ((0, "llama"), (1, "secret")):
            hidden = rows[f"fast-start@{gpu}.service: worker {name}"]
            assert not hidden["ok"] and "/tmp/engine-python is hidden from the unit by PrivateTmp=yes" in hidden["detail"]
        assert "fast-start@0.service: model llama" not in rows
    finally:
        box.config.write_text(config_text())
        box.run("rm", "-rf", "/srv/secret", "/tmp/engine-python")


def test_check_config_fails_what_the_unit_cannot_use_and_takes_a_relative_path(box):
    """As root: a socket_dir under the unit's PrivateTmp=, a metrics folder ProtectSystem=strict
    leaves read-only, a model whose files link into a hidden blob store, and an empty file each
    fail check-config, as the unit would fail them; a relative --config is read as given."""
    def check(*args: str, cwd: str = "/") -> tuple[int, dict[str, dict]]:
        p = box.run("sh", "-c", f"cd {cwd} && {FAST_START} check-config --json " + " ".join(args), check=False,
                    timeout=300)
        return p.returncode, {r["check"]: r for r in json.loads(p.stdout)}

    code, rows = check("--config", "fast-start.toml", cwd="/etc/fast-start")
    assert code == 0, rows
    box.run("mkdir", "-p", "/tmp/blobs", "/srv/snap", "/var/lib/prometheus/node-exporter")
    box.run("sh", "-c", "for f in /srv/model/*; do cp $f /tmp/blobs/; ln -s /tmp/blobs/$(basename $f) /srv/snap/; done")
    snap = LLAMA.replace('"llama"', '"snap"').replace("/srv/model", "/srv/snap")
    box.config.write_text(config_text(models=LLAMA + snap).replace('socket_dir = "/run/fast-start"',
                                                                  'socket_dir = "/tmp/fs-run"\nmetrics_file = '
                                                                  '"/var/lib/prometheus/node-exporter/fs-{gpu}.prom"'))
    try:
        code, rows = check("--config", "/etc/fast-start/fast-start.toml")
        assert code == 2, rows
        for gpu in (0, 1):
            unit = f"fast-start@{gpu}.service"
            assert "/tmp/fs-run is hidden from the unit by PrivateTmp=yes" in rows[f"{unit}: socket_dir"]["detail"]
            assert "/tmp/blobs/" in rows[f"{unit}: model snap"]["detail"], rows
            assert rows[f"{unit}: metrics_file"]["detail"] == (
                "the unit sees /var/lib/prometheus/node-exporter read-only (ProtectSystem=strict): add a drop-in with "
                "ReadWritePaths=/var/lib/prometheus/node-exporter (systemctl edit fast-start@.service)")
        assert f"{unit}: model llama" not in rows
        box.config.write_text("")
        code, rows = check("--config", "/etc/fast-start/fast-start.toml")
        assert code == 2 and not rows["config"]["ok"] and "no [[model]]" in rows["config"]["detail"]
    finally:
        box.config.write_text(config_text())
        box.run("rm", "-rf", "/srv/snap", "/tmp/blobs", "/var/lib/prometheus")


@pytest.mark.parametrize("extra,reason", [("colour = 3", "[daemon] has unknown key 'colour'"),
                                          ('memory_budget = "1MB"', "more than memory_budget '1MB'"),
                                          ('worker_python = "/usr/bin/true"', "the fill worker /usr/bin/true")],
                         ids=["unknown key", "budget", "worker"])
def test_a_config_error_ends_the_unit_failed_with_the_reason_at_priority_err(box, extra, reason):
    """Found as the config loads, by the worker reading the model, or a worker that cannot run:
    exit status 2, which the unit's RestartPreventExitStatus= keeps from restarting (no loop), and
    the reason in the journal at priority err."""
    box.config.write_text(config_text(extra=extra))
    try:
        t0 = time.monotonic()
        p = box.run("systemctl", "start", "fast-start@1", check=False, timeout=120)
        assert p.returncode != 0 and time.monotonic() - t0 < 30
        state = {k: box.show("fast-start@1", k) for k in ("ActiveState", "SubState", "NRestarts", "ExecMainStatus")}
        assert state == {"ActiveState": "failed", "SubState": "failed", "NRestarts": "0", "ExecMainStatus": "2"}
        errors = box.run("journalctl", "-p", "err", "-u", "fast-start@1", "--no-pager", "-o", "cat").stdout
        assert reason in errors, errors[-2000:]
    finally:
        box.config.write_text(config_text())
        box.run("systemctl", "reset-failed", "fast-start@1", check=False)


VICTIM = """
[[model]]
name = "victim"
path = "/srv/victim"
gpus = [0]
engine_version = "test"
"""


def test_a_removed_model_folder_and_a_restart_keep_the_other_models_cache(box):
    """`rm -rf` of one served model's folder, then `systemctl restart`: the unit comes back active
    with its fd store, and engines of the other model hit without a fill."""
    box.run("cp", "-a", "/srv/model", "/srv/victim")
    try:
        ready(box, config_text(models=LLAMA + VICTIM))
        box.run("rm", "-rf", "/srv/victim")
        since = now(box)
        box.config.write_text(config_text(bandwidth=CRAWL, models=LLAMA + VICTIM))    # a fill would never end
        crash_or_restart(box, "systemctl restart")
        assert box.show("fast-start@0", "ActiveState") == "active"
        assert int(box.show("fast-start@0", "NFileDescriptorStore")) > 0
        log = journal_since(box, "fast-start@0", since)
        assert "re-adopted llama rank 0" in log and "cached llama" not in log, log[-3000:]
        got = engine(box)
        assert got["source"] == "cache" and got["sums"] == box.want
    finally:
        box.run("rm", "-rf", "/srv/victim")
        ready(box)


def test_a_model_folder_the_unit_cannot_read_fails_that_model_alone_without_a_restart_loop(box):
    """A shard the service user cannot read: the unit starts with the other model cached, never
    restarts, and the reason is in the journal at priority err; `status` exits 1 naming it."""
    box.run("cp", "-a", "/srv/model", "/srv/victim")
    box.run("sh", "-c", "chmod 0600 /srv/victim/*.safetensors")
    try:
        box.run("systemctl", "stop", "fast-start@0")
        box.config.write_text(config_text(models=LLAMA + VICTIM))
        box.run("systemctl", "start", "fast-start@0", timeout=180)
        state = {k: box.show("fast-start@0", k) for k in ("ActiveState", "NRestarts")}
        assert state == {"ActiveState": "active", "NRestarts": "0"}
        assert "victim failed" in box.show("fast-start@0", "StatusText")
        errors = box.run("journalctl", "-p", "err", "-u", "fast-start@0", "--no-pager", "-o", "cat").stdout
        assert "victim cannot be filled: cannot read /srv/victim/" in errors and "Permission denied" in errors, errors
        s = status(box)
        assert [m["name"] for m in s["models"]] == ["llama"] and s["missing"][0]["state"] == "failed"
        assert engine(box)["source"] == "cache"
    finally:
        box.run("rm", "-rf", "/srv/victim")
        ready(box)


def test_two_instances_side_by_side_and_stopping_one_keeps_the_other(box):
    ready(box)
    box.run("systemctl", "start", "fast-start@1", timeout=180)
    assert box.run("test", "-S", "/run/fast-start/gpu1.sock", check=False).returncode == 0
    box.run("systemctl", "stop", "fast-start@1")
    assert box.run("test", "-S", "/run/fast-start/gpu0.sock", check=False).returncode == 0
    assert box.run("test", "-e", "/run/fast-start/gpu1.sock", check=False).returncode != 0
    assert engine(box)["source"] == "cache"


VLLM_MODEL = """
[[model]]
name = "llama-vllm"
path = "/srv/model"
gpus = [0]
layout = "vllm"
engine_version = "auto"
"""


def test_vllm_fills_its_own_model_under_the_shipped_unit(box):
    """layout "vllm": the fill worker runs vLLM inside the hardened unit (a torch.distributed world
    of one, caches in the unit's CacheDirectory=) and the daemon serves what it filled."""
    if not os.environ.get("CI"):
        pytest.importorskip("vllm")
    try:
        ready(box, config_text(models=LLAMA + VLLM_MODEL))
        cached = {m["name"]: m for m in status(box)["models"]}
        assert "llama-vllm" in cached, cached
        log = journal(box, "fast-start@0")
        assert "llama-vllm is filled by" in log and "vllm 0." in log and "cached llama-vllm rank 0" in log
        assert "Loading safetensors checkpoint shards" not in log          # no progress bar in the journal
        records = box.run("journalctl", "-u", "fast-start@0", "--no-pager", "-o", "json",
                          "--output-fields=MESSAGE,PRIORITY").stdout.splitlines()
        warned = [r["PRIORITY"] for r in map(json.loads, records) if "Enforce eager set" in str(r.get("MESSAGE"))]
        assert warned and set(warned) == {"4"}, warned          # vLLM's warnings at warning, not info
    finally:
        ready(box)


def vllm_service(c, tag: str) -> tuple[dict, str]:
    """tests/vllm_engine.py (vLLM's defaults: torch.compile on) as a systemd service under the
    sandbox an engine's unit would have: its $HOME read-only, its /tmp private. Its report and log."""
    args = {"model": "/srv/model", "tp": 1, "load_format": "fast_start", "eager": False, "out": f"/srv/{tag}.json",
            "extra": {"socket_dir": "/run/fast-start", "fallback": False}}
    binds = ["-p", c.run_env.service_dropin.strip()] if c.run_env.service_dropin else []    # a checkout under /tmp
    p = c.run("systemd-run", "--wait", "--pipe", "--collect", "--quiet", f"--unit=engine-{tag}", *binds,
              "-p", "ProtectHome=read-only", "-p", "PrivateTmp=yes", "-E", "VLLM_USE_AOT_COMPILE=0",
              sys.executable, str(REPO / "tests" / "vllm_engine.py"), json.dumps(args), timeout=600)
    return json.loads(c.run("cat", f"/srv/{tag}.json").stdout), p.stdout + p.stderr


def test_an_engine_service_with_a_read_only_home_starts_from_the_artifacts_the_unit_kept(box):
    """vLLM compiles at its first start as a service whose $HOME it cannot write; fast-start@0 keeps
    what it compiled (in its StateDirectory=, the engine user's alone) and the next start begins
    from it, compiling nothing (VLLM_USE_AOT_COMPILE=0: vLLM 0.32's CPU build cannot load its
    AOT-compiled functions back, test_vllm_artifacts.py)."""
    if not os.environ.get("CI"):
        pytest.importorskip("vllm")
    try:
        ready(box, config_text(models=LLAMA + VLLM_MODEL))
        (first, first_log), (second, second_log) = vllm_service(box, "first"), vllm_service(box, "second")
        assert first["ranks"][0]["source"] == second["ranks"][0]["source"] == "cache"
        assert first["tokens"] == second["tokens"]
        assert "the daemon keeps this engine's artifacts" in first_log, first_log[-3000:]
        assert "vLLM starts from the artifacts the daemon kept" in second_log, second_log[-3000:]
        assert "vLLM added to the kept artifacts" not in second_log
        kept = box.run("sh", "-c", "stat -c '%a %U' /var/lib/fast-start/artifacts/gpu0/0 "
                                   "/var/lib/fast-start/artifacts/gpu0/0/*.tar").stdout.split("\n")
        assert kept[:2] == ["700 fast-start", "600 fast-start"], kept
        shown = box.run(FAST_START, "status", "--gpu", "0").stdout
        assert "llama-vllm: uid 0's kept artifacts: 1 set(s)" in shown and "last engine start: handed over" in shown
    finally:
        ready(box)


def test_evictions_survive_a_restart_and_fill_refills_without_one(box):
    """Under the shipped unit: the eviction history lives in StateDirectory= across a restart,
    and `fast-start fill` brings an evicted model back while the unit keeps running."""
    ready(box)
    try:
        box.run(FAST_START, "evict", "--gpu", "0", "--model", "llama")
        evicted = json.loads(box.run(FAST_START, "evictions", "--json").stdout)[0]["evictions"][-1]
        assert (evicted["model"], evicted["reason"]) == ("llama", "manual")
        pid = box.show("fast-start@0", "MainPID")
        assert box.run(FAST_START, "status", check=False).returncode == 1          # configured, not cached
        p = box.run(FAST_START, "fill", "--gpu", "0", "--model", "llama", "--wait", "240", timeout=300)
        assert "filled llama" in p.stdout and box.show("fast-start@0", "MainPID") == pid
        assert engine(box)["source"] == "cache"
        box.run("systemctl", "restart", "fast-start@0", timeout=300)
        history = json.loads(box.run(FAST_START, "evictions", "--json").stdout)[0]["evictions"]
        assert evicted in history           # recorded by the process before the restart (earlier tests' too)
        assert box.run("stat", "-c", "%a %U", "/var/lib/fast-start").stdout.split() == ["700", "fast-start"]
    finally:
        ready(box)

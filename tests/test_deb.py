"""The Debian package (packaging/deb) under a real systemd: built twice (`packaging/deb/build`,
what `make deb` runs; lintian must report no errors), installed with apt in a container whose
/usr and /var are throwaway overlays of the host's, fast-start@0 started on Debian's python3
with the fill worker in the test's venv (worker_python), an engine served; then an upgrade by
`dpkg -i` of the second build, which restarts the instance and keeps its cache (the fd store);
then a purge that leaves nothing of the package behind. Needs root, systemd-nspawn and the
Debian build tools (`make system-deps` installs them)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import fast_start
from container import Container, RunEnv, available
from fast_start import protocol
from test_control_plane import fast_start_copy
from test_systemd import engine, journal, journal_since, now, readable, sums, wait_for

pytestmark = pytest.mark.slow      # builds the Debian package and installs it in a container

REPO = Path(__file__).resolve().parent.parent
VERSION = fast_start.__version__
UPGRADE = f"{VERSION}+1"
OLD_PROTOCOL = protocol.VERSION - 1
# A fill at this rate would take hours: an instance that is active again with the model cached
# re-adopted it from the fd store.
CONFIG = """[daemon]
socket_dir = "/run/fast-start"
device = "cpu"
worker_python = "{python}"
fill_bandwidth = "{bandwidth}"

[[model]]
name = "llama"
path = "/srv/model"
gpus = [0]
tensor_parallel_size = 2
engine_version = "test"
"""
# Everything the package installs or its instances make; none of it may outlive a purge.
PATHS = ["/usr/bin/fast-start", "/usr/lib/python3/dist-packages/fast_start",
         f"/usr/lib/python3/dist-packages/fast_start-{VERSION}.dist-info", "/lib/systemd/system/fast-start@.service",
         "/usr/lib/sysusers.d/fast-start.conf", "/etc/fast-start", "/usr/share/man/man8/fast-start.8.gz",
         "/usr/share/bash-completion/completions/fast-start", "/usr/share/doc/fast-start", "/usr/share/fast-start",
         "/var/lib/fast-start",
         "/var/cache/fast-start", "/run/fast-start", "/etc/systemd/system/multi-user.target.wants/fast-start@0.service"]


def build_tools_missing() -> str | None:
    missing = [t for t in ("dpkg-buildpackage", "dh", "dh_python3", "lintian") if not shutil.which(t, path="/usr/bin")]
    if not Path("/usr/share/perl5/Debian/Debhelper/Buildsystem/pybuild.pm").exists():
        missing.append("dh-python")
    return f"needs {', '.join(missing)} (`make system-deps` installs them as root)" if missing else None


@pytest.fixture(scope="session")      # test_runbook installs the same packages
def debs(tmp_path_factory):
    why = available() or build_tools_missing()
    if why:     # in CI these tests must run: a skip there would hide a missing install step
        (pytest.fail if os.environ.get("CI") else pytest.skip)(why)
    out = tmp_path_factory.mktemp("deb")
    built = {}
    for version in (VERSION, UPGRADE):
        p = subprocess.run([str(REPO / "packaging" / "deb" / "build"), str(out), version],
                           capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        assert "E: " not in p.stdout + p.stderr            # lintian: no errors (warnings are listed in the README)
        built[version] = out / f"fast-start_{version}_all.deb"
        assert built[version].is_file()
    return built


@pytest.fixture(scope="module")
def box(debs, tmp_path_factory, llama):
    tmp = tmp_path_factory.mktemp("debbox")
    env = RunEnv(REPO)
    model = readable(shutil.copytree(llama, tmp / "model"))
    conf = tmp / "conf"
    conf.mkdir()
    for name, python, bandwidth in (("normal.toml", sys.executable, "0"), ("crawl.toml", sys.executable, "1KB"),
                                    ("old-worker.toml", "/opt/old-engine/bin/python", "1KB")):
        (conf / name).write_text(CONFIG.format(python=python, bandwidth=bandwidth))
    old_site = fast_start_copy(tmp / "old-site", "0.1.9", OLD_PROTOCOL)
    dropin = tmp / "dropin"
    dropin.mkdir()
    (dropin / "test.conf").write_text("[Service]\nRestartSec=1\n" + env.service_dropin)
    binds = {str(model): "/srv/model", str(conf): "/srv/conf", str(dropin): "/etc/systemd/system/fast-start@.service.d",
             str(old_site): "/srv/old-site"}
    c = apt_container(tmp, env, debs, binds)
    c.want = sums(fast_start.fetch(fast_start.WeightSpec(str(model), tensor_parallel_size=2, rank=0,
                                                         engine_version="test"), socket_dir="/nonexistent"))
    yield c
    c.close()


def apt_container(tmp: Path, env: RunEnv, debs: dict, binds: dict[str, str]) -> Container:
    """A container booted with systemd whose /usr and /var are throwaway overlays of the host's
    (apt installs there), with the checkout and its environment (`env`), the built packages at
    /srv/debs and `binds`."""
    c = Container(tmp, {**env.binds, str(debs[VERSION].parent): "/srv/debs", **binds}, overlays=("/usr", "/var"))
    # The host's users and groups next to the container's own: the dpkg database (the host's)
    # names some of them.
    for table in ("passwd", "group"):
        have = {line.split(":")[0] for line in c.run("cat", f"/etc/{table}").stdout.splitlines()}
        missing = "".join(line + "\n" for line in Path(f"/etc/{table}").read_text().splitlines()
                          if line.split(":")[0] not in have)
        c.run("sh", "-c", f"cat >> /etc/{table} <<'EOF'\n{missing}EOF")
    env.open_to_others(c)
    return c


def installed_version(c) -> str:
    return c.run("dpkg-query", "-W", "-f", "${Status} ${Version}", "fast-start", check=False).stdout


def test_install_start_serve_upgrade_and_purge(box, debs):
    c = box
    apt = c.run("env", "DEBIAN_FRONTEND=noninteractive", "apt-get", "install", "-y",
                f"/srv/debs/{debs[VERSION].name}", check=False, timeout=300)
    assert apt.returncode == 0, apt.stdout[-3000:] + apt.stderr[-3000:]
    assert installed_version(c) == f"install ok installed {VERSION}"

    # What the package put where: Debian's python3 runs the CLI; the conffile, the user, the
    # man page and the completion are there.
    assert c.run("head", "-1", "/usr/bin/fast-start").stdout.strip() == "#!/usr/bin/python3"
    assert c.run("fast-start", "--version").stdout.strip() == f"fast-start {VERSION}"
    assert "/etc/fast-start/fast-start.toml" in c.run("dpkg-query", "-W", "-f", "${Conffiles}", "fast-start").stdout
    assert c.run("getent", "passwd", "fast-start").stdout.startswith("fast-start:")
    man = c.run("zcat", "/usr/share/man/man8/fast-start.8.gz").stdout
    assert man.startswith(".TH FAST\\-START 8") and "/usr/share/doc/fast\\-start/RUNBOOK.md.gz" in man
    runbook = c.run("zcat", "/usr/share/doc/fast-start/RUNBOOK.md.gz").stdout
    assert runbook == (REPO / "RUNBOOK.md").read_text()
    for doc in ("operations.md", "vllm.md"):      # the pages the runbook and the unit point to
        assert c.run("zcat", f"/usr/share/doc/fast-start/{doc}.gz").stdout == (REPO / "docs" / doc).read_text()
    words = c.run("bash", "-c", "source /usr/share/bash-completion/completions/fast-start; "
                  "COMP_WORDS=(fast-start evict --a); COMP_CWORD=2; _fast_start_completion fast-start; "
                  'echo "${COMPREPLY[@]}"').stdout.split()
    assert "--all" in words
    assert "ExecStart=/usr/bin/fast-start daemon" in c.run("systemctl", "cat", "fast-start@0").stdout

    # The engine side with no index (the container has no network): the package's wheel into a
    # fresh venv, at exactly the daemon's version, its vLLM plugin registered.
    c.run("/usr/bin/python3", "-m", "venv", "/opt/engine")
    done = c.run("fast-start", "install-engine", "/opt/engine/bin/python", "--json", check=False, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    got = json.loads(done.stdout)
    assert got["version"] == VERSION and got["file"].startswith("/opt/engine/lib/python3")
    assert got["plugin"] == ["fast_start.plugins.vllm.loader:register"]
    assert c.run("/opt/engine/bin/python", "-c", "import fast_start; print(fast_start.__version__)"
                 ).stdout.strip() == VERSION

    # Started with the shipped conffile (device "cuda", on a machine without the NVIDIA driver; its
    # model folder, missing too, would fail that model alone): the daemon refuses the start for a
    # reason it names, so the unit ends failed at once (no restart loop), the reason at priority err.
    t0 = time.monotonic()
    assert c.run("systemctl", "start", "fast-start@0", check=False, timeout=120).returncode != 0
    assert time.monotonic() - t0 < 10
    assert [c.show("fast-start@0", k) for k in ("ActiveState", "NRestarts")] == ["failed", "0"]
    errors = c.run("journalctl", "-p", "err", "-u", "fast-start@0", "-o", "cat", "--no-pager").stdout
    assert "cannot load the CUDA driver (libcuda.so.1)" in errors, errors[-2000:]
    c.run("systemctl", "reset-failed", "fast-start@0")

    # Configured by the operator (the conffile replaced), started, READY, serving.
    c.run("cp", "/srv/conf/normal.toml", "/etc/fast-start/fast-start.toml")
    c.run("systemctl", "enable", "fast-start@0")
    c.run("systemctl", "start", "fast-start@0", timeout=300)
    assert c.show("fast-start@0", "ActiveState") == "active", journal(c, "fast-start@0")[-3000:]
    assert c.run("fast-start", "status", "--gpu", "0").returncode == 0
    got = engine(c)
    assert got["source"] == "cache" and got["sums"] == c.want
    # Through journald's native protocol (python3-systemd): every record names its GPU, a model's
    # its model and fingerprint, for filters and alerts.
    lines = c.run("journalctl", "-u", "fast-start@0", "FAST_START_MODEL=llama", "-o", "json", "--no-pager").stdout
    cached = [e for e in map(json.loads, lines.splitlines()) if e["MESSAGE"].startswith("cached llama rank 0")]
    assert cached and cached[-1]["FAST_START_GPU"] == "0" and cached[-1]["PRIORITY"] == "6"
    digest = json.loads(c.run("fast-start", "fingerprints", "--gpu", "0", "--json").stdout)
    assert cached[-1]["FAST_START_FINGERPRINT"] in json.dumps(digest)

    # An upgrade while a worker environment still has a fast-start of another protocol: the new
    # daemon could not verify its re-adopted cache there, so the package leaves the instance
    # running on the old version and names the environment and the steps.
    pid = c.show("fast-start@0", "MainPID")
    c.run("/usr/bin/python3", "-m", "venv", "--without-pip", "/opt/old-engine")
    c.run("sh", "-c", "echo /srv/old-site > $(/opt/old-engine/bin/python -c "
          "'import sysconfig; print(sysconfig.get_path(\"purelib\"))')/old-fast-start.pth")
    c.run("cp", "/srv/conf/old-worker.toml", "/etc/fast-start/fast-start.toml")
    up = c.run("env", "DEBIAN_FRONTEND=noninteractive", "dpkg", "-i", f"/srv/debs/{debs[UPGRADE].name}",
               check=False, timeout=300)
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    assert "instances keep the old version for now" in up.stdout and "restarting" not in up.stdout, up.stdout
    assert f"protocol {OLD_PROTOCOL}" in up.stdout and "install-engine" in up.stdout, up.stdout
    assert c.show("fast-start@0", "MainPID") == pid and c.run("fast-start", "status", "--gpu", "0").returncode == 0

    # Upgrade: the package restarts the instance on the new code, which takes its cache back from
    # the fd store (at 1 KB/s a fill would not end within the test's time); the operator's
    # config is kept without a question.
    c.run("cp", "/srv/conf/crawl.toml", "/etc/fast-start/fast-start.toml")
    pid, since = c.show("fast-start@0", "MainPID"), now(c)
    assert int(c.show("fast-start@0", "NFileDescriptorStore")) >= 1
    up = c.run("env", "DEBIAN_FRONTEND=noninteractive", "dpkg", "-i", f"/srv/debs/{debs[UPGRADE].name}",
               check=False, timeout=300)
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    assert "restarting the running fast-start@N instances" in up.stdout
    assert installed_version(c) == f"install ok installed {UPGRADE}"
    wait_for(lambda: c.show("fast-start@0", "MainPID") not in ("0", pid)
             and c.show("fast-start@0", "ActiveState") == "active", 120, c)
    log = journal_since(c, "fast-start@0", since)
    assert "re-adopted llama rank 0" in log and "cached llama" not in log, log[-3000:]
    assert c.run("cmp", "/srv/conf/crawl.toml", "/etc/fast-start/fast-start.toml").returncode == 0
    got = engine(c)
    assert got["source"] == "cache" and got["sums"] == c.want

    # Purge: the instance stopped (its cache freed), nothing of the package left; the system
    # user stays, as Debian leaves them.
    purge = c.run("env", "DEBIAN_FRONTEND=noninteractive", "apt-get", "purge", "-y", "fast-start", check=False,
                  timeout=300)
    assert purge.returncode == 0, purge.stdout[-3000:] + purge.stderr[-3000:]
    assert "not-installed" in installed_version(c) or installed_version(c) == ""
    left = [p for p in PATHS if c.run("test", "-e", p, check=False).returncode == 0]
    assert not left, left
    assert c.show("fast-start@0", "ActiveState") == "inactive"
    assert c.show("fast-start@0", "LoadState") == "not-found"
    assert c.run("pgrep", "-u", "fast-start", check=False).returncode == 1     # no process of the service user

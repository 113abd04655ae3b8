"""A real systemd as PID 1 in a container (systemd-nspawn), for the unit's tests.

`Container` boots `systemd-nspawn -D / --volatile=yes` (the host's /usr read-only, a fresh tmpfs
root) from a cgroup of its own, binds in what the tests name, and runs commands inside with
`nsenter`. It is torn down (poweroff, then SIGKILL, then its cgroups removed) by `close()`,
which also runs at interpreter exit so an interrupted test run leaves nothing behind.
"""
from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


class RunEnv:
    """The checkout and the Python environment the tests run in, as a container needs them: bound
    in at their own paths, reachable by other users, and visible to a unit despite PrivateTmp=."""

    def __init__(self, repo: Path):
        venv, base = Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve()
        self.binds = {str(repo): str(repo)}
        if repo not in venv.parents:
            self.binds[str(venv)] = str(venv)        # the environment the tests run in
        if not str(base).startswith("/usr"):
            self.binds[str(base)] = str(base)        # the interpreter it points at
        self.folders = {p for p in (repo, venv, base) if not str(p).startswith("/usr")}
        # The checkout may live under /tmp, which PrivateTmp= hides from a service: bind it back.
        under_tmp = sorted(str(p) for p in (repo, venv, base) if str(p).startswith("/tmp/"))
        self.service_dropin = f"BindReadOnlyPaths={' '.join(under_tmp)}\n" if under_tmp else ""

    def open_to_others(self, c: "Container") -> None:
        """Let every user of the container reach the interpreter and the checkout."""
        for folder in self.folders:
            for parent in [folder, *folder.parents][:-1]:
                c.run("chmod", "o+x", str(parent), check=False)   # a read-only bind keeps its own mode


def available() -> str | None:
    """Why the container cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root"
    if not shutil.which("systemd-nspawn"):
        return "needs systemd-nspawn (package systemd-container; `make test` installs it as root)"
    return None


class Container:
    def __init__(self, workdir: Path, binds: dict[str, str], readonly: bool = True, overlays: tuple[str, ...] = ()):
        self.workdir, self.name = workdir, f"fs-ci-{os.getpid()}-{time.monotonic_ns() % 10**6}"
        self.cgroups = [CGROUP_ROOT / h / self.name for h in ("unified", "systemd") if (CGROUP_ROOT / h).is_dir()]
        for cg in self.cgroups:
            cg.mkdir(exist_ok=True)
        join = "; ".join(f"echo $$ > {cg}/cgroup.procs" for cg in self.cgroups)
        flag = "--bind-ro" if readonly else "--bind"
        # overlays: host folders made writable inside, their changes thrown away with the container
        bind_args = " ".join([*(f"{flag}={src}:{dst}" for src, dst in binds.items()),
                              *(f"--overlay={path}::{path}" for path in overlays)])
        # nspawn makes sub-cgroups where it starts: a cgroup of our own keeps the host's clean.
        script = (f"{join}; exec systemd-nspawn --register=no --keep-unit -D / --volatile=yes --private-network "
                  f"-M {self.name} {bind_args} -b --console=pipe systemd.mask=systemd-firstboot.service")
        self.log = workdir / "container.log"
        with open(self.log, "w") as log:
            self.launcher = subprocess.Popen(["bash", "-c", script], stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True)
        atexit.register(self.close)
        self.pid = self._find_pid1()
        self._wait(lambda: self.run("test", "-S", "/run/systemd/private", check=False).returncode == 0, 30)
        state = self.run("systemctl", "is-system-running", "--wait", check=False, timeout=90).stdout.strip()
        if state not in ("running", "degraded"):
            raise RuntimeError(f"container did not boot ({state}):\n{self.log.read_text()[-3000:]}")

    def _find_pid1(self) -> int:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                children = Path(f"/proc/{self.launcher.pid}/task/{self.launcher.pid}/children").read_text().split()
            except OSError:
                children = []
            for child in children:
                if Path(f"/proc/{child}/comm").read_text().strip() == "systemd":
                    return int(child)
            if self.launcher.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"systemd-nspawn did not start systemd:\n{self.log.read_text()[-3000:]}")

    @staticmethod
    def _wait(cond, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError("condition not met in time")
            time.sleep(0.1)

    def run(self, *cmd: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        """Run a command inside the container (all namespaces) and return its result."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("FAST_START_")}   # the container's own
        p = subprocess.run(["nsenter", "-t", str(self.pid), "-a", *cmd], capture_output=True, text=True,
                           timeout=timeout, env=env)
        if check and p.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} -> {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
        return p

    def show(self, unit: str, prop: str) -> str:
        return self.run("systemctl", "show", "-P", prop, unit).stdout.strip()

    def close(self) -> None:
        if self.launcher.poll() is None:
            self.run("systemctl", "poweroff", check=False, timeout=30)
            try:
                self.launcher.wait(15)
            except subprocess.TimeoutExpired:
                for pid in (self.pid, self.launcher.pid):   # PID 1 of the container takes its namespace down
                    try:
                        os.kill(pid, 9)
                    except ProcessLookupError:
                        pass
                self.launcher.wait(10)
        for cg in self.cgroups:
            for sub in sorted(cg.rglob("*"), key=lambda p: -len(p.parts)):
                if sub.is_dir():
                    try:
                        sub.rmdir()
                    except OSError:
                        pass
            try:
                cg.rmdir()
            except OSError:
                pass
        atexit.unregister(self.close)

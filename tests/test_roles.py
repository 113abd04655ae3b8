"""Engines' roles as their workers tell the daemon (serving, standby, waking): shown by `status`,
and a standby woken after its model's serving engine died counted as a failover, timed, in the
journal and the metrics. Real engine processes holding zero_copy leases of a real daemon."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from probe import ask, status, wait_until
from devtools.harness import write_config
from fast_start import protocol
from fast_start.errors import FastStartError
from fast_start.transport import connect, request

# Maps the model in zero_copy, then tells each role read from stdin, one per line.
ENGINE = textwrap.dedent("""
    import sys, fast_start
    from fast_start.client import tell_role
    w = fast_start.fetch(fast_start.WeightSpec(sys.argv[1], engine_version="test"), socket_dir=sys.argv[2],
                         fallback=False)
    print("mapped", w.lease, flush=True)
    for line in sys.stdin:
        tell_role(w, line.strip())
        print("told", flush=True)
""")


class Engine:
    def __init__(self, small: Path, run: Path):
        self.proc = subprocess.Popen([sys.executable, "-c", ENGINE, str(small), str(run)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        said = self.proc.stdout.readline().split()
        assert said[0] == "mapped", said
        self.pid, self.lease = self.proc.pid, int(said[1])

    def tell(self, *roles: str) -> None:
        for role in roles:
            self.proc.stdin.write(role + "\n")
            self.proc.stdin.flush()
            assert self.proc.stdout.readline().strip() == "told"

    def kill(self, d) -> None:
        self.proc.kill()
        self.proc.wait(60)
        wait_until(lambda: self.pid not in roles_of(d), 60, f"pid {self.pid}'s lease ended")


def roles_of(d) -> dict[int, str]:
    return {lease["pid"]: lease["role"] for lease in status(d)["leases"]}


@pytest.fixture
def served(tmp_path, small, daemons):
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", [
        {"name": "small", "path": str(small), "gpus": [0], "engine_version": "test"}])
    engines: list[Engine] = []

    def engine() -> Engine:
        engines.append(Engine(small, tmp_path / "run"))
        return engines[-1]
    yield daemons(cfg), engine, cfg
    for e in engines:
        e.proc.kill()
        e.proc.wait(60)


def test_a_standby_woken_after_the_serving_engine_died_is_a_failover_in_status_metrics_and_log(served):
    d, engine, cfg = served
    primary, standby = engine(), engine()
    standby.tell("standby")
    assert roles_of(d) == {primary.pid: "serving", standby.pid: "standby"}
    shown = subprocess.run([Path(sys.executable).parent / "fast-start", "status", "--config", cfg],
                           capture_output=True, text=True, timeout=60)
    assert f"{primary.pid}:zero_copy {standby.pid}:zero_copy:standby" in shown.stdout, shown.stdout + shown.stderr
    assert "failover" not in shown.stdout

    primary.kill(d)
    standby.tell("waking")
    assert roles_of(d) == {standby.pid: "waking"}
    standby.tell("serving")
    s = status(d)
    assert s["failovers"] == 1 and s["leases"][0]["role"] == "serving"
    last = s["last_failover"]
    assert (last["model"], last["died"], last["serving"]) == ("small", primary.pid, standby.pid)
    assert 0 <= last["seconds"] < 600
    assert re.search(rf"failover: small's serving engine \(pid {primary.pid}\) died; standby pid {standby.pid} "
                     r"serving \d+\.\d{3} s later", d.log.read_text())
    samples = ask(d, protocol.Metrics())["samples"]
    assert ["fast_start_failovers_total", {"gpu": "0", "model": "small"}, 1] in samples
    shown = subprocess.run([Path(sys.executable).parent / "fast-start", "status", "--config", cfg],
                           capture_output=True, text=True, timeout=60)
    assert re.search(rf"GPU 0: 1 failover\(s\); the last \d+ s ago: small's serving engine \(pid {primary.pid}\) "
                     rf"died, standby pid {standby.pid} serving \d+\.\d{{3}} s later", shown.stdout), \
        shown.stdout + shown.stderr


def test_no_failover_without_a_serving_engine_s_death(served):
    """A standby woken by hand, or after another standby died, or one that went to sleep after the
    death, ends no failover."""
    d, engine, _ = served
    primary, first, second = engine(), engine(), engine()
    first.tell("standby", "waking", "serving")                  # woken by hand: the primary still serves
    second.tell("standby")
    first.tell("standby")
    first.kill(d)                                               # a standby died
    second.tell("waking", "serving")
    assert status(d)["failovers"] == 0
    primary.kill(d)                                             # a serving engine died ...
    late = engine()
    late.tell("standby", "waking", "serving")                   # ... before this one stood by
    s = status(d)
    assert s["failovers"] == 0 and "last_failover" not in s
    assert roles_of(d) == {second.pid: "serving", late.pid: "serving"}


def test_a_role_for_another_s_lease_or_no_role_is_refused_and_the_daemon_serves_on(served):
    d, engine, _ = served
    holder = engine()
    for lease, role, error in [(holder.lease, "standby", f"lease {holder.lease} is not held by pid {os.getpid()}"),
                               (999, "serving", f"lease 999 is not held by pid {os.getpid()}")]:
        with connect(d.socket, 5) as conn:
            request(conn, protocol.Hello(protocol.VERSION))
            with pytest.raises(FastStartError, match=re.escape(error)):
                request(conn, protocol.Role(lease, role))
    holder.proc.stdin.write("asleep\n")
    holder.proc.stdin.flush()
    assert holder.proc.stdout.readline().strip() == "told"     # the engine goes on: its warning is logged
    assert roles_of(d) == {holder.pid: "serving"}
    holder.proc.send_signal(signal.SIGKILL)
    holder.proc.wait(60)
    assert status(d)["state"] == "ready"

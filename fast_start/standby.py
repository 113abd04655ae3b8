"""An engine with a hot standby: `python -m fast_start.supervise --standby HOST:PORT -- vllm serve MODEL ...`.

A restart, even from a warm interpreter and kept artifacts, pays the engine's per-process GPU
work again (loading its compiled graphs, capturing CUDA graphs: 11 s of a 19 s restart on an
H100). A standby pays it before the crash. The supervisor runs two engines of the one command,
each forked from the warm interpreter and listening on a Unix socket of its own (`--uds`, in a
folder of the supervisor's): the serving engine, to which the front (`fast_start.front`) joins
every connection made to HOST:PORT, and the standby, which started the same way (with
`--load-format fast_start` in `zero_copy`, on the daemon's weights: no second copy) and then
sleeps (vLLM's level-1 sleep, its scheduler paused). Each engine is told what it starts as
(`STARTS_AS`): the standby's KV cache has its addresses but no memory of its own until it wakes
(`plugins/vllm/standby_kv.py`), so it starts beside a serving engine that holds the GPU at
vLLM's usual `gpu_memory_utilization`. When the serving engine dies, the front holds new
connections, the dead engine's processes are killed and reaped (its memory is the standby's KV
cache's), the standby is woken (its KV cache backed, its graphs valid), and the front joins the
connections to it; a new standby starts. A death is that of the engine's server (the forked
child) or of a process of its group titled as vital (`VITAL`: vLLM's engine core and workers);
a helper that ends on its own is not one. Roles and each failover are one line each on stderr (the unit's journal).
Both engines answer only from the daemon's weights: a command that would let a miss load from
disk is refused (`off_the_cache`).

vLLM's `/sleep` and `/wake_up` need `VLLM_SERVER_DEV_MODE=1`, which the supervisor sets: they
are reachable through the public address too, so keep it where only trusted clients reach.
"""
from __future__ import annotations

import http.client
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from .forked import WINDOW_S, Failures, child, children, own_group, say, stops_held

STARTING, STANDBY, SERVING = "starting", "standby", "serving"
STARTS_AS = "FAST_START_STARTS_AS"      # what a forked engine starts as: SERVING, or STANDBY (its KV cache light)
POLL_S = 0.2        # how often a starting engine is asked whether it listens yet
VITAL = (b"VLLM::",)     # titles of the processes an engine cannot serve without (engine core, workers)


class UnixHTTP(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.unix_path)


def ask(path: str, method: str, url: str, timeout: float = 60.0) -> int:
    """The status of one HTTP request to the engine listening at `path` (0: it does not listen)."""
    conn = UnixHTTP(path, timeout)
    try:
        conn.request(method, url)
        return conn.getresponse().status
    except OSError:
        return 0
    finally:
        conn.close()


@dataclass
class Engine:
    pid: int
    socket: str
    starts_as: str
    role: str = STARTING
    watched: dict[int, int] = field(default_factory=dict)      # pidfd -> pid: its server and vital processes

    def watch(self) -> None:
        """Watch the engine's server and the processes of its group that it cannot serve without
        (`VITAL`); a helper that ends on its own (a compile worker) is not a death."""
        for pid in group_of(self.pid):
            if pid not in self.watched.values() and vital(pid):
                try:
                    self.watched[os.pidfd_open(pid)] = pid
                except ProcessLookupError:
                    pass

    def close(self) -> None:
        for fd in self.watched:
            os.close(fd)
        self.watched.clear()


def off_the_cache(command: list[str]) -> str:
    """Why engines of `command` could answer from weights other than the daemon's ("" if they
    cannot): a standby serves only the cache's, so a miss must fail the engine, not load from disk."""
    given: dict[str, str] = {}
    for i, word in enumerate(command):
        name, eq, value = word.partition("=")
        name = name.replace("_", "-")
        if name in ("--load-format", "--model-loader-extra-config"):
            given[name] = value if eq else (command[i + 1] if i + 1 < len(command) else "")
    try:
        extra = json.loads(given.get("--model-loader-extra-config") or "{}")
    except ValueError:
        extra = None
    if given.get("--load-format") != "fast_start" or not isinstance(extra, dict) or extra.get("fallback") is not False:
        return ("a standby serves only the daemon's weights, and these engines would load from disk on a miss: "
                "add --load-format fast_start --model-loader-extra-config '{\"fallback\": false}' (with the "
                "config's other keys) to the engine's command")
    return ""


def vital(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().startswith(VITAL)
    except OSError:
        return False


def group_of(leader: int) -> list[int]:
    """The processes of `leader`'s process group."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getpgid(int(entry)) == leader:
                    out.append(int(entry))
            except ProcessLookupError:
                continue
    return out


class Standby:
    def __init__(self, main, argv: list[str], listen: tuple[str, int], restarts: int):
        self.main, self.argv, self.restarts = main, argv, restarts
        self.failures = Failures()
        self.code = 0
        self.engines: list[Engine] = []
        self.started = 0
        self.stopping = False
        self.front = self._front(listen)            # first: an address it cannot listen on leaves nothing behind
        self.folder = tempfile.mkdtemp(prefix="fast-start-standby-")
        self.front_fd = os.pidfd_open(self.front.pid)
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(self.wake_w)

    def _front(self, listen: tuple[str, int]) -> subprocess.Popen:
        family = socket.AF_INET6 if ":" in listen[0] else socket.AF_INET
        try:
            sock = socket.create_server(listen, family=family, backlog=1024)
        except OSError as e:
            raise SystemExit(f"fast-start: cannot listen on {listen[0]}:{listen[1]} for --standby: "
                             f"{os.strerror(e.errno)}; give a free address (another server on the port?)") from None
        say(f"listening on {listen[0] or '*'}:{listen[1]}; connections wait there for the serving engine")
        front = subprocess.Popen([sys.executable, "-m", "fast_start.front", str(sock.fileno())],
                                 stdin=subprocess.PIPE, text=True, pass_fds=[sock.fileno()])
        sock.close()
        return front

    def point(self, engine: Engine | None) -> None:
        self.front.stdin.write(f"serve {engine.socket}\n" if engine else "hold\n")
        self.front.stdin.flush()

    def fork(self) -> Engine | None:
        """A new engine, or None where a stop came first (its handler may run just before the block:
        an engine forked after it would never be told to stop)."""
        self.started += 1
        path = os.path.join(self.folder, f"engine-{self.started}.sock")
        starts_as = STANDBY if self.serving() else SERVING
        with stops_held():          # a stop now waits until this engine is recorded, then reaches it too
            if self.stopping:
                return None
            pid = os.fork()
            if pid == 0:
                self._child(path, starts_as)
            own_group(pid)
            engine = Engine(pid, path, starts_as)
            engine.watched[os.pidfd_open(pid)] = pid
            self.engines.append(engine)
        return engine

    def _child(self, path: str, starts_as: str) -> None:
        """The forked engine: none of the supervisor's descriptors, told what it starts as."""
        signal.set_wakeup_fd(-1)
        for fd in (self.wake_r, self.wake_w, self.front_fd, self.front.stdin.fileno()):
            os.close(fd)
        for other in self.engines:
            other.close()
        os.environ[STARTS_AS] = starts_as
        child(self.main, [*self.argv, "--uds", path],
              f"engine {os.getpid()} starting from the warm interpreter ({starts_as} once it listens)")

    def serving(self) -> Engine | None:
        return next((e for e in self.engines if e.role == SERVING), None)

    def settle(self, engine: Engine) -> None:
        """A starting engine that listens: one started as the standby goes to sleep, and serves at
        once (woken) if the serving engine died meanwhile; the other serves."""
        engine.watch()
        if engine.starts_as == SERVING:
            self.serve(engine)
            return
        started = time.monotonic()
        if ask(engine.socket, "POST", "/sleep?level=1") != 200:
            self.died(engine, "it did not go to sleep")
            return
        engine.role = STANDBY
        say(f"engine {engine.pid} standing by (asleep in {time.monotonic() - started:.2f} s)")
        if self.serving() is None and not self.wake(engine):
            say(f"the standby {engine.pid} did not wake; starting another")

    def serve(self, engine: Engine) -> None:
        engine.role = SERVING
        self.point(engine)
        say(f"engine {engine.pid} serving")

    def wake(self, engine: Engine) -> bool:
        """Wake the standby (its KV cache backed again) and serve from it; False: it is buried."""
        if ask(engine.socket, "POST", "/wake_up") != 200:
            self.bury(engine)
            return False
        self.serve(engine)
        return True

    def fail_over(self, dead: Engine, why: str) -> bool:
        """The serving engine died: the front holds new connections until the standby is awake.
        Whether the standby serves."""
        noticed = time.monotonic()
        self.point(None)
        self.bury(dead)         # first: its memory is the standby's KV cache's
        standby = next((e for e in self.engines if e.role == STANDBY), None)
        if standby is None:
            say(f"engine {dead.pid} died ({why}) with no standby ready; the next engine that listens serves")
        elif not self.wake(standby):
            say(f"engine {dead.pid} died ({why}) and the standby {standby.pid} did not wake; starting another")
        else:
            say(f"failover: engine {dead.pid} died ({why}); standby {standby.pid} serving "
                f"{time.monotonic() - noticed:.2f} s later")
            return True
        return False

    def bury(self, engine: Engine) -> None:
        """Kill and reap every process of the engine's group, and every orphan an engine left (one
        that left its group and whose parent died: the supervisor, their subreaper, is its parent)."""
        self.engines.remove(engine)
        keep = {e.pid for e in self.engines} | {self.front.pid}
        while True:
            orphans = [pid for pid in children() if pid not in keep]
            for pid in (-engine.pid, *orphans):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                os.waitpid(-engine.pid, 0)
                continue
            except ChildProcessError:
                pass
            if not orphans:
                break
            for pid in orphans:
                try:
                    os.waitpid(pid, 0)
                except ChildProcessError:
                    pass
        engine.close()

    def step(self) -> None:
        """Wait for a death, a signal, or (while an engine starts) the next look at it; act on it."""
        starting = [e for e in self.engines if e.role == STARTING]
        ready = self._poll([self.wake_r, self.front_fd, *(fd for e in self.engines for fd in e.watched)],
                           POLL_S if starting else None)
        self._drain()
        if self.front_fd in ready and not self.stopping:
            self.give_up(f"the front ended ({self.front.wait()}); the supervisor ends with the engines")
        for engine in list(self.engines):
            ended = [engine.watched[fd] for fd in ready if fd in engine.watched]
            if ended and engine in self.engines and not self.stopping:
                self.died(engine, f"its process {ended[0]} ended")
        for engine in starting:
            if engine in self.engines and ask(engine.socket, "GET", "/health", timeout=POLL_S * 10) == 200:
                self.settle(engine)
        if not self.stopping and len(self.engines) < 2 and not any(e.role == STARTING for e in self.engines):
            self.fork()

    def died(self, engine: Engine, why: str) -> None:
        """A failover that served is no failure: the address answered throughout. Every other
        death (a standby's, a starting engine's, a serving one's that no standby took over)
        counts toward `--restarts`."""
        if engine.role == SERVING:
            if self.fail_over(engine, why):
                return
        else:
            say(f"engine {engine.pid} ({engine.role}) died ({why}); starting another")
            self.bury(engine)
        failed = self.failures.add()
        if failed > self.restarts:
            self.give_up(f"engines died {failed} times in {WINDOW_S // 60} minutes; the supervisor ends and "
                         "leaves the next restart to systemd")

    def give_up(self, line: str) -> None:
        say(line)
        self.forward(signal.SIGKILL, None)
        self.code = 1

    def run(self) -> int:
        self.fork()
        while not self.stopping:
            self.step()
        return self.stop()

    @staticmethod
    def _poll(fds: list[int], timeout_s: float | None) -> list[int]:
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        return [fd for fd, _ in poller.poll(None if timeout_s is None else timeout_s * 1000)]

    def _drain(self) -> None:
        try:
            while os.read(self.wake_r, 64):
                pass
        except BlockingIOError:
            pass

    def forward(self, sig: int, _frame) -> None:
        """systemctl stop: every engine gets the signal; the supervisor ends once they have."""
        self.stopping = True
        for engine in self.engines:
            try:
                os.killpg(engine.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self) -> int:
        codes = []
        for engine in list(self.engines):
            _, status = os.waitpid(engine.pid, 0)
            codes.append(os.waitstatus_to_exitcode(status))
            self.bury(engine)
        self.front.stdin.close()
        self.front.wait()
        shutil.rmtree(self.folder, ignore_errors=True)
        return self.code or next(iter(codes), 0)

"""An engine restarted from a warm interpreter: `python -m fast_start.supervise [--preload MODULE]... -- vllm serve ...`.

A crashed engine's restart pays its imports again (`import vllm`: 8-12 s on the GPU machine, the
largest term of a restart that starts from kept weights and artifacts). The supervisor imports the
command's console script and the modules it names once (`PRELOAD` for vLLM's server), without
touching CUDA, then runs the engine in a forked child. When the engine dies (a crash, an OOM kill,
`kill -9`), every process it left is killed and reaped (its GPU memory freed) and a new child is
forked from the same untouched interpreter: the restart starts where `import vllm` ended. vLLM's
engine process is forked from it too (`ENV`), not spawned as `vllm serve` does by default.

It stays the unit's main process: the engine keeps the unit's cgroup, sandbox and user, `systemctl
stop` (SIGTERM, SIGINT) reaches the engine, and the supervisor ends as the engine did. An
engine that ends cleanly ends the supervisor; one that fails more than `--restarts` times in
`WINDOW_S` ends it as the engine ended, and systemd's `Restart=` decides. Stdlib only.
`--standby HOST:PORT` keeps a second engine asleep to take over instead (`fast_start.standby`);
a failover that served counts toward no `--restarts` limit.
"""
from __future__ import annotations

import argparse
import ctypes
import importlib
import os
import runpy
import signal
import sys
import time
from importlib.metadata import entry_points

from .forked import STOPS, WINDOW_S, Failures, child, children, own_group, say, stops_held

PRELOAD = {"vllm": ("vllm.entrypoints.cli.serve", "vllm.entrypoints.openai.api_server",   # `vllm serve`'s imports
                    "vllm.v1.engine.core")}
# Unless the operator set them: `vllm serve` spawns its engine process (a fresh interpreter that
# imports vLLM again, 15 s on the GPU machine) unless told to fork it from the warm one.
ENV = {"vllm": {"VLLM_WORKER_MULTIPROC_METHOD": "fork"}}
PR_SET_CHILD_SUBREAPER = 36


def engine(command: list[str]):
    """(the callable that runs `command`, its argv, the package it comes from): a console script
    (`vllm serve ...`; a path's file name counts) or, as Python takes it, `-m MODULE ...`."""
    if command[0] == "-m" and len(command) > 1:
        module = command[1]
        if "." in module:       # its package: the module itself is a script, run only in the child
            importlib.import_module(module.rpartition(".")[0])
        return (lambda: _run_module(module)), command[1:], module.split(".")[0]
    name = os.path.basename(command[0])
    found = entry_points(group="console_scripts", name=name)
    if not found:
        raise SystemExit(f"fast-start: no console script named {name!r} in this Python ({sys.executable}); give the "
                         "engine's command as its script (`vllm serve ...`) or as `-m MODULE ...`, and run the "
                         "supervisor with the engine's Python")
    return next(iter(found)).load(), [name, *command[1:]], name


def _run_module(module: str) -> None:
    """`python -m module` in the child: its code runs as __main__ (its imports are warm)."""
    sys.modules.pop(module, None)
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def preload(modules: list[str]) -> None:
    """Import `modules`; refuse any that initialized CUDA (a forked child could not use it)."""
    for name in modules:
        importlib.import_module(name)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise SystemExit("fast-start: the preloaded modules initialized CUDA, which a forked engine cannot use; "
                         f"drop the --preload that does ({', '.join(modules)})")


def reap_all(group: int) -> None:
    """Kill the engine's process group and whatever else it left (the supervisor is their subreaper),
    and reap them all: the GPU is free when this returns."""
    while True:
        for pid in (-group, *children()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def described(status: int) -> str:
    return f"signal {signal.Signals(-status).name}" if status < 0 else f"exit {status}"


class Supervisor:
    def __init__(self, main, argv: list[str], restarts: int):
        self.main, self.argv, self.restarts = main, argv, restarts
        self.failures = Failures()
        self.pid = 0
        self.stopping, self.stopped_by = False, 0

    def forward(self, sig: int, _frame) -> None:
        """systemctl stop: the engine's process group gets the signal; no restart follows."""
        self.stopping, self.stopped_by = True, sig
        if self.pid:
            try:
                os.killpg(self.pid, sig)
            except ProcessLookupError:
                pass

    def run_once(self) -> int:
        """Fork the engine, wait for it, clean up after it: its status (negative: the signal)."""
        started = time.monotonic()
        with stops_held():          # a stop now waits until the engine's pid is known
            if self.stopping:       # a stop came just before: no engine to start, end by its signal
                return -self.stopped_by
            self.pid = os.fork()
            if self.pid == 0:
                child(self.main, self.argv, f"engine started (pid {os.getpid()}) from the warm interpreter, "
                                            f"{time.monotonic() - started:.2f} s")
            own_group(self.pid)
        _, status = os.waitpid(self.pid, 0)       # retried by Python after a forwarded stop's handler
        reap_all(self.pid)
        return os.waitstatus_to_exitcode(status)

    def run(self) -> int:
        """The engine's status once it ends for good (negative: the signal that ended it)."""
        while True:
            code = self.run_once()
            if self.stopping or code == 0:
                return code
            failed = self.failures.add()
            if failed > self.restarts:
                say(f"the engine ended ({described(code)}) {failed} times in {WINDOW_S // 60} minutes; "
                    "the supervisor ends with it and leaves the next restart to systemd")
                return code
            say(f"the engine ended ({described(code)}); starting it again from the warm interpreter "
                f"({failed} of {self.restarts} restarts in {WINDOW_S // 60} minutes)")


def end_as(code: int) -> int:
    """End as the engine did: by its signal (systemd then tells a stop from a crash as it would
    for the engine itself), else with its exit status."""
    if code < 0:
        if -code != signal.SIGKILL:         # SIGKILL has no handler to reset
            signal.signal(-code, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [-code])
        os.kill(os.getpid(), -code)
    return code if code >= 0 else 128 - code


def arguments(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m fast_start.supervise", description=__doc__.split("\n")[0])
    ap.add_argument("--preload", action="append", default=[], metavar="MODULE",
                    help="import MODULE before the engine forks (added to the command's own: PRELOAD)")
    ap.add_argument("--restarts", type=int, default=3,
                    help=f"restarts within {WINDOW_S // 60} minutes before the supervisor ends (default 3); "
                         "with --standby, a failover that served is none")
    ap.add_argument("--standby", metavar="HOST:PORT", type=address,
                    help="serve HOST:PORT from one engine and keep a second asleep to take over when it dies "
                         "(fast_start.standby); vLLM's server only")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- the engine's console script and its arguments")
    args = ap.parse_args(argv)
    args.command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not args.command:
        ap.error("give the engine's command after --: -- vllm serve MODEL ... or -- -m MODULE ...")
    if args.standby:
        from .standby import off_the_cache
        if why := off_the_cache(args.command):
            ap.error(why)
    return args


def address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not port.isdigit() or not host:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT (e.g. 0.0.0.0:8000, [::]:8000)")
    return host.strip("[]"), int(port)


def main(argv: list[str] | None = None) -> int:
    args = arguments(sys.argv[1:] if argv is None else argv)
    started = time.monotonic()
    run, command, package = engine(args.command)
    preload([*PRELOAD.get(package, ()), *args.preload])
    for name, value in ENV.get(package, {}).items():
        if name not in os.environ:
            os.environ[name] = value
            say(f"{name}={value} (set it to keep {package}'s own choice)")
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    say(f"{package} imported in {time.monotonic() - started:.1f} s; every restart of the engine starts from here")
    if args.standby:
        from .standby import Standby
        os.environ["VLLM_SERVER_DEV_MODE"] = "1"       # its /sleep and /wake_up
        supervisor = Standby(run, command, args.standby, args.restarts)
    else:
        supervisor = Supervisor(run, command, args.restarts)
    for sig in STOPS:
        signal.signal(sig, supervisor.forward)
    return end_as(supervisor.run())


if __name__ == "__main__":
    sys.exit(main())

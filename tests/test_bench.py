"""The restart benchmark's reading of an engine's log (bench/serve_restart.py): each phase ends
at the first line after the previous phase's end that says so; a phase the engine did not log
(no torch.compile when eager) is skipped and its time falls to the next."""
from __future__ import annotations

from bench.serve_restart import PHASES, artifacts, phases

# vLLM 0.26's lines, as `vllm serve` of a compiled engine wrote them, stamped since exec.
SERVED = [(16.3, "(APIServer pid=1) INFO 12-06 08:52:38 [api_utils.py:345] version 0.26.0"),
          (33.9, "(EngineCore pid=2) INFO 12-06 08:52:56 [__init__.py:112] Registered model loader"),
          (34.5, "(EngineCore pid=2) INFO 12-06 08:52:56 [core.py:116] Initializing a V1 LLM engine (v0.26.0)"),
          (35.4, "(EngineCore pid=2) INFO [model_runner.py:305] Model loading took 0.0 GiB and 0.338204 seconds"),
          (41.0, "(EngineCore pid=2) INFO [monitor.py:53] torch.compile took 5.53 s in total"),
          (41.4, "(EngineCore pid=2) INFO [gpu_worker.py:560] Available KV cache memory: 56.58 GiB"),
          (47.5, "(EngineCore pid=2) INFO [model_runner.py:747] Graph capturing finished in 6 secs, took 1.00 GiB"),
          (48.1, "(EngineCore pid=2) INFO [core.py:340] init engine (profile, create kv cache, warmup model) took 13 s"),
          (49.5, "(APIServer pid=1) INFO:     Application startup complete.")]


def test_each_phase_ends_at_its_line_and_the_first_request_follows_the_last():
    got = phases("default warm", SERVED, 49.7)
    assert list(got) == [name for name, _ in PHASES] + ["first request"]
    assert got == {"import": 16.3, "engine process": 18.2, "weights": 0.9, "torch.compile": 5.6,
                   "profile, KV cache": 0.4, "CUDA graphs": 6.1, "warm-up": 0.6, "server start": 1.4,
                   "first request": 0.2}
    assert round(sum(got.values()), 6) == 49.7


def test_a_phase_not_logged_is_skipped_and_its_time_counted_in_the_next():
    eager = [line for line in SERVED if "torch.compile" not in line[1] and "Graph capturing" not in line[1]]
    got = phases("default warm", eager, 49.7)
    assert got["torch.compile"] is None and got["CUDA graphs"] is None
    assert got["profile, KV cache"] == 6.0 and got["warm-up"] == 6.7
    assert phases("default warm", SERVED[:3], None)["first request"] is None      # never answered


def test_a_failover_is_one_span_whatever_the_next_standby_logs_meanwhile():
    after_kill = [(t - 30.0, line) for t, line in SERVED]       # the next standby starting
    assert phases("zero_copy standby, failover", after_kill, 0.41) == {"first request": 0.41}


def test_each_run_names_its_kept_artifacts_outcome_by_the_loaders_line():
    line = "(EngineCore pid=2) INFO [kept.py:74] fast-start: vLLM starts from the artifacts the daemon kept for these settings"
    assert artifacts(SERVED[:3] + [(35.0, line)] + SERVED[3:]) == "hit"
    missed = "fast-start: no artifacts kept for these settings (no artifacts of m are kept for this user yet)"
    assert artifacts([(35.0, missed)]) == "miss"
    assert artifacts(SERVED) == ""                                  # vLLM's own loader says nothing
    rebuilt = "fast-start: vLLM added to the kept artifacts although they were made for these settings"
    assert artifacts([(35.0, line), (50.0, rebuilt)]) == "hit, yet rebuilt"

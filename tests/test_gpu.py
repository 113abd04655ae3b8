"""The CUDA device end to end (marker `gpu`; skipped without CUDA)."""
from __future__ import annotations

import gc
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import fast_start
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from devtools import synth
from probe import status
from devtools.harness import write_config
from test_exit import assert_left_cleanly, engine_exits, fetch_threads
from test_tp_forward import assert_close_bf16, reference, run_ranks

pytestmark = pytest.mark.gpu
METHODS = ["none", "fp8", "fp8-channel", "fp8-block"]


def raw(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def cuda_config(tmp_path, models, **daemon):
    return write_config(tmp_path / "fs.toml", tmp_path / "run", models, device="cuda", **daemon)


def model(name, path, gpus=(0,), **kw):
    return {"name": name, "path": str(path), "gpus": list(gpus), "engine_version": "test", **kw}


def compute_apps() -> set[int]:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                         capture_output=True, text=True, check=True).stdout
    return {int(x) for x in out.split()}


def test_cuda_cache_is_bit_identical_to_disk_for_every_method(tmp_path, llama, llama_fp8, daemons):
    models = [model(f"{q}-r{r}", llama, quantization=q, tensor_parallel_size=2, rank_offset=r)
              for q in METHODS for r in range(2)]
    models += [model("fp8ckpt", llama_fp8, quantization="fp8-checkpoint")]
    models += [model(f"as-{dtype}", llama, dtype=dtype) for dtype in ("float32", "float16")]   # cast as staged
    daemons(cuda_config(tmp_path, models, arena_chunk="1MiB"))         # several arenas a shard
    specs = [fast_start.WeightSpec(str(llama), 2, r, quantization=q, engine_version="test")
             for q in METHODS for r in range(2)]
    specs.append(fast_start.WeightSpec(str(llama_fp8), quantization="fp8-checkpoint", engine_version="test"))
    specs += [fast_start.WeightSpec(str(llama), dtype=dtype, engine_version="test") for dtype in ("float32", "float16")]
    for spec in specs:
        for mode in ("zero_copy", "copy"):
            cache = fast_start.fetch(spec, device="cuda:0", mode=mode, socket_dir=str(tmp_path / "run"),
                                     fallback=False)
            disk = fast_start.fetch(spec, device="cuda:0", socket_dir=str(tmp_path / "none"))
            cpu = fast_start.fetch(spec, device="cpu", socket_dir=str(tmp_path / "none"))
            assert cache.source == "cache" and disk.source == "disk" and cache.keys() == disk.keys()
            for name in disk:
                assert cache[name].device.type == "cuda"
                assert torch.equal(raw(cache[name]), raw(disk[name])), (spec, name)
                assert torch.equal(raw(disk[name]).cpu(), raw(cpu[name])), (spec, name)   # GPU == CPU bytes


WRITER = textwrap.dedent("""
    import sys, torch, fast_start
    w = fast_start.fetch(fast_start.WeightSpec(sys.argv[1], engine_version="test"), device="cuda:0",
                         socket_dir=sys.argv[2], fallback=False)
    try:
        w["model.norm.weight"].fill_(7)
        torch.cuda.synchronize()
        print("write went through")
    except Exception as e:
        print("write failed:", type(e).__name__, str(e)[:200])
""")


def test_write_through_zero_copy_tensor_fails_and_cache_stays_intact(tmp_path, llama, daemons):
    daemons(cuda_config(tmp_path, [model("llama", llama)]))
    p = subprocess.run([sys.executable, "-c", WRITER, str(llama), str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=300)
    assert "write went through" not in p.stdout, p.stdout + p.stderr
    assert "write failed" in p.stdout or p.returncode != 0, p.stdout + p.stderr
    spec = fast_start.WeightSpec(str(llama), engine_version="test")
    cache = fast_start.fetch(spec, device="cuda:0", socket_dir=str(tmp_path / "run"), fallback=False)
    disk = fast_start.fetch(spec, device="cuda:0", socket_dir=str(tmp_path / "none"))
    for name in disk:
        assert torch.equal(raw(cache[name]), raw(disk[name])), name


def test_copy_then_daemon_killed_leaves_engine_tensors_valid(tmp_path, llama, daemons):
    d = daemons(cuda_config(tmp_path, [model("llama", llama)]))
    spec = fast_start.WeightSpec(str(llama), quantization="none", engine_version="test")
    w = fast_start.fetch(spec, device="cuda:0", mode="copy", socket_dir=str(tmp_path / "run"), fallback=False)
    assert w.source == "cache"
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait(30)
    disk = fast_start.fetch(spec, device="cuda:0", socket_dir=str(tmp_path / "none"))
    for name in disk:
        assert torch.equal(raw(w[name]), raw(disk[name])), name


@pytest.mark.parametrize("chunk", ["512MiB", "256KiB"])
def test_a_copy_leaves_no_map_behind_and_holds_the_caches_bytes(tmp_path, llama, daemons, chunk):
    """Each map a copy reads is unmapped once the device has made the copy, before fetch returns;
    with small chunks the arenas are many, and their fds come a batch at a time."""
    from fast_start import arena, protocol
    d = daemons(cuda_config(tmp_path, [model("llama", llama)], arena_chunk=chunk))
    assert chunk == "512MiB" or status(d)["models"][0]["arenas"] > 2 * protocol.FD_BATCH
    spec = fast_start.WeightSpec(str(llama), quantization="none", engine_version="test")

    def mapped() -> int:
        return sum(type(o) is arena.Imported and o.ptr is not None for o in gc.get_objects())
    before = mapped()
    w = fast_start.fetch(spec, device="cuda:0", mode="copy", socket_dir=str(tmp_path / "run"), fallback=False)
    assert mapped() == before
    disk = fast_start.fetch(spec, device="cuda:0", socket_dir=str(tmp_path / "none"))
    for name in disk:
        assert torch.equal(raw(w[name]), raw(disk[name])), name


def test_recorded_attributes_are_made_on_the_gpu_in_one_copy_per_dtype_each_its_own_value():
    """What a vLLM model built on meta gets back by value (`vllm_state.made`): records from an
    accelerator land on the engine's GPU with their values, dtypes and shapes, each writable
    without touching its neighbours; CPU records stay on the CPU."""
    from fast_start.plugins.vllm import state as vllm_state
    records = {f"layers.{i}.k_scale": ["float32", [], "cuda", [float(i)]] for i in range(40)}
    records.update({"table": ["int64", [2, 3], "cuda", list(range(6))], "host": ["float32", [1], "cpu", [3.0]],
                    "none": ["bfloat16", [0], "cuda", []], "where": ["device", "cuda"]})
    got = vllm_state.made(records, torch.device("cuda:0"))
    assert list(got) == list(records)
    for i in range(40):
        t = got[f"layers.{i}.k_scale"]
        assert t.device == torch.device("cuda:0") and t.shape == () and t.item() == float(i)
    assert got["table"].dtype == torch.int64 and got["table"].cpu().tolist() == [[0, 1, 2], [3, 4, 5]]
    assert got["host"].device.type == "cpu" and got["none"].shape == (0,) and got["where"] == torch.device("cuda:0")
    got["layers.0.k_scale"].fill_(-1.0)
    assert [got[f"layers.{i}.k_scale"].item() for i in range(3)] == [-1.0, 1.0, 2.0]


ATTENTION_PROBE = textwrap.dedent("""
    import json, sys, torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.v1.attention import selector
    from fast_start.plugins.vllm import attention as vllm_attention
    noted = json.loads(sys.argv[1])
    with set_current_vllm_config(VllmConfig()):
        context = vllm_attention.recording(noted) if sys.argv[2] == "record" else vllm_attention.choosing(noted)
        with context:
            backend = selector.get_attn_backend(128, torch.bfloat16, "auto")
    print(json.dumps({"backend": backend.get_name(), "noted": noted,
                      "modules": sorted(m for m in sys.modules if m.startswith("vllm.v1.attention.backends."))}))
""")


def test_the_fills_attention_backend_is_chosen_again_alone_and_a_refused_one_is_vllms_choice():
    """On the GPU, in fresh processes (what a restart is): vLLM's own choice of attention backend
    tries its candidates; named again from the fill's note it is the same backend with fewer
    backend modules imported; a noted backend vLLM refuses for these inputs is vLLM's own choice."""
    pytest.importorskip("vllm")

    def probe(noted: list, how: str) -> dict:
        out = subprocess.run([sys.executable, "-c", ATTENTION_PROBE, json.dumps(noted), how], capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.splitlines()[-1])
    own = probe([], "record")
    assert [e["backend"] for e in own["noted"]] == [own["backend"]]
    again = probe(own["noted"], "choose")
    assert again["backend"] == own["backend"]
    assert set(again["modules"]) < set(own["modules"]), (again["modules"], own["modules"])
    refused = probe([{**own["noted"][0], "backend": "FLASHMLA"}], "choose")     # an MLA backend, for MHA inputs
    assert refused["backend"] == own["backend"]


def test_a_map_reads_the_arena_and_a_failed_access_is_raised_with_nothing_left_mapped():
    """A read-only map reads the arena's bytes; a driver error while setting its access reaches
    the caller, and the range it had mapped is unmapped again."""
    from fast_start import arena, vmm
    from fast_start.errors import ArenaError
    data = torch.arange(1 << 20, dtype=torch.int32, device="cuda:0")
    writer = vmm.VmmWriter(data.nbytes, 0, "map-access")
    writer.write(0, data)
    fd = writer.finish()
    try:
        flat = arena.map_readonly(fd, writer.size, writer.device, torch.device("cuda:0"))
        assert torch.equal(flat[:data.nbytes].view(torch.int32), data)
        mapped = sum(type(o) is arena.Imported and o.ptr is not None for o in gc.get_objects())
        with pytest.raises(ArenaError, match="cuMemSetAccess"):
            arena.Imported(fd, writer.size, torch.cuda.device_count() + 7, readonly=True)   # no such GPU
        gc.collect()
        assert sum(type(o) is arena.Imported and o.ptr is not None for o in gc.get_objects()) == mapped
        del flat
    finally:
        os.close(fd)


def test_serving_daemon_holds_no_cuda_context(tmp_path, llama, daemons):
    d = daemons(cuda_config(tmp_path, [model("llama", llama)]))
    w = fast_start.fetch(fast_start.WeightSpec(str(llama), engine_version="test"), device="cuda:0",
                         socket_dir=str(tmp_path / "run"), fallback=False)
    apps = compute_apps()
    if os.getpid() not in apps:           # the engine (this process) has a context: can nvidia-smi see it?
        pytest.skip("nvidia-smi lists no compute processes on this machine (sandboxed runtime)")
    assert d.proc.pid not in apps         # the daemon does not
    del w


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_daemons_serve_two_engines_by_gpu_uuid(tmp_path, llama, daemons):
    cfg = cuda_config(tmp_path, [model("llama", llama, gpus=[0, 1], tensor_parallel_size=2)])
    daemons(cfg, 0)
    daemons(cfg, 1)
    nccl = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    # Rank 0 sees both GPUs in reverse order and uses its cuda:1 (physical GPU 0); rank 1 sees GPU 1 alone.
    envs = [{**nccl, "CUDA_VISIBLE_DEVICES": "1,0"}, {**nccl, "CUDA_VISIBLE_DEVICES": "1"}]
    sources = run_ranks(llama, "nccl", ["cuda:1", "cuda:0"], tmp_path / "run", tmp_path / "logits", envs)
    assert sources == ["cache", "cache"]
    assert_close_bf16(torch.load(tmp_path / "logits"), reference(llama, "cuda:0"))


def test_cuda_arenas_survive_the_daemon_through_the_fd_store(tmp_path, llama, daemons):
    spec = fast_start.WeightSpec(str(llama), quantization="fp8-block", engine_version="test")
    cfg = cuda_config(tmp_path, [model("llama", llama, quantization="fp8-block")])
    first = daemons(cfg)
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(30)
    second = daemons(cfg, listen=dict(first.listener.store))
    assert "re-adopted llama rank 0" in second.log.read_text()
    assert not second.listener.texts("STATUS=filling llama")
    cache = fast_start.fetch(spec, device="cuda:0", socket_dir=str(tmp_path / "run"), fallback=False)
    disk = fast_start.fetch(spec, device="cuda:0", socket_dir=str(tmp_path / "none"))
    for name in disk:
        assert torch.equal(raw(cache[name]), raw(disk[name])), name


def test_verify_deep_compares_cuda_arenas_with_the_disk(tmp_path, llama, daemons):
    from typer.testing import CliRunner
    from fast_start.cli import app
    cfg = cuda_config(tmp_path, [model("llama", llama, quantization="fp8")])
    daemons(cfg)
    r = CliRunner().invoke(app, ["verify", "--model", str(llama), "--config", str(cfg), "--deep", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == [{"gpu": 0, "model": "llama", "match": True, "fields": [], "files": None,
                                     "tensors_differing": []}]


@pytest.mark.parametrize("mode", ["zero_copy", "copy"])
def test_transformers_model_from_a_cuda_daemon(tmp_path, llama, daemons, mode):
    transformers = pytest.importorskip("transformers")
    from fast_start.transformers import load
    daemons(cuda_config(tmp_path, [model("llama", llama)]))
    spec = fast_start.WeightSpec(str(llama), engine_version="test")
    m = load(str(llama), spec, device="cuda:0", mode=mode, socket_dir=str(tmp_path / "run"), fallback=False)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(llama), dtype=torch.bfloat16).to("cuda:0").eval()
    ids = torch.tensor([[1, 5, 9, 200, 17, 3]], device="cuda:0")
    with torch.no_grad():
        got = m.generate(ids, max_new_tokens=12, do_sample=False)
        want = ref.generate(ids, max_new_tokens=12, do_sample=False)
    assert m.fast_start_source == "cache" and torch.equal(got, want)


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """A 4.2 GiB Llama-shaped checkpoint (one random tensor per shape, repeated)."""
    return synth.write_checkpoint(tmp_path_factory.mktemp("big"), synth.llama_of_size(int(4.2 * 2**30)), files=2,
                                  reuse=True)


@pytest.mark.parametrize("mode", ["zero_copy", "copy"])
def test_twenty_fresh_engines_fetch_four_gib_and_leave_with_their_own_status(tmp_path, big, daemons, mode):
    """What a test, a health check or a warm-up script does: a fresh process fetches and exits at
    once, or forks first; four at a time, twenty of each."""
    d = daemons(cuda_config(tmp_path, [model("big", big)]), wait=False).wait_ready(600)
    for how in ("end", "fork"):
        with ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(lambda _: engine_exits(d.socket_dir, big, "cuda:0", mode, how), range(20)))
        for out in outs:
            assert_left_cleanly(out, how)


def test_a_fetch_on_a_gpu_starts_no_thread(tmp_path, llama, daemons):
    d = daemons(cuda_config(tmp_path, [model("llama", llama)]))
    before, after = fetch_threads(d.socket_dir, llama, "cuda:0")
    assert before == after


def test_detach_makes_the_maps_the_engines_own_at_the_same_addresses(tmp_path, llama, daemons):
    """What vLLM's reload_weights gets on a zero_copy engine: the weights writable where they were
    (a CUDA graph's pointers stay valid), the daemon's cache unwritten."""
    from fast_start.detach import detach
    daemons(cuda_config(tmp_path, [model("llama", llama)]))
    spec = fast_start.WeightSpec(str(llama), engine_version="test")
    w = fast_start.fetch(spec, device="cuda:0", socket_dir=str(tmp_path / "run"), fallback=False)
    before = {n: (t.data_ptr(), raw(t).clone()) for n, t in w.items()}
    assert detach(w.values()) >= sum(t.nbytes for t in w.tensors.values()) > 0
    for n, t in w.items():
        assert t.data_ptr() == before[n][0] and torch.equal(raw(t), before[n][1])
        t.view(torch.uint8).add_(1)
    torch.cuda.synchronize()
    again = fast_start.fetch(spec, device="cuda:0", socket_dir=str(tmp_path / "run"), fallback=False)
    for n, t in again.items():
        assert torch.equal(raw(t), before[n][1]) and not torch.equal(raw(w[n]), before[n][1]), n
    assert detach(w.values()) == 0             # nothing left to detach


def vllm_engine(out: Path, model_path: Path, env: dict | None = None, **args) -> tuple[int, dict, str]:
    """One vLLM engine (bench/vllm_cuda_engine.py) in a fresh process, `env` added to ours: exit
    status, report, log."""
    log = out.with_suffix(".log")
    with open(log, "w") as f:
        rc = subprocess.run([sys.executable, "-m", "bench.vllm_cuda_engine",
                             json.dumps({"model": str(model_path), "out": str(out), **args})],
                            stdout=f, stderr=subprocess.STDOUT, timeout=600, cwd=Path(__file__).parent.parent,
                            env={**os.environ, **(env or {})}).returncode
    return rc, json.loads(out.read_text()) if out.exists() else {}, log.read_text(errors="replace")


def test_vllm_sleep_mode_and_reload_weights_end_with_the_default_loaders_weights(tmp_path, daemons):
    """vLLM's features that write weights, at its default gpu_memory_utilization: sleep and wake at
    levels 1 and 2 in copy mode, and reload_weights in zero_copy, give the default loader's
    tokens and weights; sleep mode in zero_copy is refused at start in one line."""
    vllm = pytest.importorskip("vllm")
    from bench.vllm_cuda import DENSE
    path = synth.write_checkpoint(tmp_path / "qwen3", DENSE, seed=7)
    models = [{"name": "qwen3", "path": str(path), "gpus": [0], "layout": "vllm", "engine_version": vllm.__version__}]
    daemons(cuda_config(tmp_path, models, worker_python=sys.executable), wait=False).wait_ready(600)
    options = {"socket_dir": str(tmp_path / "run"), "fallback": False}
    rc, want, log = vllm_engine(tmp_path / "default.json", path, gpu_memory_utilization=0.9)
    assert rc == 0, log[-4000:]
    runs = {f"copy-sleep-{level}": dict(sleep=level, extra={**options, "mode": "copy"}) for level in (1, 2)}
    runs["zero_copy-reload"] = dict(reload=True, extra={**options, "mode": "zero_copy"})
    for name, args in runs.items():
        rc, got, log = vllm_engine(tmp_path / f"{name}.json", path, load_format="fast_start",
                                   gpu_memory_utilization=0.9, **args)
        assert rc == 0, (name, log[-4000:])
        assert got["source"] == "cache", name
        assert got["tokens"] == got["after"]["tokens"] == want["tokens"], name
        assert got["digest"] == got["after"]["digest"] == want["digest"], name
    rc, _, log = vllm_engine(tmp_path / "refused.json", path, load_format="fast_start", sleep=1,
                             gpu_memory_utilization=0.9, extra={**options, "mode": "zero_copy"})
    assert rc != 0 and "fast-start: enable_sleep_mode frees and restores the engine's own weight memory" in log, \
        log[-4000:]


def test_a_standby_starts_with_no_kv_memory_and_its_captured_graphs_serve_once_woken(tmp_path, daemons):
    """An engine started as the standby's supervisor starts a standby (compiled, CUDA graphs, at
    vLLM's default 0.9): its KV cache holds no memory until it wakes, then the GPU's free memory
    drops by the KV cache's size, and the graphs captured on the light ranges give the default
    loader's tokens."""
    vllm = pytest.importorskip("vllm")
    from bench.vllm_cuda import DENSE
    path = synth.write_checkpoint(tmp_path / "qwen3", DENSE, seed=7)
    models = [{"name": "qwen3", "path": str(path), "gpus": [0], "layout": "vllm", "engine_version": vllm.__version__}]
    daemons(cuda_config(tmp_path, models, worker_python=sys.executable), wait=False).wait_ready(600)
    compiled = {"enforce_eager": False, "gpu_memory_utilization": None}
    rc, want, log = vllm_engine(tmp_path / "default.json", path, engine=compiled)
    assert rc == 0, log[-4000:]
    rc, got, log = vllm_engine(tmp_path / "standby.json", path, load_format="fast_start", standby=True,
                               engine=compiled, extra={"socket_dir": str(tmp_path / "run"), "fallback": False})
    assert rc == 0, log[-4000:]
    kv = re.search(r"fast-start: the KV cache's (\d+\.\d+) GiB lie at addresses of their own, light", log)
    backed = re.search(r"fast-start: the KV cache's \d+\.\d+ GiB backed in (\d+\.\d+) s", log)
    assert kv and backed, log[-4000:]
    free = got["free"]
    assert free["started"] - free["awake"] >= 0.9 * float(kv[1]) * 2**30, (free, kv[1])
    assert got["source"] == "cache" and got["tokens"] == want["tokens"]
    (lease,) = free["leases_asleep"]         # `status`: the standby's role and what its process holds asleep
    assert lease["role"] == "standby" and 0 < lease["gpu_bytes"] <= 4 * 2**30, (lease, free)     # the target
    rc, _, log = vllm_engine(tmp_path / "level-2.json", path, load_format="fast_start", standby=True, sleep=2,
                             engine={"enable_sleep_mode": False}, extra={"socket_dir": str(tmp_path / "run"),
                                                                         "fallback": False})
    assert rc != 0 and "fast-start: a level-2 sleep discards the weights and wakes by reloading them" in log, \
        log[-4000:]


def test_a_compiled_engine_whose_home_is_read_only_starts_from_the_artifacts_the_daemon_kept(tmp_path, daemons):
    """vLLM's defaults (torch.compile, CUDA graphs, 0.9) with $HOME not writable: the first
    zero_copy engine compiles and the daemon keeps what it built; the next ones start from it and
    compile nothing; all give the default loader's tokens. vLLM 0.26's first load of its AOT
    artifacts rewrites two Inductor `.best_config` files (seen on an H100), so the second start
    may add to the set; the third adds nothing."""
    vllm = pytest.importorskip("vllm")
    from bench.vllm_cuda import DENSE
    path = synth.write_checkpoint(tmp_path / "qwen3", DENSE, seed=7)
    models = [{"name": "qwen3", "path": str(path), "gpus": [0], "layout": "vllm", "engine_version": vllm.__version__}]
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    daemons(cuda_config(tmp_path, models, worker_python=sys.executable), env={"STATE_DIRECTORY": str(state)},
            wait=False).wait_ready(600)
    compiled = {"enforce_eager": False, "gpu_memory_utilization": 0.9}
    rc, want, log = vllm_engine(tmp_path / "default.json", path, engine=compiled,
                                env={"VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache")})
    assert rc == 0, log[-4000:]
    logs = {}
    for tag in ("first", "second", "third"):
        rc, got, logs[tag] = vllm_engine(tmp_path / f"{tag}.json", path, load_format="fast_start", engine=compiled,
                                         extra={"socket_dir": str(tmp_path / "run"), "fallback": False},
                                         env={"HOME": "/dev/null"})
        assert rc == 0 and got["source"] == "cache" and got["tokens"] == want["tokens"], (tag, logs[tag][-4000:])
    assert "the daemon keeps this engine's artifacts" in logs["first"], logs["first"][-4000:]
    for tag in ("second", "third"):
        assert "vLLM starts from the artifacts the daemon kept" in logs[tag], logs[tag][-4000:]
    assert "vLLM added to the kept artifacts" not in logs["third"], logs["third"][-4000:]


def test_a_second_daemon_for_the_gpu_from_another_config_fails_at_once(tmp_path, daemons):
    """Another socket_dir means another gpu<N>.lock: the lock on the GPU's device node still
    refuses a second daemon for the same GPU, which ends at once (exit 2: no restart loop)."""
    small = synth.write_checkpoint(tmp_path / "small", synth.Shape(num_layers=1))
    first = daemons(cuda_config(tmp_path, [model("small", small)]))
    other = write_config(tmp_path / "other.toml", tmp_path / "other-run", [model("small", small)], device="cuda")
    second = daemons(other, wait=False)
    assert second.proc.wait(60) == 2
    (line,) = [l for l in second.log.read_text().splitlines() if l.startswith("error")]
    assert line.startswith("error: GPU 0 is served by another fast-start daemon (it holds /dev/nvidia0)"), line
    assert first.proc.poll() is None and first.socket.is_socket()


def test_a_gpu_the_machine_lacks_fails_check_config_and_the_daemon_with_one_line(tmp_path, daemons):
    """`gpus = [N]` past the machine's GPUs: check-config fails its row, and a daemon for it ends
    at once (exit 2, no restart loop), both naming the GPUs the driver sees."""
    missing = torch.cuda.device_count()
    small = synth.write_checkpoint(tmp_path / "small", synth.Shape(num_layers=1))
    cfg = cuda_config(tmp_path, [model("small", small, gpus=(missing,))])
    said = f"there is no GPU {missing} here: the CUDA driver sees GPU"
    check = subprocess.run([sys.executable, "-m", "fast_start.cli", "check-config", "--config", cfg, "--json"],
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 2, check.stderr
    (row,) = [r for r in json.loads(check.stdout) if r["check"] == f"memory GPU {missing}"]
    assert not row["ok"] and row["detail"].startswith(said), row
    daemon = daemons(cfg, gpu=missing, wait=False)
    assert daemon.proc.wait(60) == 2
    (line,) = [l for l in daemon.log.read_text().splitlines() if l.startswith("error")]
    assert line.startswith(f"error: {said}"), line

"""A tensor-parallel restart measured end to end: one daemon per GPU, one engine rank per GPU.

    python -m bench.tp_restart --gpus 4                  # the ~122B Qwen3-MoE FP8 at TP 4 (~123 GB on disk)
    python -m bench.tp_restart --gpus 4 --layers 24      # the same shapes at half the layers

1. Writes a synthetic pre-quantized checkpoint (FP8, 128x128 block scales, `fp8-checkpoint`) of a
   Qwen3-MoE shape of about 122 billion parameters: hidden 4096, 128 experts of 1536, 64 heads,
   4 KV heads, vocabulary 151936, 49 layers (`--layers` changes only the depth). Written once
   under `--dir` and reused; the page cache is hot for every row.
2. Disk path: every rank's `fetch` with no daemon, all ranks at once (as a real restart loads).
3. Starts `fast-start daemon --gpu N` for every GPU on one shared config, waits for every READY,
   and reads each fill time.
4. Cache path: every rank at once, `fetch` in `zero_copy` and in `copy` mode, median of `--repeat`.
5. Each rank compares its shard, from the disk path and from the cache, with an independent
   slicing of the checkpoint (written out below, not fast-start's rules) for the first, a middle
   and the last layer and every tensor outside the layers.
6. A forward pass at `--forward-layers` depth (same widths), every rank on its GPU over NCCL
   with weights fetched from a daemon, against the same model run on one GPU from the disk.

Prints a table and writes `--json`.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import fast_start
from fast_start import protocol
from devtools import synth
from fast_start.transport import connect, request
from devtools.harness import Daemon, write_config

SHAPE = synth.Shape(architecture="Qwen3MoeForCausalLM", hidden_size=4096, num_layers=49, num_heads=64,
                    num_kv_heads=4, head_dim=128, intermediate_size=1536, vocab_size=151936,
                    num_experts=128, moe_intermediate_size=1536)
QUANT = "fp8-checkpoint"
IDS = [1, 5, 9, 200, 17, 3, 77, 1000, 4, 8, 151000, 42]


def params(shape: synth.Shape) -> int:
    return sum(torch.Size(shape.tensor_shape(n)).numel() for n in synth.required_tensors(shape.dims()))


def checkpoint(root: Path, layers: int) -> Path:
    shape = synth.Shape(**{**SHAPE.__dict__, "num_layers": layers})
    t0 = time.perf_counter()
    folder = synth.cached(root, shape, f"qwen3moe-{layers}L-fp8", files=max(1, layers // 2), fp8="block", reuse=True)
    print(f"{folder}: {params(shape) / 1e9:.1f}B parameters, ready in {time.perf_counter() - t0:.0f} s", flush=True)
    return folder


# ---- independent slicing: the hf tensor-parallel layout written out from the model's definition

COLUMN = re.compile(r"(q_proj|k_proj|v_proj|gate_proj|up_proj)\.weight(_scale_inv)?$"
                    r"|^(model\.embed_tokens|lm_head)\.weight$")
ROW = re.compile(r"(o_proj|down_proj)\.weight(_scale_inv)?$")


def expected(name: str, full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s part of a full checkpoint tensor: equal chunks of output rows (column-parallel,
    vocabulary) or input columns (row-parallel), block scales chunked with their blocks; the rest whole."""
    if COLUMN.search(name):
        return full.chunk(world, 0)[rank]
    if ROW.search(name):
        return full.chunk(world, 1)[rank]
    return full


def checked_names(names: list[str], layers: int) -> list[str]:
    keep = {0, layers // 2, layers - 1}
    return [n for n in names if not (m := re.match(r"model\.layers\.(\d+)\.", n)) or int(m.group(1)) in keep]


def compare(folder: Path, weights, rank: int, world: int, layers: int) -> int:
    """Number of checked tensors; raises on the first that differs."""
    from safetensors import safe_open
    index = folder / "model.safetensors.index.json"
    where = json.loads(index.read_text())["weight_map"] if index.exists() else None
    names = checked_names(list(weights.tensors), layers)
    for name in names:
        file = folder / (where[name] if where else "model.safetensors")
        with safe_open(str(file), "pt") as f:
            want = expected(name, f.get_tensor(name), rank, world)
        got = weights[name].cpu()
        if got.dtype != want.dtype or not torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8)):
            raise AssertionError(f"rank {rank}: {name} differs from the independent slicing")
    return len(names)


# ---- one engine rank (a process per GPU)

def rank_main(a) -> None:
    rank, world = a.rank, a.gpus
    torch.cuda.set_device(rank)
    torch.zeros(1, device="cuda")                         # CUDA context before the clock starts
    spec = fast_start.WeightSpec(str(a.model), world, rank, quantization=QUANT, engine_version="bench")
    device = f"cuda:{rank}"
    out = {"rank": rank}
    while time.time() < a.start_at:                       # every rank starts together
        time.sleep(0.001)
    if a.rank_of == "disk":
        t0 = time.perf_counter()
        w = fast_start.fetch(spec, device, socket_dir=a.socket_dir)
        torch.cuda.synchronize()
        out.update(disk_s=time.perf_counter() - t0, source=w.source,
                   bytes=sum(t.nbytes for t in w.tensors.values()))
        out["checked_tensors"] = compare(a.model, w, rank, world, a.layers)
    else:
        for mode in ("zero_copy", "copy"):
            times = []
            for _ in range(a.repeat):
                t0 = time.perf_counter()
                w = fast_start.fetch(spec, device, mode=mode, socket_dir=a.socket_dir, fallback=False)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
                del w
            out[f"{mode}_s"] = statistics.median(times)
        w = fast_start.fetch(spec, device, socket_dir=a.socket_dir, fallback=False)
        out["source"], out["checked_tensors"] = w.source, compare(a.model, w, rank, world, a.layers)
    Path(a.out).write_text(json.dumps(out))


def rank_env(gpus: int) -> dict[str, str]:
    """Each engine rank gets its share of the CPUs for torch's thread pool, as engines arrange
    (vLLM's GPU workers do the same); N ranks each spinning every core's worth of OpenMP threads
    would measure thread contention instead of loading."""
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")
            or str(max(1, len(os.sched_getaffinity(0)) // gpus))}


def all_ranks(a, what: str, model: Path, socket_dir: Path, layers: int, tmp: Path) -> list[dict]:
    start_at = time.time() + 20                           # imports and CUDA contexts happen before
    procs = []
    for r in range(a.gpus):
        out = tmp / f"{what}-{r}.json"
        procs.append((out, subprocess.Popen([sys.executable, __file__, "--rank-of", what, "--rank", str(r),
                                             "--gpus", str(a.gpus), "--model", str(model), "--layers", str(layers),
                                             "--socket-dir", str(socket_dir), "--start-at", str(start_at),
                                             "--repeat", str(a.repeat), "--out", str(out)], env=rank_env(a.gpus))))
    for _, p in procs:
        if p.wait() != 0:
            raise SystemExit(f"{what} rank failed (exit {p.returncode})")
    return [json.loads(out.read_text()) for out, _ in procs]


def start_daemons(model: Path, gpus: int, tmp: Path) -> list[Daemon]:
    tmp.mkdir(parents=True, exist_ok=True)
    entry = {"name": "qwen3moe", "path": str(model), "gpus": list(range(gpus)), "tensor_parallel_size": gpus,
             "quantization": QUANT, "engine_version": "bench"}
    cfg = write_config(tmp / "fs.toml", tmp / "run", [entry], device="cuda")
    daemons = [Daemon(tmp, cfg, g) for g in range(gpus)]    # all fill at once, as at boot
    for d in daemons:
        d.wait_ready(3600)
    return daemons


def fill_seconds(d: Daemon) -> float:
    with connect(d.socket, 10) as conn:
        request(conn, protocol.Hello(protocol.VERSION))
        return request(conn, protocol.Status()).body["models"][0]["fill_seconds"]


# ---- the forward pass: Qwen3-MoE in plain torch on this rank's hf-layout shards

def dequant(w: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    rows, cols = w.shape
    s = scale_inv.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    return (w.float() * s).to(torch.bfloat16)


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def forward(W, c: dict, ids: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Logits [tokens, vocab] (gathered over ranks) of one causal sequence."""
    import torch.distributed as dist
    import torch.nn.functional as F

    def reduce(x):
        if world > 1:
            dist.all_reduce(x)
        return x

    def lin(x, name):
        return x @ dequant(W[name + ".weight"], W[name + ".weight_scale_inv"]).T

    hd, eps, T = c["head_dim"], c["rms_norm_eps"], len(ids)
    inv = 1.0 / c["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float32, device=ids.device) / hd)
    ang = torch.outer(torch.arange(T, dtype=torch.float32, device=ids.device), inv)
    cos, sin = (torch.cat([f(ang)] * 2, -1)[:, None].to(torch.bfloat16) for f in (torch.cos, torch.sin))

    def rope(x):                                  # [T, heads, hd]
        return x * cos + torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], -1) * sin

    emb = W["model.embed_tokens.weight"]
    local = ids - rank * emb.shape[0]
    inside = (local >= 0) & (local < emb.shape[0])
    x = reduce(emb[local.clamp(0, emb.shape[0] - 1)] * inside[:, None])
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        h = rms(x, W[p + ".input_layernorm.weight"], eps)
        q, k, v = (lin(h, f"{p}.self_attn.{n}_proj").view(T, -1, hd) for n in "qkv")
        q = rope(rms(q, W[p + ".self_attn.q_norm.weight"], eps))
        k = rope(rms(k, W[p + ".self_attn.k_norm.weight"], eps))
        rep = q.shape[1] // k.shape[1]
        q, k, v = (t.transpose(0, 1)[None] for t in (q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + reduce(lin(y[0].transpose(0, 1).reshape(T, -1), p + ".self_attn.o_proj"))
        h = rms(x, W[p + ".post_attention_layernorm.weight"], eps)
        probs = (h.float() @ W[p + ".mlp.gate.weight"].float().T).softmax(-1)
        top, idx = probs.topk(c["num_experts_per_tok"], -1)
        top = top / top.sum(-1, keepdim=True)
        out = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
        for e in idx.unique().tolist():
            rows, slot = (idx == e).nonzero(as_tuple=True)
            pe = f"{p}.mlp.experts.{e}"
            a = F.silu(lin(h[rows], pe + ".gate_proj")) * lin(h[rows], pe + ".up_proj")
            out.index_add_(0, rows, lin(a, pe + ".down_proj").float() * top[rows, slot, None])
        x = x + reduce(out).to(x.dtype)
    logits = rms(x, W["model.norm.weight"], eps) @ W["lm_head.weight"].T
    if world > 1:
        parts = [torch.empty_like(logits) for _ in range(world)]
        dist.all_gather(parts, logits)
        logits = torch.cat(parts, -1)
    return logits.float()


def forward_main(a) -> None:
    """One rank of the forward (`--gpus` ranks over NCCL, cache) or the reference (one GPU, disk)."""
    import torch.distributed as dist
    reference = a.rank_of == "reference"
    rank, world = (0, 1) if reference else (a.rank, a.gpus)
    torch.cuda.set_device(rank)
    if not reference:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    spec = fast_start.WeightSpec(str(a.model), world, rank, quantization=QUANT, engine_version="bench")
    w = fast_start.fetch(spec, f"cuda:{rank}", socket_dir=a.socket_dir, fallback=reference)
    c = json.loads((a.model / "config.json").read_text())
    with torch.no_grad():
        logits = forward(w, c, torch.tensor(IDS, device=f"cuda:{rank}"), rank, world)
    if rank == 0:
        torch.save({"logits": logits.cpu(), "source": w.source}, a.out)
    if not reference:
        dist.barrier()
        dist.destroy_process_group()


def forward_check(a, root: Path, tmp: Path) -> dict:
    small = checkpoint(root, a.forward_layers)
    common = ["--gpus", str(a.gpus), "--model", str(small), "--layers", str(a.forward_layers)]
    ref_out = tmp / "reference.pt"
    subprocess.run([sys.executable, __file__, "--rank-of", "reference", *common,
                    "--socket-dir", str(tmp / "none"), "--out", str(ref_out)], check=True)
    daemons = start_daemons(small, a.gpus, tmp / "forward")
    try:
        out, port = tmp / "tp.pt", 29500 + os.getpid() % 1000
        run = str(tmp / "forward" / "run")
        procs = [subprocess.Popen([sys.executable, __file__, "--rank-of", "forward", "--rank", str(r), *common,
                                   "--socket-dir", run, "--port", str(port), "--out", str(out)],
                                  env=rank_env(a.gpus))
                 for r in range(a.gpus)]
        if any(p.wait() for p in procs):
            raise SystemExit("a forward rank failed")
    finally:
        for d in daemons:
            d.stop()
    ref, tp = torch.load(ref_out), torch.load(out)
    diff = (tp["logits"] - ref["logits"]).abs().max().item()
    scale = ref["logits"].abs().max().item()
    return {"layers": a.forward_layers, "tp_source": tp["source"], "reference_source": ref["source"],
            "max_abs_diff": diff, "max_abs_logit": scale, "relative": diff / scale,
            "argmax_equal": (tp["logits"].argmax(-1) == ref["logits"].argmax(-1)).float().mean().item()}


# ---- the run

def report(r: dict) -> list[str]:
    lines = [f"{r['params'] / 1e9:.1f}B-parameter Qwen3-MoE FP8 ({r['layers']} layers), "
             f"{r['checkpoint_bytes'] / 1e9:.1f} GB on disk, TP {r['gpus']}; {r['gpu']}, driver {r['driver']}, "
             f"torch {r['torch']}",
             "rank | GiB  | disk fetch (all at once) | fill  | zero_copy (median) | copy (median) | checked",
             "-----|------|--------------------------|-------|--------------------|---------------|--------"]
    for d, f, c in zip(r["disk"], r["fill_s"], r["cache"], strict=True):
        lines.append(f"{d['rank']:4} | {d['bytes'] / 2**30:4.1f} | {d['disk_s']:22.2f} s | {f:4.1f}s | "
                     f"{c['zero_copy_s'] * 1e3:15.1f} ms | {c['copy_s'] * 1e3:10.1f} ms | "
                     f"{d['checked_tensors']}+{c['checked_tensors']}")
    disk = max(d["disk_s"] for d in r["disk"])
    zc, cp = max(c["zero_copy_s"] for c in r["cache"]), max(c["copy_s"] for c in r["cache"])
    lines += [f"restart (slowest rank): disk {disk:.2f} s, zero_copy {zc * 1e3:.1f} ms ({disk / zc:.0f}x), "
              f"copy {cp * 1e3:.1f} ms ({disk / cp:.0f}x); fills {max(r['fill_s']):.1f} s (slowest daemon)"]
    f = r["forward"]
    lines.append(f"forward at {f['layers']} layers, TP {r['gpus']} over NCCL ({f['tp_source']}) vs one GPU "
                 f"({f['reference_source']}): max |diff| {f['max_abs_diff']:.4f} of max |logit| "
                 f"{f['max_abs_logit']:.2f} ({f['relative']:.2%}); argmax equal at {f['argmax_equal']:.0%} "
                 "of positions")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", type=int, default=4, help="GPUs = TP size = daemons = engine ranks")
    ap.add_argument("--layers", type=int, default=SHAPE.num_layers, help="49: about 122B parameters; 24: half")
    ap.add_argument("--forward-layers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--dir", default=str(Path(tempfile.gettempdir()) / "fast-start-bench"))
    ap.add_argument("--json", default="bench-tp.json")
    # internal: one rank's process
    ap.add_argument("--rank-of", choices=("disk", "cache", "forward", "reference"))
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--socket-dir", default="")
    ap.add_argument("--start-at", type=float, default=0.0)
    ap.add_argument("--port", type=int, default=29500)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    if a.rank_of in ("disk", "cache"):
        return rank_main(a)
    if a.rank_of:
        return forward_main(a)
    assert torch.cuda.device_count() >= a.gpus, f"needs {a.gpus} GPUs, sees {torch.cuda.device_count()}"
    root = Path(a.dir)
    model = checkpoint(root, a.layers)
    shape = synth.Shape(**{**SHAPE.__dict__, "num_layers": a.layers})
    driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                            capture_output=True, text=True, check=True).stdout.split("\n")[0]
    r = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(0), "driver": driver,
         "torch": torch.__version__, "gpus": a.gpus, "layers": a.layers, "params": params(shape),
         "checkpoint_bytes": sum(f.stat().st_size for f in model.glob("*.safetensors")), "repeat": a.repeat}
    with tempfile.TemporaryDirectory(prefix="fast-start-tp-") as tmp:
        tmp = Path(tmp)
        r["disk"] = all_ranks(a, "disk", model, tmp / "none", a.layers, tmp)
        daemons = start_daemons(model, a.gpus, tmp / "cache")
        try:
            r["fill_s"] = [fill_seconds(d) for d in daemons]
            r["cache"] = all_ranks(a, "cache", model, tmp / "cache" / "run", a.layers, tmp)
        finally:
            for d in daemons:
                d.stop()
        r["forward"] = forward_check(a, root, tmp)
    Path(a.json).write_text(json.dumps(r, indent=1))
    print("\n".join(report(r)))


if __name__ == "__main__":
    main()

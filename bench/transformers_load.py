"""The transformers restart benchmark (`python -m bench.transformers_load`).

An engine restart measured as an operator sees it: a fresh Python process per restart that
ends with a ready `PreTrainedModel` on the device and its greedy tokens. Three ways, side by
side in one run, on one Llama-shaped bf16 checkpoint (default ~8 GB, page cache hot):
`AutoModelForCausalLM.from_pretrained(device_map=...)` from disk, and `fast_start.transformers.load`
from a daemon's cache in `zero_copy` and `copy` mode. Reports the load call (median of
`--repeat`), what every restart pays regardless (imports, config, CUDA context), the whole
process, and whether every restart produced the same tokens.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from devtools import synth
from fast_start.config import parse_bytes
from devtools.harness import Daemon, write_config

# One restart. "prepare" is what every restart pays whatever the weights' source: imports (the
# model's modeling module pulls in most of transformers), config.json and the CUDA context.
# "load" is the weights: the load call, timed to a synchronized, ready model. Then the tokens.
RESTART = """
import json, sys, time
t0 = time.perf_counter()
import torch, transformers
from fast_start import WeightSpec
from fast_start.transformers import load
path, how, socket_dir, device = sys.argv[1:5]
config = transformers.AutoConfig.from_pretrained(path)
transformers.AutoModelForCausalLM._model_mapping[type(config)]     # imports the modeling module
torch.zeros(1, device=device)
t1 = time.perf_counter()
if how == "from_pretrained":
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map=device)
else:
    spec = WeightSpec(path, engine_version=transformers.__version__)
    model = load(path, spec, device=device, mode=how, socket_dir=socket_dir, fallback=False)
if device != "cpu":
    torch.cuda.synchronize()
t2 = time.perf_counter()
ids = torch.tensor([[1, 5, 9, 200, 17, 3]], device=device)
with torch.no_grad():
    tokens = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)[0].tolist()
print(json.dumps({"prepare_s": t1 - t0, "load_s": t2 - t1, "tokens": tokens,
                  "source": getattr(model, "fast_start_source", "disk")}))
"""
WAYS = ("from_pretrained", "zero_copy", "copy")


def restart(folder: Path, how: str, socket_dir: Path, device: str) -> dict:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", RESTART, str(folder), how, str(socket_dir), device],
                         capture_output=True, text=True, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    r["process_s"] = time.perf_counter() - t0
    return r


def measure(size: int, root: Path, repeat: int, device: str) -> dict:
    import transformers

    shape = synth.llama_of_size(size, hidden_size=4096)
    folder = synth.cached(root, shape, files=max(1, size // 2**32), reuse=True)
    nbytes = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    r = {"checkpoint_bytes": nbytes, "device": device, "transformers": transformers.__version__, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="fast-start-bench-") as tmp:
        tmp = Path(tmp)
        cfg = write_config(tmp / "fs.toml", tmp / "run", [{"name": "llama", "path": str(folder), "gpus": [0],
                                                            "engine_version": transformers.__version__}],
                           device="cpu" if device == "cpu" else "cuda")
        daemon = Daemon(tmp, cfg).wait_ready(900)
        try:
            restart(folder, "from_pretrained", tmp / "run", device)      # warm the page cache
            for _ in range(repeat):         # interleaved, so drift in the machine hits all three alike
                for how in WAYS:
                    r["runs"].setdefault(how, []).append(restart(folder, how, tmp / "run", device))
        finally:
            daemon.stop()
    return r


def report(r: dict) -> list[str]:
    gb = r["checkpoint_bytes"] / 1e9
    runs = r["runs"]
    med = {how: {k: statistics.median(x[k] for x in runs[how]) for k in ("load_s", "process_s", "prepare_s")}
           for how in WAYS}
    same = len({json.dumps(x["tokens"]) for how in WAYS for x in runs[how]}) == 1
    sources = {how: sorted({x["source"] for x in runs[how]}) for how in WAYS}
    lines = [f"{gb:.2f} GB Llama-shaped bf16 checkpoint on {r['device']}, transformers {r['transformers']},"
             f" median of {len(runs['copy'])} fresh processes each"]
    for how in WAYS:
        m = med[how]
        lines.append(f"{how:16} load {m['load_s']:7.3f} s  whole process {m['process_s']:7.2f} s"
                     f"  (prepare {m['prepare_s']:.2f} s)  source {','.join(sources[how])}")
    base = med["from_pretrained"]
    for how in ("zero_copy", "copy"):
        lines.append(f"{how}: load {base['load_s'] / med[how]['load_s']:.1f}x faster than from_pretrained,"
                     f" whole process {base['process_s'] / med[how]['process_s']:.1f}x")
    lines.append(f"same greedy tokens in every restart: {same}")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="8GB", help="checkpoint size (bf16)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dir", default=str(Path(tempfile.gettempdir()) / "fast-start-bench"))
    ap.add_argument("--json", default="bench-transformers.json")
    a = ap.parse_args(argv)
    r = measure(parse_bytes(a.size), Path(a.dir), a.repeat, a.device)
    r["date"] = time.strftime("%Y-%m-%d")
    r["torch"] = torch.__version__
    if torch.cuda.is_available():
        r["gpu"] = torch.cuda.get_device_name(0)
    Path(a.json).write_text(json.dumps(r, indent=1))
    print("\n".join(report(r)))


if __name__ == "__main__":
    main()

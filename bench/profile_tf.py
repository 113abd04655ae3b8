import cProfile, pstats, sys, time, tempfile, subprocess, json, io
from pathlib import Path
import transformers
from fast_start.harness import Daemon, write_config
folder = next(Path("/tmp/fsb").glob("llama-*"))
tmp = Path(tempfile.mkdtemp())
cfg = write_config(tmp / "fs.toml", tmp / "run", [{"name": "llama", "path": str(folder), "gpus": [0], "engine_version": transformers.__version__}])
cfg.write_text(cfg.read_text().replace('device = "cpu"', 'device = "cuda"'))
d = Daemon(tmp, cfg).wait_ready(900)
PROF = """
import cProfile, pstats, sys, time
t0 = time.perf_counter()
import torch, transformers
from fast_start import WeightSpec
from fast_start.transformers import load
path, sock = sys.argv[1:3]
print("imports", time.perf_counter() - t0)
pr = cProfile.Profile(); pr.enable()
m = load(path, WeightSpec(path, engine_version=transformers.__version__), device="cuda:0", socket_dir=sock, fallback=False)
torch.cuda.synchronize()
pr.disable()
pstats.Stats(pr).sort_stats("cumulative").print_stats(45)
"""
try:
    out = subprocess.run([sys.executable, "-c", PROF, str(folder), str(tmp / "run")], capture_output=True, text=True)
    print(out.stdout[-14000:], out.stderr[-3000:])
finally:
    d.stop()

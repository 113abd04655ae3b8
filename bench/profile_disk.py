import cProfile, pstats, sys, time
import torch
from fast_start import synth
from fast_start.fingerprint import WeightSpec
from fast_start.materialize import load_from_disk
sys.path.insert(0, "bench")
from tp_restart import checkpoint
folder = checkpoint(__import__("pathlib").Path("/tmp/tpb"), 1)
spec = WeightSpec(str(folder), 2, 0, quantization="fp8-checkpoint", engine_version="bench")
torch.zeros(1, device="cuda:0")
for i in range(2):
    t0 = time.perf_counter(); w = load_from_disk(spec, "cuda:0")[0]; torch.cuda.synchronize(); t1 = time.perf_counter()
    print(len(w), "tensors", round(t1 - t0, 3), "s", round((t1 - t0) / len(w) * 1e3, 3), "ms/tensor", flush=True)
    del w
cProfile.run("load_from_disk(spec, 'cuda:0'); torch.cuda.synchronize()", "/tmp/p.out")
pstats.Stats("/tmp/p.out").sort_stats("tottime").print_stats(15)

"""A short-lived engine: fetch a model, then leave the way a test, a health check or a warm-up
script does. `python tests/exit_engine.py SOCKET_DIR MODEL DEVICE MODE HOW`; prints the source.

HOW: `end` (the script's end), `del` (the weights deleted, collected), `raise` (an uncaught
exception: exit 1), `sys_exit` (sys.exit(7)), `fork` (a child forked after the fetch reads
nothing on a GPU, exits 11 at its script's end; the parent exits 0 if it saw 11).
"""
import gc
import os
import sys

import torch

import fast_start

socket_dir, model, device, mode, how = sys.argv[1:6]
weights = fast_start.fetch(fast_start.WeightSpec(model, engine_version="test"), device=device, mode=mode,
                           fallback=False, socket_dir=socket_dir)
first = next(iter(weights.values()))
torch.cuda.synchronize() if first.is_cuda else None
print(weights.source, flush=True)
if how == "del":
    del weights, first
    gc.collect()
elif how == "raise":
    raise ValueError("the engine's own error")
elif how == "sys_exit":
    sys.exit(7)
elif how == "fork":
    pid = os.fork()
    if pid == 0:
        if not first.is_cuda:
            float(first.float().sum())      # the child reads its inherited CPU map
        sys.exit(11)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    float(first.float().sum())              # the parent's weights still read after the child's exit
    sys.exit(0 if code == 11 else 100 + code)

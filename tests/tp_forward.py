"""One rank of a tensor-parallel forward pass on fetched shards (run as a process per rank).

python tp_forward.py FOLDER RANK WORLD BACKEND DEVICE SOCKET_DIR OUT PORT
Writes the full logits (gathered) to OUT on rank 0, and the fetch's source to OUT.RANK.source.
"""
import os
import sys

import torch
import torch.distributed as dist

import fast_start
from tiny_llama import TinyLlama, config

IDS = [[1, 5, 9, 200, 17, 3, 77, 1000, 4, 8]]


def main(folder, rank, world, backend, device, socket_dir, out, port):
    rank, world = int(rank), int(world)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world)
    spec = fast_start.WeightSpec(folder, tensor_parallel_size=world, rank=rank, engine_version="test")
    weights = fast_start.fetch(spec, device=device, socket_dir=socket_dir)
    with open(f"{out}.{rank}.source", "w") as f:
        f.write(weights.source)
    with torch.device("meta"):
        model = TinyLlama(config(folder), tp=world, rank=rank).to(torch.bfloat16)
    fast_start.load_into(model, weights).eval()
    with torch.no_grad():
        logits = model(torch.tensor(IDS, device=device))
    if rank == 0:
        torch.save(logits.float().cpu(), out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
    # The forward is done and written. gloo's teardown in the interpreter's exit can abort
    # ("terminate called without an active exception") once a peer has gone: skip it.
    sys.stdout.flush()
    os._exit(0)

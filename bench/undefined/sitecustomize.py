"""On PYTHONPATH for every process of a bench run with FAST_START_BENCH_UNDEFINED=1 (the daemon,
its fill worker, each engine): memory torch hands out uninitialized is filled (NaN for floats,
the largest value for integers). A parameter that no checkpoint writes and no processing reads
(vLLM 0.26 allocates a W4A16 NVFP4 MoE layer's input global scales, which only W4A4 loads) then
holds the same bytes under every loader, not whatever its process's allocator held before, and
a digest over every parameter can compare loaders."""
import torch

torch.use_deterministic_algorithms(True, warn_only=True)
torch.utils.deterministic.fill_uninitialized_memory = True

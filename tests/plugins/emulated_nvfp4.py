"""Test only: NVFP4 linear kernels for vLLM's CPU build (which has none), registered as a
`vllm.general_plugins` entry point so that the engine and the fast-start fill worker load them
alike. Never installed: tests put this folder on PYTHONPATH.

- W4A16 checkpoints: vLLM forces its Marlin kernel, which has no CPU build.
  `EmulatedMarlinNvFp4LinearKernel` stands in for it, doing in PyTorch what Marlin's processing does in kind: it repacks every
  weight into another layout (E2M1 codes as int32 words, k-major), turns the e4m3 block scales
  into the model dtype k-major, folds a factor into the global scale, and makes a per-process
  `workspace`, a mutable int32 lock buffer that every GEMM takes and gives back (Marlin's is
  sized by the GPU's SM count). Its `fast_start_finish` makes the workspace again.
- W4A4 checkpoints: vLLM's own `EmulationNvFp4LinearKernel`, made available on the CPU.

`FAST_START_TEST_FP4=marlin-first` puts the Marlin stand-in ahead of vLLM's emulation for W4A4
too (an engine whose kernel family differs from the fill's).
"""
import os

import torch

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
SCALE_FACTOR = 2.0 ** 7         # folded out of the block scales into the global scale, as Marlin does


def register() -> None:
    from vllm.model_executor.kernels import linear
    from vllm.model_executor.kernels.linear.nvfp4.emulation import EmulationNvFp4LinearKernel
    from vllm.platforms import PlatformEnum

    if getattr(linear, "_fast_start_test_fp4", False):
        return
    linear._fast_start_test_fp4 = True
    marlin = linear.MarlinNvFp4LinearKernel

    class EmulatedMarlinNvFp4LinearKernel(marlin):
        @classmethod
        def is_supported(cls, compute_capability=None):
            return True, None

        def process_weights_after_loading(self, layer):
            print("emulated Marlin: repacking a layer's weights", flush=True)
            n, k = layer.output_size_per_partition, layer.input_size_per_partition
            packed = layer.weight.data                                  # uint8 [n, k/2]
            codes = torch.stack([packed & 0xF, packed >> 4], -1).reshape(n, k).to(torch.int32)
            words = codes.T.reshape(k // 8, 8, n)                      # k-major, 8 codes to a word
            shifts = (torch.arange(8, dtype=torch.int32) * 4).view(1, 8, 1)
            layer.weight = torch.nn.Parameter((words << shifts).sum(1, dtype=torch.int32), requires_grad=False)
            scale = layer.weight_scale.data.float().T.contiguous() / SCALE_FACTOR
            layer.weight_scale = torch.nn.Parameter(scale.to(layer.params_dtype), requires_grad=False)
            layer.weight_global_scale = torch.nn.Parameter(layer.weight_global_scale.data.float() * SCALE_FACTOR,
                                                           requires_grad=False)
            self.fast_start_finish(layer)

        def fast_start_finish(self, layer):
            layer.workspace = torch.zeros(16, dtype=torch.int32, device=layer.weight.device)

        def apply_weights(self, layer, x, bias=None):
            lock = layer.workspace
            if int(lock[0]) != 0:
                raise RuntimeError("Marlin workspace lock already held: the workspace is shared")
            lock[0] += 1
            words = layer.weight                                        # int32 [k/8, n]
            shifts = (torch.arange(8, dtype=torch.int32) * 4).view(1, 8, 1)
            codes = ((words.unsqueeze(1) >> shifts) & 0xF).reshape(-1, words.shape[1])   # [k, n]
            table = torch.tensor(E2M1, dtype=torch.float32)
            values = table[(codes & 7).long()] * torch.where(codes >= 8, -1.0, 1.0)
            scale = layer.weight_scale.float().repeat_interleave(16, 0)                   # [k, n]
            w = values * scale * layer.weight_global_scale.float()
            out = torch.matmul(x.float(), w).to(x.dtype)
            lock[0] -= 1
            return out if bias is None else out + bias

    linear.MarlinNvFp4LinearKernel = EmulatedMarlinNvFp4LinearKernel
    cpu = linear._POSSIBLE_NVFP4_KERNELS.setdefault(PlatformEnum.CPU, [])
    cpu.append(EmulationNvFp4LinearKernel)
    if os.environ.get("FAST_START_TEST_FP4") == "marlin-first":
        cpu.insert(0, EmulatedMarlinNvFp4LinearKernel)

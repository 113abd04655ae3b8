"""Test only: a pure-torch block-FP8 linear kernel for vLLM's CPU build (which has none without
AMX), registered as a `vllm.general_plugins` entry point so that the engine and the fast-start
fill worker load it alike. Never installed: tests put this folder on PYTHONPATH.

`FAST_START_TEST_FP8` picks a variant, to stand in for what differs between CUDA setups:
- "plain" (default): processing only re-wraps the weights, as vLLM's CUTLASS block kernel does;
- "other": the same kernel under another class name (an engine that chose another kernel);
- "gap": processing also sets state that vLLM's pre-processed pass does not rebuild;
- "mended": processing sets the two attributes vLLM 0.30-0.33's pre-processed pass leaves unset
  (`logical_output_size` on the kernel, `deep_gemm_warmup_provider` on the layer);
- "table": the kernel computes a lookup table as it is made, on the default device, and holds it
  (a tensor that a model built on `meta` leaves on meta, and the cache does not hold).
"""
import os

import torch


def register() -> None:
    from vllm.model_executor import kernels
    from vllm.model_executor.kernels.linear.scaled_mm.BlockScaledMMLinearKernel import Fp8BlockScaledMMLinearKernel
    from vllm.platforms import PlatformEnum

    class EmulatedFp8BlockKernel(Fp8BlockScaledMMLinearKernel):
        apply_input_quant = False

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if VARIANT == "table":
                self.table = torch.arange(1024, dtype=torch.float32)

        @classmethod
        def is_supported(cls, compute_capability=None):
            return True, None

        @classmethod
        def can_implement(cls, config):
            return True, None

        def apply_weights(self, layer, x, bias=None, **kwargs):
            p = self._get_layer_params(layer)
            w, s = p.weight, p.block_scale
            bn, bk = layer.weight_block_size
            scale = s.float().repeat_interleave(bn, 0)[: w.shape[0]].repeat_interleave(bk, 1)[:, : w.shape[1]]
            return torch.nn.functional.linear(x, (w.float() * scale).to(x.dtype), bias)

        def apply_block_scaled_mm(self, A, B, As, Bs):
            raise NotImplementedError

        def process_weights_after_loading(self, layer):
            super().process_weights_after_loading(layer)
            if VARIANT == "gap":
                self.emulated_processed = True
            if VARIANT == "mended":
                self.logical_output_size = layer.weight.shape[0]
                layer.deep_gemm_warmup_provider = self

    VARIANT = os.environ.get("FAST_START_TEST_FP8", "plain")
    if VARIANT == "mended":
        EmulatedFp8BlockKernel.logical_output_size = None
    kernel = EmulatedFp8BlockKernel
    if VARIANT == "other":
        kernel = type("OtherEmulatedFp8BlockKernel", (EmulatedFp8BlockKernel,), {})
    chosen = kernels.linear._POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CPU]
    if not any(k.__name__.endswith("EmulatedFp8BlockKernel") for k in chosen):
        chosen.insert(0, kernel)

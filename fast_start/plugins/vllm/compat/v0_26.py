"""vLLM 0.26 to 0.29, read in 0.26 (run on the H200 with its CUDA build)."""

PREPROCESSED_PASS = False       # every quantized layer a processed cache holds is finished by fast-start
COUNTS_MAPPED_WEIGHTS = False
SKIPS_KERNEL: frozenset[str] = frozenset()
# compressed-tensors' NVFP4 MoE method re-assigns its global scales as plain tensors after the
# Marlin repack; its kernel reads them there.
KEPT = {"CompressedTensorsW4A4Nvfp4MoEMethod": ("w13_weight_scale_2", "w2_weight_scale_2")}

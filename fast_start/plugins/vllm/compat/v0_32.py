"""vLLM 0.32 and 0.33, read in 0.32 (run by `make test` with its CPU build)."""

PREPROCESSED_PASS = True
COUNTS_MAPPED_WEIGHTS = True
# ModelOpt's FP4 linear method returns from its processing under the pass before its kernel's
# (which makes Marlin's workspace) and before it sets `is_w4a16_nvfp4` (`install.mend_gaps`).
SKIPS_KERNEL = frozenset({"ModelOptLinearMethod"})
KEPT: dict[str, tuple[str, ...]] = {}       # the NVFP4 MoE method's global scales stay parameters

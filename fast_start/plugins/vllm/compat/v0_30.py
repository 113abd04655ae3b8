"""vLLM 0.30 and 0.31: read for the pre-processed pass, which they gained; the rest as in 0.32,
whose code these carry (not run)."""

PREPROCESSED_PASS = True
COUNTS_MAPPED_WEIGHTS = False
SKIPS_KERNEL = frozenset({"ModelOptLinearMethod"})
KEPT: dict[str, tuple[str, ...]] = {}

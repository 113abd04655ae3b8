"""What differs between the vLLM versions fast-start supports: one module per version range.

Each module states, as constants, what was read in that range's source and what the fill and
the engine branch on:

- `PREPROCESSED_PASS`: vLLM skips a quant method's tensor transforms for weights installed
  already processed (`weights_already_processed()`, 0.30), where the method says it can;
- `COUNTS_MAPPED_WEIGHTS`: vLLM is told the bytes of weights mapped from elsewhere
  (`BaseModelLoader.get_external_weight_memory`, 0.32), and sizes the KV cache and its start-up
  check knowing them; before, fast-start counts them itself (`loader._wrap_runners`);
- `SKIPS_KERNEL`: quant methods whose pre-processed pass returns before their kernel's own
  processing, so a kernel with per-process state goes without it (`preprocessed.py`);
- `KEPT`: tensors a method's processing leaves as plain attributes, not parameters, which the
  fill caches as buffers (`preprocessed.kept`).

`current()` is the module for the vLLM installed here. A version outside every range gets the
nearest range's module, with a warning: the fill's kernel plan and the engine's attribute
signature still catch what differs (a miss, never a wrong engine).
"""
from __future__ import annotations

import functools
import importlib
import logging
import re

log = logging.getLogger("vllm.fast_start")

# (first version, first version after, module), oldest first.
RANGES = (((0, 26), (0, 30), "v0_26"), ((0, 30), (0, 32), "v0_30"), ((0, 32), (0, 34), "v0_32"))


def module_for(version: str):
    """The module of the range holding vLLM `version` ("0.26.0", "0.32.1.dev3+g…"); outside them
    all, the nearest one, with a warning."""
    found = re.match(r"(\d+)\.(\d+)", version)
    at = (int(found[1]), int(found[2])) if found else RANGES[-1][0]
    name = next((m for low, high, m in RANGES if low <= at < high), None)
    if name is None:
        name = RANGES[0][2] if at < RANGES[0][0] else RANGES[-1][2]
        log.warning("fast-start: vLLM %s is outside the versions it was read against (%s); it uses the rules of "
                    "the nearest (%s)", version, ", ".join(f"{a[0]}.{a[1]}-{b[0]}.{b[1] - 1}" for a, b, _ in RANGES),
                    name.replace("v", "").replace("_", "."))
    return importlib.import_module(f"{__name__}.{name}")


@functools.cache
def current():
    """The module for the vLLM installed here."""
    import vllm
    return module_for(vllm.__version__)

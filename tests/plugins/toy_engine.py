"""Test only: a trivial engine that another package would register through the
`fast_start.engines` entry point (tests/test_engines.py writes that package's metadata).

Its rule: every floating tensor of the checkpoint doubled, under the checkpoint's names (its
"as-loaded layout", built by fast-start's own pipeline). Its settings: a [model.toy] table
(`Settings`), which goes into the fingerprint's `engine_options`. It fills TP 1 alone.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from fast_start import quant
from fast_start.headers import rank_bytes, read_identity


class Tables:
    VOCAB_PADDING = 0

    @staticmethod
    def arrange(dims, tp_size, tensors):
        for name, t in tensors:
            yield name, t * 2 if t.is_floating_point() else t


@dataclass(frozen=True)
class Settings:
    mode: str = "a"
    """Toy's mode: "a" or "b"."""
    passes: int = 1
    """How often Toy's kernels run."""


class Toy:
    name = "toy"
    title = "Toy"
    distributions = ("fast-start-test-toy",)
    module = "toy_engine"
    filler = "toy_engine:fill"
    settings = Settings
    moved = {}

    def check(self, model):
        if model.settings.mode not in ("a", "b"):
            yield "mode", f"is {model.settings.mode!r}", "use \"a\" or \"b\""
        if model.tensor_parallel_size != 1:
            yield "tensor_parallel_size", f"is {model.tensor_parallel_size}", "Toy fills TP 1 only"

    def options(self, model) -> str:
        return json.dumps(asdict(model.settings), sort_keys=True)

    def expert_parallel(self, model) -> str:
        return ""

    def requested_quantization(self, configured: str) -> str:
        return configured

    def identity(self, folder: Path, configured: str):
        architecture, checkpoint_config = read_identity(folder)
        return architecture, configured, quant.hash_of({"engine": self.name, "checkpoint": checkpoint_config})

    def estimate(self, spec) -> int:
        return rank_bytes(Path(spec.path), spec.dtype, 1)

    def tables(self):
        return Tables


def fill(spec, device, progress, chunk):
    from fast_start import materialize
    return materialize.materialize(spec, device, chunk, progress)


ENGINE = Toy()

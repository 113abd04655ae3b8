"""What a vLLM fill records beside its tensors: the manifest's `engine`, typed.

Written by the fill (`fill.py`) as JSON in the manifest, read back once where an engine takes
the cache (`loader.py`) and validated there: a record this version cannot read is a miss naming
the key, never a half-installed model.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from ...errors import CacheMiss

STAGES = ("loaded", "processed")


@dataclass(frozen=True)
class FillRecord:
    engine: str                     # the engine's name, as `engines` knows it
    # "loaded": the tensors as vLLM's weight loaders left them (the engine runs vLLM's processing);
    # "processed": after `process_weights_after_loading` (the engine installs and finishes them).
    stage: str
    plan: dict                      # each quantized module's quant method and kernels (`state.kernel_plan`)
    attention: list                 # the attention backends the fill's vLLM chose (`attention.recording`)
    buffers: tuple[str, ...] = ()   # names of the cached tensors that are buffers, not parameters
    removed: tuple[str, ...] = ()   # "processed": parameters vLLM's processing dropped
    signature: dict | None = None   # "processed": every module's Python-side state (`state.signature`)
    kernels: dict | None = None     # "processed": kernel libraries and GPU (`state.kernel_environment`)
    attrs: dict | None = None       # where a model built on meta completes from the cache: attributes by value

    def to_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict) -> "FillRecord":
        """The record of a manifest's `engine`; CacheMiss naming what this version cannot read."""
        def bad(what: str):
            return CacheMiss(f"the fill's record {what}", "evict the model (fast-start evict) so that it is "
                             "filled again by this fast-start")
        if not isinstance(d, dict):
            raise bad("is not a table")
        known = {f.name for f in fields(cls)}
        if set(d) - known:
            raise bad(f"has keys this version does not know: {', '.join(sorted(set(d) - known))}")
        missing = [f.name for f in fields(cls) if f.name not in d and f.name in ("engine", "stage", "plan", "attention")]
        if missing:
            raise bad(f"lacks {', '.join(missing)}")
        if d["stage"] not in STAGES or (d["stage"] == "processed" and not isinstance(d.get("signature"), dict)):
            raise bad(f"has stage {d['stage']!r} without what that stage needs")
        kinds = {"plan": dict, "attention": list, "buffers": list, "removed": list, "signature": dict,
                 "kernels": dict, "attrs": dict}
        for key, kind in kinds.items():
            if d.get(key) is not None and not isinstance(d[key], kind):
                raise bad(f"has {key} of type {type(d[key]).__name__}, not {kind.__name__}")
        return cls(**{**d, "buffers": tuple(d.get("buffers", ())), "removed": tuple(d.get("removed", ()))})

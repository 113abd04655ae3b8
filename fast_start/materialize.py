"""The weight pipeline: checkpoint → dtype/quantization → tensor-parallel shard → tensors or arena.

`derive` is the one function that turns a checkpoint into a rank's tensors. The daemon's worker
runs it into an arena (`materialize`), an engine's disk fallback runs it into ordinary tensors
(`load_from_disk`), and `plan` runs it on the `meta` device to learn every output's name, dtype
and shape from the headers alone, so the arena can be laid out before any data is read. One code
path for all three is what makes cache and disk bit-identical.

Cast-only tensors are read as slices (`get_slice`), so a rank reads only its part from disk;
tensors quantized here are read whole because a per-tensor scale needs the whole tensor.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace

import torch

from . import arena as arenas
from . import dtypes, engines, fp8, quant, shard, staging
from .checkpoint import Checkpoint, open_checkpoint, tensor_reader
from .errors import QuantizationError
from .fingerprint import Fingerprint, WeightSpec, fingerprint, layouts
from .arena import checksum
from .manifest import ArenaEntry, Manifest, pack

Reader = Callable[[str, "shard.Cut | None"], torch.Tensor]


# Where a tensor the pipeline yields as it was staged may be staged: (name, shape, dtype) -> a
# tensor of that shape and dtype on the device (a fill's place in its arena), or None.
Place = Callable[[str, torch.Size, torch.dtype], "torch.Tensor | None"]


def derive(ckpt: Checkpoint, spec: WeightSpec, read: Reader, device: str | torch.device = "cpu",
           place: Place | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, contiguous tensor on `device`) for every tensor of this rank in `spec.layout`.

    Nothing of a yielded tensor is held here once the next is asked for: a consumer that lets go
    of each holds one tensor at a time on the device (merges in progress aside, an engine's
    `arrange`).
    """
    method, dtype, tp = check_spec(ckpt, spec)
    tensors = _rank_tensors(ckpt, read, method, dtype, tp, staging.to_device(device), place)
    tables = _tables(spec)
    for name, t in tables.arrange(ckpt.dims, tp.size, tensors) if tables else tensors:
        yield name, t.contiguous()
        del t


def _rank_tensors(ckpt: Checkpoint, read: Reader, method: quant.Method, dtype: torch.dtype, tp: shard.TP,
                  to_device: staging.ToDevice, place: Place | None) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's tensors under the checkpoint's names, in checkpoint order."""
    for name, info in ckpt.tensors.items():
        if shard.SKIP.search(name):
            continue
        scale = shard.SCALE.match(name)
        if scale:                                   # a pre-quantized checkpoint's scale
            t = to_device(read(name, None))
            yield name, shard.shard(name, t, tp, ckpt.tensors[scale.group(1)].shape)
        elif method.quantize and quant.is_quantized(name):
            q, s = fp8.quantize(method, to_device(read(name, None)))
            yield name, shard.shard(name, q, tp)
            yield name + method.scale_suffix, shard.shard(name + method.scale_suffix, s, tp, info.shape)
            del q, s
        else:
            t = read(name, shard.cut_for(name, info.shape, tp))
            want = _served_dtype(name, t.dtype, dtype)
            yield name, to_device(t, want, place(name, t.shape, want) if place else None)
        t = None


# Exponent-only block scales (MX formats): never weights, whatever their name.
_SCALES = tuple(getattr(torch, n) for n in ("float8_e8m0fnu",) if hasattr(torch, n))


def _served_dtype(name: str, stored: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    # FP8 weights and activation scales of a pre-quantized checkpoint keep their stored dtype.
    if not stored.is_floating_point or stored == fp8.FP8 or stored in _SCALES or name.endswith("input_scale"):
        return stored
    return dtype


def _tables(spec: WeightSpec):
    """fast-start's own tables for the as-loaded layout of the engine `spec.layout` names (None:
    "hf", the checkpoint's names); raises for a layout no engine names, or whose engine has none."""
    if spec.layout == "hf":
        return None
    engine = engines.get(spec.layout)
    if engine is None:
        raise QuantizationError(f"layout {spec.layout!r} is not supported", f"use one of {', '.join(layouts())}")
    tables = engine.tables()
    if tables is None:
        raise QuantizationError(f"layout {spec.layout!r} is filled by its engine alone, which the fill worker's "
                                "environment lacks", f"install {engine.title} where the fill worker runs (worker_python)")
    return tables


def check_spec(ckpt: Checkpoint, spec: WeightSpec):
    """Everything that can be said about a spec from headers alone; raises before any data is read."""
    tables = _tables(spec)
    method = quant.method(spec.quantization)
    quant.require_verified(method)
    if tables and method.name != "none":
        raise QuantizationError(f"layout {spec.layout!r} from fast-start's own tables caches unquantized weights "
                                f"only, not {method.name!r}", f"install {engines.get(spec.layout).title} where the "
                                "fill worker runs (worker_python) so that it fills the model, or use layout = \"hf\"")
    dtype = dtypes.torch_dtype(quant.check_dtype(spec.dtype))
    tp = shard.check_tp(ckpt.dims, spec.tensor_parallel_size, spec.rank,
                        tables.VOCAB_PADDING if tables else 0)
    quantized = [n for n, i in ckpt.tensors.items() if i.dtype == fp8.FP8]
    if method.prequantized and not quantized:
        raise QuantizationError(f"{ckpt.folder} holds no FP8 weights, so {method.name!r} has nothing to pass through",
                                "use quantization = \"fp8\" to quantize while loading, or \"none\"")
    if not method.prequantized and quantized:
        raise QuantizationError(f"{ckpt.folder} is already FP8 ({quantized[0]!r}); {method.name!r} would re-quantize it",
                                "use quantization = \"fp8-checkpoint\"")
    for n in quantized:
        if n + "_scale" not in ckpt.tensors and n + "_scale_inv" not in ckpt.tensors:
            raise QuantizationError(f"FP8 tensor {n!r} in {ckpt.folder / ckpt.tensors[n].file} has no scale",
                                    f"the checkpoint needs {n}_scale or {n}_scale_inv next to it")
    for name, info in ckpt.tensors.items():       # every tensor must be covered by a rule
        if not shard.SKIP.search(name) and not shard.SCALE.match(name):
            shard.cut_for(name, info.shape, tp)
    return method, dtype, tp


def aliases(ckpt: Checkpoint, spec: WeightSpec) -> dict[str, str]:
    """Tied weights the checkpoint stores once (vLLM's model holds a tied lm_head as the embedding)."""
    if spec.layout == "hf" and ckpt.dims.tie_word_embeddings and "lm_head.weight" not in ckpt.tensors:
        return {"lm_head.weight": "model.embed_tokens.weight"}
    return {}


def plan(ckpt: Checkpoint, spec: WeightSpec) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) of every output, computed on `meta` from the headers alone."""
    def read(name: str, cut: shard.Cut | None) -> torch.Tensor:
        info = ckpt.tensors[name]
        t = torch.empty(info.shape, dtype=info.dtype, device="meta")
        return t if cut is None else t.narrow(cut.dim, cut.start, cut.length)
    return [(n, dtypes.name_of(t.dtype), tuple(t.shape)) for n, t in derive(ckpt, spec, read, "meta")]


def load_from_disk(spec: WeightSpec, device: str | torch.device = "cpu",
                   ckpt: Checkpoint | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str], Fingerprint]:
    """The disk path: this rank's tensors as ordinary tensors on `device`."""
    ckpt = ckpt or open_checkpoint(spec.path)
    plan(ckpt, spec)    # every error that headers can reveal, before any data is read
    with tensor_reader(ckpt) as read:
        tensors = {n: _owned(t) for n, t in derive(ckpt, spec, read, device)}
    return tensors, aliases(ckpt, spec), fingerprint(spec, ckpt)


def _owned(t: torch.Tensor) -> torch.Tensor:
    # safetensors hands out views of its file mapping where no cast or copy happened. The engine
    # must own its weights: a checkpoint rewritten in place would otherwise change them (or SIGBUS).
    return t if t.untyped_storage().resizable() else t.clone()


def materialize(spec: WeightSpec, device: str = "cpu", chunk: int | None = None,
                progress: Callable[[int, int], None] | None = None,
                ckpt: Checkpoint | None = None) -> tuple[Manifest, list[int]]:
    """Fill arenas with this rank's tensors: returns the manifest and the sealed arena fds."""
    ckpt = ckpt or open_checkpoint(spec.path)
    entries, sizes = pack(plan(ckpt, spec), chunk)
    by_name, final = {e.name: e for e in entries}, []
    with arenas.Written(f"{ckpt.folder.name}-r{spec.rank}", device, sum(e.nbytes for e in entries), progress) as out:
        writers = [out.open(size) for size in sizes]

        def place(name: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor | None:
            """A tensor yielded as staged (its entry has its name, shape and dtype) is staged in its
            arena: on a GPU the fill then holds no copy of it beside the arenas."""
            e = by_name.get(name)
            if e is None or e.shape != tuple(shape) or e.dtype != dtypes.name_of(dtype):
                return None
            return writers[e.arena].typed(e.offset, dtype, e.shape)

        with tensor_reader(ckpt) as read:
            for name, t in derive(ckpt, spec, read, device, place):     # compute where the arena is
                e = by_name[name]
                out.write(e.arena, e.offset, t)
                final.append(replace(e, checksum=checksum(t)))
                del t
        out.seal()
    fds = out.fds
    manifest = Manifest(fingerprint(spec, ckpt), tuple(ArenaEntry(w.size, w.device) for w in writers),
                        tuple(final), aliases(ckpt, spec))
    manifest.validate()
    return manifest, fds


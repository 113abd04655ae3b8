"""Arenas: the memory one model shard's tensors are packed into, held and shared as file descriptors.

On the CPU an arena is a `memfd`: written once with `pwrite`, then sealed (no write, grow or
shrink, and no further seals), so no process holding the fd, the daemon included, can change
the bytes a client has mapped. A client maps it read-only (`zero_copy`: writes through such a
tensor fault) and builds dtype views at the manifest's offsets. The mapping lives as long as the
last tensor that uses it. The fd is the capability: whoever holds it can read the weights, so
fds only travel over an authenticated Unix socket (`SCM_RIGHTS`).

The CUDA arena (`vmm.py`: VMM allocations exported as POSIX fds) has the same interface: a
writer with `size`, `device`, `write(offset, tensor)`, `finish() -> fd` and `abort()`, and a
read-only map of an fd as a flat uint8 tensor.
"""
from __future__ import annotations

import _thread
import fcntl
import gc
import mmap
import os
import time
import types
import warnings
from collections.abc import Iterator
from queue import SimpleQueue
from typing import TYPE_CHECKING

import torch

from . import cudadrv, dtypes, table
from .errors import ArenaError

if TYPE_CHECKING:
    from .manifest import Manifest

_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL
_WRITE_STEP = 1 << 26
_CHUNK = 1 << 28   # bytes per checksum step (a multiple of _BLOCK)
_BLOCK = 4096
_NAP_S, _NAPS = 2e-5, 500      # `Imported.ready` first waits in 500 naps of 20 us (see there)


class MemfdWriter:
    """Fills a new memfd of `size` bytes; `finish()` seals it and hands over the fd."""
    device = "cpu"

    def __init__(self, size: int, name: str):
        self.fd = os.memfd_create(f"fast-start:{name}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
        except OSError as e:
            os.close(self.fd)
            raise ArenaError(f"cannot size a {size}-byte arena for {name}: {e}",
                             "free memory or lower the model's footprint") from None
        self.size = size

    def write(self, offset: int, tensor: torch.Tensor) -> None:
        assert tensor.is_contiguous() and offset + tensor.nbytes <= self.size
        data = memoryview(tensor.detach().cpu().reshape(-1).view(torch.uint8).numpy())
        done = 0
        while done < len(data):
            done += os.pwrite(self.fd, data[done:done + _WRITE_STEP], offset + done)

    def finish(self) -> int:
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)
        fd, self.fd = self.fd, -1
        return fd

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def create(size: int, device: str, name: str):
    """A writer for a new arena of at least `size` bytes on "cpu" or "cuda:N"."""
    if device == "cpu":
        return MemfdWriter(size, name)
    if device.startswith("cuda"):
        from . import vmm
        return vmm.VmmWriter(size, torch.device(device).index or 0, name)
    raise ArenaError(f"arena device {device!r} is unknown", 'use "cpu" or "cuda:N"')


def map_readonly(fd: int, size: int, arena_device: str, device: torch.device, pending: list | None = None) -> torch.Tensor:
    """Map an arena fd read-only as a flat uint8 tensor on `device`; the fd may be closed afterwards.

    `arena_device` is where the arena lives ("cpu" or a GPU UUID); it must be `device` itself.
    With a `pending` list a GPU map returns before its access is set and joins the list: views
    can be made meanwhile, but nothing may read them before `ready(pending)`.
    """
    if arena_device == "cpu" and device.type == "cpu":
        return _map_memfd(fd, size)
    if device.type == "cuda":
        ordinal = device.index if device.index is not None else torch.cuda.current_device()
        if cudadrv.device_uuid(ordinal) == arena_device:
            imported = Imported(fd, size, ordinal, readonly=True)
            if pending is None:
                imported.ready()
            else:
                pending.append(imported)
            # torch keeps a reference to the Imported object for as long as any view of the tensor lives.
            return torch.as_tensor(imported, device=f"cuda:{ordinal}")
    raise ArenaError(f"arena on {arena_device} cannot be mapped on {device}",
                     "fetch on the device the daemon serves")


def ready(pending: list[Imported]) -> None:
    """Wait until every map in `pending` can be read; the first failure's ArenaError."""
    errors = [e for e in (p.ready(raise_error=False) for p in pending) if e is not None]
    if errors:
        raise errors[0]


class Imported:
    """An arena fd imported and mapped on a GPU by an engine (`cudadrv`: no cuda-bindings import
    on the engine's start); unmapped when garbage-collected, i.e. when its last tensor view dies.

    Setting the access (the part of a map whose time grows with the size) runs on the process's
    access thread (`_access_jobs`), so the caller can make its views meanwhile; `ready()` waits
    for it.
    """

    def __init__(self, fd: int, size: int, ordinal: int, readonly: bool):
        self.size, self.ordinal = size, ordinal
        self.read_by = None     # an event after the map's only reader (a copy), else any kernel may read it
        self.ptr = cudadrv.map_fd(fd, size, ordinal)
        # The job holds no reference to self: the last one could otherwise be dropped, and
        # __del__ wait for the access, in that very job on the access thread. (A copy's maps are
        # dropped there on purpose, by a later job: `_unmap_once_copied`.)
        self.done, self.errors = _thread.allocate_lock(), []
        self.done.acquire()
        started = _thread.allocate_lock()
        started.acquire()
        _access_jobs().put((_set_access, (self.ptr, size, ordinal, readonly, self.done, self.errors, started)))
        # Wait until the access thread is about to enter the driver call: it needs the GIL to get
        # there, and the views this thread makes next would hold the GIL until they are all made.
        started.acquire()
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (self.ptr, False),
                                         "version": 3}

    def ready(self, raise_error: bool = True) -> ArenaError | None:
        # Naps first, not one sleep until the access thread is done: on the H200 machine a thread
        # blocked for the rest of a 32 GiB access (0.5-1 ms) returned 23-300 us after it ended, one
        # that naps 14-29 us (presumably its CPU idles less deeply). An access that takes longer than
        # the naps (140 GB would take 4 ms) is waited for as before.
        for _ in range(_NAPS):
            if self.done.acquire(timeout=_NAP_S):
                break
        else:
            self.done.acquire()
        self.done.release()
        if self.errors and raise_error:
            raise self.errors[0]
        return self.errors[0] if self.errors else None

    def __del__(self):
        if not getattr(self, "ptr", None) or not cudadrv.loaded():
            return
        if self.ready(raise_error=False) is None:     # else no kernel could read it, nor wait on the GPU
            if self.read_by is not None:
                self.read_by.synchronize()              # its only reader is done
            else:
                torch.cuda.synchronize(self.ordinal)    # no kernel may still read what we unmap
        cudadrv.unmap(self.ptr, self.size)
        self.ptr = None


_jobs: SimpleQueue | None = None
_view_queues: list[SimpleQueue] | None = None
_VIEWS_APART = 2048         # tables of fewer tensors are made by the caller alone (`_views_of`)
_VIEW_THREADS = 3


def _forget_access_thread() -> None:
    global _jobs, _view_queues
    _jobs = _view_queues = None     # a forked child has none of the threads: its first fetch starts its own


os.register_at_fork(after_in_child=_forget_access_thread)


def _access_jobs() -> SimpleQueue:
    """The queue of the thread that sets maps' access, one per process, started on first use
    (starting a thread took 0.1 ms of a fetch: `warm_ups` starts it while the daemon answers)."""
    global _jobs
    if _jobs is None:
        jobs = SimpleQueue()
        _thread.start_new_thread(_serve, (jobs,))
        _jobs = jobs
    return _jobs


def _view_workers() -> list[SimpleQueue]:
    """The queues of the threads that make views of large tables (`_views_of`), one each, started on
    first use (`warm_ups` starts them while the daemon answers): as many as the CPUs this process
    may run on allow, besides its own, up to three; none on one CPU."""
    global _view_queues
    if _view_queues is None:
        queues = [SimpleQueue() for _ in range(min(_VIEW_THREADS, len(os.sched_getaffinity(0)) - 1))]
        for queue in queues:
            _thread.start_new_thread(_serve, (queue,))
        _view_queues = queues
    return _view_queues


def _serve(jobs: SimpleQueue) -> None:
    while True:
        job, args = jobs.get()
        try:
            job(*args)
        except Exception:       # noqa: BLE001 - the thread serves on; a job reports to its caller itself
            pass
        del args        # nothing of a job outlives it here


def _drop_when_done(held: list, copied, ordinal: int) -> None:
    """Wait (sleeping, so the GIL is free) until `copied` has happened, then drop `held`: its maps
    are unmapped here. On the maps' GPU: this thread must not make a context on another."""
    with torch.cuda.device(ordinal):
        while not copied.query():
            time.sleep(_NAP_S * 10)
        held.clear()


def warm_ups(device: torch.device) -> Iterator[None]:
    """What a process's first map of arenas on `device` and first views of them would do, one step
    per `next()`, for a fetch to run while the daemon answers: start the access thread, then make a
    tensor from an array interface, a dtype view, a strided view and an `unbind` of a tiny tensor
    (torch's first call of each took 0.05-0.15 ms of a fetch on the H200), then start the view
    threads (a large table's views are made on them: `_views_of`). A fetch stops when the
    reply arrives: the map and the views then pay what is left after the access has begun, where it
    overlaps the access instead of delaying it. Nothing it makes is kept."""
    try:
        if device.type == "cuda":
            _access_jobs()
            yield
        probe = torch.empty(16, dtype=torch.uint8, device=device)
        yield
        if device.type == "cuda":
            probe = torch.as_tensor(types.SimpleNamespace(__cuda_array_interface__=probe.__cuda_array_interface__),
                                    device=device)
            yield
        probe = probe.view(torch.bfloat16)
        yield
        with torch.inference_mode():        # no step ends inside it: the caller's mode is never changed
            probe.as_strided((2, 2), (2, 1), 0).unbind(0)
        yield
        _view_workers()
    except Exception:       # a warm-up only: whatever failed here, the map itself does again and reports
        return


def _set_access(ptr: int, size: int, ordinal: int, readonly: bool, done, errors: list, started) -> None:
    started.release()       # the caller waits for this, not for the access
    try:
        cudadrv.set_access(ptr, size, ordinal, readonly)
    except Exception as e:     # whatever it is, the caller must not read the range
        errors.append(e if isinstance(e, ArenaError) else ArenaError(f"cuMemSetAccess failed: {e!r}",
                                                                     "check the GPU and its driver"))
    finally:
        done.release()


def _map_memfd(fd: int, size: int) -> torch.Tensor:
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    if seals & _SEALS != _SEALS:
        raise ArenaError("arena memfd is not sealed against writes", "refill the cache from a trusted daemon")
    if os.fstat(fd).st_size != size:
        raise ArenaError(f"arena has {os.fstat(fd).st_size} bytes, the manifest says {size}", "refill the cache")
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    with warnings.catch_warnings():
        # torch warns that the buffer is not writable: that is the point of a read-only map.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mm, dtype=torch.uint8)


def tensors(manifest: Manifest, fds: list[int], mode: str, device: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor of a manifest from its arena fds (which the caller keeps and may close)."""
    maps = map_arenas(fds, [(a.size, a.device) for a in manifest.arenas], mode, device)
    return from_table(table.encode(manifest), maps)


def map_arenas(fds: list[int], arenas: list[tuple[int, str]], mode: str, device: torch.device,
               pending: list | None = None) -> list[torch.Tensor]:
    """Each arena (size, device) from its fd as a flat uint8 tensor on `device`.

    `zero_copy`: read-only maps (with a `pending` list, not yet readable: see `map_readonly`).
    `copy`: one device copy of each arena into memory the caller owns (one large copy runs at
    full bandwidth; per-tensor clones would not), the maps dropped as soon as it is done: on a
    GPU by the access thread, while the caller goes on (`_unmap_once_copied`).
    """
    if len(fds) != len(arenas):
        raise ArenaError(f"got {len(fds)} arena fds for {len(arenas)} arenas",
                         "ask the daemon again; the reply was incomplete")
    if mode != "copy":
        return [map_readonly(fd, size, where, device, pending) for fd, (size, where) in zip(fds, arenas)]
    imported: list[Imported] = []
    maps = [map_readonly(fd, size, where, device, imported) for fd, (size, where) in zip(fds, arenas)]
    ready(imported)
    copies = [m.clone() for m in maps]
    if imported:
        _unmap_once_copied(maps, imported)
    return copies


def _unmap_once_copied(maps: list[torch.Tensor], imported: list[Imported]) -> None:
    """GPU maps that a copy reads, unmapped on the access thread once the copy is done: the caller
    goes on (an engine builds its model) while the GPU copies. The copies are ordered on the
    stream they were made on, as any tensor torch makes; the daemon's memory stays mapped, and so
    allocated, until they are made, whatever the daemon does meanwhile."""
    ordinal = imported[0].ordinal       # one device: map_readonly maps on `device` only
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(ordinal))
    for each in imported:
        each.read_by = copied
    _access_jobs().put((_drop_when_done, ([maps, imported], copied, ordinal)))


def from_table(data: bytes | bytearray, maps: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every tensor of a tensor table (`table.py`) as a view into the mapped arenas `maps`.

    One view per run (its tensors along a leading dimension), split with `unbind`; a table of
    thousands of tensors is split in parts on the view threads at once (`_views_of`). Each run is
    checked exactly (arena, dtype, shape against nbytes, alignment, its last element inside its
    arena) before its view is made, so a damaged or hostile table cannot make a view reach
    outside an arena.
    """
    d, rows, names = table.parse(data)
    width = table.FIXED + 2 * d
    typed: dict[tuple[int, int], torch.Tensor] = {}
    runs: list[tuple] = []          # (typed view, count, shape, stride, step, offset), in elements
    first = 0                       # the run's first tensor, in `names`
    for at in range(0, len(rows), width):
        count, step, offset, nbytes, arena, code, ndim = rows[at:at + table.FIXED]
        shape, stride = rows[at + table.FIXED:at + table.FIXED + ndim].tolist(), \
            rows[at + table.FIXED + d:at + table.FIXED + d + ndim].tolist()
        if not 0 <= code < len(table.ITEMSIZES):
            raise ArenaError(f"tensor table entry {names[first]!r} has an unknown dtype",
                             "use a fast-start client of the daemon's version")
        itemsize = table.ITEMSIZES[code]
        _check_run(names[first], offset, nbytes, arena, ndim, shape, stride, count, step, itemsize, d, maps)
        if (arena, code) not in typed:
            flat = maps[arena]
            typed[arena, code] = flat[:flat.numel() // itemsize * itemsize].view(
                dtypes.torch_dtype(dtypes.TABLE[code].name))
        runs.append((typed[arena, code], count, shape, stride, step // itemsize, offset // itemsize))
        first += count
    collecting = gc.isenabled()
    gc.disable()        # thousands of new tensors would start a full collection of the engine's heap
    try:
        out = dict(zip(names, _views_of(runs, len(names))))
    finally:
        if collecting:
            gc.enable()
    if len(out) != len(names):
        raise ArenaError("tensor table names a tensor twice", "evict and refill the model")
    return out


def _views_of(runs: list[tuple], n: int) -> list[torch.Tensor]:
    """The `n` tensors of `runs`, in order. A table of thousands (an MoE rank) is cut into equal
    parts made at once by the caller and the view threads: torch makes a view without the GIL
    and takes it only to wrap each in a Python object, so the parts overlap."""
    workers = _view_workers() if n >= _VIEWS_APART else None
    if not workers:
        return _views(runs)
    parts = _parts(runs, n, len(workers) + 1)
    results: list = [None] * len(parts)
    dones = []
    for i in range(1, len(parts)):
        done = _thread.allocate_lock()
        done.acquire()
        workers[i - 1].put((_view_job, (parts[i], results, i, done)))
        dones.append(done)
    try:
        results[0] = _views(parts[0])
    finally:
        for done in dones:      # every part is waited for: no thread may still make views of these maps
            done.acquire()
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        raise failed[0]
    return [t for part in results for t in part]


def _views(runs: list[tuple]) -> list[torch.Tensor]:
    tensors: list[torch.Tensor] = []
    # Strided views made in inference mode skip autograd's view tracking (about half of their
    # cost); of a normal tensor they are normal tensors, which may become Parameters or (in
    # copy mode) be written in place. The dtype views are made outside it (`from_table`): one
    # made in it would be an inference tensor, and so would every view of it.
    with torch.inference_mode():
        for view, count, shape, stride, step, offset in runs:
            if count == 1:
                tensors.append(view.as_strided(shape, stride, offset))
            else:
                tensors.extend(view.as_strided((count, *shape), (step, *stride), offset).unbind(0))
    return tensors


def _view_job(part: list[tuple], results: list, i: int, done) -> None:
    try:
        results[i] = _views(part)
    except BaseException as e:      # noqa: BLE001 - the caller raises it
        results[i] = e
    finally:
        done.release()


def _parts(runs: list[tuple], n: int, pieces: int) -> list[list[tuple]]:
    """`runs` (view, count, shape, stride, step, offset) cut into `pieces` lists of runs of about
    n / pieces tensors each, in order: a run that spans a cut is split in two at a tensor."""
    size = -(-n // pieces)
    parts: list[list[tuple]] = [[]]
    room = size
    for view, count, shape, stride, step, offset in runs:
        while count:
            if not room:
                parts.append([])
                room = size
            take = min(count, room)
            parts[-1].append((view, take, shape, stride, step, offset))
            offset, count, room = offset + take * step, count - take, room - take
    return parts


def _check_run(name: str, offset: int, nbytes: int, arena: int, ndim: int, shape: list[int], stride: list[int],
               count: int, step: int, itemsize: int, d: int, maps: list[torch.Tensor]) -> None:
    """Exact checks of one run (Python integers: no overflow); ArenaError naming its first tensor."""
    size = 1
    for s in shape:
        size *= s
    ok = 0 <= arena < len(maps) and 0 <= ndim <= d and min(shape + stride, default=0) >= 0 and count >= 1 \
        and size * itemsize == nbytes and offset >= 0 and offset % itemsize == 0 \
        and (count == 1 or (step > 0 and step % itemsize == 0))
    if ok:
        span = 0 if 0 in shape else (1 + sum((n - 1) * s for n, s in zip(shape, stride))) * itemsize
        ok = offset + (count - 1) * step + span <= maps[arena].numel()
    if not ok:
        raise ArenaError(f"tensor table entry {name!r} (and {count - 1} like it) does not fit its arena",
                         "evict and refill the model; use a fast-start client of the daemon's version")


def checksum(t: torch.Tensor) -> str:
    """Device-independent checksum of a tensor's bytes in row-major order (a view: of its copy).

    The bytes, zero-padded, are read as int64 words in blocks of 4 KiB; the result is the sum of
    all words and the sum of block sums weighted by block position (both mod 2**64). Integer
    sums wrap the same way on every device and in any order, so CPU and GPU agree, and one pass
    runs at memory speed. It detects corruption (stray writes, torn copies), not tampering.
    """
    b = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if b.data_ptr() % 8:
        b = b.clone()   # int64 views need 8-byte alignment
    s1 = s2 = 0
    for start in range(0, b.numel(), _CHUNK):
        c = b[start:start + _CHUNK]
        if c.numel() % _BLOCK:
            c = torch.cat([c, c.new_zeros(_BLOCK - c.numel() % _BLOCK)])
        blocks = c.view(torch.int64).view(-1, _BLOCK // 8).sum(1)
        first = start // _BLOCK + 1
        pos = torch.arange(first, first + blocks.numel(), dtype=torch.int64, device=blocks.device)
        s1 += int(blocks.sum())
        s2 += int((blocks * pos).sum())
    return f"{s1 % 2**64:016x}{s2 % 2**64:016x}"

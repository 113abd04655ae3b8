"""The engine side: `fetch` a rank's weights and `load_into` a module built on `meta`.

`fetch` returns the same tensors whether they come from a daemon's arenas or from disk: both run
`materialize.derive`. In `zero_copy` mode arena tensors are read-only views of shared memory
(writing through one faults); in `copy` mode each arena is copied once into memory the engine
owns, its mapping dropped and its fd closed before the next is mapped. A copy tells the daemon
that it takes the model over (`Release` with `copied`) once the reply has come and is its
model's, and only then may the daemon let go of the model (`on_release = "drop"`): a hand-over
that breaks off before (a timeout, an engine killed, a reply turned down) costs the cache nothing,
and no arena is ever held twice but the one being copied (the rest are in flight to the engine).

A fetch from the cache is one request and one reply per daemon asked (`Acquire` names the
protocol version and the device; `Acquired` carries the lease, the arena fds and the tensor
table), and the tensors are built a run of equal shapes at a time (`arena.from_table`): a fresh
engine process has its weights in milliseconds, however many tensors a rank has. Each side works
while the other does: the engine connects before it takes the checkpoint files' identities (the
daemon admits the connection meanwhile) and sends its request before it reads the headers (the
fields of the fingerprint only they give left empty: `fingerprint.requested`); while the daemon
answers it reads them, to check the reply's fingerprint against its own (a reply that is not its
model's is given back, and the engine asks again with the whole fingerprint), and warms up
torch's first views as far as the reply leaves time for (`arena.warm_ups`). Everything runs on
the caller's thread: the engine's process is left with no thread of fast-start's.
"""
from __future__ import annotations

import itertools
import logging
import os
import socket
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch

from . import arena as arenas
from . import protocol, watch
from .errors import ArenaError, CacheMiss, CheckpointError, FastStartError, LoadError
from .fingerprint import Fingerprint, WeightSpec, fingerprint, requested
from .transport import connect, request, socket_dir as _socket_dir, sockets as _sockets

if TYPE_CHECKING:
    from .manifest import Manifest      # not imported on the engine's path (its import costs)


log = logging.getLogger("fast_start")

FRESH_S = 1.0       # a connection older than this when its request is ready is made anew (daemons cut idle ones)


class Weights(Mapping):
    """name -> tensor for one rank. Tied names (`aliases`) resolve to the tensor they share.

    `source` is "cache" or "disk"; `fingerprint` is what the tensors were derived from.
    """

    def __init__(self, tensors: dict[str, torch.Tensor], aliases: dict[str, str], source: str,
                 fingerprint: Fingerprint):
        self.tensors, self.aliases = tensors, aliases
        self.source, self.fingerprint = source, fingerprint
        self.lease: int | None = None     # the daemon's lease id for cache weights
        self.socket: str | None = None    # the daemon that holds the lease
        self.model: str | None = None     # the name it serves them under
        self.engine: dict = {}            # a vLLM fill's stage, kernel plan and signature (manifest.engine)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[self.aliases.get(name, name)]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def __repr__(self) -> str:
        return f"Weights({len(self)} tensors, source={self.source!r}, rank={self.fingerprint.rank})"


def fetch(spec: WeightSpec, device: str | torch.device = "cpu", mode: str = "zero_copy",
          fallback: bool = True, socket_dir: str | None = None, connect_timeout: float = 5.0) -> Weights:
    """This rank's weights on `device` (`mode`: a `protocol.Mode`): from a daemon's cache where one
    holds them, else from disk.

    The daemon is looked for in `socket_dir`, else `$FAST_START_SOCKET_DIR`, else /run/fast-start.
    A miss loads from disk with one log line naming the reason; with `fallback=False` it raises
    `CacheMiss` instead. The misses, in the order they can happen: no daemon socket; a daemon
    that cannot be reached or is not trusted (`transport.connect`); one of another device (passed
    over: a miss only where no daemon serves this one); the daemon's own miss, which names the
    fingerprint fields that differ, files not those of the fill, a checkpoint this user cannot
    read, no room for a copy, a model evicted or not yet filled (`misses.py`); a checkpoint file
    replaced while this engine read it (`_Headers`); a reply of another fingerprint than the one
    read, or malformed, or with fds missing (`_use`). The closest miss (fewest differing fields)
    is the one named. A checkpoint that cannot be read raises `CheckpointError` either way.
    """
    try:
        mode = protocol.Mode.of(mode, "fetch mode")
    except ValueError as e:
        raise FastStartError(str(e), "pass fetch(..., mode=...) one of them") from None
    device = torch.device(device)
    # The first daemon is connected to before the checkpoint is read: it admits the connection
    # and readies a thread for it while this process takes the files' identities.
    directory = _socket_dir(socket_dir)
    daemons = _daemons(directory, device, connect_timeout)
    first = next(daemons, None)
    try:
        headers = _Headers(spec, watch.identity(spec.path))
        try:
            if first is None:
                headers.fingerprint()       # a checkpoint error is the caller's
                raise CacheMiss(f"no fast-start daemon socket in {directory}",
                                "start the daemon (systemctl start fast-start@N) or pass socket_dir")
            return _from_cache(headers, device, mode, directory, itertools.chain([first], daemons), connect_timeout)
        except CheckpointError:
            raise
        except FastStartError as miss:
            fields = getattr(miss, "fields", ())
            if not fallback:
                raise CacheMiss(miss.what, miss.fix, fields) from None
            log.warning("fast-start: cache miss for %s rank %d (%s%s); loading from disk", spec.path, spec.rank,
                        miss.what, f"; differing fields: {', '.join(fields)}" if fields else "")
    finally:
        if first is not None and first[1] is not None:
            first[1].close()        # used or not (closing twice is harmless)
    from .materialize import load_from_disk     # safetensors and the pipeline: the disk path only
    tensors, aliases, fp = load_from_disk(spec, device)
    return Weights(tensors, aliases, "disk", fp)


_Daemon = tuple[Path, "socket.socket | None", float, tuple]    # path, connection, when made, or why not


def _daemons(directory: Path, device: torch.device, timeout: float) -> Iterator[_Daemon]:
    """A connection to each daemon socket in `directory`, this GPU's first, made as it is asked
    for: (path, connection, time.monotonic() when made, ()), or (path, None, 0.0, (reason, fix, ()))."""
    for path in _likely_first(_sockets(directory), device):
        try:
            conn = connect(path, timeout)
        except (FastStartError, OSError) as e:
            yield path, None, 0.0, _unreachable(path, e)
            continue
        yield path, conn, time.monotonic(), ()


def _unreachable(path: Path, e: FastStartError | OSError) -> tuple:
    """A miss (reason, fix, fields) for a daemon that could not be connected to or asked."""
    if isinstance(e, FastStartError):
        return f"{path}: {e.what}", e.fix, tuple(getattr(e, "fields", ()))
    return f"{path}: {e.strerror or e}", "check that the daemon runs", ()


class _Headers:
    """The engine's own fingerprint of `spec`, computed once: while the first daemon answers (its
    checkpoint's headers and config.json are read then), or when first asked for. Each shard is
    opened once, and its identity must still be the one sent (`files`): a shard replaced
    meanwhile is a miss. A checkpoint error is raised each time it is asked for."""

    def __init__(self, spec: WeightSpec, files: watch.Identity):
        self.spec, self.files = spec, files
        self.result: Fingerprint | None = None
        self.error: FastStartError | None = None

    def fingerprint(self) -> Fingerprint:
        if self.result is None and self.error is None:
            seen: watch.Identity = {}
            try:
                self.result = fingerprint(self.spec, identities=seen)
            except FastStartError as e:
                self.error = e
            changed = sorted(n for n, identity in seen.items() if self.files.get(n) != identity)
            if changed and self.error is None:
                self.error = CacheMiss(f"{changed[0]} changed while this engine read the checkpoint",
                                       "fetch again once the checkpoint is written", ("files",))
        if self.error is not None:
            raise self.error
        return self.result

    def read(self, device: torch.device) -> Iterator[None]:
        """The steps for the wait for a reply: the fingerprint, then the first views' warm-ups."""
        try:
            self.fingerprint()
        except FastStartError:
            pass                # raised where the fingerprint is used
        yield
        yield from arenas.warm_ups(device)


def _from_cache(headers: _Headers, device: torch.device, mode: str, directory: Path, daemons: Iterator[_Daemon],
                timeout: float) -> Weights:
    """One round trip per daemon asked: `Acquire` names the protocol and the device, and the reply
    carries the lease, the fds and the tensor table. The first request goes out before the
    checkpoint is read (`fingerprint.requested`, with the files' identities); the fingerprint is
    read while the daemon answers, and checked against the reply's. A daemon that cannot tell
    from that much is asked again with the whole fingerprint: its answer names the reason."""
    ask = protocol.Acquire(requested(headers.spec).to_dict(), mode, headers.files, protocol.VERSION,
                           _device_id(device), partial=1, path=str(Path(headers.spec.path).absolute()))
    misses = []    # (reason, fix, differing fields)
    for path, conn, opened, miss in daemons:
        if conn is None:
            misses.append(miss)
            continue
        try:
            if time.monotonic() - opened > FRESH_S:        # slow storage: the daemon may have closed it
                conn.close()
                conn = connect(path, timeout)
            with conn:
                reply = _ask(conn, ask, headers, device)
        except CheckpointError:
            raise
        except (FastStartError, OSError) as e:
            misses.append(_unreachable(path, e))
            continue
        if isinstance(reply, Weights):
            reply.socket = str(path)
            return reply
        if not isinstance(reply, protocol.Miss):
            misses.append((f"{path}: a {reply.kind!r} reply to an acquire", "use a fast-start client of the daemon's "
                           "version", ()))
        elif reply.fields != ["device"]:      # a daemon of another GPU: not a miss of ours
            misses.append((reply.reason + (f" (model {reply.model!r})" if reply.model else ""),
                           reply.fix or "run `fast-start fingerprints` and compare with this engine's spec",
                           reply.fields))
    if not misses:
        raise CacheMiss(f"no daemon in {directory} serves device {ask.device}", "check the daemon's config")
    reason, fix, fields = min(misses, key=lambda m: (not m[2], len(m[2])))
    raise CacheMiss(reason, fix, tuple(fields))


def _ask(conn: socket.socket, ask: protocol.Acquire, headers: _Headers, device: torch.device):
    """The weights a daemon's answer to `ask` gives, else its reply (a miss). A partial `ask` is
    asked again whole where the daemon could not match it, or matched a model whose fingerprint is
    not the one the engine read (another quantization of the same files, a header rewritten
    unseen); a lease the engine does not use is given back."""
    reply, fds = request(conn, ask, with_fds=True, meanwhile=headers.read(device), first_batch=True)
    batches = protocol.fd_batches(conn, reply, fds)
    try:
        want = headers.fingerprint()
        again = isinstance(reply, protocol.Miss) and reply.fields == ["partial"]
        if isinstance(reply, protocol.Acquired) and ask.partial and not _holds(reply, want):
            _close_all(batches)
            _give_back(conn, reply)
            again, reply, batches = True, None, iter(())     # nothing held any more, should the re-ask fail
        if again:
            whole = protocol.Acquire(want.to_dict(), ask.mode, ask.files, ask.protocol, ask.device, path=ask.path)
            reply, fds = request(conn, whole, with_fds=True, first_batch=True)
            batches = protocol.fd_batches(conn, reply, fds)
    except BaseException:
        _close_all(batches)
        if isinstance(reply, protocol.Acquired):
            _give_back(conn, reply)
        raise
    if not isinstance(reply, protocol.Acquired):
        _close_all(batches)
        return reply
    handed = ask.mode == "copy" and _holds(reply, want)
    if handed:
        batches = _handed_over(conn, reply, batches)
    try:
        return _use(reply, batches, want, ask.mode, device)
    except FastStartError:
        if not handed:
            _give_back(conn, reply)
        raise


def _handed_over(conn: socket.socket, reply: protocol.Acquired, batches: Iterator[list[int]]) -> Iterator[list[int]]:
    """A copy's fd batches, the daemon told first that this engine takes the model over: its
    reply and the rest of the fds are already on their way (a batch is read, copied and closed
    before the next), and the daemon's answer is read after them. The copy goes on whatever the
    daemon answers: should it have gone away, its fds went with it."""
    try:
        protocol.send(conn, protocol.Release(reply.lease, copied=True))
    except OSError as e:
        log.warning("fast-start: could not tell the daemon that lease %d's copy is handed over: %s", reply.lease, e)
        yield from batches
        return
    yield from batches
    try:
        answer, _ = protocol.recv(conn, accept_fds=False)
        if isinstance(answer, protocol.Error):
            raise FastStartError(answer.what, answer.fix)
    except (FastStartError, OSError) as e:
        log.warning("fast-start: the daemon's answer to lease %d's hand-over: %s", reply.lease, e)


def _give_back(conn: socket.socket, reply: protocol.Acquired) -> None:
    """Release the lease of a reply the engine turns down; the daemon keeps the model."""
    try:
        request(conn, protocol.Release(reply.lease))
    except (FastStartError, OSError) as e:
        log.warning("fast-start: could not release lease %d: %s", reply.lease, e)


def _close(fds: list[int]) -> None:
    for i, fd in enumerate(fds):
        if fd >= 0:
            os.close(fd)
            fds[i] = -1


def _close_all(batches: Iterator[list[int]]) -> None:
    """Read and close whatever fds of a reply are left (the connection is then in step again)."""
    for batch in batches:
        _close(batch)


def _likely_first(sockets: list[Path], device: torch.device) -> list[Path]:
    """The daemon of this GPU's index first (`gpu<N>.sock`, N as the host numbers it), then the rest."""
    if device.type != "cuda":
        return sockets
    index = device.index if device.index is not None else torch.cuda.current_device()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    if visible != [""]:
        index = int(visible[index]) if index < len(visible) and visible[index].strip().isdigit() else -1
    return sorted(sockets, key=lambda p: p.name != f"gpu{index}.sock")


def _use(reply: protocol.Acquired, batches: Iterator[list[int]], want: Fingerprint, mode: str,
         device: torch.device) -> Weights:
    """Weights from an Acquired reply: the arenas mapped a batch of fds at a time (each fd closed
    once its arena is mapped, before the next batch is read), the table's views."""
    try:
        head = _Head.of(reply.manifest)
        if not _holds(reply, want):
            raise CacheMiss("the daemon answered with a different fingerprint", "report this as a bug",
                            head.fingerprint.diff(want))
        maps: list[torch.Tensor] = []
        for batch in batches:
            try:
                maps += arenas.map_arenas(batch, head.arenas[len(maps):len(maps) + len(batch)], mode, device,
                                          close=True)
            finally:
                _close(batch)       # the fds an error left open (map_arenas marks those it closed -1)
        if len(maps) != len(head.arenas):
            raise ArenaError(f"got {len(maps)} arena fds for {len(head.arenas)} arenas",
                             "ask the daemon again; the reply was incomplete")
    finally:
        _close_all(batches)         # the batches an error left unread
    tensors = arenas.from_table(reply.attachment, maps)
    bad = [a for a, t in head.aliases.items() if not isinstance(t, str) or t not in tensors or a in tensors]
    if bad:
        raise ArenaError(f"the daemon's manifest has invalid aliases {bad[:5]}", "evict and refill the model")
    weights = Weights(tensors, head.aliases, "cache", want)
    weights.engine, weights.model = head.engine, reply.model
    weights.lease = reply.lease if mode == "zero_copy" else None   # a copy's lease ended at its hand-over
    return weights


class _Head(NamedTuple):
    """A manifest less its tensors: what a daemon sends beside the tensor table (`table.py`)."""
    fingerprint: Fingerprint
    arenas: list[tuple[int, str]]       # (size, device) of each
    aliases: dict[str, str]
    engine: dict                        # the engine's record of its fill ({} for fast-start's own)

    @classmethod
    def of(cls, d) -> "_Head":
        """The head a reply's JSON object holds; ArenaError naming what is malformed."""
        try:
            arenas = [(int(a["size"]), str(a["device"])) for a in d["arenas"]]
            return cls(Fingerprint.from_dict(d["fingerprint"]), arenas, dict(d["aliases"]), dict(d.get("engine", {})))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ArenaError(f"the daemon's manifest is malformed ({e!r})",
                             "use a fast-start client of the daemon's version") from None


def _holds(reply: protocol.Acquired, want: Fingerprint) -> bool:
    """Whether a daemon's reply holds the very fingerprint the engine read (a partial request can
    match a model of the same files read otherwise: another quantization)."""
    return isinstance(reply.manifest, dict) and reply.manifest.get("fingerprint") == want.to_dict()


def _device_id(device: torch.device) -> str:
    """How daemons name a device: "cpu", or the GPU's UUID (never an index: CUDA_VISIBLE_DEVICES differs)."""
    if device.type == "cpu":
        return "cpu"
    from .cudadrv import device_uuid
    return device_uuid(device.index if device.index is not None else torch.cuda.current_device())


def from_arenas(manifest: Manifest, fds: list[int], mode: str = "zero_copy",
                device: str | torch.device = "cpu") -> Weights:
    """Build weights from arena fds (the caller keeps ownership of the fds and may close them);
    `arena.tensors` says what each mode maps."""
    tensors = arenas.tensors(manifest, fds, mode, torch.device(device))
    weights = Weights(tensors, dict(manifest.aliases), "cache", manifest.fingerprint)
    weights.engine = manifest.engine
    return weights


def release(weights: Weights, connect_timeout: float = 5.0) -> None:
    """Give a zero-copy lease back early (an engine that turned the cache down); errors are logged."""
    if weights.lease is None or weights.socket is None:
        return
    try:
        with connect(Path(weights.socket), connect_timeout) as conn:
            request(conn, protocol.Hello(protocol.VERSION))
            request(conn, protocol.Release(weights.lease))
    except (FastStartError, OSError) as e:
        log.warning("fast-start: could not release lease %d at %s: %s", weights.lease, weights.socket, e)
    weights.lease = None


def tell_role(weights: Weights, role: str, connect_timeout: float = 5.0) -> None:
    """Tell the daemon what the engine holding `weights`' lease does now (`protocol.ROLES`);
    errors are logged: a role is the operator's view, never the engine's failure."""
    if weights.lease is None or weights.socket is None:
        return
    try:
        with connect(Path(weights.socket), connect_timeout) as conn:
            request(conn, protocol.Hello(protocol.VERSION))
            request(conn, protocol.Role(weights.lease, role))
    except (FastStartError, OSError) as e:
        log.warning("fast-start: could not tell %s that lease %d is %s: %s", weights.socket, weights.lease, role, e)


def load_into(module: torch.nn.Module, weights: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    """Replace a `meta` module's parameters and persistent buffers with `weights`, keeping ties.

    Tied parameters (one object under several names) get one tensor under all their names.
    Raises `LoadError` naming missing, unexpected and wrong-shaped or wrong-dtype tensors;
    nothing is replaced unless everything fits. Non-persistent buffers (rotary caches) are the
    caller's to recompute.
    """
    groups: dict[int, list[str]] = {}
    state = module.state_dict(keep_vars=True)
    for name, t in state.items():
        groups.setdefault(id(t), []).append(name)
    chosen, missing, wrong, used = {}, [], [], set()
    for names in groups.values():
        found = next((n for n in names if n in weights), None)
        if found is None:
            missing += names
            continue
        used.update(n for n in names if n in weights)
        src, want = weights[found], state[names[0]]
        if src.shape != want.shape or src.dtype != want.dtype:
            wrong.append(f"{found}: got {src.dtype} {tuple(src.shape)}, module has {want.dtype} {tuple(want.shape)}")
        chosen[tuple(names)] = src
    unexpected = [n for n in weights if n not in used]
    if missing or unexpected or wrong:
        raise fit_error(missing, unexpected, wrong,
                        "build the module for the same architecture, TP rank, dtype and quantization as the weights")
    for names, src in chosen.items():
        value = src if not isinstance(state[names[0]], torch.nn.Parameter) else torch.nn.Parameter(src, requires_grad=False)
        for name in names:
            owner, _, attr = name.rpartition(".")
            sub = module.get_submodule(owner)
            table = sub._parameters if attr in sub._parameters else sub._buffers
            table[attr] = value
    return module


def fit_error(missing: list[str], unexpected: list[str], wrong: list[str], fix: str) -> LoadError:
    """One LoadError listing (the first few of) each kind of misfit between weights and a module."""
    return LoadError("weights do not fit the module: " + "; ".join(
        f"{label} {items[:5]}{' …' if len(items) > 5 else ''}"
        for label, items in (("missing", missing), ("unexpected", unexpected), ("mismatched", wrong)) if items), fix)


def cached(spec: WeightSpec, device: str | torch.device = "cpu", socket_dir: str | None = None,
           connect_timeout: float = 5.0) -> tuple[int, str]:
    """Bytes the daemon serving `device` holds for exactly `spec`'s fingerprint, and that daemon's
    `on_release`; (0, "") if none does. Asked by vLLM's start-up memory check, never by a fetch:
    `reports` is imported here, off the fetch path, whose import its record classes would slow."""
    from . import reports

    digest = fingerprint(spec).digest()
    device_id = _device_id(torch.device(device))
    for path in _sockets(_socket_dir(socket_dir)):
        try:
            with connect(path, connect_timeout) as conn:
                if request(conn, protocol.Hello(protocol.VERSION)).device != device_id:
                    continue
                held = reports.read(reports.Fingerprints, request(conn, protocol.Fingerprints()).body)
        except (FastStartError, OSError):
            continue
        found = [m.bytes for m in held.models if m.digest == digest]
        if found:
            return found[0], held.on_release
    return 0, ""

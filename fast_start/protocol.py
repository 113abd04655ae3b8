"""The wire protocol between engines, the CLI, the daemon and its fill worker.

Frames are a 4-byte big-endian length and a UTF-8 JSON object with a `kind`; each kind is a
dataclass below and `decode` accepts exactly its fields with their types. File descriptors ride
on a frame as `SCM_RIGHTS`. There is no pickle anywhere: a frame can only ever become one of
these dataclasses.

Trust model: the socket lives in a directory only the daemon's user can write; the daemon
checks every peer's uid and groups with `SO_PEERCRED`/`SO_PEERGROUPS` before reading a byte,
and a client checks the directory, the socket and the daemon's credentials before sending one.
An arena fd is a read capability for that model's weights and is only ever sent to a peer that
passed this check. Inside that boundary peers are still not trusted to be well-formed: any
frame may be garbage, oversized, truncated or slow, and gets an error reply or a closed
connection, never a crash or a stall of other connections. The daemon receives frames with no
room for ancillary data, so file descriptors sent *to* it are discarded by the kernel and
never occupy one of its descriptors.
"""
from __future__ import annotations

import array
import json
import os
import socket
import time
from dataclasses import dataclass, field, fields

from .errors import FastStartError

VERSION = 2                    # of every frame below; a worker of another version is refused
MAX_REQUEST = 1 << 20          # what the daemon reads from a client
MAX_REPLY = 256 << 20          # manifests of large MoE models run to megabytes
MAX_FDS = 253                  # the kernel's limit per message (SCM_MAX_FD)
_HEADER = 4


class ProtocolError(FastStartError):
    """A frame was malformed or of an unexpected kind; the stream is still in step."""


class FramingError(ProtocolError):
    """A frame was oversized or truncated: the stream is out of step and must be closed."""


@dataclass(frozen=True)
class Hello:
    protocol: int
    kind: str = "hello"


@dataclass(frozen=True)
class Status:
    kind: str = "status"


@dataclass(frozen=True)
class Fingerprints:
    kind: str = "fingerprints"


@dataclass(frozen=True)
class Acquire:
    fingerprint: dict
    mode: str
    files: dict                   # the engine's checkpoint files: name -> [dev, inode, size, mtime_ns]
    kind: str = "acquire"


@dataclass(frozen=True)
class Release:
    lease: int
    kind: str = "release"


@dataclass(frozen=True)
class Evict:
    model: str = ""               # "" evicts every model
    kind: str = "evict"


@dataclass(frozen=True)
class Evictions:
    kind: str = "evictions"


@dataclass(frozen=True)
class Welcome:
    protocol: int
    device: str                   # "cpu", or the GPU's UUID
    gpu: int
    pid: int
    kind: str = "welcome"


@dataclass(frozen=True)
class Report:
    body: dict
    kind: str = "report"


@dataclass(frozen=True)
class Acquired:
    lease: int
    model: str
    manifest: dict
    kind: str = "acquired"


@dataclass(frozen=True)
class Miss:
    reason: str
    fields: list = field(default_factory=list)   # differing fingerprint fields of the closest model
    model: str = ""
    fix: str = ""
    kind: str = "miss"


@dataclass(frozen=True)
class Error:
    what: str
    fix: str = ""
    kind: str = "error"


@dataclass(frozen=True)
class Progress:                   # worker -> daemon during a fill
    model: str
    rank: int
    done: int
    total: int
    kind: str = "progress"


@dataclass(frozen=True)
class Filled:                     # worker -> daemon, with the arena fds
    model: str
    manifest: dict
    seconds: float
    kind: str = "filled"


@dataclass(frozen=True)
class WorkerHello:                # worker -> daemon, its first frame: keep these fields in every version
    protocol: int
    version: str                  # fast_start.__version__ of the worker's environment
    python: str                   # sys.executable
    prefix: str                   # sys.prefix: which environment
    engines: dict                 # engine name -> version found there (e.g. {"vllm": "0.32.0"})
    kind: str = "worker_hello"


@dataclass(frozen=True)
class CheckJob:                   # daemon -> worker: validate a model's headers, size its arenas
    model: str
    spec: dict                    # WeightSpec fields
    kind: str = "check_job"


@dataclass(frozen=True)
class Checked:                    # worker -> daemon
    model: str
    bytes: int                    # what its arenas will take
    kind: str = "checked"


@dataclass(frozen=True)
class FillJob:                    # daemon -> worker: materialize one model shard
    model: str
    spec: dict                    # WeightSpec fields
    device: str                   # "cpu" or "cuda:N"
    bandwidth: int                # bytes/s the fill may read; 0 = unlimited
    kind: str = "fill_job"


@dataclass(frozen=True)
class VerifyJob:                  # daemon or CLI -> worker, with the arena fds: checksum a shard's arenas
    model: str
    manifest: dict
    spec: dict                    # {} to check the arenas only; WeightSpec fields to also derive from disk
    kind: str = "verify_job"


@dataclass(frozen=True)
class Verified:                   # worker -> daemon
    model: str
    bad: list                     # names of tensors whose checksum differs
    kind: str = "verified"


KINDS = {c.__dataclass_fields__["kind"].default: c for c in (
    Hello, Status, Fingerprints, Acquire, Release, Evict, Evictions, Welcome, Report, Acquired, Miss, Error,
    Progress, Filled, WorkerHello, CheckJob, Checked, FillJob, VerifyJob, Verified)}
JOBS = ("check_job", "fill_job", "verify_job")
REQUESTS = ("hello", "status", "fingerprints", "acquire", "release", "evict", "evictions")
_TYPES = {"int": int, "str": str, "dict": dict, "list": list, "float": (int, float)}


def encode(msg) -> bytes:
    # Shallow: asdict() would deep-copy a manifest of thousands of entries on every reply.
    data = json.dumps({f.name: getattr(msg, f.name) for f in fields(msg)}, separators=(",", ":")).encode()
    return len(data).to_bytes(_HEADER, "big") + data


def decode(data: bytes, allowed: tuple[str, ...] | None = None):
    """Bytes of one frame's body -> its dataclass; `ProtocolError` naming what was wrong."""
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ProtocolError(f"frame is not UTF-8 JSON: {str(e)[:80]}", "send a JSON object with a 'kind'") from None
    if not isinstance(obj, dict) or obj.get("kind") not in KINDS:
        raise ProtocolError(f"frame has no known kind (got {str(obj.get('kind') if isinstance(obj, dict) else obj)[:40]!r})",
                            f"use one of {', '.join(REQUESTS)}")
    if allowed is not None and obj["kind"] not in allowed:
        raise ProtocolError(f"a {obj['kind']!r} frame is not expected here", f"send one of {', '.join(allowed)}")
    cls = KINDS[obj["kind"]]
    known = {f.name: f for f in fields(cls)}
    for key, value in obj.items():
        if key not in known:
            raise ProtocolError(f"{obj['kind']!r} frame has unknown field {key!r}", f"fields are {', '.join(known)}")
        want = _TYPES[known[key].type]
        if not isinstance(value, want) or isinstance(value, bool):
            raise ProtocolError(f"{obj['kind']!r} field {key!r} has the wrong type", f"send {known[key].type}")
    try:
        return cls(**obj)
    except TypeError as e:
        raise ProtocolError(f"{obj['kind']!r} frame lacks a field: {e}", f"fields are {', '.join(known)}") from None


def send(sock: socket.socket, msg, fds: list[int] | tuple[int, ...] = ()) -> None:
    """Send one frame; `fds` ride on its first byte."""
    data = encode(msg)
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
    sent = sock.sendmsg([data], ancillary)
    if sent < len(data):
        sock.sendall(data[sent:])


def recv(sock: socket.socket, max_size: int = MAX_REPLY, allowed: tuple[str, ...] | None = None,
         accept_fds: bool = True, frame_timeout: float | None = None):
    """Receive one frame: (message, fds). EOF before a frame starts gives (None, []).

    The wait for a frame's first byte follows the socket's own timeout; once it has arrived the
    whole frame must arrive within `frame_timeout` seconds, so that a peer sending a byte at a
    time cannot hold a connection. With `accept_fds=False` there is no room for ancillary data:
    the kernel discards any descriptors sent along, and none is ever installed here.
    """
    fds: list[int] = []
    space = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize) if accept_fds else 0
    try:
        first = _read(sock, 1, fds, space, None, allow_eof=True)
        if first is None:
            return None, []
        deadline = time.monotonic() + frame_timeout if frame_timeout else None
        head = first + _read(sock, _HEADER - 1, fds, space, deadline)
        size = int.from_bytes(head, "big")
        if size > max_size:
            raise FramingError(f"frame of {size} bytes exceeds the {max_size}-byte limit", "send a smaller frame")
        msg = decode(_read(sock, size, fds, space, deadline), allowed)
    except BaseException:
        _close(fds)
        raise
    return msg, fds


def _read(sock: socket.socket, n: int, fds: list[int], space: int, deadline: float | None,
          allow_eof: bool = False) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            sock.settimeout(max(deadline - time.monotonic(), 1e-3))
        try:
            data, anc, flags, _ = sock.recvmsg(n - len(buf), space, socket.MSG_CMSG_CLOEXEC)
        except socket.timeout:
            if deadline is None:
                raise
            raise FramingError(f"frame not complete in time ({len(buf)} of {n} bytes)",
                               "send whole frames at once") from None
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(payload[:len(payload) - len(payload) % got.itemsize])
                fds.extend(got)
        if flags & socket.MSG_CTRUNC and space:
            raise FramingError("more file descriptors than the receiver accepts", f"send at most {MAX_FDS}")
        if not data:
            if allow_eof and not buf:
                return None
            raise FramingError(f"connection closed after {len(buf)} of {n} bytes", "send whole frames")
        buf += data
    return bytes(buf)


def _close(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass

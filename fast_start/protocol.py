"""The wire protocol between engines, the CLI, the daemon and its fill worker.

Frames are a 4-byte big-endian length and a UTF-8 JSON object with a `kind`; each kind is a
`Message` class below and `decode` accepts exactly its fields with their types. File descriptors
ride on a frame as `SCM_RIGHTS`. One reply, `Acquired`, may be followed by a binary block whose
size it names (the tensor table, `table.py`). There is no pickle anywhere: a frame can only ever
become one of these classes. They are plain classes, not dataclasses: engines import this module
on every start, and generating twenty dataclasses is a visible part of that import.

Trust model: the socket lives in a directory only the daemon's user can write; the daemon checks
every peer's uid and groups with `SO_PEERCRED`/`SO_PEERGROUPS` before reading a byte, and a
client checks the directory, the socket and the daemon's credentials before sending one. An
arena fd is a read capability for that model's weights and is only ever sent to a peer that
passed this check and could read the checkpoint's files itself (`trust.unreadable`). Inside that
boundary peers are still not trusted to be well-formed: any frame may be garbage, oversized,
truncated or slow, and gets an error reply or a closed connection, never a crash or a stall of
other connections. The daemon receives frames with no room for ancillary data, so file
descriptors sent *to* it are discarded by the kernel and never occupy one of its descriptors.
"""
from __future__ import annotations

import array
import enum
import json
import os
import socket
import time
from collections.abc import Iterator

from .errors import FastStartError

VERSION = 6                    # of every frame below; a worker of another version is refused
MAX_REQUEST = 1 << 20          # what the daemon reads from a client
MAX_REPLY = 256 << 20          # manifests of large MoE models run to megabytes
MAX_FDS = 253                  # the kernel's limit per message (SCM_MAX_FD)
# An Acquired reply's fds travel this many to a frame, and an engine maps and closes each batch
# before it reads the next (`fd_batches`): receiving many fds at once makes the kernel grow the
# engine's fd table, which in a process with threads waits for an RCU grace period (BENCHMARKS.md).
FD_BATCH = 4
_HEADER = 4


class ProtocolError(FastStartError):
    """A frame was malformed or of an unexpected kind; the stream is still in step."""


class FramingError(ProtocolError):
    """A frame was oversized or truncated: the stream is out of step and must be closed."""


class Message:
    """One frame's body: the fields a subclass annotates (with their defaults), in order; immutable.

    `ATTACHED` names the field that counts the bytes of a binary block sent right after the frame;
    `recv` puts that block in `attachment`.
    """
    kind = ""
    FIELDS: tuple[str, ...] = ()
    TYPES: dict[str, str] = {}
    DEFAULTS: dict = {}
    ATTACHED = ""

    def __init_subclass__(cls) -> None:
        own = cls.__dict__.get("__annotations__", {})
        cls.FIELDS, cls.TYPES = tuple(own), dict(own)
        cls.DEFAULTS = {name: cls.__dict__[name] for name in own if name in cls.__dict__}

    def __init__(self, *args, **kwargs) -> None:
        if len(args) > len(self.FIELDS):
            raise TypeError(f"{self.kind} takes {len(self.FIELDS)} fields, got {len(args)}")
        values = dict(zip(self.FIELDS, args))
        for name, value in kwargs.items():
            if name not in self.FIELDS or name in values:
                raise TypeError(f"{self.kind}: unexpected or repeated field {name!r}")
            values[name] = value
        for name in self.FIELDS:
            if name not in values:
                if name not in self.DEFAULTS:
                    raise TypeError(f"{self.kind}: missing field {name!r}")
                default = self.DEFAULTS[name]
                values[name] = default.copy() if isinstance(default, (list, dict)) else default
        self.__dict__.update(values)
        self.__dict__["attachment"] = b""

    def attach(self, data: bytes) -> "Message":
        """This frame with `data` sent right after it (the size its `ATTACHED` field names)."""
        if not self.ATTACHED or getattr(self, self.ATTACHED) != len(data):
            raise ValueError(f"a {self.kind} frame announces no attachment of {len(data)} bytes")
        self.__dict__["attachment"] = data
        return self

    def __setattr__(self, name, value):
        raise AttributeError(f"{self.kind} frames are immutable")

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and other.__dict__ == self.__dict__

    __hash__ = None

    def wire(self) -> dict:
        """The JSON object this frame is on the wire."""
        return {"kind": self.kind, **{name: self.__dict__[name] for name in self.FIELDS}}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={self.__dict__[k]!r}' for k in self.FIELDS)})"


class Hello(Message):
    kind = "hello"
    protocol: int


class Status(Message):
    kind = "status"


class Fingerprints(Message):
    kind = "fingerprints"


class Acquire(Message):           # an engine's request (a partial one may be asked again whole): no Hello needed
    kind = "acquire"
    fingerprint: dict
    mode: str
    files: dict                   # the engine's checkpoint files: name -> [dev, inode, size, mtime_ns]
    protocol: int = 0             # the client's VERSION (0: it said so in a Hello)
    device: str = ""              # where it maps: "cpu" or a GPU's UUID; "" any
    manifest: str = "table"       # "table": the binary tensor table follows Acquired; "json": the whole manifest
    partial: int = 0              # 1: a `fingerprint.requested` (the files not yet read; the engine checks the reply's)
    purpose: str = "engine"       # "verify": `fast-start verify --deep` reads the cache; not an engine's hit
    path: str = ""                # the folder the engine reads the files from (a bind mount, hard links)


class Release(Message):
    kind = "release"
    lease: int
    copied: bool = False          # a copy-mode engine holds every fd of the reply: the hand-over is done


class Role(Message):              # an engine's worker: what its engine does now (vLLM's sleep mode)
    kind = "role"
    lease: int
    role: str                     # ROLES


ROLES = ("serving", "standby", "waking")


class Mode(str, enum.Enum):
    """How an engine takes the cache's tensors: maps them (the daemon's memory, shared), or clones
    them (its own)."""
    ZERO_COPY = "zero_copy"
    COPY = "copy"
    __str__, __format__ = str.__str__, str.__format__

    @classmethod
    def of(cls, value, what: str = "mode") -> "Mode":
        """`value` as a Mode; ValueError naming `what` and the modes there are."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"{what} {value!r} is unknown; use one of {', '.join(MODES)}") from None


MODES = tuple(m.value for m in Mode)


class Evict(Message):
    kind = "evict"
    model: str = ""               # "" evicts every model


class Evictions(Message):
    kind = "evictions"


class Metrics(Message):
    kind = "metrics"


class Fill(Message):
    kind = "fill"
    model: str = ""               # "" fills every configured model that is not cached


class Welcome(Message):
    kind = "welcome"
    protocol: int
    device: str                   # "cpu", or the GPU's UUID
    gpu: int
    pid: int


class Report(Message):
    kind = "report"
    body: dict


class Acquired(Message):
    kind = "acquired"
    ATTACHED = "table"
    lease: int                    # a copy-mode lease ends with the engine's Release(copied=True)
    model: str
    manifest: dict                # "json": the manifest; "table": all of it but the tensors
    table: int = 0                # bytes of the tensor table (`table.py`) that follow this frame
    fds: int = 0                  # the reply's arena fds: FD_BATCH ride on it, the rest on `Fds` frames after it


class Fds(Message):                        # daemon -> engine, right after an Acquired: its next fds
    kind = "fds"
    first: int                    # the index of its first fd among the reply's


class Miss(Message):
    kind = "miss"
    reason: str
    fields: list = []                 # differing fingerprint fields of the closest model
    model: str = ""
    fix: str = ""


class Error(Message):
    kind = "error"
    what: str
    fix: str = ""
    config: bool = False        # the configuration asks for what cannot be (a restart would not help)
    checkpoint: bool = False    # the model's folder cannot be used (that model fails, not the daemon)


class Artifacts(Message):                  # engine -> daemon: the set it kept for `key`, if any (`artifacts.py`)
    kind = "artifacts"
    model: str
    key: str                      # the engine's word for what decides whether a set fits
    settings: dict                # the settings behind `key` (str -> str): a miss names those that differ


UNKEPT = "unkept"                          # a Miss's field: this daemon keeps no artifacts of the model at all


class KeptArtifacts(Message):              # daemon -> engine, with a read-only fd of the set's tar archive
    kind = "kept_artifacts"
    key: str
    size: int
    sha256: str


class Keep(Message):                       # engine -> daemon: keep this set; `size` bytes of tar follow the frame
    kind = "keep"
    model: str
    key: str
    settings: dict
    size: int
    sha256: str


class Progress(Message):                   # worker -> daemon during a fill
    kind = "progress"
    model: str
    rank: int
    done: int
    total: int


class Filled(Message):                     # worker -> daemon, with the arena fds
    kind = "filled"
    model: str
    manifest: dict
    seconds: float


class WorkerHello(Message):                # worker -> daemon, its first frame: keep these fields in every version
    kind = "worker_hello"
    protocol: int
    version: str                  # fast_start.__version__ of the worker's environment
    python: str                   # sys.executable
    prefix: str                   # sys.prefix: which environment
    engines: dict                 # engine name -> version installed there (`engines.installed`)


class CheckJob(Message):                   # daemon -> worker: validate a model's headers, size its arenas
    kind = "check_job"
    model: str
    spec: dict                    # WeightSpec fields


class Checked(Message):                    # worker -> daemon
    kind = "checked"
    model: str
    bytes: int                    # what its arenas will take


class FillJob(Message):                    # daemon -> worker: materialize one model shard
    kind = "fill_job"
    model: str
    spec: dict                    # WeightSpec fields
    device: str                   # "cpu" or "cuda:N"
    bandwidth: int                # bytes/s the fill may read; 0 = unlimited
    chunk: int = 512 << 20        # an arena's most bytes (a larger tensor gets one of its own)


class VerifyJob(Message):                  # daemon or CLI -> worker, with the arena fds: checksum a shard's arenas
    kind = "verify_job"
    model: str
    manifest: dict
    spec: dict                    # {} to check the arenas only; WeightSpec fields to also derive from disk


class Verified(Message):                   # worker -> daemon
    kind = "verified"
    model: str
    bad: list                     # names of tensors whose checksum differs


KINDS = {c.kind: c for c in (
    Hello, Status, Fingerprints, Acquire, Release, Role, Evict, Evictions, Fill, Metrics, Welcome, Report, Acquired, Fds, Miss, Error,
    Artifacts, KeptArtifacts, Keep,
    Progress, Filled, WorkerHello, CheckJob, Checked, FillJob, VerifyJob, Verified)}
JOBS = ("check_job", "fill_job", "verify_job")
REQUESTS = ("hello", "status", "fingerprints", "acquire", "release", "role", "evict", "evictions", "fill", "metrics",
            "artifacts", "keep")
ARTIFACTS = ("artifacts", "keep")
_TYPES = {"int": int, "str": str, "dict": dict, "list": list, "float": (int, float), "bool": bool}


def encode(msg: Message) -> bytes:
    data = json.dumps(msg.wire(), separators=(",", ":")).encode()
    return len(data).to_bytes(_HEADER, "big") + data


def decode(data: bytes, allowed: tuple[str, ...] | None = None):
    """Bytes of one frame's body -> its Message; `ProtocolError` naming what was wrong."""
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ProtocolError(f"frame is not UTF-8 JSON: {str(e)[:80]}", "send a JSON object with a 'kind'") from None
    if not isinstance(obj, dict) or obj.get("kind") not in KINDS:
        raise ProtocolError(f"frame has no known kind (got {str(obj.get('kind') if isinstance(obj, dict) else obj)[:40]!r})",
                            f"use one of {', '.join(REQUESTS)}")
    if allowed is not None and obj["kind"] not in allowed:
        raise ProtocolError(f"a {obj['kind']!r} frame is not expected here", f"send one of {', '.join(allowed)}")
    cls = KINDS[obj.pop("kind")]
    for key, value in obj.items():
        if key not in cls.TYPES:
            raise ProtocolError(f"{cls.kind!r} frame has unknown field {key!r}", f"fields are {', '.join(cls.FIELDS)}")
        want = _TYPES[cls.TYPES[key]]
        if not isinstance(value, want) or (isinstance(value, bool) and want is not bool):
            raise ProtocolError(f"{cls.kind!r} field {key!r} has the wrong type", f"send {cls.TYPES[key]}")
    try:
        return cls(**obj)
    except TypeError as e:
        raise ProtocolError(f"{cls.kind!r} frame lacks a field: {e}", f"fields are {', '.join(cls.FIELDS)}") from None


def send(sock: socket.socket, msg: Message, fds: list[int] | tuple[int, ...] = ()) -> None:
    """Send one frame and its attachment; `fds` ride on its first byte. An Acquired reply's fds
    (as many as its `fds` says) go FD_BATCH to a frame: the first on it, the rest on `Fds` frames."""
    if isinstance(msg, Acquired):
        if msg.fds != len(fds):
            raise ValueError(f"an acquired frame announces {msg.fds} fds, not {len(fds)}")
        _send(sock, msg, fds[:FD_BATCH])
        for first in range(FD_BATCH, len(fds), FD_BATCH):
            _send(sock, Fds(first), fds[first:first + FD_BATCH])
        return
    _send(sock, msg, fds)


def _send(sock: socket.socket, msg: Message, fds: list[int] | tuple[int, ...]) -> None:
    data = encode(msg) + msg.attachment
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
        attached = getattr(msg, msg.ATTACHED) if msg.ATTACHED else 0
        if attached:
            if not 0 < attached <= max_size:
                raise FramingError(f"a {msg.kind} frame announces {attached} attached bytes, over the "
                                   f"{max_size}-byte limit", "send a smaller frame")
            msg.attach(_read(sock, attached, fds, space, deadline))
    except BaseException:
        _close(fds)
        raise
    return msg, fds


def fd_batches(sock: socket.socket, reply: Message, first: list[int]) -> Iterator[list[int]]:
    """A reply's fds a batch at a time: `first` (those that came on it), then for an Acquired each
    `Fds` frame's, read when the next batch is asked for. The caller owns (and closes) each batch
    it gets; one that stops early reads and closes the rest before it uses the connection again."""
    if not isinstance(reply, Acquired):
        yield first
        return
    if len(first) != min(FD_BATCH, reply.fds):
        _close(first)
        raise FramingError(f"an acquired frame came with {len(first)} of its {reply.fds} fds", "ask again")
    yield first
    for start in range(FD_BATCH, reply.fds, FD_BATCH):
        msg, fds = recv(sock, MAX_REQUEST, ("fds",))
        if msg is None or msg.first != start or len(fds) != min(FD_BATCH, reply.fds - start):
            _close(fds)
            raise FramingError(f"the fds of an acquired frame broke off at {start} of {reply.fds}", "ask again")
        yield fds


def all_fds(sock: socket.socket, reply: Message, first: list[int]) -> list[int]:
    """Every fd of a reply: those that came on it, and for an Acquired the rest of its batches."""
    fds: list[int] = []
    try:
        for batch in fd_batches(sock, reply, first):
            fds += batch
    except BaseException:
        _close(fds)
        raise
    return fds


def _read(sock: socket.socket, n: int, fds: list[int], space: int, deadline: float | None,
          allow_eof: bool = False) -> bytearray | None:
    buf = bytearray(n)
    view, done = memoryview(buf), 0
    while done < n:
        if deadline is not None:
            sock.settimeout(max(deadline - time.monotonic(), 1e-3))
        try:
            got, anc, flags, _ = sock.recvmsg_into([view[done:]], space, socket.MSG_CMSG_CLOEXEC)
        except socket.timeout:
            if deadline is None:
                raise
            raise FramingError(f"frame not complete in time ({done} of {n} bytes)",
                               "send whole frames at once") from None
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                received = array.array("i")
                received.frombytes(payload[:len(payload) - len(payload) % received.itemsize])
                fds.extend(received)
        if flags & socket.MSG_CTRUNC and space:
            raise FramingError("more file descriptors than the receiver accepts", f"send at most {MAX_FDS}")
        if not got:
            if allow_eof and not done:
                return None
            raise FramingError(f"connection closed after {done} of {n} bytes", "send whole frames")
        done += got
    return buf


def _close(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass

"""What the daemon reports (`protocol.Report`), as typed records.

The cache builds each report as one of these and sends `body(record)`, a JSON object: what
`--json` prints. A reader (the CLI, an engine's client) takes it back with `read(Kind, body)`,
which checks every field once, where it enters, and raises ProtocolError naming the first that
does not fit; past that point code reads attributes, never keys. Fields a daemon of an earlier
version may lack have defaults; keys a reader does not know are left out.

NamedTuples, not dataclasses (cheaper to make); still, an engine's client imports this module
only where it asks for fingerprints, not on the fetch path.
"""
import types
import typing
from typing import NamedTuple

from .protocol import ProtocolError


class Memory(NamedTuple):
    held: int                           # bytes this daemon's cache holds
    keep_free: int
    total: int | None = None            # the device's; None where it cannot be told
    free: int | None = None


class CachedModel(NamedTuple):          # a cached model, as `status` lists it
    name: str
    rank: int
    tensor_parallel_size: int
    bytes: int
    tensors: int
    fingerprint: str                    # the digest's first 16 hex digits
    fill_seconds: float
    filled_at: float
    adopted: bool                       # re-adopted from systemd's fd store, not filled
    arenas: int
    path: str | None = None             # its checkpoint: for admins only
    note: str | None = None


class KeptSets(NamedTuple):             # one engine user's kept artifacts of a model (`artifact_store.py`)
    model: str
    uid: int
    sets: int
    bytes: int
    last: str = ""                      # the last engine start's: "hit", "miss", "kept"; "" none since the daemon started
    why: str = ""                       # a miss's reason
    at: float = 0.0


class Missing(NamedTuple):              # a configured model that is not cached (`Cache.pending`)
    name: str
    state: str
    detail: str = ""
    since: float | None = None          # None: never filled nor asked for


class Lease(NamedTuple):
    id: int
    pid: int
    uid: int
    model: str
    mode: str
    since: float
    role: str = "serving"               # its engine's, as its worker last said (`protocol.ROLES`)
    gpu_bytes: int | None = None        # the GPU memory its process uses (NVML); None: not told


class Failover(NamedTuple):             # a standby woken after the serving engine of its model died
    model: str
    died: int                           # the pid whose lease ended
    serving: int                        # the woken standby's
    seconds: float                      # from the death the daemon saw to the standby awake
    at: float                           # time.time() when it woke


class Status(NamedTuple):
    gpu: int
    state: str                          # "ready": every configured model cached; else "incomplete"
    pid: int
    models: list[CachedModel]
    missing: list[Missing]
    leases: list[Lease]
    device: str = ""
    version: str = ""
    started_at: float | None = None
    reloads: int | None = None          # config reloads since the start; None: a daemon too old to count
    reload_error: str = ""              # why the last reload kept the running config
    reload_began: float = 0.0           # when the last finished reload began to read the config (time.time())
    memory: Memory | None = None
    artifacts: list[KeptSets] | None = None     # engines' kept artifacts: all users' for admins, else the peer's
    failovers: int = 0                  # since the daemon started
    last_failover: Failover | None = None


class Progress(NamedTuple):             # a fill under way, as the daemon last reported it
    model: str
    rank: int
    done: int                           # bytes
    total: int
    eta_s: int | None = None            # seconds left, where it can be told


class DaemonState(NamedTuple):
    """The state file a daemon keeps (`daemon.state_path`): what `status` shows of a daemon whose
    socket does not answer (yet): loading, or failed; and of a GPU the config names that has no
    daemon at all: stopped."""
    gpu: int
    state: str                          # "loading", "ready", "failed" (or "stopped": `status` alone)
    pid: int
    time: float | None = None           # when it was written
    version: str = ""
    started_at: float | None = None
    progress: Progress | None = None
    error: str = ""


class ModelFingerprint(NamedTuple):
    name: str
    digest: str
    bytes: int
    fingerprint: dict                   # `Fingerprint.to_dict()`
    files: dict                         # the checkpoint files' identity at the fill (`watch.Identity`)
    path: str | None = None             # for admins only


class Fingerprints(NamedTuple):
    gpu: int
    on_release: str
    models: list[ModelFingerprint]


class Eviction(NamedTuple):
    time: float
    model: str
    reason: str
    bytes: int
    leases: int


class Evictions(NamedTuple):
    gpu: int
    evictions: list[Eviction]


class Metrics(NamedTuple):
    gpu: int
    samples: list                       # [name, {label: value}, value] (`metrics.Metrics.samples`)


class Released(NamedTuple):             # a copy-mode engine's release
    released: int                       # the lease
    on_release: str


class Assigned(NamedTuple):             # a lease's role, as its engine said it
    lease: int
    role: str


class Evicted(NamedTuple):
    evicted: list[str]


class Filling(NamedTuple):
    filling: list[str]                  # queued to fill
    cached: list[str]                   # configured and cached already


def body(record: NamedTuple) -> dict:
    """`record` as the JSON object it is on the wire; fields that are None are left out."""
    return {k: _plain(v) for k, v in record._asdict().items() if v is not None}


def _plain(value):
    if hasattr(value, "_asdict"):
        return body(value)
    return [_plain(v) for v in value] if isinstance(value, list) else value


R = typing.TypeVar("R")


def read(kind: type[R], obj, where: str = "report") -> R:
    """The record `kind` a report's body `obj` holds; ProtocolError naming the first field that
    is missing or of the wrong type."""
    if not isinstance(obj, dict):
        raise ProtocolError(f"{where} is a {type(obj).__name__}, not an object", _FIX)
    hints = typing.get_type_hints(kind)
    values = {}
    for name in kind._fields:
        if name not in obj:
            if name not in kind._field_defaults:
                raise ProtocolError(f"{where} lacks {name!r}", _FIX)
            continue
        values[name] = _value(hints[name], obj[name], f"{where}'s {name!r}")
    return kind(**values)


_FIX = "use a fast-start CLI of the daemon's version"
_SIMPLE = {int: int, float: (int, float), str: str, bool: bool, dict: dict, list: list}


def _value(hint, value, where: str):
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:     # X | None
        if value is None:
            return None
        (hint,) = [a for a in args if a is not type(None)]
        return _value(hint, value, where)
    if typing.get_origin(hint) is list:
        if not isinstance(value, list):
            raise ProtocolError(f"{where} is not a list", _FIX)
        return [_value(args[0], v, f"{where}[{i}]") for i, v in enumerate(value)]
    if hasattr(hint, "_fields"):
        return read(hint, value, where)
    want = _SIMPLE[hint]
    if not isinstance(value, want) or (isinstance(value, bool) and hint is not bool):
        raise ProtocolError(f"{where} is {str(value)[:40]!r}, not {hint.__name__}", _FIX)
    return value

"""The daemon's start-up steps that need no daemon (`daemon.py` runs them in order): the GPU's
locks, the config's `engine_version = "auto"` resolved by the workers, what systemd's fd store
kept re-adopted, and the socket bound. No torch in here.
"""
from __future__ import annotations

import fcntl
import logging
import os
import socket
import threading
from dataclasses import replace

from . import config as configs
from . import fdstore, notify, protocol, trust, watch
from .cache import Cache
from .entry import Entry
from .errors import ConfigError, FastStartError
from .fill import Workers
from .fingerprint import FROM_FILES, fingerprint, requested
from .journal import fields
from .transport import lock_path, socket_path

log = logging.getLogger("fast_start.daemon")


def hold_locks(directory: str, gpu: int, device: str) -> list[int]:
    """Hold `gpu<N>.lock` and the GPU's device node for the life of the process (their fds); fail
    at once if another daemon holds either."""
    path = lock_path(directory, gpu)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise FastStartError(f"GPU {gpu}'s daemon already runs (pid {holder}, lock {path})",
                             f"stop it first (systemctl stop fast-start@{gpu}), or serve another GPU") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    node = _lock_device(directory, gpu, device)
    return [fd] + ([node] if node is not None else [])


def _lock_device(directory: str, gpu: int, device: str) -> int | None:
    """A lock on the GPU's device node: a daemon for the same GPU from another config (another
    socket_dir, so another gpu<N>.lock) fails at once. The node is opened, never used: no CUDA
    context. Where there is none (the CPU device, a container that names nodes otherwise), the
    socket directory's lock is the only one."""
    if device != "cuda":
        return None
    node = f"/dev/nvidia{gpu}"
    try:
        fd = os.open(node, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise FastStartError(f"GPU {gpu} is served by another fast-start daemon (it holds {node}), though "
                             f"not from {directory}", "stop that daemon first (another config's: its "
                             "socket_dir differs), or serve another GPU") from None
    return fd


def resolve(cfg: configs.Config, gpu: int, workers: Workers) -> configs.Config:
    """`cfg` with GPU `gpu`'s `engine_version = "auto"` replaced by what each model's worker
    environment has installed. Starts (and so version-checks) every worker it names."""
    models = []
    for m in cfg.models:
        if gpu in m.gpus:
            hello = workers.get(cfg.python(m)).hello
            log.info("%s is filled by %s (environment %s: fast-start %s, %s)", m.name, hello.python, hello.prefix,
                     hello.version, ", ".join(f"{k} {v}" for k, v in hello.engines.items()) or "no engine")
            if m.engine_version == configs.AUTO:     # the config allows it for an engine's model only
                if m.filler.name not in hello.engines:
                    raise ConfigError(f"{cfg.path}: [[model]] {m.name!r} has engine_version = \"auto\", but "
                                      f"{hello.python} has no {m.filler.title} installed",
                                      "set worker_python (or the model's python) to the engine's interpreter")
                m = replace(m, engine_version=hello.engines[m.filler.name])
        models.append(m)
    return replace(cfg, models=tuple(models))


def config_fields(model: configs.ModelConfig, gpu: int) -> dict:
    """The fingerprint fields the config alone decides (no checkpoint file read)."""
    return {k: v for k, v in requested(model.spec(gpu))._asdict().items() if not (k in FROM_FILES and v == "")}


def adopt(cache: Cache, cfg: configs.Config, gpu: int, workers: Workers, stop: threading.Event) -> set[str]:
    """Re-adopt into `cache` what systemd's fd store kept from a previous daemon process.

    A stored shard is kept only if the config still asks for exactly it (same fingerprint,
    computed from the config and the checkpoint's headers, no tensor data read), its
    checkpoint files are those it was filled from, and its checksums still hold; anything
    else is dropped and its model filled again. Nothing here fails the start.
    """
    stored, problems = fdstore.adopt()
    for p in problems:
        log.warning("dropped %s", p)
    models = {m.name: m for m in cfg.models_on(gpu)}
    adopted = set()
    for st in stored:
        model = models.get(st.model)
        reason = _adoptable(st, model, gpu, cache.device)
        if reason:
            _drop(cache, st, *reason)
            continue
        notify.status(f"verifying {st.model}, kept by systemd's fd store")
        try:
            bad = [msg for msg, _ in workers.get(cfg.python(model)).run(
                protocol.VerifyJob(st.model, st.manifest.to_dict(), {}), st.fds)][-1].bad
        except FastStartError as e:
            if stop.is_set():
                raise
            _drop(cache, st, f"it could not be verified ({e.what})", "checksum")
            continue
        if bad:
            _drop(cache, st, f"checksums differ ({len(bad)} tensors)", "checksum")
            continue
        entry = Entry(model, st.manifest, st.fds, 0.0, st.files, st.filled_at, st.names, adopted=True)
        cache.add(entry)
        adopted.add(st.model)
        log.info("re-adopted %s rank %d (%s, %d tensors) from systemd's fd store", st.model,
                 st.manifest.fingerprint.rank, configs.format_bytes(entry.nbytes), len(st.manifest.tensors))
        cache.metrics.inc("fast_start_readoptions_total", model=st.model)
    return adopted


def _adoptable(st: fdstore.Stored, model: configs.ModelConfig | None, gpu: int,
               device: str) -> tuple[str, str] | None:
    """Why a stored shard cannot be re-adopted as `model` (what, eviction reason), or None."""
    if model is None:
        return f"GPU {gpu} no longer serves {st.model!r}", "config change"
    if any(a.device != device for a in st.manifest.arenas):
        return "it lives on another device", "config change"
    try:
        differ = st.manifest.fingerprint.diff(fingerprint(model.spec(gpu)))
    except FastStartError as e:
        # Storage away (NFS down at boot): what the config decides must still match; engines
        # are matched against the files of the fill, so nothing stale can be served.
        differ = st.manifest.fingerprint.diff(st.manifest.fingerprint._replace(**config_fields(model, gpu)))
        if not differ:
            log.warning("cannot read %s's checkpoint now (%s); re-adopting what was filled from it", st.model,
                        e.what)
    if differ:
        return f"the config changed its {', '.join(differ)}", "config change"
    if not st.files:
        return "no file identities were stored with it", "checkpoint changed"
    changed = watch.differs(st.files, watch.identity(model.path), gone_is_change=False)
    if changed:
        return f"the checkpoint changed since the fill ({changed})", "checkpoint changed"
    return None


def _drop(cache: Cache, st: fdstore.Stored, why: str, reason: str) -> None:
    log.warning("dropping the stored arena of %s: %s", st.model, why, extra=fields(st.model))
    for fd in st.fds:
        os.close(fd)
    fdstore.remove(st.names)
    cache.record(st.model, reason, sum(a.size for a in st.manifest.arenas))


def bind(directory: str, gpu: int, shared: bool) -> socket.socket:
    """GPU `gpu`'s listening socket, 0600 from its first moment (0666 where other users are
    allowed: peers are admitted by their credentials, `serve.py`)."""
    path = socket_path(directory, gpu)
    if path.is_symlink() or (path.exists() and not path.is_socket()):
        raise trust.TrustError(f"{path} exists and is not a socket", "remove it")
    path.unlink(missing_ok=True)     # a stale socket of a previous run; we hold the GPU's lock
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    old = os.umask(0o177)            # no window in which the socket is more open than 0600
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    if shared:
        os.chmod(path, 0o666)
    sock.listen(128)
    sock.setblocking(False)
    return sock

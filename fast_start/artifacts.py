"""The engine's side of kept artifacts (the daemon's side: `artifact_store.py`).

An engine points the caches it rebuilds at every start (vLLM's torch.compile cache, Triton's
kernels) at a folder of its user's under the temp dir (`Folder`): a sandboxed or containerized
engine's `$HOME` may be neither writable nor kept, and this folder needs neither. Its path is the
same at every start of the engine (same user, daemon socket, model and key), because vLLM's
compile cache names its files by absolute path. `hand_over` fills it from the set the daemon kept
for the engine's key, checking the archive's SHA-256 as it unpacks; a set that fails the check or
holds anything but folders and regular files under relative names is refused, and the folder
left empty, so the engine rebuilds. A folder that already holds the daemon's set, every file of it
whole, is used as it is (`.set` beside it records the set). Once the engine has started,
`Folder.keep` sends the folder back if it holds anything the set did not: the first start of a
key, or a rebuild after a refusal.

Stdlib only: the engine's plugin calls it with torch loaded, but nothing here needs it.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import stat
import tarfile
import tempfile
from contextlib import contextmanager
from pathlib import Path

from . import protocol, transport
from .errors import FastStartError

CHUNK = 1 << 20
PREFIX = "fast-start-artifacts-"        # then the user's uid: the folder of that user's folders


class Folder:
    """The engine's artifact folder; `outcome` says how it was filled ("hit", "miss: why",
    "refused: why"), `listing` what it held then."""

    def __init__(self, socket_path: str, model: str, key: str, settings: dict[str, str]):
        self.socket, self.model, self.key, self.settings = socket_path, model, key, settings
        name = hashlib.sha256("\0".join((socket_path, model, key)).encode()).hexdigest()[:32]
        root = users_folder()
        self.path, self.record = root / name, root / f"{name}.set"
        self.outcome, self.listing = "", {}

    @contextmanager
    def locked(self):
        """This folder to itself: two engines of one key (a standby, a restart racing a stop) fill it in turn."""
        fd = os.open(f"{self.record}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def holds(self, sha256: str) -> bool:
        """Whether the folder holds the set `sha256`, every file of it at its size."""
        try:
            kept = json.loads(self.record.read_text())
            return kept["sha256"] == sha256 and all(
                os.lstat(self.path / name).st_size == size for name, size in kept["files"].items())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return False

    def remember(self, sha256: str) -> None:
        """Record that the folder holds the set `sha256`, its files as `listing` has them."""
        partial = self.record.with_suffix(".part")
        partial.write_text(json.dumps({"sha256": sha256, "files": self.listing}))
        partial.replace(self.record)

    def clear(self) -> None:
        self.record.unlink(missing_ok=True)
        shutil.rmtree(self.path, ignore_errors=True)
        self.path.mkdir(mode=0o700)

    def keep(self, timeout: float = 30.0) -> list[str]:
        """Send the folder to the daemon if it holds a file the set did not, or one of another size
        (a file rewritten as it was, a lock touched, is not new): the new files' names."""
        now = _listing(self.path)
        new = sorted(name for name, size in now.items() if self.listing.get(name) != size)
        if not new:
            return []
        with tempfile.TemporaryFile() as archive:
            digest, size = _pack(self.path, archive)
            with transport.connect(Path(self.socket), timeout) as conn:
                conn.settimeout(timeout + size / (32 << 20))
                protocol.send(conn, protocol.Keep(self.model, self.key, self.settings, size, digest))
                conn.sendfile(archive)
                reply, _ = protocol.recv(conn, accept_fds=False)
        if isinstance(reply, (protocol.Error, protocol.Miss)):
            why = reply.what if isinstance(reply, protocol.Error) else reply.reason
            raise FastStartError(f"the daemon did not keep the artifacts: {why}", reply.fix)
        self.listing = now
        with self.locked():
            self.remember(digest)
        return new


def users_folder() -> Path:
    """This user's folder of artifact folders in the temp dir, made if missing; refused (OSError)
    where it is not a folder of this user's closed to others (another user made the name first)."""
    root = Path(tempfile.gettempdir()) / f"{PREFIX}{os.geteuid()}"
    try:
        root.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise OSError(f"{root} is not a folder of this user's closed to others; remove it")
    return root


class Unkept(FastStartError):
    """The daemon keeps no artifacts of this model (or cannot be asked): the engine's caches stay its own."""


def hand_over(socket_path: str, model: str, key: str, settings: dict[str, str], timeout: float = 5.0) -> Folder:
    """A new folder for the engine's artifacts, holding the set the daemon kept for `key` if it
    has one; `Unkept` where the daemon keeps none of this model."""
    try:
        with transport.connect(Path(socket_path), timeout) as conn:
            reply, fds = transport.request(conn, protocol.Artifacts(model, key, settings), with_fds=True)
    except (FastStartError, OSError) as e:       # a daemon of an earlier version does not know the request
        raise Unkept(f"the daemon cannot be asked for artifacts: {getattr(e, 'what', e)}", "") from None
    kept = fds.pop() if isinstance(reply, protocol.KeptArtifacts) and len(fds) == 1 else None
    for fd in fds:          # whatever else came: nothing to use
        os.close(fd)
    if isinstance(reply, protocol.Miss) and protocol.UNKEPT in reply.fields:
        raise Unkept(reply.reason, reply.fix)
    try:
        folder = Folder(socket_path, model, key, settings)
        with folder.locked():
            fill(folder, reply, kept)
    except OSError as e:
        raise Unkept(f"no folder for the artifacts can be made in {tempfile.gettempdir()}: {e}",
                     "give the engine a writable TMPDIR") from None
    finally:
        if kept is not None:
            os.close(kept)
    return folder


def fill(folder: Folder, reply, kept: int | None) -> None:
    """Fill the (locked) folder from the set `kept` (an fd) unless it holds it already, and say how."""
    if kept is None:        # the daemon keeps none: whatever the folder holds is sent once the engine started
        folder.path.mkdir(mode=0o700, exist_ok=True)
        folder.outcome = f"miss: {getattr(reply, 'reason', f'the daemon answered {reply.kind}')}"
        return
    unpacked = not folder.holds(reply.sha256)
    if unpacked:
        folder.clear()
        with open(kept, "rb", closefd=False) as f:
            why = _unpack(f, reply.sha256, folder.path)
        if why:
            folder.clear()
            folder.outcome = f"refused: {why}"
            return
    folder.outcome, folder.listing = "hit", _listing(folder.path)
    if unpacked:
        folder.remember(reply.sha256)


def _listing(root: Path) -> dict[str, int]:
    """relative name -> size of every regular file under `root`."""
    out = {}
    for folder, _, names in os.walk(root):
        for name in names:
            st = os.lstat(os.path.join(folder, name))
            out[os.path.relpath(os.path.join(folder, name), root)] = st.st_size
    return out


def _pack(root: Path, archive) -> tuple[str, int]:
    """Write `root`'s folders and regular files (links and others left out) as a tar: its SHA-256
    and size, `archive` left at its start."""
    with tarfile.open(fileobj=archive, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for folder, dirs, names in os.walk(root):
            for name in sorted(dirs) + sorted(names):
                path = os.path.join(folder, name)
                info = tar.gettarinfo(path, os.path.relpath(path, root))
                if info.isdir():
                    tar.addfile(info)
                elif info.isreg():
                    with open(path, "rb") as f:
                        tar.addfile(info, f)
    size = archive.tell()
    archive.seek(0)
    digest = hashlib.sha256()
    while chunk := archive.read(CHUNK):
        digest.update(chunk)
    archive.seek(0)
    return digest.hexdigest(), size


class _Hashed:
    """A file read through, its SHA-256 taken of every byte read."""

    def __init__(self, f):
        self.f, self.digest = f, hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.digest.update(data)
        return data


def _unpack(f, sha256: str, root: Path) -> str:
    """Unpack the tar `f` into `root`; why it was refused, or "" if it was whole and safe."""
    hashed = _Hashed(f)
    try:
        with tarfile.open(fileobj=hashed, mode="r|") as tar:
            for member in tar:
                parts = Path(member.name).parts
                if not (member.isreg() or member.isdir()) or not parts or Path(member.name).is_absolute() \
                        or ".." in parts:
                    return f"the archive holds {member.name!r}, which is not a file or folder inside it"
                target = root.joinpath(*parts)
                if member.isdir():
                    target.mkdir(mode=0o700, exist_ok=True)
                    continue
                source = tar.extractfile(member)
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                             0o700 if member.mode & 0o100 else 0o600)
                with open(fd, "wb") as out:
                    shutil.copyfileobj(source, out, CHUNK)
        while hashed.read(CHUNK):
            pass
    except (tarfile.TarError, OSError) as e:
        return f"the archive cannot be read ({type(e).__name__}: {e})"
    if hashed.digest.hexdigest() != sha256:
        return "the archive is not the bytes the daemon kept (its SHA-256 differs)"
    return ""

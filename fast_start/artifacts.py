"""The engine's side of kept artifacts (the daemon's side: `artifact_store.py`).

An engine keeps the caches it rebuilds at every start (vLLM's torch.compile cache, Triton's
kernels) in a `Folder`: the engine's own cache folder where it can write there (`own`), else a
folder of its user's under the temp dir (a sandboxed or containerized engine's `$HOME` may be
neither writable nor kept; that folder needs neither). Either is the same path at every start of
the engine, because vLLM's compile cache names its files by absolute path; the path is part of
the key. `hand_over` adds to the folder what it lacks of the set the daemon kept for the engine's
key, unpacked beside it first with the archive's SHA-256 checked: a set that fails the check or
holds anything but folders and regular files under relative names is refused and nothing of it
is added, so the engine starts from what its folder holds, as it would without fast-start. A
folder already holding the set, every file of it whole, is used as it is (`.set` beside it
records the set). Once the engine has started, `Folder.keep` sends the set back if the engine
added to it: a file new since the start or of another size, or one of the engine's own folders
(`ours`) not yet kept. Files an earlier engine made after its set was kept (kernels compiled
while it served) count too; `Folder.made` tells them from the engine's own. A temp folder is the
engine's alone, all of it kept; in an own folder, other engines' files stay out of the set.

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
UNPACKING = ".fast-start-unpacking-"    # a set unpacked beside the folder's files, before they get what they lack


class Folder:
    """The engine's artifact folder; `outcome` says how it was filled ("hit", "miss: why",
    "refused: why"), `listing` which files of the kept set it holds (name -> size), `before` all
    it held then."""

    def __init__(self, socket_path: str, model: str, key: str, settings: dict[str, str], own: Path | None = None):
        name = hashlib.sha256("\0".join((socket_path, model, key, str(own or ""))).encode()).hexdigest()[:32]
        root = users_folder()
        self.own, self.path, self.record = own is not None, own or root / name, root / f"{name}.set"
        if own is not None:     # a temp folder's path follows from the key; an own one's is a setting of it
            key = hashlib.sha256(f"{key}\0{own}".encode()).hexdigest()
            settings = {**settings, "cache folder": str(own)}
        self.socket, self.model, self.key, self.settings = socket_path, model, key, settings
        self.outcome, self.listing, self.before = "", {}, {}

    @contextmanager
    def locked(self):
        """This folder to itself: two engines of one key (a standby, a restart racing a stop) fill it in turn."""
        fd = os.open(f"{self.record}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def held(self, sha256: str) -> dict[str, int] | None:
        """The files of the set `sha256` if the folder holds every one of them at its size."""
        try:
            kept = json.loads(self.record.read_text())
            if kept["sha256"] == sha256 and all(
                    os.lstat(self.path / name).st_size == size for name, size in kept["files"].items()):
                return kept["files"]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
        return None

    def remember(self, sha256: str) -> None:
        """Record that the folder holds the set `sha256`, its files as `listing` has them."""
        partial = self.record.with_suffix(".part")
        partial.write_text(json.dumps({"sha256": sha256, "files": self.listing}))
        partial.replace(self.record)

    def keep(self, ours: tuple[str, ...] = (), timeout: float = 30.0) -> list[str]:
        """Send the daemon the set, with what the engine added: files new since the start or of
        another size, and those in its folders `ours` (a temp folder is all the engine's); the
        names of the files the set lacked, none sent where it lacks none."""
        now = _listing(self.path)
        ours = ("",) if not self.own else tuple(os.path.relpath(p, self.path) + os.sep for p in ours
                                                 if Path(p).is_relative_to(self.path))
        wanted = {name: size for name, size in now.items() if name in self.listing
                  or self.before.get(name) != size or name.startswith(ours)}
        new = sorted(name for name, size in wanted.items() if self.listing.get(name) != size)
        if not new:
            return []
        with tempfile.TemporaryFile() as archive:
            digest, size = _pack(self.path, sorted(wanted), archive)
            with transport.connect(Path(self.socket), timeout) as conn:
                conn.settimeout(timeout + size / (32 << 20))
                protocol.send(conn, protocol.Keep(self.model, self.key, self.settings, size, digest))
                conn.sendfile(archive)
                reply, _ = protocol.recv(conn, accept_fds=False)
        if isinstance(reply, (protocol.Error, protocol.Miss)):
            why = reply.what if isinstance(reply, protocol.Error) else reply.reason
            raise FastStartError(f"the daemon did not keep the artifacts: {why}", reply.fix)
        self.listing = wanted
        with self.locked():
            self.remember(digest)
        return new

    def made(self, names: list[str]) -> list[str]:
        """Of `names` (what `keep` added to the set), those the engine wrote since its start; the
        rest the folder held as they are when it started: an earlier engine made them after its
        set was kept (kernels compiled while it served)."""
        return [name for name in names if self.before.get(name) != self.listing.get(name)]


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


def hand_over(socket_path: str, model: str, key: str, settings: dict[str, str], own: Path | None = None,
              timeout: float = 5.0) -> Folder:
    """The engine's folder (`own`, or one in the temp dir), holding the set the daemon kept for
    `key` if it has one; `Unkept` where the daemon keeps none of this model."""
    try:
        folder = Folder(socket_path, model, key, settings, own)
    except OSError as e:
        raise Unkept(f"no folder for the artifacts can be made in {tempfile.gettempdir()}: {e}",
                     "give the engine a writable TMPDIR") from None
    try:
        with transport.connect(Path(socket_path), timeout) as conn:
            reply, fds = transport.request(conn, protocol.Artifacts(model, folder.key, folder.settings),
                                           with_fds=True)
    except (FastStartError, OSError) as e:       # a daemon of an earlier version does not know the request
        raise Unkept(f"the daemon cannot be asked for artifacts: {getattr(e, 'what', e)}", "") from None
    kept = fds.pop() if isinstance(reply, protocol.KeptArtifacts) and len(fds) == 1 else None
    for fd in fds:          # whatever else came: nothing to use
        os.close(fd)
    if isinstance(reply, protocol.Miss) and protocol.UNKEPT in reply.fields:
        raise Unkept(reply.reason, reply.fix)
    try:
        with folder.locked():
            fill(folder, reply, kept)
    except OSError as e:
        raise Unkept(f"the kept artifacts cannot be put in {folder.path}: {e}",
                     f"make {folder.path.parent} writable for the engine's user") from None
    finally:
        if kept is not None:
            os.close(kept)
    return folder


def fill(folder: Folder, reply, kept: int | None) -> None:
    """Add to the (locked) folder what it lacks of the set `kept` (an fd), and say how."""
    folder.path.mkdir(mode=0o700, exist_ok=True)
    if kept is None:        # the daemon keeps none: what the engine makes is sent once it started
        folder.outcome = f"miss: {getattr(reply, 'reason', f'the daemon answered {reply.kind}')}"
    elif (held := folder.held(reply.sha256)) is not None:
        folder.outcome, folder.listing = "hit", held
    else:
        with open(kept, "rb", closefd=False) as f:
            why, files = _unpack_missing(f, reply.sha256, folder.path)
        folder.outcome, folder.listing = f"refused: {why}" if why else "hit", files
        if not why:
            folder.remember(reply.sha256)
    folder.before = _listing(folder.path)


def _listing(root: Path) -> dict[str, int]:
    """relative name -> size of every regular file under `root` (fast-start's unpacking left out)."""
    out = {}
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(UNPACKING)]
        for name in names:
            st = os.lstat(os.path.join(folder, name))
            out[os.path.relpath(os.path.join(folder, name), root)] = st.st_size
    return out


def _pack(root: Path, names: list[str], archive) -> tuple[str, int]:
    """Write the regular files `names` under `root` as a tar: its SHA-256 and size, `archive` left
    at its start."""
    with tarfile.open(fileobj=archive, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in names:
            info = tar.gettarinfo(root / name, name)
            if info.isreg():
                with open(root / name, "rb") as f:
                    tar.addfile(info, f)
    size = archive.tell()
    archive.seek(0)
    digest = hashlib.sha256()
    while chunk := archive.read(CHUNK):
        digest.update(chunk)
    archive.seek(0)
    return digest.hexdigest(), size


def _unpack_missing(f, sha256: str, root: Path) -> tuple[str, dict[str, int]]:
    """Unpack the tar `f` beside `root`'s files, then give `root` the files it lacks: why it was
    refused ("": it was whole and safe, and added) and its files (name -> size)."""
    staging = Path(tempfile.mkdtemp(prefix=UNPACKING, dir=root))
    try:
        why, files = _unpack(f, sha256, staging)
        for name in files:          # none where it was refused
            target = root / name
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(staging / name, target)
            except FileExistsError:         # the engine's own, or another engine's just now: left as it is
                pass
        return why, files
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _unpack(f, sha256: str, root: Path) -> tuple[str, dict[str, int]]:
    """Unpack the tar `f` into the empty folder `root` if its bytes are the daemon's: why it was
    refused, or "" if it was whole and safe; its files (name -> size)."""
    digest = hashlib.sha256()
    f.seek(0)
    while chunk := f.read(CHUNK):
        digest.update(chunk)
    if digest.hexdigest() != sha256:
        return "the archive is not the bytes the daemon kept (its SHA-256 differs)", {}
    f.seek(0)
    files = {}
    try:
        with tarfile.open(fileobj=f, mode="r|") as tar:
            for member in tar:
                parts = Path(member.name).parts
                if not (member.isreg() or member.isdir()) or not parts or Path(member.name).is_absolute() \
                        or ".." in parts:
                    return f"the archive holds {member.name!r}, which is not a file or folder inside it", {}
                target = root.joinpath(*parts)
                if member.isdir():
                    target.mkdir(mode=0o700, parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                             0o700 if member.mode & 0o100 else 0o600)
                with open(fd, "wb") as out:
                    shutil.copyfileobj(tar.extractfile(member), out, CHUNK)
                files[os.path.join(*parts)] = member.size
    except (tarfile.TarError, OSError) as e:
        return f"the archive cannot be read ({type(e).__name__}: {e})", {}
    return "", files

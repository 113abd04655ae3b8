"""What an engine rebuilds at every start and can keep (vLLM's torch.compile artifacts, the
Triton kernels they use): kept by the daemon in its state directory, per engine user and model.

An engine sends a set as one tar stream (`Keep`) under a key, the engine's word for everything
that decides whether a set fits it (vLLM: its config hash, its compile-relevant environment, the
versions), with the settings behind it spelled out, which is what names a miss. It asks for the
set of its key (`Artifacts`) and gets a read-only fd of the file and its SHA-256, which it checks
as it unpacks; a set that fails is replaced by the engine's next `Keep`. A set goes only to the
uid that kept it: it is code the engine runs (compiled graphs, kernels), and one user's must never
run as another.

Layout: `<root>/<uid>/<id>.tar` and `<id>.json` (model, key, settings, size, sha256, kept_at,
used_at), `id` a hash of model and key. Each uid keeps at most `budget` bytes: the sets used
least recently go first. Sets of models no longer configured stay until the budget needs their
room. Files are written under a fresh name and renamed, read without following symlinks.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

from . import files, protocol, reports
from .trust import Peer

log = logging.getLogger("fast_start.daemon")
CHUNK = 1 << 20
SHOWN = 3               # differing settings a miss names


class Cut(OSError):
    """The peer stopped sending a Keep's bytes (it went away or was too slow)."""


class Upload:
    """The bytes that follow a `Keep` frame on its connection: `read(n)` gives the next at most
    `n`; `left` counts those not yet read (the connection is closed if any are left)."""

    def __init__(self, read: Callable[[int], bytes], size: int):
        self.read_some, self.left = read, size

    def read(self, n: int) -> bytes:
        try:
            data = self.read_some(min(n, self.left))
        except OSError as e:
            raise Cut(f"the artifacts stopped coming: {e}") from e
        if not data:
            raise Cut("the connection ended inside the artifacts")
        self.left -= len(data)
        return data


class Artifacts:
    def __init__(self, root: Path | None, budget: int, models: Callable[[], set[str]], metrics):
        self.root, self.budget, self.models, self.metrics = root, budget, models, metrics
        self.lock = threading.Lock()
        self.last: dict[tuple[int, str], tuple[str, str, float]] = {}     # (uid, model) -> its last event, why, when
        for part in root.glob("*/.*.part") if root else ():     # uploads a stop broke off
            part.unlink()
        for tar in root.glob("*/*.tar") if root else ():        # kept, but stopped before its record was
            if not tar.with_suffix(".json").exists():
                tar.unlink()

    def handle(self, msg, peer: Peer, upload: Upload | None = None):
        """An `Artifacts` or `Keep` request -> (reply, fds, done(sent))."""
        why = self._refused(msg.model)
        if why:
            return protocol.Miss(why[0], [protocol.UNKEPT], msg.model, why[1]), [], _nothing
        if isinstance(msg, protocol.Keep):
            return self.keep(msg, peer, upload), [], _nothing
        return self.find(msg, peer)

    def _refused(self, model: str) -> tuple[str, str] | None:
        if self.root is None or self.budget == 0:
            return ("this daemon keeps no artifacts" + ("" if self.budget else " ([daemon] artifacts = \"0\")"),
                    "run it under its unit (StateDirectory=) with [daemon] artifacts above 0")
        if model not in self.models():
            return f"model {model!r} is not configured here", "ask for a model of this daemon's config"
        return None

    def find(self, msg: protocol.Artifacts, peer: Peer):
        with self.lock:
            sets = [s for s in self._sets(peer.uid) if s["model"] == msg.model]
            kept = next((s for s in sets if s["key"] == msg.key), None)
            fd = self._open(peer.uid, kept) if kept else None
        if fd is None:
            miss = protocol.Miss(f"the artifacts kept of {msg.model} for these settings were damaged and dropped "
                                 "(see the daemon's log)", [], msg.model) if kept else \
                _miss(msg, max(sets, key=lambda s: s["used_at"], default=None))
            self._note(peer, msg.model, "miss", miss.reason)
            return miss, [], _nothing
        self._note(peer, msg.model, "hit")
        log.info("handed uid %d's artifacts of %s (%d bytes) over", peer.uid, msg.model, kept["size"])
        return protocol.KeptArtifacts(kept["key"], kept["size"], kept["sha256"]), [fd], lambda sent: os.close(fd)

    def keep(self, msg: protocol.Keep, peer: Peer, upload: Upload):
        if not (0 < msg.size <= self.budget and len(msg.sha256) == 64 and set(msg.sha256) <= set("0123456789abcdef")):
            return protocol.Error(f"artifacts of {msg.size} bytes with SHA-256 {msg.sha256[:64]!r} cannot be kept: "
                                  f"an engine user may keep up to {self.budget} bytes on this GPU",
                                  "send a non-empty set and its hex SHA-256; or raise [daemon] artifacts")
        try:
            return self._write(msg, peer, upload)
        except Cut:
            raise
        except OSError as e:
            log.warning("cannot keep uid %d's artifacts of %s: %s", peer.uid, msg.model, e)
            return protocol.Error(f"the daemon cannot keep the artifacts: {e}", "free room in its state directory")

    def _write(self, msg: protocol.Keep, peer: Peer, upload: Upload):
        folder = self._folder(peer.uid)
        fd, part = tempfile.mkstemp(prefix=".", suffix=".part", dir=folder)
        try:
            with os.fdopen(fd, "wb") as f:
                digest = hashlib.sha256()
                while upload.left:
                    data = upload.read(CHUNK)
                    digest.update(data)
                    f.write(data)
                f.flush()
                os.fsync(f.fileno())
            if digest.hexdigest() != msg.sha256:
                return protocol.Error("the artifacts sent are not the bytes their SHA-256 names",
                                      "send them again (was the archive changed while it was sent?)")
            now = time.time()
            meta = {"model": msg.model, "key": msg.key, "settings": msg.settings, "size": msg.size,
                    "sha256": msg.sha256, "kept_at": now, "used_at": now}
            with self.lock:
                name = _id(msg.model, msg.key)
                os.replace(part, folder / f"{name}.tar")
                files.write_atomic(folder / f"{name}.json", json.dumps(meta), 0o600)
                gone = self._prune(peer.uid, name)
        finally:
            if os.path.exists(part):
                os.unlink(part)
        self._note(peer, msg.model, "kept")
        log.info("kept uid %d's artifacts of %s (%d bytes%s)", peer.uid, msg.model, msg.size,
                 f"; dropped {len(gone)} set(s) used less recently to stay within {self.budget} bytes" if gone else "")
        return protocol.Report({"kept": msg.size, "dropped": len(gone)})

    def report(self, uid: int | None) -> list[reports.KeptSets]:
        """`uid`'s kept sets by model, with the last start's outcome; every user's with None."""
        if self.root is None:
            return []
        rows: dict[tuple[int, str], list] = {}
        with self.lock:
            uids = [uid] if uid is not None else sorted(int(p.name) for p in self.root.glob("*") if p.name.isdigit())
            for each in uids:
                for s in self._sets(each):
                    row = rows.setdefault((each, s["model"]), [0, 0])
                    row[0] += 1
                    row[1] += s["size"]
            events = {k: v for k, v in self.last.items() if uid is None or k[0] == uid}
        return [reports.KeptSets(model, each, *rows.get((each, model), (0, 0)), *events.get((each, model), ()))
                for each, model in sorted(rows.keys() | events.keys())]

    def _note(self, peer: Peer, model: str, event: str, why: str = "") -> None:
        self.metrics.inc("fast_start_artifacts_total", model=model, event=event)
        with self.lock:
            self.last[(peer.uid, model)] = (event, why, time.time())

    # -- files (under the lock) ----------------------------------------------------------------
    def _folder(self, uid: int) -> Path:
        folder = self.root / str(uid)
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not stat.S_ISDIR(os.lstat(folder).st_mode):
            raise OSError(f"{folder} is not a directory")
        return folder

    def _sets(self, uid: int) -> list[dict]:
        """`uid`'s sets, each its JSON record and `name`; one that cannot be read is dropped, once."""
        folder = self.root / str(uid)
        out = []
        try:
            names = sorted(p.stem for p in folder.glob("*.json"))
        except OSError:
            return out
        for name in names:
            try:
                meta = files.read_json(folder / f"{name}.json")
                if not isinstance(meta, dict) or set(meta) != {"model", "key", "settings", "size", "sha256",
                                                               "kept_at", "used_at"}:
                    raise files.Unreadable("not a record of kept artifacts")
            except (OSError, files.Unreadable) as e:
                log.warning("dropped uid %d's artifacts %s: %s", uid, name, e)
                _remove(folder, name)
                continue
            out.append({**meta, "name": name})
        return out

    def _open(self, uid: int, kept: dict) -> int | None:
        """A read-only fd of `kept`'s archive, its use noted; None (and the set dropped) if it is not there whole."""
        folder = self.root / str(uid)
        try:
            fd = os.open(folder / f"{kept['name']}.tar", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            log.warning("dropped uid %d's artifacts of %s: %s", uid, kept["model"], e)
            _remove(folder, kept["name"])
            return None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != kept["size"]:
            os.close(fd)
            log.warning("dropped uid %d's artifacts of %s: the archive is not the %d bytes kept", uid,
                        kept["model"], kept["size"])
            _remove(folder, kept["name"])
            return None
        record = {k: v for k, v in kept.items() if k != "name"}
        files.write_atomic(folder / f"{kept['name']}.json", json.dumps({**record, "used_at": time.time()}), 0o600)
        return fd

    def _prune(self, uid: int, keep: str) -> list[str]:
        """Drop `uid`'s sets used least recently, never `keep`, until they fit the budget."""
        sets = sorted(self._sets(uid), key=lambda s: s["used_at"])
        total, gone = sum(s["size"] for s in sets), []
        for s in sets:
            if total <= self.budget:
                break
            if s["name"] != keep:
                _remove(self.root / str(uid), s["name"])
                total -= s["size"]
                gone.append(s["name"])
        return gone


def _id(model: str, key: str) -> str:
    return hashlib.sha256(json.dumps([model, key]).encode()).hexdigest()[:32]


def _remove(folder: Path, name: str) -> None:
    for suffix in (".tar", ".json"):
        try:
            os.unlink(folder / f"{name}{suffix}")
        except FileNotFoundError:
            pass


def _miss(msg: protocol.Artifacts, closest: dict | None) -> protocol.Miss:
    if closest is None:
        return protocol.Miss(f"no artifacts of {msg.model} are kept for this user yet", [], msg.model)
    kept, now = closest["settings"], msg.settings
    differ = sorted(k for k in kept.keys() | now.keys() if kept.get(k) != now.get(k))
    if not differ:
        return protocol.Miss(f"the artifacts kept of {msg.model} were made under another key, though with the "
                             "settings named here alike", [], msg.model)
    shown = "; ".join(f"{k}: kept {_short(kept.get(k))}, now {_short(now.get(k))}" for k in differ[:SHOWN])
    more = f" (and {len(differ) - SHOWN} more)" if len(differ) > SHOWN else ""
    return protocol.Miss(f"the artifacts kept of {msg.model} were made with other settings: {shown}{more}",
                         differ, msg.model)


def _short(value) -> str:
    text = "(none)" if value is None else str(value)
    return text if len(text) <= 60 else f"{text[:24]}...{text[-33:]}"      # a path's tail tells most


def _nothing(sent: bool) -> None:
    pass

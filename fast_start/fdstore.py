"""The cache in systemd's file-descriptor store, so that it outlives the daemon process.

After a fill, each model's arena fds and a sealed memfd holding its manifest go to the store
(`FDSTORE=1`, `FDNAME=fs-<key>-m` / `fs-<key>-a<j>`, key = the fingerprint digest's first 16
hex digits). When systemd starts the daemon again (crash + `Restart=on-failure`,
`systemctl restart`), it passes them back (`LISTEN_FDS`, `LISTEN_FDNAMES`) and the daemon
re-adopts them instead of reading the checkpoint. An eviction removes them (`FDSTOREREMOVE=1`).
systemd 252 empties the store on `stop` (and on a failure with `Restart=no`).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass

from . import notify
from .errors import FastStartError
from .files import memfd, seal, sealed
from .manifest import Manifest

log = logging.getLogger("fast_start.daemon")
PREFIX = "fs"


@dataclass
class Stored:
    """One model shard handed back by systemd."""
    model: str
    manifest: Manifest
    fds: list[int]
    names: list[str]
    filled_at: float
    files: dict           # the checkpoint files' identity at the fill ({} from an older daemon)


def store(model: str, manifest: Manifest, fds: list[int], filled_at: float, files: dict) -> list[str]:
    """Put a model's manifest and arena fds into the store; returns their FDNAMEs (none without systemd)."""
    if not os.environ.get("NOTIFY_SOCKET"):
        return []
    # By model and fingerprint: two models of one fingerprint (an engine upgrade's second entry
    # for the same checkpoint) must not share names, or removing one's removes the other's.
    key = hashlib.sha256(f"{model}\0{manifest.fingerprint.digest()}".encode()).hexdigest()[:16]
    names = [f"{PREFIX}-{key}-m"] + [f"{PREFIX}-{key}-a{j}" for j in range(len(fds))]
    record = json.dumps({"model": model, "manifest": manifest.to_dict(), "filled_at": filled_at,
                         "files": files}).encode()
    mfd = memfd(f"fast-start:{model}-manifest")
    try:
        view = memoryview(record)
        while view:
            view = view[os.write(mfd, view):]
        try:
            seal(mfd)
        except OSError as e:
            log.warning("could not seal %s's manifest for systemd's fd store (%s): a restart will fill it from "
                        "disk", model, e.strerror or e)
            return []
        sent = notify.notify(f"FDSTORE=1\nFDNAME={names[0]}", [mfd])
    finally:
        os.close(mfd)
    for name, fd in zip(names[1:], fds, strict=True):
        sent = notify.notify(f"FDSTORE=1\nFDNAME={name}", [fd]) and sent
    if not sent:
        log.warning("could not put %s into systemd's fd store: a restart will fill it from disk", model)
    return names


def remove(names: list[str]) -> None:
    for name in names:
        notify.notify(f"FDSTOREREMOVE=1\nFDNAME={name}")


def adopt() -> tuple[list[Stored], list[str]]:
    """What systemd passed back: (complete shards, problems found, each already dropped)."""
    groups: dict[str, dict[str, tuple[str, int]]] = {}
    for name, fd in notify.listen_fds():
        parts = name.split("-")
        if len(parts) != 3 or parts[0] != PREFIX:
            os.close(fd)
            remove([name])
            continue
        groups.setdefault(parts[1], {})[parts[2]] = (name, fd)
    stored, problems = [], []
    for key, group in groups.items():
        names = [n for n, _ in group.values()]
        fds = {part: fd for part, (_, fd) in group.items()}
        try:
            stored.append(_shard(fds, names))
        except (FastStartError, OSError, ValueError, KeyError, TypeError) as e:
            problems.append(f"stored arena {key}: {e}")
            for fd in fds.values():
                os.close(fd)
            remove(names)
    return stored, problems


def _shard(fds: dict[str, int], names: list[str]) -> Stored:
    mfd = fds["m"]
    if not sealed(mfd):
        raise ValueError("manifest memfd is not sealed")
    size, data = os.fstat(mfd).st_size, bytearray()
    while len(data) < size:
        chunk = os.pread(mfd, size - len(data), len(data))
        if not chunk:
            raise ValueError("manifest memfd is shorter than its size")
        data += chunk
    record = json.loads(data)
    manifest = Manifest.from_dict(record["manifest"])
    arenas = [fds[f"a{j}"] for j in range(len(manifest.arenas))]
    if len(arenas) != len(fds) - 1:
        raise ValueError("stored arenas do not match the manifest")
    os.close(mfd)
    return Stored(record["model"], manifest, arenas, names, float(record["filled_at"]), record.get("files") or {})

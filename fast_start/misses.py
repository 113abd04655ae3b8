"""Why the cache cannot serve an engine what it asks for, in words (`protocol.Miss`): the cache
(`cache.py`) decides that it misses, these say why, as exactly as the daemon knows. Each reads
only what it is given; the cache holds its lock where they read its state.
"""
from __future__ import annotations

from . import memory, protocol, reports, trust, watch
from .entry import Entry
from .fingerprint import Fingerprint
from .trust import Peer


def unmatched(want: Fingerprint, closest: Entry | None, pending: dict[str, reports.Missing],
              former: dict[str, tuple[Fingerprint, str]]) -> protocol.Miss:
    """No entry holds `want`: an evicted model that did (`former`), the models still pending, no
    model at all, or the fields in which the closest entry differs."""
    for name, state in pending.items():
        fp, reason = former.get(name, (None, ""))
        if fp == want:
            changed = reason == "checkpoint changed"
            why = "checkpoint changed since the fill" if changed else f"evicted ({reason})"
            return protocol.Miss(f"{why}; {name} is {state.state}" + (f": {state.detail}" if state.detail else ""),
                                 ["files"] if changed else [], name, "see fast-start status")
    if closest is None and pending:
        states = "; ".join(f"{name} is {p.state}" + (f" ({p.detail})" if p.detail else "") for name, p in pending.items())
        return protocol.Miss(f"no model is cached now: {states}", [], "",
                             "see fast-start status; a model is served as soon as its fill completes")
    if closest is None:
        return protocol.Miss("this daemon caches no model", [], "", "add the model to the daemon's config "
                             "([[model]] with this GPU in gpus) and run systemctl reload")
    return protocol.Miss("fingerprint differs", list(closest.manifest.fingerprint.diff(want)), closest.model.name)


def other_files(entry: Entry, theirs) -> tuple[protocol.Miss, str]:
    """The engine's files (`theirs`, their identities) are not those of the fill: the miss, and
    how the checkpoint changed since the fill ("" where it did not: the engine's is another copy)."""
    changed = watch.differs(entry.files, watch.identity(entry.model.path), gone_is_change=False)
    if changed:
        return protocol.Miss(f"checkpoint changed since the fill ({changed})", ["files"], entry.model.name,
                             "wait for the daemon to refill it (fast-start status)"), changed
    other = watch.differs(entry.files, theirs) if isinstance(theirs, dict) else "no file identities sent"
    return protocol.Miss(f"the engine's checkpoint files are not those the daemon cached from {entry.model.path} "
                         f"({other})", ["files"], entry.model.name,
                         "load the model from the folder the daemon's [[model]] path names"), ""


def unreadable(peer: Peer, entry: Entry, theirs: str) -> protocol.Miss | None:
    """`peer` cannot read `entry`'s files (knowing the fingerprint and the files' identities is not
    reading them): by the configured path or, where that fails, by the folder the engine names
    (`theirs`: a bind mount, hard links) if the files there are the very files of the fill."""
    names = [n for n, i in entry.files.items() if i[2] >= 0]
    denied = trust.unreadable(peer, entry.model.path, names)
    if denied and theirs and theirs != entry.model.path:
        there = watch.identity(theirs)
        if all(there.get(n) == entry.files[n] for n in names):
            denied = trust.unreadable(peer, theirs, names) and denied
    if not denied:
        return None
    return protocol.Miss(f"uid {peer.uid} cannot read {denied}", ["access"], entry.model.name,
                         "let that user read the checkpoint")


def no_room_for_copy(entry: Entry, device: str, gpu: int, keep_free: int) -> protocol.Miss | None:
    """A copy the device has no room for while the daemon keeps its cache (`on_release = "keep"`):
    the engine's copy and the cache would both need the model's bytes, and the cache kept beside
    a copy leaves `keep_free` to the other engines as a fill does."""
    now = memory.of(device)
    need = entry.nbytes + max((a.size for a in entry.manifest.arenas), default=0) + keep_free
    if now is None or now.free >= need:
        return None
    what = (f"no room on {memory.where(device, gpu)} for a copy of {entry.model.name} ({memory.gib(entry.nbytes)}) "
            f"beside the cache (on_release = \"keep\"): {memory.gib(now.free)} free, {memory.gib(need)} needed with "
            "keep_free")
    return protocol.Miss(what, ["memory"], entry.model.name, 'set on_release = "drop" in the daemon\'s config '
                         "(a copy then takes the cache's place), or load with mode zero_copy")


def reason(miss: protocol.Miss) -> str:
    """The reason a miss is counted by (`cache.MISS_REASONS`)."""
    return next((f for f in ("memory", "access", "files") if f in miss.fields), None) or \
        ("fingerprint" if miss.fields else "evicted" if miss.reason.startswith("evicted") else "not_cached")


def without_folders(miss: protocol.Miss, folders: tuple[str, ...]) -> protocol.Miss:
    """`miss` as a peer that is no admin gets it: no model folder named in it."""
    text = miss.reason
    for folder in folders:
        text = text.replace(folder, "the model's folder")
    return protocol.Miss(text, miss.fields, miss.model, miss.fix)

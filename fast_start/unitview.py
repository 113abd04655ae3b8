"""What the daemon of a `fast-start@N` unit can reach: its `User=` and the sandbox settings that
hide paths from it.

`check-config`, run as root, checks as the unit would: it reads the unit's settings from systemd
(`systemctl show`), runs the path checks again as the unit's user, group and supplementary
groups (a child process: the kernel decides what that user may read), and names the setting
that hides a path from the unit's mount namespace. Torch-free.
"""
from __future__ import annotations

import grp
import os
import pwd
import shutil
import subprocess
from dataclasses import dataclass

PROPERTIES = ("LoadState", "User", "Group", "SupplementaryGroups", "PrivateTmp", "ProtectHome",
              "InaccessiblePaths", "TemporaryFileSystem", "BindPaths", "BindReadOnlyPaths", "ProtectSystem",
              "ReadWritePaths", "RuntimeDirectory", "StateDirectory", "CacheDirectory")
# Where a unit's own directories (RuntimeDirectory= and the like) lie: writable under any ProtectSystem=.
OWN = {"RuntimeDirectory": "/run", "StateDirectory": "/var/lib", "CacheDirectory": "/var/cache"}
HOMES = ("/home", "/root", "/run/user")


@dataclass(frozen=True)
class Unit:
    name: str
    user: str                               # "" where the unit runs as root
    group: str
    groups: tuple[str, ...]
    hidden: tuple[tuple[str, str], ...]     # (a path, the setting that hides it and all under it)
    bound: tuple[str, ...] = ()             # BindPaths= / BindReadOnlyPaths= destinations: seen again
    protect_system: str = "no"
    writable_paths: tuple[str, ...] = ()    # ReadWritePaths= and the unit's own directories


def read(gpu: int) -> Unit | None:
    """fast-start@`gpu`'s settings as systemd has loaded them; None where systemd does not know the
    unit (no systemd, or the unit is not installed)."""
    name = f"fast-start@{gpu}.service"
    systemctl = shutil.which("systemctl")
    if systemctl is None:
        return None
    try:
        done = subprocess.run([systemctl, "show", name, *(f"--property={p}" for p in PROPERTIES)],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    props = dict(line.partition("=")[::2] for line in done.stdout.splitlines())
    if done.returncode or props.get("LoadState") != "loaded":
        return None
    bound = [entry.lstrip("-").split(":")[1 if ":" in entry else 0]
             for key in ("BindPaths", "BindReadOnlyPaths") for entry in props.get(key, "").split()]
    writable = [entry.lstrip("-+") for entry in props.get("ReadWritePaths", "").split()]
    writable += [f"{OWN[key]}/{d}" for key in OWN for d in props.get(key, "").split()]
    return Unit(name, props.get("User", ""), props.get("Group", ""),
                tuple(props.get("SupplementaryGroups", "").split()), tuple(hidden(props)), tuple(bound),
                props.get("ProtectSystem", "no") or "no", tuple(writable))


def hidden(props: dict[str, str]) -> list[tuple[str, str]]:
    """(path, setting) for every path a unit with these properties cannot see."""
    out = []
    if props.get("PrivateTmp") not in (None, "", "no"):
        out += [(p, f"PrivateTmp={props['PrivateTmp']}") for p in ("/tmp", "/var/tmp")]
    if props.get("ProtectHome") in ("yes", "tmpfs"):
        out += [(p, f"ProtectHome={props['ProtectHome']}") for p in HOMES]
    for entry in props.get("InaccessiblePaths", "").split():
        path = entry.lstrip("-+")
        out.append((path, f"InaccessiblePaths={path}"))
    for entry in props.get("TemporaryFileSystem", "").split():
        path = entry.split(":")[0]
        out.append((path, f"TemporaryFileSystem={path}"))
    return out


def hider(unit: Unit, path: str) -> str | None:
    """The setting of `unit` that hides `path` (or the file it resolves to), else None."""
    for p in dict.fromkeys((os.path.abspath(path), os.path.realpath(path))):
        if any(_under(p, b) for b in unit.bound):
            continue
        for where, setting in unit.hidden:
            if _under(p, where):
                return setting
    return None


def writable(unit: Unit, folder: str) -> bool:
    """Whether `unit`'s sandbox leaves `folder` writable: ProtectSystem=strict makes everything
    read-only but ReadWritePaths= and the unit's own directories (the file modes are the kernel's)."""
    if unit.protect_system != "strict":
        return True
    return any(_under(p, w) for p in dict.fromkeys((os.path.abspath(folder), os.path.realpath(folder)))
               for w in unit.writable_paths)


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def as_user(unit: Unit) -> dict:
    """subprocess.run's arguments that run a child as the unit's user, its group, and the groups
    systemd gives it (the user's own and SupplementaryGroups=); {} for a unit run as root.
    Raises LookupError naming a user or group this machine does not have."""
    if not unit.user or unit.user == "root":
        return {}
    try:
        pw = pwd.getpwnam(unit.user)
    except KeyError:
        raise LookupError(f"User={unit.user} does not exist") from None
    try:
        gid = grp.getgrnam(unit.group).gr_gid if unit.group else pw.pw_gid
        extra = [grp.getgrnam(g).gr_gid for g in unit.groups]
    except KeyError as e:
        raise LookupError(f"group {e.args[0]} of the unit does not exist") from None
    return {"user": pw.pw_uid, "group": gid, "extra_groups": sorted({*os.getgrouplist(unit.user, gid), *extra})}

"""Who may talk to whom: socket-directory checks and peer credentials, for daemon and client.

The daemon's socket directory must be a real directory (not a symlink) owned by the daemon's
user and writable by nobody else; the daemon refuses to start otherwise rather than repair a
directory someone else could have prepared. A client applies the same rules to the directory
and the socket before connecting, and checks the daemon's `SO_PEERCRED` before sending.
"""
from __future__ import annotations

import os
import pwd
import socket
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

from .errors import FastStartError

SERVICE_USER = "fast-start"


class TrustError(FastStartError):
    """A socket, its directory or a peer fails the ownership and permission rules."""


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int

    def groups(self) -> set[int]:
        """The peer's primary and supplementary groups (read from /proc while it is connected)."""
        gids = {self.gid}
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("Groups:"):
                    gids.update(int(g) for g in line.split()[1:])
        except OSError:
            pass
        return gids


def peer(sock: socket.socket) -> Peer:
    fmt = "3i"
    return Peer(*struct.unpack(fmt, sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize(fmt))))


def trusted_daemon_uids() -> set[int]:
    """A client trusts daemons running as itself, root or the service user."""
    uids = {os.geteuid(), 0}
    try:
        uids.add(pwd.getpwnam(SERVICE_USER).pw_uid)
    except KeyError:
        pass
    return uids


def prepare_socket_dir(path: str | Path, group: int | None = None) -> Path:
    """Create or check the daemon's socket directory: ours, no symlink, writable by us alone."""
    path = Path(path)
    mode = 0o750 if group is not None else 0o700
    try:
        path.mkdir(mode=mode, parents=False)
    except FileExistsError:
        pass
    except OSError as e:
        raise TrustError(f"cannot create socket directory {path}: {e}",
                         "create it (systemd's RuntimeDirectory= does) or fix socket_dir") from None
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise TrustError(f"socket directory {path} is a symlink or not a directory", "remove it and restart")
    if st.st_uid != os.geteuid():
        raise TrustError(f"socket directory {path} is owned by uid {st.st_uid}, not by the daemon's uid {os.geteuid()}",
                         "remove it, or run the daemon as its owner")
    if st.st_mode & 0o022:
        raise TrustError(f"socket directory {path} is group- or world-writable (mode {stat.S_IMODE(st.st_mode):o})",
                         f"remove it, or chmod {mode:o} it after checking its contents")
    if group is not None:
        os.chown(path, -1, group)
    os.chmod(path, mode)    # tighten read/search bits on a directory that is ours and not writable by others
    return path


def check_socket_path(sock_path: str | Path, trusted: set[int]) -> None:
    """Client side: the directory and the socket are owned by a trusted uid and not writable by others."""
    sock_path = Path(sock_path)
    for p, want, what in ((sock_path.parent, stat.S_ISDIR, "directory"), (sock_path, stat.S_ISSOCK, "socket")):
        try:
            st = os.lstat(p)
        except OSError as e:
            raise TrustError(f"cannot inspect {p}: {e.strerror}", "check that the daemon runs") from None
        if stat.S_ISLNK(st.st_mode) or not want(st.st_mode):
            raise TrustError(f"{p} is a symlink or not a {what}", f"remove it; only the daemon creates its {what}")
        if st.st_uid not in trusted:
            raise TrustError(f"{what} {p} is owned by uid {st.st_uid}, not by a trusted daemon user",
                             "check who created it; the daemon runs as root, fast-start or yourself")
        if st.st_mode & (0o022 if what == "directory" else 0o002):
            raise TrustError(f"{what} {p} is writable by others (mode {stat.S_IMODE(st.st_mode):o})",
                             "restart the daemon so it recreates it with safe permissions")

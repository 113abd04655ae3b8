"""Who may talk to whom: socket-directory checks and peer credentials, for daemon and client.

The daemon's socket directory must be a real directory (not a symlink) owned by the daemon's
user and writable by nobody else; the daemon refuses to start otherwise rather than repair a
directory someone else could have prepared. A client applies the same rules to the directory
and the socket before connecting, and checks the daemon's `SO_PEERCRED` before sending.

An engine is served a model's weights only if it could read the checkpoint itself
(`unreadable`): the cache must not let a user read what the files would not let them read.

Who may connect is decided by credentials, not file modes: when other users are allowed
(`allowed_uids`, `allowed_groups`) the directory is 0755 and the socket 0666, and the daemon
checks each peer's uid and groups (`SO_PEERCRED`, `SO_PEERGROUPS`: the credentials of the
connecting process, read from the socket, so neither `/proc` nor group ownership is needed,
which a hardened unit would hide or forbid). Otherwise they are 0700 and 0600.
"""
from __future__ import annotations

import array
import errno
import os
import pwd
import socket
import stat
import struct
from pathlib import Path
from typing import Iterable, NamedTuple

from .errors import ConfigError, FastStartError

SERVICE_USER = "fast-start"


class TrustError(FastStartError):
    """A socket, its directory or a peer fails the ownership and permission rules."""


SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)     # Linux >= 4.13; not named by Python 3.11


class Peer(NamedTuple):
    pid: int
    uid: int
    gid: int
    groups: frozenset[int] = frozenset()   # primary and supplementary gids
    admin: bool = False          # may evict and see every lease (root, the daemon's user, admin_groups)


def peer(sock: socket.socket) -> Peer:
    """The credentials of the process that connected `sock` (as of its connect)."""
    fmt = "3i"
    pid, uid, gid = struct.unpack(fmt, sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize(fmt)))
    groups = {gid}
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 1024)   # up to 256 groups
        got = array.array("I")
        got.frombytes(raw[:len(raw) - len(raw) % got.itemsize])
        groups.update(got)
    except OSError:
        pass        # more than 256 groups, or an old kernel: the primary group still counts
    return Peer(pid, uid, gid, frozenset(groups))


class TrustedUids:
    """The uids a client trusts to run its daemon: itself, root and the service user. The user
    database is asked only for an owner that is neither (a first lookup costs half a millisecond
    of an engine's start)."""

    def __init__(self):
        self.service: int | None = None
        self.looked_up = False

    def __contains__(self, uid: int) -> bool:
        if uid in (os.geteuid(), 0):
            return True
        if not self.looked_up:
            try:
                self.service = pwd.getpwnam(SERVICE_USER).pw_uid
            except KeyError:
                pass
            self.looked_up = True
        return uid == self.service


def prepare_socket_dir(path: str | Path, shared: bool = False) -> Path:
    """Create or check the daemon's socket directory: ours, no symlink, writable by us alone.

    `shared`: other users may connect (0755), else 0700. Problems are `ConfigError`s: the
    operator fixes `socket_dir` or the directory, the daemon does not repair what it did not make.
    """
    path = Path(path)
    mode = 0o755 if shared else 0o700
    try:
        path.mkdir(mode=mode, parents=False)
    except FileExistsError:
        pass
    except OSError as e:
        raise ConfigError(f"cannot create socket directory {path}: {e.strerror or e}",
                          "create it (systemd's RuntimeDirectory= does) or fix socket_dir") from None
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"socket directory {path} is a symlink or not a directory", "remove it and restart")
    if st.st_uid != os.geteuid():
        live = sorted(p.name for p in path.glob("gpu*.sock"))      # never suggest removing those
        raise ConfigError(f"socket directory {path} is owned by uid {st.st_uid}, not by the daemon's uid {os.geteuid()}"
                          + (f", and holds {', '.join(live)} of its daemons" if live else ""),
                          "start this daemon as its unit does (systemctl start fast-start@N), as that user"
                          if live else "remove it, or run the daemon as its owner")
    if st.st_mode & 0o022:
        raise ConfigError(f"socket directory {path} is group- or world-writable (mode {stat.S_IMODE(st.st_mode):o})",
                          f"remove it, or chmod {mode:o} it after checking its contents")
    os.chmod(path, mode)    # ours and not writable by others: set the read/search bits we want
    return path


def check_socket_path(sock_path: str | Path, trusted: TrustedUids | set[int]) -> None:
    """Client side: the directory and the socket are owned by a trusted uid, the directory writable
    by no one else (so nobody else can put a socket there). A socket's own write bit only says who
    may connect, which the daemon decides by credentials."""
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
        if what == "directory" and st.st_mode & 0o022:
            raise TrustError(f"{what} {p} is writable by others (mode {stat.S_IMODE(st.st_mode):o})",
                             "restart the daemon so it recreates it with safe permissions")


# POSIX ACLs as the kernel stores them (`system.posix_acl_access`): a 4-byte version, then
# entries of tag (u16), permissions (u16), id (u32). acl(5) gives the order of the checks.
_ACL_XATTR, _ACL_ENTRY = "system.posix_acl_access", struct.Struct("<HHI")
_USER_OBJ, _USER, _GROUP_OBJ, _GROUP, _MASK, _OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
_READ, _SEARCH = 4, 1


def unreadable(peer: Peer, folder: str | Path, names: Iterable[str]) -> str | None:
    """The first file of `names` in `folder` that `peer` could not open for reading, by the
    kernel's rules (search permission on every folder on the way to the file and to what a
    symlink points at, read permission on the file; owner, group and other bits and POSIX
    ACLs), or None. Root reads everything; so may any capability, which is not looked at: a
    peer refused here that holds one reads the checkpoint from disk instead."""
    if peer.uid == 0:
        return None
    searched: dict[Path, bool] = {}
    for name in names:
        path = Path(folder) / name
        real = Path(os.path.realpath(path))
        folders = {*path.parents, *real.parents}
        for d in sorted(folders - searched.keys()):
            searched[d] = _permits(d, peer, _SEARCH)
        if not all(searched[d] for d in folders) or not _permits(real, peer, _READ):
            return str(path)
    return None


def _permits(path: Path, peer: Peer, want: int) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    if st.st_uid == peer.uid:
        return (st.st_mode >> 6) & want == want
    try:
        acl = _acl(path)
    except OSError:
        return False
    if acl is None:
        if st.st_gid in peer.groups:
            return (st.st_mode >> 3) & want == want
        return st.st_mode & want == want
    mask = next((perm for tag, perm, _ in acl if tag == _MASK), 7)
    for tag, perm, uid in acl:
        if tag == _USER and uid == peer.uid:
            return perm & mask & want == want
    groups = [perm for tag, perm, gid in acl if (tag == _GROUP_OBJ and st.st_gid in peer.groups)
              or (tag == _GROUP and gid in peer.groups)]
    if groups:
        return any(perm & mask & want == want for perm in groups)
    return next((perm for tag, perm, _ in acl if tag == _OTHER), 0) & want == want


def _acl(path: Path) -> list[tuple[int, int, int]] | None:
    """The file's access ACL entries (tag, permissions, id), or None when it has none."""
    try:
        raw = os.getxattr(path, _ACL_XATTR)
    except OSError as e:
        if e.errno in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP):
            return None
        raise
    return [_ACL_ENTRY.unpack_from(raw, at) for at in range(4, len(raw) - _ACL_ENTRY.size + 1, _ACL_ENTRY.size)]


def others_can_write(python: str | Path) -> str | None:
    """Where someone other than this user (and root) could change what `python` runs, or None.

    Root must not run code from an environment another user can write (a `.pth` line in its
    site-packages runs at every start): the interpreter and each folder on the way to it (the
    path as given and as resolved), the environment's folder (a venv's `pyvenv.cfg` beside its
    `bin`), its site-packages and what lies at their top."""
    given = Path(python).absolute()
    paths = [given, *given.parents]
    real = Path(os.path.realpath(given))
    paths += [real, *real.parents]
    env = given.parent.parent
    if (env / "pyvenv.cfg").exists():
        paths.append(env)
        for site in env.glob("lib*/python3*/site-packages"):
            paths += [site, site.parent, site.parent.parent, *site.iterdir()]
    me = os.geteuid()
    for path in dict.fromkeys(paths):
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if st.st_uid not in (0, me):
            return f"{path} belongs to uid {st.st_uid}"
        # A sticky folder (/tmp) lets others add names, not replace the ones checked here.
        if not stat.S_ISLNK(st.st_mode) and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and \
                not (stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX):
            return f"{path} is writable by its group or by anyone (mode {stat.S_IMODE(st.st_mode):04o})"
    return None

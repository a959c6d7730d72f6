"""The user and group a messenger daemon runs as, and its data dir handed over to them.

A service may name a `user` and a `group` ([services.NAME] in monitord.toml). Before every
start the local supervisor (monitord.local.supervisor) and the agent's area runner
(monitord.vps.area_runner) resolve them here on their own machine, give the area's data dir
to that user (`hand_over`) and start the daemon with setgroups/setgid/setuid
(`popen_kwargs`: subprocess's `user=`, `group=`, `extra_groups=`; the supplementary groups
are the user's own from the group database, as systemd's User= and login do). A name that
does not resolve is `ServiceUserUnknown` (code SERVICE_USER_UNKNOWN), an OSError so that
every spawn path which already handles a failed exec handles it the same way: logged, and
retried with backoff. With neither set the daemon runs as its spawner, as before.

`clear_inheritable_capabilities()` is for a spawner that holds capabilities only to do this (a
non-root monitord with the systemd unit's AmbientCapabilities=, docs/operations.md): the
ambient and inheritable sets survive exec, and a change between two non-root users keeps
them, so without it every daemon would inherit them.

Standard library only, Python >= 3.9: the agent (VPS) uses it too.
"""

from __future__ import annotations

import ctypes
import errno
import grp
import os
import pwd
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4


class ServiceUserUnknown(OSError):
    """A service's user or group does not exist on this machine (SERVICE_USER_UNKNOWN)."""

    # orchestrator.errors.ErrorCode.SERVICE_USER_UNKNOWN, as its plain string: the lease
    # guard imports this module and should start without loading the whole catalogue.
    code = "SERVICE_USER_UNKNOWN"

    def __init__(self, detail: str) -> None:
        super().__init__(errno.ENOENT, detail)
        self.detail = detail

    def __str__(self) -> str:
        return self.detail


@dataclass(frozen=True)
class RunAs:
    """Resolved credentials: `uid` None keeps the spawner's user (only a group was asked)."""

    uid: int | None
    gid: int
    groups: tuple[int, ...]
    user: str | None = None
    home: str | None = None


def resolve(*, user: str | None, group: str | None) -> RunAs | None:
    """The credentials for a service's `user` / `group` (None: run as the spawner).
    Raises ServiceUserUnknown naming what is missing."""
    if user is None and group is None:
        return None
    entry = None
    if user is not None:
        try:
            entry = pwd.getpwnam(user)
        except KeyError:
            raise ServiceUserUnknown(f"user {user!r} does not exist on this machine") from None
    if group is not None:
        try:
            gid = grp.getgrnam(group).gr_gid
        except KeyError:
            raise ServiceUserUnknown(f"group {group!r} does not exist on this machine") from None
    else:
        assert entry is not None
        gid = entry.pw_gid
    if entry is None:
        return RunAs(uid=None, gid=gid, groups=())
    return RunAs(uid=entry.pw_uid, gid=gid, groups=tuple(os.getgrouplist(entry.pw_name, gid)),
                 user=entry.pw_name, home=entry.pw_dir)


def popen_kwargs(who: RunAs | None) -> dict[str, Any]:
    """subprocess.Popen keywords that start the child as `who` (none for None)."""
    if who is None:
        return {}
    kwargs: dict[str, Any] = {"group": who.gid, "extra_groups": list(who.groups)}
    if who.uid is not None:
        kwargs["user"] = who.uid
    return kwargs


def login_environment(who: RunAs | None) -> dict[str, str]:
    """HOME, USER and LOGNAME of `who` (what a login would set); empty for None."""
    if who is None or who.user is None:
        return {}
    return {"HOME": who.home or "/", "USER": who.user, "LOGNAME": who.user}


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_LINKS = 40  # as the kernel's own path walk


def _link_trusted(parent: os.stat_result, link: os.stat_result) -> bool:
    """Whether a symlink may be followed: only its directory's writers can replace it, so it
    is trusted when they are root or this process alone (not group- or other-writable), or
    when the directory is sticky and the link itself belongs to root or this process."""
    trusted = (0, os.geteuid())
    if parent.st_uid in trusted and not parent.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return True
    return bool(parent.st_mode & stat.S_ISVTX) and link.st_uid in trusted


def open_dir_nofollow(path: Path) -> int:
    """A descriptor of the directory `path`, reached from / one component at a time with
    O_NOFOLLOW, each opened relative to the one before: nothing can be swapped in between.
    A symlink on the way is followed only if `_link_trusted` (a data dir on another disk,
    set up by root); one in a directory another user can write is refused with ELOOP, so
    that user cannot point the walk (and what is done at its end) elsewhere."""
    parts = [p for p in os.path.abspath(path).split("/") if p]
    fd = os.open("/", _DIR_FLAGS)
    links = 0
    try:
        while parts:
            name = parts.pop(0)
            if name == ".":
                continue
            st = os.stat(name, dir_fd=fd, follow_symlinks=False) if name != ".." else None
            if st is not None and stat.S_ISLNK(st.st_mode):
                links += 1
                if links > _MAX_LINKS or not _link_trusted(os.fstat(fd), st):
                    raise OSError(errno.ELOOP, f"{path}: not following {name!r}, a symlink"
                                               " in a directory another user can write")
                target = os.readlink(name, dir_fd=fd)
                if target.startswith("/"):
                    os.close(fd)
                    fd = os.open("/", _DIR_FLAGS)
                parts[:0] = [p for p in target.split("/") if p]
                continue
            child = os.open(name, _DIR_FLAGS, dir_fd=fd)  # ELOOP if swapped for a link now
            os.close(fd)
            fd = child
        return fd
    except BaseException:
        os.close(fd)
        raise


def hand_over(path: Path, who: RunAs) -> None:
    """Make `path` and everything below it owned by `who`, so the daemon can use data that
    monitord created or copied there. The data dir is reached by `open_dir_nofollow` (its
    parent may be the service user's, who could otherwise plant a symlink there and have
    root's files given to them) and changed through its descriptor; below it the walk goes
    by directory descriptor and never follows a symlink, so a link planted inside cannot
    redirect it; a file with several hard links is left alone (it may be a link to a file
    outside the data dir; the kernel's protected_hardlinks keeps the user from making new
    links to files that are not theirs)."""
    uid = -1 if who.uid is None else who.uid
    top = open_dir_nofollow(path)
    try:
        os.fchown(top, uid, who.gid)
        for _dir, dirs, files, dir_fd in os.fwalk(".", dir_fd=top):
            for name in (*dirs, *files):
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                if (uid in (-1, st.st_uid)) and st.st_gid == who.gid:
                    continue
                if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
                    continue
                os.chown(name, uid, who.gid, dir_fd=dir_fd, follow_symlinks=False)
    finally:
        os.close(top)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


_LINUX_CAPABILITY_VERSION_3 = 0x20080522


def clear_inheritable_capabilities() -> None:
    """Empty the calling thread's inheritable and ambient capability sets — what a child
    keeps across exec — and leave its effective and permitted sets alone. (A kernel or libc
    without capabilities has nothing to clear.)"""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
        header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
        data = (_CapData * 2)()
        if libc.capget(ctypes.byref(header), data) == 0 and any(d.inheritable for d in data):
            for half in data:
                half.inheritable = 0
            libc.capset(ctypes.byref(header), data)
    except (OSError, AttributeError):
        pass

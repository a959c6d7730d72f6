"""Fencing an area's daemon by a cgroup v2 of its own, where this process owns one.

The fences signal a daemon's process group (monitord/base/group_stop.py, the lease guard). A
daemon's child that calls setsid() (any daemon that double-forks to daemonize) leaves that
group: the fence would report the area stopped while the child keeps running, and the other
side then starts a second runner of the account. A cgroup holds every descendant whatever it
does with sessions, and writing 1 to its `cgroup.kill` (Linux >= 5.14) SIGKILLs all of them,
forks under way included.

`prepare(name)` decides once, at start, whether this process can own such cgroups: the cgroup
v2 hierarchy (fstype cgroup2 in /proc/self/mountinfo: /sys/fs/cgroup, or /sys/fs/cgroup/unified
on a hybrid system) mounted read-write, this process's own cgroup (the `0::` line of
/proc/self/cgroup) a directory it owns and may write (root, or the unit's user under systemd's
`Delegate=yes`), and `cgroup.kill` in a cgroup made there. Its answer, a `Fences`, names the
directory the areas' cgroups go in, `{own}/{name}` (a sub-cgroup: this process stays where it
is, so no process ever sits beside the areas' cgroups, which the kernel's "no internal
processes" rule would refuse once controllers are enabled), or says why there is none, in a
sentence `monitord check` shows.

Each area run (area and generation) gets `area_dir()`: a name that a restarted monitord or
agent finds again (it is also recorded with the survivor's record). `open_procs()` makes it
and opens its `cgroup.procs` in the spawner, and `join()`, in the child between fork and exec,
writes 0 to that descriptor: the child is in the cgroup before it can fork. The kernel judges
that write by the opener's credentials, so it works after the child switched to its service's
user (Linux >= 5.16; before that such a child stays out, and only its process group fences
it; `joined()` tells). `kill()`, `populated()` and `remove()` are the fence's three steps;
the waiting between them is the caller's. `cgroup_of()`, `recorded_dir()` and `leftovers()`
serve adoption: the cgroup a survivor is in or its record names, and those nobody adopted.
`write_note()` / `read_note()` keep the decision in the side's state dir for `check`, which
runs as another process. Where no cgroup can be used every caller falls back to the
process-group fence alone: a start never fails because of a cgroup.

Used by the local supervisor (monitord/local/supervisor.py), on the VPS by the agent's area
runner and each lease guard (monitord/vps/area_runner.py, monitord/vps/lease_guard.py), by
monitord/base/group_stop.py, and by `monitord check` and the VPS's self-check
(monitord/surface/check_command.py, monitord/vps/self_check.py). Standard library only, Python
>= 3.9, no asyncio: the lease guard imports it at every start.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from monitord.base import atomic_file

MOUNTINFO = "/proc/self/mountinfo"
OWN_CGROUP = "/proc/self/cgroup"
NOTE_NAME = "fencing.json"  # in the state dir: how this side's areas are fenced (`check`)
_MAKE_ATTEMPTS = 3  # open_procs: an area's cgroup made while its parent is being removed
# (3.9: no `X | None` at run time)
_Text = Optional[str]


@dataclass(frozen=True)
class Fences:
    """Where this process puts its areas' cgroups (`base`), or why it cannot (`why`).
    `mount` is the cgroup v2 mount point when there is one: a recorded area cgroup must lie
    below it."""

    base: _Text
    why: str = ""
    mount: _Text = None
    root: str = "/"  # the path within the hierarchy that is mounted there (a container's)

    @property
    def by_cgroup(self) -> bool:
        return self.base is not None

    def describe(self, what: str) -> str:
        """One line for `check`: how `what` (e.g. "local areas") are fenced here, and why."""
        if self.base is not None:
            return (f"{what} are fenced by cgroup ({self.base}): a daemon's child that calls"
                    " setsid() is stopped with its daemon")
        return (f"{what} are fenced by process group only: {self.why}: a daemon's child that"
                " calls setsid() escapes the fence")

    def to_json(self) -> dict[str, Any]:
        return {"by": "cgroup" if self.base is not None else "process_group",
                "cgroup": self.base, "why": self.why}

    @classmethod
    def from_json(cls, data: Any) -> Fences:
        base, why = data.get("cgroup"), data.get("why")
        if not (base is None or isinstance(base, str)) or not isinstance(why, str):
            raise ValueError("not a fencing note")
        return cls(base, why=why)


def write_note(directory: Path, fences: Fences) -> None:
    """Say in `directory` (the side's state dir) how its areas are fenced, for `monitord
    check`, which runs as another process, maybe in another cgroup."""
    atomic_file.atomic_write_bytes(directory / NOTE_NAME, json.dumps(fences.to_json()).encode(),
                                   durable=False)


def read_note(directory: Path) -> Fences | None:
    """What `write_note` said in `directory`; None before it said anything. OSError if it
    cannot be read, ValueError if it is not such a note."""
    try:
        data = json.loads((directory / NOTE_NAME).read_bytes())
    except FileNotFoundError:
        return None
    if not isinstance(data, dict):
        raise ValueError("not a fencing note")
    return Fences.from_json(data)


def instance_name(state_dir: str) -> str:
    """The name of the cgroup that holds one instance's areas: its state dir's, hashed (two
    instances in one cgroup, as tests run, never share it; the same dir always gets it)."""
    return "areas-" + hashlib.sha256(os.fsencode(state_dir)).hexdigest()[:12]


def area_dir(base: str, *, area: str, generation: int) -> str:
    """The cgroup of one run of `area` at `generation` (area ids are names: no `/`)."""
    return os.path.join(base, f"{area}@{generation}")


def prepare(name: str, *, who: str = "this process", mountinfo: str = MOUNTINFO,
            own_cgroup: str = OWN_CGROUP) -> Fences:
    """Whether this process (`who`, as the reasons name it: "monitord") can fence its areas
    by cgroup, and where (the module docstring). Reads the two /proc files given, makes
    `{own}/{name}` to look for `cgroup.kill` and removes it again (a spawn makes it when it
    needs it). Never raises for a cgroup it cannot use."""
    found = _cgroup2_mount(mountinfo)
    if found is None:
        return Fences(None, why="cgroup v2 is not mounted here")
    mount, root, read_only = found
    path = _own_path(own_cgroup)
    base, why = None, ""
    if path is None:
        why = f"{who} is in no cgroup v2"
    elif read_only:
        why = (f"cgroup v2 ({mount}) is mounted read-only for {who} (systemd's"
               " ProtectControlGroups=yes)")
    else:
        own = _directory(path, mount=mount, root=root)
        why = _not_ours(own, who=who)
        if not why:
            base = os.path.join(own, name)
            why = _no_kill(base, own=own)
    return Fences(None if why else base, why=why, mount=mount, root=root)


def _not_ours(own: str, *, who: str) -> str:
    """Why `who` may not make cgroups below its own, `own`; "" if it may: it owns it (root,
    or delegated to its user) and may write it (not merely by CAP_DAC_OVERRIDE: a cgroup
    systemd did not delegate is systemd's)."""
    try:
        st = os.stat(own)
    except OSError as e:
        return f"the cgroup of {who}, {own}, is not reachable ({e.strerror})"
    euid = os.geteuid()
    if (euid != 0 and st.st_uid != euid) or not os.access(own, os.W_OK | os.X_OK,
                                                          effective_ids=True):
        return (f"the cgroup of {who}, {own}, is not delegated to it (owner uid {st.st_uid};"
                " under systemd the unit needs Delegate=yes)")
    return ""


def _no_kill(base: str, *, own: str) -> str:
    """Why no area cgroup can be killed in `base`; "" if one can (it has cgroup.kill)."""
    try:
        os.mkdir(base, 0o755)
        made = True
    except FileExistsError:
        made = False
    except OSError as e:
        return f"cannot make a cgroup in {own} ({e.strerror or e})"
    has_kill = os.path.exists(os.path.join(base, "cgroup.kill"))
    if made:
        _remove_quietly(base)
    if not has_kill:
        return f"Linux {platform.release()} has no cgroup.kill (5.14 or later has)"
    return ""


def recorded_dir(value: object, *, fences: Fences, area: str, generation: int) -> _Text:
    """The area cgroup a survivor's record names, if it is one: a directory below the cgroup
    v2 mount named for exactly that area and generation. None otherwise (a record of a
    release before cgroups, or one that names anything else)."""
    if not isinstance(value, str) or fences.mount is None or not os.path.isabs(value):
        return None
    path = os.path.normpath(value)
    inside = os.path.commonpath([path, fences.mount]) == fences.mount and path != fences.mount
    if not inside or os.path.basename(path) != f"{area}@{generation}":
        return None
    return path if os.path.isdir(path) else None


def open_procs(path: str) -> int:
    """Make the cgroup `path` (and its parent, the instance's) if need be and open its
    cgroup.procs for writing; the descriptor is closed on exec. OSError if either fails.
    (The parent goes with its last area, `remove`, maybe in another process between the two
    mkdirs: then they are tried again.)"""
    attempts = _MAKE_ATTEMPTS
    while True:
        try:
            os.makedirs(path, mode=0o755, exist_ok=True)
            return os.open(os.path.join(path, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            attempts -= 1
            if not attempts:
                raise


def join(procs_fd: int) -> None:
    """In a child between fork and exec: enter the cgroup whose cgroup.procs `procs_fd` is
    (0: the writer itself). Nothing else happens here, no lock is taken: the parent may have
    threads. A refused write leaves the child where it is (its process group still fences it)."""
    try:
        os.write(procs_fd, b"0")
    except OSError:
        pass


def cgroup_of(pid: int, *, fences: Fences) -> _Text:
    """The directory of the cgroup v2 that process `pid` is in, or None (gone, unreadable,
    or no cgroup v2 here)."""
    if fences.mount is None:
        return None
    path = _own_path(f"/proc/{pid}/cgroup")
    return None if path is None else _directory(path, mount=fences.mount, root=fences.root)


def joined(path: str, pid: int) -> bool:
    """Whether process `pid` (a zombie too) is in the area cgroup `path`: /proc/PID/cgroup
    names it, compared by its last two names (the instance's and the run's, which are
    unique), since the hierarchy's mount root need not be the cgroup namespace's."""
    found = _own_path(f"/proc/{pid}/cgroup")
    return found is not None and found.split("/")[-2:] == path.rstrip("/").split("/")[-2:]


def kill(path: str) -> None:
    """SIGKILL every process in the cgroup `path` and below it (cgroup.kill). A cgroup that
    is gone is nothing to kill; any other OSError is raised."""
    try:
        with open(os.path.join(path, "cgroup.kill"), "w") as f:
            f.write("1")
    except FileNotFoundError:
        pass


def populated(path: str) -> bool:
    """Whether a live process is in the cgroup `path` or below it (cgroup.events; a zombie
    is not). A cgroup that is gone holds none; any other OSError is raised."""
    try:
        with open(os.path.join(path, "cgroup.events")) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return False
    return "populated 1" in lines


def remove(path: str) -> None:
    """Remove the empty cgroup `path`, and its parent (the instance's) once it holds no area
    either. One still populated, gone already or not ours to remove is left as it is (an
    empty one goes at the next start: `leftovers`)."""
    _remove_quietly(path)
    _remove_quietly(os.path.dirname(path))


def leftovers(base: str, *, keep: set[str]) -> list[str]:
    """The area cgroups in `base` other than `keep`: what a previous instance left (an
    area stopped while it was down, a child escaped from a daemon that died)."""
    try:
        names = os.listdir(base)
    except OSError:
        return []
    found = [os.path.join(base, name) for name in sorted(names)]
    return [path for path in found if os.path.isdir(path) and path not in keep]


def _remove_quietly(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass


def _cgroup2_mount(mountinfo: str) -> tuple[str, str, bool] | None:
    """(mount point, root of the mount, read-only) of the first cgroup2 mount, or None."""
    try:
        with open(mountinfo) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        head, sep, tail = line.partition(" - ")
        fields, after = head.split(), tail.split()
        if not sep or len(fields) < 6 or not after or after[0] != "cgroup2":
            continue
        options = fields[5].split(",")
        return _unescape(fields[4]), _unescape(fields[3]), "ro" in options
    return None


def _directory(path: str, *, mount: str, root: str) -> str:
    """Where the cgroup `path` (as /proc/PID/cgroup names it) is, below `mount`, the mount of
    the hierarchy's `root` (not "/" where only a sub-tree is mounted: a container's)."""
    if root != "/" and (path + "/").startswith(root.rstrip("/") + "/"):
        path = path[len(root.rstrip("/")):] or "/"
    return os.path.join(mount, path.lstrip("/")).rstrip("/") or "/"


def _own_path(own_cgroup: str) -> _Text:
    """This process's cgroup v2 path (the `0::PATH` line), or None."""
    try:
        with open(own_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("0::"):
            path = line[3:]
            return None if path.endswith(" (deleted)") else path
    return None


def _unescape(field: str) -> str:
    """A mountinfo path: space, tab, newline and backslash are written as octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field

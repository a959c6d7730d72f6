"""Process identity, read from Linux /proc, and what a command looks like once it runs.

A PID alone names nothing durable: PIDs are reused. A `ProcessIdentity` is the PID plus
the process start time (clock ticks since boot, field 22 of /proc/PID/stat): two identities
are the same process only if both agree. It also carries the command line as read, which is
not part of the identity: a process changes it by an exec (a wrapper script that execs its
daemon keeps its pid and start time) or by rewriting it (setproctitle). Zombies count as
gone. Used by the local supervisor (adopting survivors of a previous instance), the remote
agent (adopting lease guards after an agent restart) and the lease guard itself.

A configured command is not what /proc shows once it runs: a script with a `#!` line runs
with the kernel's argv `[interpreter, (its one argument), script, args…]`, `/usr/bin/env`
then shows the program it found on PATH. `exec_forms()` derives those argvs from a command
and `same_command()` compares two commands by the executable they resolve to and their
arguments: the supervisor's adoption judges "still the wanted command" with them
(docs/supervisor.md, "Survivors of a previous instance").

No asyncio here: the lease guard imports this module and starts once per remote daemon,
so every import is paid in each daemon's start (asyncio alone costs it about 50 ms).
Stopping a process group, which waits, is monitord.base.group_stop.
"""

from __future__ import annotations

import functools
import os
import resource
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_PROC = Path("/proc")
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# How many `#!` interpreters deep the kernel follows (fs/exec.c: 5 binfmt rounds), and how
# much of a script's first line it reads (BINPRM_BUF_SIZE).
_SHEBANG_DEPTH = 4
_SHEBANG_BYTES = 256


@dataclass(frozen=True)
class ProcessIdentity:
    """Who a process is: pid and start time in clock ticks since boot. `cmdline` is its argv
    as read, kept for the record and the logs; it is not compared (module docstring)."""

    pid: int
    start_ticks: int
    cmdline: tuple[str, ...] = field(compare=False)

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "start_ticks": self.start_ticks, "cmdline": list(self.cmdline)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ProcessIdentity:
        return cls(
            pid=int(data["pid"]),
            start_ticks=int(data["start_ticks"]),
            cmdline=tuple(str(part) for part in data["cmdline"]),
        )


@dataclass(frozen=True)
class _Stat:
    state: str
    ppid: int
    pgrp: int
    start_ticks: int


def _read_stat(pid: int) -> _Stat | None:
    try:
        with open(f"{_PROC}/{pid}/stat", "rb") as f:  # not pathlib: /proc scans call this a lot
            raw = f.read().decode("utf-8", "replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name is in parentheses and may itself contain spaces or ')'.
    fields = raw[raw.rindex(")") + 2 :].split()
    return _Stat(
        state=fields[0], ppid=int(fields[1]), pgrp=int(fields[2]), start_ticks=int(fields[19])
    )


def _read_cmdline(pid: int) -> tuple[str, ...] | None:
    try:
        raw = (_PROC / str(pid) / "cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return tuple(part.decode("utf-8", "replace") for part in raw.split(b"\0") if part)


def read(pid: int) -> ProcessIdentity | None:
    """The identity of a live (non-zombie) process, or None if there is none with that PID."""
    stat = _read_stat(pid)
    if stat is None or stat.state in ("Z", "X"):
        return None
    cmdline = _read_cmdline(pid)
    if cmdline is None:
        return None
    return ProcessIdentity(pid=pid, start_ticks=stat.start_ticks, cmdline=cmdline)


def is_same_process(identity: ProcessIdentity) -> bool:
    """True only if that exact process (pid and start time) is still alive, whatever its
    argv is now."""
    return read(identity.pid) == identity


def resident_bytes(identity: ProcessIdentity) -> int | None:
    """What that exact process holds in memory now (/proc/PID/statm's resident pages, shared
    pages counted); None once it is gone or its pid is another process's."""
    try:
        resident = int((_PROC / str(identity.pid) / "statm").read_bytes().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    # (read after statm: a pid reused in between is seen, never measured as ours)
    return resident * resource.getpagesize() if is_same_process(identity) else None


def exec_forms(
    command: Sequence[str], *, search_path: str, cwd: str
) -> list[tuple[str, ...]]:
    """The argvs that a process started with `command` (by execvpe, as subprocess does, with
    PATH `search_path`, in `cwd`) shows in /proc/PID/cmdline, in the order it passes them:
    the command itself; for a `#!` script the kernel's `[interpreter, (argument), script,
    args…]`, again for an interpreter that is itself a script; for `env` (`/usr/bin/env
    python3`, also with `-S`) the argv of the program it execs, found on `search_path`. What
    a program execs of its own accord (a wrapper script's `exec`) cannot be derived."""
    if not command:
        return []
    filename = _exec_filename(command[0], search_path=search_path, cwd=cwd)
    return _forms(filename, tuple(command), search_path=search_path, cwd=cwd,
                  depth=_SHEBANG_DEPTH)


def same_command(
    a: Sequence[str], b: Sequence[str], *, a_path: str, b_path: str, cwd: str
) -> bool:
    """Whether two commands run the same: the same arguments after argv[0] and the same
    executable file, once each argv[0] is resolved as execvpe would (on `a_path`, `b_path`
    respectively, relative names in `cwd`) and its symlinks followed. `tg-daemon` found on
    PATH and `/usr/local/bin/tg-daemon` are the same command; a name that resolves to no
    file is compared as written."""
    if len(a) != len(b) or not a or tuple(a[1:]) != tuple(b[1:]):
        return False
    found_a = _exec_filename(a[0], search_path=a_path, cwd=cwd)
    found_b = _exec_filename(b[0], search_path=b_path, cwd=cwd)
    if found_a is None or found_b is None:
        return a[0] == b[0]
    return os.path.realpath(os.path.join(cwd, found_a)) == os.path.realpath(
        os.path.join(cwd, found_b)
    )


def _exec_filename(name: str, *, search_path: str, cwd: str) -> str | None:
    """The file name execvpe passes to execve for argv[0] `name` (subprocess's search: a
    name with a slash as written, else the first `dir/name` on the path that is an
    executable file), or None if there is none. Relative results are relative to `cwd`."""
    if os.path.dirname(name):
        return name
    for directory in search_path.split(os.pathsep):
        candidate = os.path.join(directory, name)
        full = os.path.join(cwd, candidate)
        if os.path.isfile(full) and os.access(full, os.X_OK):
            return candidate
    return None


def _shebang(filename: str, *, cwd: str) -> tuple[str, str | None] | None:
    """(interpreter, its one argument or None) of a script's `#!` line; None for a file
    that has none (or cannot be read)."""
    try:
        with open(os.path.join(cwd, filename), "rb") as f:
            head = f.read(_SHEBANG_BYTES)
    except OSError:
        return None
    if not head.startswith(b"#!"):
        return None
    line = head[2:].split(b"\n", 1)[0].decode("utf-8", "surrogateescape").strip(" \t")
    if not line:
        return None
    parts = line.split(None, 1)
    return parts[0], (parts[1].strip(" \t") if len(parts) > 1 else None)


def _forms(
    filename: str | None, argv: tuple[str, ...], *, search_path: str, cwd: str, depth: int
) -> list[tuple[str, ...]]:
    """`argv` as execve'd on `filename`, then what the kernel and `env` make of it."""
    forms = [argv]
    if filename is None or depth <= 0:
        return forms
    script = _shebang(filename, cwd=cwd)
    if script is not None:
        interpreter, argument = script
        kernel_argv = (interpreter, *((argument,) if argument else ()), filename, *argv[1:])
        return forms + _forms(interpreter, kernel_argv, search_path=search_path, cwd=cwd,
                              depth=depth - 1)
    if os.path.basename(filename) == "env":
        program_argv = _env_program(argv[1:])
        if program_argv:
            found = _exec_filename(program_argv[0], search_path=search_path, cwd=cwd)
            return forms + _forms(found, program_argv, search_path=search_path, cwd=cwd,
                                  depth=depth - 1)
    return forms


def _env_program(args: Sequence[str]) -> tuple[str, ...]:
    """The argv `env ARGS…` execs: `-S STRING` split, options and NAME=VALUE dropped."""
    words = list(args)
    if words and words[0].startswith("-S"):
        import shlex  # only here: the lease guard imports this module at every start

        words = shlex.split(words[0][2:]) + words[1:]
    while words and (words[0] in ("-", "-i", "--ignore-environment", "--")
                     or ("=" in words[0] and not words[0].startswith("-"))):
        words.pop(0)
    if words and words[0].startswith("-"):
        return ()  # an option we do not follow
    return tuple(words)


def is_alive(pid: int) -> bool:
    """True if a non-zombie process with this PID exists (any identity)."""
    stat = _read_stat(pid)
    return stat is not None and stat.state not in ("Z", "X")


def group_members(pgid: int) -> list[int]:
    """PIDs of the live (non-zombie) processes in a process group; one scan of /proc."""
    members: list[int] = []
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        stat = _read_stat(int(entry.name))
        if stat is not None and stat.pgrp == pgid and stat.state not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def parent_of(pid: int) -> int | None:
    """The parent pid of a live (not zombie) process; None if there is no such process."""
    stat = _read_stat(pid)
    if stat is None or stat.state in ("Z", "X"):
        return None
    return stat.ppid


def group_exists(pgid: int) -> bool:
    """Whether any process (a zombie too) is in the process group: a signal 0, no scan."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # there is one, of another user
        return True
    return True


def children_of(parents: set[int]) -> dict[int, list[int]]:
    """parent pid -> pids of its live children, for the given parents; one scan of /proc."""
    found: dict[int, list[int]] = {pid: [] for pid in parents}
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        stat = _read_stat(int(entry.name))
        if stat is not None and stat.ppid in found and stat.state not in ("Z", "X"):
            found[stat.ppid].append(int(entry.name))
    return found


@functools.lru_cache(maxsize=1)
def _boot_time() -> float:
    """When the machine booted (constant: read once; /proc/stat is long)."""
    for line in (_PROC / "stat").read_text().splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    raise RuntimeError("/proc/stat has no btime line")


def started_at(identity: ProcessIdentity) -> float:
    """Wall-clock start time (seconds since the epoch) of the process."""
    return _boot_time() + identity.start_ticks / _CLOCK_TICKS


def seconds_since_boot() -> float:
    with (_PROC / "uptime").open() as f:
        return float(f.read().split()[0])


def uptime_s(identity: ProcessIdentity, *, since_boot: float | None = None) -> float:
    """Seconds the process has been running, from the kernel's own start time (`since_boot`:
    a `seconds_since_boot()` the caller read once for many processes)."""
    now = seconds_since_boot() if since_boot is None else since_boot
    return max(0.0, now - identity.start_ticks / _CLOCK_TICKS)


def child_has_exited(child: subprocess.Popen[bytes]) -> bool:
    """Whether our child has exited, WITHOUT reaping it: while it is an unreaped zombie its
    PID (and so its process group id) cannot be reused, so signalling the group stays safe."""
    if child.returncode is not None:
        return True
    try:
        info = os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return info is not None


def signal_group(pgid: int, sig: signal.Signals) -> bool:
    """Send a signal to a process group; False if the group no longer exists."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True


def live_groups() -> frozenset[int]:
    """The process groups that have a live (not zombie) member now: one scan of /proc."""
    found: set[int] = set()
    for name in os.listdir(_PROC):
        if name.isdigit():
            stat = _read_stat(int(name))
            if stat is not None and stat.state not in ("Z", "X"):
                found.add(stat.pgrp)
    return frozenset(found)


def find_by_environ(key: str, value: str) -> list[tuple[ProcessIdentity, dict[str, str]]]:
    """Live processes whose environment holds `key=value` (a marker their spawner set),
    with their environment; one scan of /proc. Unreadable environments are skipped."""
    marker = f"{key}={value}".encode()
    found: list[tuple[ProcessIdentity, dict[str, str]]] = []
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if marker not in environ:
            continue
        identity = read(int(entry.name))
        if identity is None:
            continue
        env: dict[str, str] = {}
        for item in environ:
            name, sep, val = item.partition(b"=")
            if sep:
                env[name.decode(errors="replace")] = val.decode(errors="replace")
        found.append((identity, env))
    return found

"""The lease guard: `python -m monitord.vps.lease_guard --lease-file F [options] -- ARGV…`.

The agent starts one guard per remote daemon, in a session of its own (so it neither shares
the agent's fate nor its signals). The guard starts the daemon as its child, in its own
process group, with PR_SET_PDEATHSIG=SIGKILL so the daemon dies if the guard dies, and, given
`--cgroup DIR` (where the agent owns a cgroup v2: monitord/base/cgroup_fence.py), in that
cgroup, entered before exec: whatever the daemon starts stays in it, a child that calls
setsid() too. Then it
watches two things: the daemon, and the lease file. It sleeps until the first of: the
daemon exits (its pidfd), a signal arrives, the lease's own expiry, or `LOOK_S` has passed
(to see a renewed or removed lease file) — so a hundred idle guards cost the VPS a few
wake-ups a second each, not twenty. When the lease lapses (or the file disappears, or the
guard gets SIGTERM) it fences: SIGTERM to the daemon's process
group, a grace period (`--fence-grace` on a lapse, `--stop-grace` on SIGTERM), then
SIGKILL, then cgroup.kill for what is left in the cgroup (waited empty, at most
`CGROUP_EMPTY_S`, and removed), and exits. When the daemon exits on its own, what it left in
its group and its cgroup is killed the same way and the
guard exits with the same status. The guard never starts a daemon on a lapsed lease.

Why the guard survives the agent instead of dying with it: see docs/agent.md. In short, the
lease file, not the agent's life, is the permission; a guard that kept running after an
agent crash still stops the daemon at lease expiry, and a restarted agent re-adopts it.

Kept to the standard library plus our own small modules so that it starts fast from the
zipapp: the agent runs it as `sys.executable [-I] monitord.pyz lease-guard ...`
(monitord.vps.area_runner.vps_command).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from monitord.base import atomic_file, cgroup_fence, proc_identity, run_as
from monitord.vps import lease_file

POLL_S = 0.05  # without pidfds (Linux < 5.3): how often the daemon is looked at
# How often the lease file is looked at between the daemon's, a signal's and the lease's
# own wake-ups: it bounds how late a removed lease (the agent's fence) is seen, not a lapse.
LOOK_S = 0.25
EXIT_LEASE_LAPSED = 75  # EX_TEMPFAIL: the lease was not (or no longer) current
CGROUP_EMPTY_S = 2.0  # what is left in the daemon's cgroup gets this long to die
_PR_SET_PDEATHSIG = 1


def _say(event: str, **fields: object) -> None:
    """One JSON line on stderr (the area's log file)."""
    line = {"event": event, "logger": "lease_guard", "pid": os.getpid(), "ts": time.time()}
    print(json.dumps({**line, **fields}), file=sys.stderr, flush=True)


class _LeaseWatch:
    """Re-reads the lease file only when it was replaced (inode or mtime changed)."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._key: tuple[int, int] | None = None
        self._record: lease_file.LeaseRecord | None = None

    def current(self) -> bool:
        try:
            st = self._path.stat()
        except OSError:
            return False
        key = (st.st_ino, st.st_mtime_ns)
        if key != self._key:
            self._key, self._record = key, lease_file.read(self._path)
        record = self._record
        return record is not None and record.is_current(
            wall=time.time(), boot=lease_file.boottime()
        )

    def seconds_left(self) -> float:
        """Until the lease last read lapses on the first of its two clocks (0 if it has)."""
        record = self._record
        if record is None:
            return 0.0
        return max(0.0, min(record.expires_at_wall - time.time(),
                            record.expires_at_boottime - lease_file.boottime()))


class _Sleeper:
    """Sleeps until the daemon exits, a signal arrives or a timeout passes. Signals reach
    it through `signal.set_wakeup_fd` (a handler alone would not cut a `select` short:
    Python retries it); the daemon's exit through its pidfd, when the kernel has them."""

    def __init__(self, child_pid: int) -> None:
        self._wake_r, self._wake_w = os.pipe()
        for fd in (self._wake_r, self._wake_w):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(self._wake_w)
        try:
            self._pidfd: int | None = os.pidfd_open(child_pid)
        except (AttributeError, OSError):  # no pidfd here (or the daemon is gone already)
            self._pidfd = None

    @property
    def longest_s(self) -> float:
        return LOOK_S if self._pidfd is not None else POLL_S

    def sleep(self, timeout_s: float) -> None:
        fds = [self._wake_r] if self._pidfd is None else [self._wake_r, self._pidfd]
        ready, _, _ = select.select(fds, [], [], max(0.0, timeout_s))
        if self._wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(self._wake_r, 512)


def _die_with_parent(libc: ctypes.CDLL, parent_pid: int, procs_fd: int | None) -> None:
    """Runs in the daemon between fork and exec: its own process group (what the fence
    signals), its cgroup (`procs_fd`: its cgroup.procs, opened by the guard), and death by
    SIGKILL when the guard dies. (libc is loaded before the fork: nothing but these syscalls
    happens in the child; `Popen(process_group=)` is 3.11+.)"""
    os.setpgid(0, 0)
    if procs_fd is not None:
        cgroup_fence.join(procs_fd)
    # The guard may hold capabilities (to start daemons as other users and signal them);
    # the daemon keeps none across its exec. (Python has already switched user and group by
    # now; PDEATHSIG survives that only because it is set after it.)
    run_as.clear_inheritable_capabilities()
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        os._exit(126)
    if os.getppid() != parent_pid:  # the guard died before prctl took effect
        os._exit(126)


def _kill_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _empty_cgroup(path: str | None) -> None:
    """Once the daemon is gone: SIGKILL what is left in its cgroup (what left its process
    group), wait until nothing of it lives (at most CGROUP_EMPTY_S) and remove the cgroup."""
    if path is None:
        return
    try:
        cgroup_fence.kill(path)
        deadline = time.monotonic() + CGROUP_EMPTY_S
        while cgroup_fence.populated(path):
            if time.monotonic() >= deadline:
                _say("cgroup_not_empty", cgroup=path, within_s=CGROUP_EMPTY_S)
                return
            time.sleep(0.01)
    except OSError as e:
        _say("cgroup_not_emptied", cgroup=path, error=str(e))
        return
    cgroup_fence.remove(path)


def _fence(
    child: subprocess.Popen[bytes],
    *,
    grace_s: float,
    fence_grace_s: float,
    watch: _LeaseWatch,
    reason: str,
    cgroup: str | None,
) -> int:
    """SIGTERM the daemon's group, wait `grace_s` (cut to `fence_grace_s` if the lease lapses
    meanwhile), SIGKILL it, then empty its cgroup; returns the daemon's status."""
    _say("fence_start", reason=reason, child_pid=child.pid, grace_s=grace_s)
    _kill_group(child.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    lapse_deadline: float | None = None
    while not proc_identity.child_has_exited(child) and time.monotonic() < deadline:
        if lapse_deadline is None and not watch.current():
            lapse_deadline = time.monotonic() + fence_grace_s
            deadline = min(deadline, lapse_deadline)
        time.sleep(0.01)
    escalated = not proc_identity.child_has_exited(child)
    _kill_group(child.pid, signal.SIGKILL)  # also mops up anything the daemon left behind
    status = child.wait()
    _empty_cgroup(cgroup)  # and what left the group
    _say("fence_done", reason=reason, child_pid=child.pid, status=status, escalated=escalated)
    return status


def run(
    *,
    lease_path: Path,
    stop_grace_s: float,
    fence_grace_s: float,
    argv: Sequence[str],
    uid: int | None = None,
    gid: int | None = None,
    groups: Sequence[int] | None = None,
    daemon_file: Path | None = None,
    cgroup: str | None = None,
) -> int:
    """Guard one daemon; with `uid` / `gid` / `groups` it runs as them (the guard does not).
    With `daemon_file`, the daemon's pid is written there once it is started (the agent
    reads it instead of scanning /proc for the guard's child). With `cgroup`, the daemon
    runs in that cgroup (made if need be; where it cannot be, its group alone fences it)."""
    stop_requested = False

    def _request_stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stop_requested
        stop_requested = True

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _request_stop)

    watch = _LeaseWatch(lease_path)
    if not watch.current():
        _say("not_started", reason="lease_not_current", lease_file=str(lease_path))
        return EXIT_LEASE_LAPSED
    guard_pid = os.getpid()
    libc = ctypes.CDLL(None, use_errno=True)
    procs_fd = None
    if cgroup is not None:
        try:
            procs_fd = cgroup_fence.open_procs(cgroup)
        except OSError as e:
            _say("cgroup_not_used", cgroup=cgroup, error=str(e))
            cgroup = None
    try:
        child = subprocess.Popen(
            list(argv),
            preexec_fn=lambda: _die_with_parent(libc, guard_pid, procs_fd),
            close_fds=True,
            user=uid,
            group=gid,
            extra_groups=None if groups is None else list(groups),
        )
    except OSError as e:
        _say("spawn_failed", error=str(e), argv=list(argv), uid=uid, gid=gid)
        if cgroup is not None:
            cgroup_fence.remove(cgroup)  # (empty: nothing ran in it)
        return 127
    finally:
        if procs_fd is not None:
            os.close(procs_fd)
    _say("started", child_pid=child.pid, argv=list(argv), uid=uid, gid=gid, cgroup=cgroup)
    if cgroup is not None and not cgroup_fence.joined(cgroup, child.pid):
        _say("daemon_outside_cgroup", cgroup=cgroup, child_pid=child.pid)
    if daemon_file is not None:
        _report_daemon(daemon_file, child.pid)
    sleeper = _Sleeper(child.pid)
    while True:
        if proc_identity.child_has_exited(child):
            _kill_group(child.pid, signal.SIGKILL)  # leftovers of a daemon that exited
            status = child.wait()
            _empty_cgroup(cgroup)
            _say("daemon_exited", child_pid=child.pid, status=status)
            return status if status >= 0 else 128 - status
        if stop_requested:
            _fence(
                child,
                grace_s=stop_grace_s,
                fence_grace_s=fence_grace_s,
                watch=watch,
                reason="stop_requested",
                cgroup=cgroup,
            )
            return 0
        if not watch.current():
            _fence(
                child,
                grace_s=fence_grace_s,
                fence_grace_s=fence_grace_s,
                watch=watch,
                reason="lease_lapsed",
                cgroup=cgroup,
            )
            return EXIT_LEASE_LAPSED
        # Just past the expiry, so that the look it wakes for finds the lease lapsed.
        sleeper.sleep(min(sleeper.longest_s, watch.seconds_left() + 0.001))


def _report_daemon(path: Path, pid: int) -> None:
    """The daemon's pid, for the agent; not being able to write it only costs the agent a
    scan of /proc (it checks the pid's parent is this guard before believing it)."""
    try:
        atomic_file.atomic_write_bytes(path, f"{pid}\n".encode(), mode=0o600, durable=False)
    except OSError as e:
        _say("daemon_file_not_written", path=str(path), error=str(e))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("a daemon command is required after --")
    return run(
        lease_path=args.lease_file,
        stop_grace_s=args.stop_grace,
        fence_grace_s=args.fence_grace,
        argv=command,
        uid=args.uid,
        gid=args.gid,
        groups=None if args.groups is None else [int(g) for g in args.groups.split(",") if g],
        daemon_file=args.daemon_file,
        cgroup=args.cgroup,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lease_guard", description=__doc__.splitlines()[0])
    parser.add_argument("--lease-file", type=Path, required=True)
    parser.add_argument("--stop-grace", type=float, default=5.0, help="on SIGTERM: seconds")
    parser.add_argument("--fence-grace", type=float, default=0.5, help="on lapse: seconds")
    parser.add_argument("--uid", type=int, default=None, help="run the daemon as this user")
    parser.add_argument("--gid", type=int, default=None, help="... and group")
    parser.add_argument("--groups", default=None, help="... and supplementary groups: 1,2,3")
    parser.add_argument("--daemon-file", type=Path, default=None,
                        help="write the daemon's pid here once it is started")
    parser.add_argument("--cgroup", default=None,
                        help="run the daemon in this cgroup v2 directory; a fence empties it")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    return parser


if __name__ == "__main__":
    sys.exit(main())

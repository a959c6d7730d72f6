"""Stopping a process group and verifying it is gone (Linux /proc, pidfds), and emptying an
area's cgroup (`empty_cgroup`: what a daemon's child that left the group still runs in).

Used by the local supervisor and the remote agent, which run on an event loop; kept apart
from monitord.base.proc_identity so that what starts once per remote daemon (the lease
guard) does not import asyncio.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from typing import Callable, Optional

from monitord.base import cgroup_fence, proc_identity

Reap = Optional[Callable[[], object]]  # (3.9: no `X | None` at run time)


async def terminate_group(
    pgid: int, *, grace_s: float, kill_wait_s: float = 2.0, poll_s: float = 0.02,
    reap: Reap = None,
) -> bool:
    """SIGTERM a process group, wait `grace_s` for it to empty, SIGKILL what is left, then
    verify the group is gone. Returns True once no live member remains.

    The caller reaps its own children (a zombie is not a live member). A caller whose child
    the leader is passes `reap` (its `Popen.poll`): called once the leader exited, so that
    a group with no other member is known gone from one signal 0 instead of a /proc scan
    (which reads every process's stat). A reaped leader's pid is not handed out again
    before the pid counter wraps, so the signal 0 right after names our group."""
    if not proc_identity.group_exists(pgid):  # (zombies only: the first scan says gone)
        return True
    with _LeaderWatch(pgid) as leader:
        proc_identity.signal_group(pgid, signal.SIGTERM)
        if await _wait_group_empty(pgid, timeout_s=grace_s, poll_s=poll_s, leader=leader,
                                   reap=reap):
            return True
        proc_identity.signal_group(pgid, signal.SIGKILL)
        return await _wait_group_empty(pgid, timeout_s=kill_wait_s, poll_s=poll_s,
                                       leader=leader, reap=reap)


async def wait_group_gone(pgid: int, *, timeout_s: float, poll_s: float = 0.02) -> bool:
    """Wait (at most `timeout_s`) until a group already sent SIGKILL has no live member; sends
    nothing. A SIGKILLed process can take a while to die (giving back a large memory takes
    about 0.1 s a GiB): one look right after the signal can still find it running."""
    if not proc_identity.group_exists(pgid):
        return True
    return await _wait_group_empty(pgid, timeout_s=timeout_s, poll_s=poll_s)


# While the group's leader lives, the group is not empty: rather than scanning /proc every
# poll, wait for the leader's pidfd to become readable (it exits) and scan then — scanning
# anyway this often, so that a leader already gone and its pid reused costs time, never a
# wrong answer (only the scan decides).
_LEADER_RESCAN_S = 0.25


class _LeaderWatch:
    """An event set when the process `pid` exits (pidfd, Linux >= 5.3); `None` inside the
    `with` where pidfds are not available."""

    def __init__(self, pid: int) -> None:
        self._pid = pid
        self._fd: int | None = None
        self.exited: asyncio.Event | None = None

    def __enter__(self) -> asyncio.Event | None:
        try:
            self._fd = os.pidfd_open(self._pid)
        except (AttributeError, OSError):  # no pidfd here, or the leader is already gone
            return None
        self.exited = asyncio.Event()
        asyncio.get_running_loop().add_reader(self._fd, self.exited.set)
        return self.exited

    def __exit__(self, *_: object) -> None:
        if self._fd is not None:
            asyncio.get_running_loop().remove_reader(self._fd)
            os.close(self._fd)


async def _wait_group_empty(
    pgid: int, *, timeout_s: float, poll_s: float, leader: asyncio.Event | None = None,
    reap: Reap = None,
) -> bool:
    signalled = time.monotonic()
    deadline = signalled + timeout_s
    # A live leader is a live member: while its pidfd says it lives (and for at most
    # _LEADER_RESCAN_S at a time) there is nothing a scan could tell.
    looked = signalled
    while True:
        now = time.monotonic()
        if leader is not None and not leader.is_set() and now - looked < _LEADER_RESCAN_S:
            if now >= deadline:
                return False
            with contextlib.suppress(asyncio.TimeoutError):  # 3.9: not yet the builtin
                await asyncio.wait_for(
                    leader.wait(), min(_LEADER_RESCAN_S - (now - looked), deadline - now)
                )
            continue
        if reap is not None and (leader is None or leader.is_set()):
            reap()
        if not proc_identity.group_exists(pgid):  # no member at all, not even a zombie
            return True
        if pgid not in _live_groups(taken_after=signalled, max_age_s=poll_s):
            return True
        looked = now = time.monotonic()
        if now >= deadline:
            return False
        if leader is None or leader.is_set():
            await asyncio.sleep(poll_s)


# One scan of /proc answers every group being waited for: with many areas stopping at once
# (a whole service moving) each waiter polling /proc itself was most of the event loop's
# time. A waiter only uses a scan begun after its own signal was sent, so a group that was
# alive then is never reported gone from an older picture. Its age counts from when it
# ended: on a machine with many processes a scan takes longer than a poll interval, and aged
# from its start it would be too old for the very next waiter (every waiter its own scan).
# (begun, ended, groups): one object, replaced whole
_scan: tuple[float, float, frozenset[int]] = (float("-inf"), float("-inf"), frozenset())


def _live_groups(*, taken_after: float, max_age_s: float) -> frozenset[int]:
    """The process groups with a live member, from a scan begun after `taken_after` and
    ended at most `max_age_s` ago (a new scan if there is none such)."""
    global _scan
    begun, ended, groups = _scan
    now = time.monotonic()
    if begun <= taken_after or now - ended > max_age_s:
        groups = proc_identity.live_groups()
        _scan = (now, time.monotonic(), groups)
    return groups


async def empty_cgroup(path: str, *, timeout_s: float, poll_s: float = 0.02) -> bool:
    """SIGKILL whatever is left in an area's cgroup (cgroup.kill: a daemon's child that left
    its process group too, monitord/base/cgroup_fence.py), wait at most `timeout_s` until no
    live process is in it, and remove it. True once it is empty (a cgroup that is gone is);
    False if a process is still in it then, or it cannot be read: a fence is never reported
    done unverified."""
    try:
        cgroup_fence.kill(path)
    except OSError:
        pass  # (not writable now): only a cgroup found empty below counts as done
    deadline = time.monotonic() + timeout_s
    try:
        while cgroup_fence.populated(path):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(poll_s)
    except OSError:
        return False
    cgroup_fence.remove(path)
    return True

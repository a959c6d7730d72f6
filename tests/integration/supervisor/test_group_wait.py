"""Waiting for process groups to empty: real processes, real /proc. Many waiters share one
/proc scan, and no waiter ever takes a group for gone from a scan older than its signal."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time

import pytest

from monitord.base import group_stop, proc_identity


def _group(*argv: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, start_new_session=True, stdout=subprocess.PIPE)


async def _traps_set(child: subprocess.Popen[bytes], shells: int = 1) -> None:
    """Until each shell of the group printed `ready` once its signals are as the test needs
    them. A fixed sleep lost that race on a loaded machine (the shell died of the SIGTERM it
    was to trap). And a background `sleep` the test's SIGTERM must kill prints the `ready`
    itself, from its subshell, before its exec: a SIGTERM that reaches a just-forked child
    before it has reset its parent's trap is taken by that trap and lost, and the `sleep`
    then lived until the SIGKILL 5 s later, polled all along (up to 199 scans)."""
    assert child.stdout is not None
    for _ in range(shells):
        line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), timeout=30)
        assert line == b"ready\n", line


def _kill(child: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGKILL)
    child.wait()
    assert child.stdout is not None
    child.stdout.close()


def _count_scans(monkeypatch: pytest.MonkeyPatch, *, slow_s: float = 0.0
                 ) -> tuple[list[int], list[int]]:
    """From now on, ([the /proc scans the waiters took], [the times they asked for one]) —
    theirs only: counting every listdir of the process also counted whatever else ran in
    it. Each scan takes at least `slow_s` (a machine with many processes)."""
    scans, polls = [0], [0]
    live_groups, ask = proc_identity.live_groups, group_stop._live_groups

    def scanning() -> frozenset[int]:
        scans[0] += 1
        if slow_s:
            time.sleep(slow_s)  # a scan blocks the loop as the real one does
        return live_groups()

    def asking(*, taken_after: float, max_age_s: float) -> frozenset[int]:
        polls[0] += 1
        return ask(taken_after=taken_after, max_age_s=max_age_s)

    monkeypatch.setattr(proc_identity, "live_groups", scanning)
    monkeypatch.setattr(group_stop, "_live_groups", asking)
    return scans, polls


# A group whose leader exits at SIGTERM and whose other member lives 0.3 s more: every
# waiter's leader is gone at once, and then all of them poll the scans together until the
# members are gone (two `ready` lines: the leader's, after its trap, and the member's
# `sleep`'s, whose shell set its trap before starting it).
_MEMBER_OUTLIVES_LEADER = (
    "sh -c \"trap 'sleep 0.3; exit 0' TERM; (echo ready; exec sleep 30) & wait\" &"
    " trap 'exit 0' TERM; echo ready; wait"
)


async def _stop_all_at_once(monkeypatch: pytest.MonkeyPatch, *, slow_s: float = 0.0
                            ) -> tuple[int, int]:
    """(scans, polls) of stopping ten such groups at once."""
    children = [_group("sh", "-c", _MEMBER_OUTLIVES_LEADER) for _ in range(10)]
    try:
        for c in children:
            await _traps_set(c, shells=2)
        scans, polls = _count_scans(monkeypatch, slow_s=slow_s)
        gone = await asyncio.gather(*(
            group_stop.terminate_group(c.pid, grace_s=5.0, poll_s=0.02) for c in children
        ))
        assert all(gone)
        return scans[0], polls[0]
    finally:
        for c in children:
            _kill(c)


async def test_a_scan_older_than_the_signal_never_says_gone() -> None:
    # a fresh picture of /proc taken before the group exists...
    group_stop._live_groups(taken_after=float("-inf"), max_age_s=60.0)
    child = _group("sleep", "30")  # ...and a group that ignores nothing but lives on
    try:
        assert not await group_stop._wait_group_empty(child.pid, timeout_s=0.2, poll_s=0.02)
    finally:
        _kill(child)


async def test_many_groups_stopping_at_once_share_the_scans(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    scans, polls = await _stop_all_at_once(monkeypatch)
    # ten waiters polling together: about one scan a round; each its own would be one a poll
    assert polls >= 20 and scans * 3 <= polls, (scans, polls)


async def test_the_waiters_share_a_scan_that_takes_longer_than_their_poll(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A /proc with many processes: one scan takes longer than the waiters' poll interval.
    # Aged from when it began, it was too old for the next waiter at once: a scan each.
    scans, polls = await _stop_all_at_once(monkeypatch, slow_s=0.03)
    assert polls >= 20 and scans * 3 <= polls, (scans, polls)


async def test_a_member_outliving_its_leader_is_still_waited_for_and_killed() -> None:
    # the leader exits at SIGTERM; its child ignores SIGTERM and stays in the group
    child = _group("sh", "-c", "sh -c 'trap \"\" TERM; echo ready; exec sleep 30' &"
                   " trap 'exit 0' TERM; echo ready; wait")
    try:
        await _traps_set(child, shells=2)
        assert len(proc_identity.group_members(child.pid)) == 2
        assert await group_stop.terminate_group(child.pid, grace_s=0.5, poll_s=0.02)
        assert proc_identity.group_members(child.pid) == []
    finally:
        _kill(child)


async def test_a_leader_that_exits_at_sigterm_and_is_reaped_costs_no_scan(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A /proc scan reads every process's stat (tens of ms with hundreds of areas running);
    # a group whose reaped leader was its only member is known gone from one signal 0.
    # sh's own child `sleep` is in the group too and dies of the same SIGTERM; sh reaps it
    # before it exits (an orphan left to init could be a zombie there a moment, which only a
    # scan tells from a live member, and a dying one a live member on a loaded machine).
    child = _group("sh", "-c", "trap 'wait; exit 0' TERM; (echo ready; exec sleep 30) & wait")
    try:
        await _traps_set(child)
        os.kill(child.pid, 0)
        scans, _ = _count_scans(monkeypatch)
        assert await group_stop.terminate_group(child.pid, grace_s=5.0, reap=child.poll)
        assert child.returncode == 0  # reaped by terminate_group
    finally:
        _kill(child)
    # one scan at most: the leader watch looks again after 0.25 s should sh still be waiting
    assert scans[0] <= 1, scans

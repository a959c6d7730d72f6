"""A task owner holds, cancels and awaits its children; one child's crash is reported and
never takes its siblings down; a closed owner starts nothing (monitord/base/task_owner.py)."""

from __future__ import annotations

import asyncio

import pytest
import structlog

from monitord.base.task_owner import OwnerClosed, TaskOwner


async def _forever() -> None:
    await asyncio.Event().wait()


async def _crash() -> None:
    raise KeyError("an area that was not asked")


class TestChildren:
    """Children are held until they end and cancelled and awaited on close."""

    async def test_close_cancels_and_awaits_every_child(self) -> None:
        owner = TaskOwner("test")
        children = [owner.spawn(f"child {i}", _forever()) for i in range(3)]
        assert set(owner.running()) == set(children)
        await owner.close()
        assert all(child.cancelled() for child in children)
        assert owner.running() == []

    async def test_a_crash_is_logged_as_internal_and_the_siblings_go_on(self) -> None:
        async with TaskOwner("test") as owner:
            sibling = owner.spawn("sibling", _forever())
            with structlog.testing.capture_logs() as logs:
                crashed = owner.spawn("crasher", _crash())
                await asyncio.gather(crashed, return_exceptions=True)
                await asyncio.sleep(0)  # the done callback runs
            assert not sibling.done()
        [line] = [e for e in logs if e["event"] == "task_crashed"]
        assert line["error_code"] == "INTERNAL" and line["task"] == "crasher"
        assert line["owner"] == "test" and "KeyError" in line["detail"]

    async def test_wait_cancels_what_did_not_end_in_time(self) -> None:
        async with TaskOwner("test") as owner:
            quick = owner.spawn("quick", asyncio.sleep(0))
            slow = owner.spawn("slow", _forever())
            await owner.wait([quick, slow], timeout_s=0.05)
            assert quick.done() and not quick.cancelled() and slow.cancelled()

    async def test_a_closed_owner_spawns_nothing(self) -> None:
        owner = TaskOwner("test")
        await owner.close()
        coro = _forever()
        with pytest.raises(OwnerClosed):
            owner.spawn("late", coro)
        assert coro.cr_frame is None  # closed, never left un-awaited

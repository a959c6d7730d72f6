"""monitord/base/periodic.py's `min_gap_s`: wake-ups that come sooner than that after an
iteration ended are served by one iteration once the gap is over; close() still ends the
loop at once."""

from __future__ import annotations

import asyncio
import time

from monitord.base.periodic import Periodic


def _counted(gap_s: float) -> tuple[Periodic, asyncio.Queue[float]]:
    """A loop (60 s interval) that puts the time of each iteration on the queue."""
    runs: asyncio.Queue[float] = asyncio.Queue()

    async def iteration() -> None:
        runs.put_nowait(time.monotonic())

    return Periodic("test", iteration=iteration, interval_s=60.0, min_gap_s=gap_s), runs


async def test_a_burst_of_wake_ups_is_served_by_one_iteration_after_the_gap() -> None:
    loop, runs = _counted(1.0)
    task = asyncio.create_task(loop.run())
    try:
        first = await asyncio.wait_for(runs.get(), 10)
        for _ in range(20):  # a hundred moves ending, one after another
            loop.wake()
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)
        assert runs.empty()  # (a lower bound: a slow machine only runs it later)
        second = await asyncio.wait_for(runs.get(), 10)
        assert second - first >= 1.0
        await asyncio.sleep(0.3)
        assert runs.empty()  # the burst was served by that one
        loop.close()
        await asyncio.wait_for(task, 5)
    finally:
        task.cancel()


async def test_close_ends_a_loop_waiting_out_its_gap() -> None:
    loop, runs = _counted(30.0)
    task = asyncio.create_task(loop.run())
    await asyncio.wait_for(runs.get(), 10)
    loop.wake()
    await asyncio.sleep(0.05)
    loop.close()
    await asyncio.wait_for(task, 5)
    assert runs.empty()

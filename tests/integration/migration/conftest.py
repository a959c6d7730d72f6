"""Fixtures of the end-to-end migration tests: a whole installation on one machine.

`stack_factory` starts a `Stack` (monitord run as a real subprocess, the in-process SSH VPS,
the real agent from the pushed monitord.pyz, fake daemons, the split-brain detector) and
closes it — killing every process it started — at the end of the test. Every test ends by
asserting the detector saw no overlap: that check runs here, after the test body, so no
test can forget it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from monitord.testing.stack import Stack
from tests.support import stacks
from tests.support.stacks import StackFactory

__all__ = ["StackFactory", "destination_runs_held_at_healthcheck", "parked_waiting_for_data",
           "settle_remote", "stack_factory"]


@pytest.fixture
async def stack_factory(tmp_path: Path) -> AsyncIterator[StackFactory]:
    async with stacks.stack_factory(tmp_path) as make:
        yield make


async def settle_remote(stack: Stack, service: str = "tg") -> None:
    """Move a service to the VPS and wait until it is settled there."""
    await stack.place(service, "remote")
    await stack.wait_settled(expect={service: "remote"}, timeout_s=60)


async def destination_runs_held_at_healthcheck(
    stack: Stack, area: str, *, writes_for_s: float = 1.5
) -> None:
    """Settled local, monitord restarted to hold a move to the VPS at its health check, the
    move asked for; returns once the destination runs on the VPS and has been writing
    session records (the source never saw them) for `writes_for_s`. Release with
    `stack.release_hold()`."""
    await stack.wait_settled(expect={service: "local" for service in stack.areas})
    assert await stack.stop_monitord() == 0
    await stack.start_monitord(
        env={"MONITORD_HOLD_AT": "local_to_remote:HEALTHCHECK_DESTINATION"}
    )
    await stack.place("tg", "remote")
    await stack.wait_event("hold_point")
    await stack.wait_until(
        lambda: any(k.side == "remote" for k in stack.detector.alive(area)),
        timeout_s=20, what="the destination runs on the VPS",
    )
    await asyncio.sleep(writes_for_s)


async def parked_waiting_for_data(stack: Stack, area: str) -> dict[str, object]:
    """A move to the VPS held at its health check, the VPS cut off, the operator back to
    local: the rollback waits for the VPS's data and parks after rollback_data_wait_s."""
    await destination_runs_held_at_healthcheck(stack, area, writes_for_s=1.0)
    await stack.partition()
    await stack.place("tg", "local")
    stack.release_hold()

    async def parked() -> dict[str, object] | None:
        service = (await stack.status())["services"]["tg"]
        return service if service["state"] == "parked" else None

    await stack.wait_until(parked, timeout_s=60, what="parked after rollback_data_wait_s")
    service = await parked()
    assert service is not None
    assert not any(k.side == "local" for k in stack.detector.alive(area))
    return service

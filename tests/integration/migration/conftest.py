"""Fixtures of the end-to-end migration tests: a whole installation on one machine.

`stack_factory` starts a `Stack` (monitord run as a real subprocess, the in-process SSH VPS,
the real agent from the pushed monitord.pyz, fake daemons, the split-brain detector) and
closes it — killing every process it started — at the end of the test. Every test ends by
asserting the detector saw no overlap: that check runs here, after the test body, so no
test can forget it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest

from monitord.testing.stack import Stack, StackOptions

StackFactory = Callable[..., Awaitable[Stack]]


@pytest.fixture
async def stack_factory(tmp_path: Path) -> AsyncIterator[StackFactory]:
    stacks: list[Stack] = []
    async with AsyncExitStack() as exits:

        async def make(**options: Any) -> Stack:
            stack = Stack(tmp_path / f"stack{len(stacks)}", StackOptions(**options))
            await exits.enter_async_context(stack)
            stacks.append(stack)
            return stack

        yield make
        for stack in stacks:
            overlaps = stack.detector.overlaps()
            assert overlaps == [], "split brain: " + "; ".join(o.describe() for o in overlaps)


async def settle_remote(stack: Stack, service: str = "tg") -> None:
    """Move a service to the VPS and wait until it is settled there."""
    await stack.place(service, "remote")
    await stack.wait_settled(expect={service: "remote"}, timeout_s=60)

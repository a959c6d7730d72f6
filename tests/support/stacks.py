"""`stack_factory(root)`: the one way tests start whole installations (`Stack`).

Yields `make(**StackOptions)`; every stack made is closed (all its processes killed) when the
block ends, and then the detector of each must have seen no overlap (split brain) and no
start on data older than the newest (data regression; a test that discards data on purpose
names the areas in `stack.accepted_data_loss`) — so no test that starts a stack can forget
the two checks every end-to-end test owes. `defaults` are
merged under the options of each `make()` call (the faults tier passes its external VPS).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

from monitord.testing.stack import Stack, StackOptions

StackFactory = Callable[..., Awaitable[Stack]]


@asynccontextmanager
async def stack_factory(root: Path, **defaults: Any) -> AsyncIterator[StackFactory]:
    stacks: list[Stack] = []
    async with AsyncExitStack() as exits:

        async def make(**options: Any) -> Stack:
            stack = Stack(root / f"stack{len(stacks)}", StackOptions(**{**defaults, **options}))
            await exits.enter_async_context(stack)
            stacks.append(stack)
            return stack

        yield make
    for stack in stacks:
        overlaps = stack.detector.overlaps()
        assert overlaps == [], "split brain: " + "; ".join(o.describe() for o in overlaps)
        regressions = [
            r for r in stack.detector.regressions() if r.area not in stack.accepted_data_loss
        ]
        assert regressions == [], "data went back in time: " + "; ".join(
            r.describe() for r in regressions
        )

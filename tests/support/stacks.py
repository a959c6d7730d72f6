"""`stack_factory(root)`: the one way tests start whole installations (`Stack`).

Yields `make(**StackOptions)`; every stack made is closed (all its processes killed) when the
block ends, and then the split-brain detector of each must have seen no overlap — so no test
that starts a stack can forget the one check every end-to-end test owes. `defaults` are
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

"""What the benchmarks' deadline loops share: poll a condition until it holds, or fail
naming what did not happen in time (a benchmark that cannot set up raises, never hangs)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

POLL_S = 0.05


async def until(predicate: Callable[[], object], *, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout_s} s")
        await asyncio.sleep(POLL_S)  # poll interval of a deadline loop

"""Per-service slots: `parallelism` areas of a service out of service at once, and as many
more preparing their move meanwhile.

A move's PREFLIGHT (the checks, then the pre-copy while the source still runs) holds a
PREPARE slot; everything from the source's stop on (SUPPRESS_SOURCE through the commit and
the cleanup, or a rollback) holds a MOVE slot. An area takes its move slot before its next
phase is stored, so no more than `parallelism` areas of a service are ever stopped for a
move at once — what `parallelism` has always promised. What the second stage changes is
when the next areas prepare: while the ones ahead are stopped, copying and in their health
window, instead of after them; a service's areas move as a pipeline rather than in waves.

A preparing area that had to wait for its move slot runs the preflight checks once more
before its source stops (the engine's `RunPreflight(again=True)`), so a move never leaves
on a preflight that passed before a wait in which the tunnel could have dropped.

Slots are taken with `async with slots.held(preparing=...)` only; `Held.to_move()` swaps a
prepare slot for a move slot (waiting if none is free) and the `with` gives back whichever
is held, also on cancellation.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class MoveSlots:
    def __init__(self, parallelism: int) -> None:
        self._prepare = asyncio.Semaphore(parallelism)
        self._move = asyncio.Semaphore(parallelism)

    @contextlib.asynccontextmanager
    async def held(self, *, preparing: bool) -> AsyncIterator[Held]:
        held = Held(self)
        try:
            if preparing:
                await self._prepare.acquire()
                held.stage = "prepare"
            else:
                await self._move.acquire()
                held.stage = "move"
            yield held
        finally:
            held.release()


class Held:
    """The slot one area's runner holds: "prepare", "move" or None."""

    def __init__(self, slots: MoveSlots) -> None:
        self._slots = slots
        self.stage: str | None = None

    async def to_move(self) -> bool:
        """Hold a move slot (giving the prepare slot back); True if that meant waiting."""
        if self.stage == "move":
            return False
        waited = self._slots._move.locked()
        await self._slots._move.acquire()
        self.release()
        self.stage = "move"
        return waited

    def release(self) -> None:
        if self.stage == "prepare":
            self._slots._prepare.release()
        elif self.stage == "move":
            self._slots._move.release()
        self.stage = None

"""The copies the engine has in flight, by transaction: what the status shows of each (bytes
done of the total, the rate now, an ETA: orchestrator/copy_progress.py).

A copy reports as its bytes move (many times a second on a fast link); the status document
is rebuilt only when `version` changes, which it does at a copy's start and end and at most
every PUBLISH_S in between, so that a fast copy does not make every status read a rebuild.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from orchestrator.copy_progress import CopyProgress

PUBLISH_S = 0.5

Progress = Callable[[int, int], None]  # (bytes done, bytes total), as a copy reports them


class CopiesInFlight:
    def __init__(self, *, on_change: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self._copies: dict[str, CopyProgress] = {}
        self._on_change = on_change
        self._clock, self._wall = clock, wall
        self._published = 0.0
        self.version = 0

    @contextlib.contextmanager
    def tracked(self, transaction_id: str, *, stage: str, from_side: str) -> Iterator[Progress]:
        """Track one copy of `transaction_id` while the block runs; yields what the copy
        reports its progress to."""
        copy = CopyProgress(stage=stage, from_side=from_side, started=self._clock(),
                            started_at=self._wall())
        self._copies[transaction_id] = copy

        def report(done: int, total: int) -> None:
            now = self._clock()
            copy.advance(done, total, now=now)
            if now - self._published >= PUBLISH_S:
                self._publish(now)

        self._publish(self._clock())
        try:
            yield report
        finally:
            if self._copies.get(transaction_id) is copy:
                del self._copies[transaction_id]
            self._publish(self._clock())

    def key(self) -> tuple[int, int | None]:
        """What the status document's copies depend on: the version, and while any copy
        runs the time too (a stalled copy's rate falls and its ETA goes, with no report)."""
        return self.version, int(self._clock() / PUBLISH_S) if self._copies else None

    def view(self, transaction_id: str) -> dict[str, Any] | None:
        """The status's `copy` of the transaction's area: None while it copies nothing."""
        copy = self._copies.get(transaction_id)
        return None if copy is None else copy.view(self._clock())

    def _publish(self, now: float) -> None:
        self._published = now
        self.version += 1
        self._on_change()

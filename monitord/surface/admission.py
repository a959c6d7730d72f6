"""The one decision point that admits new work to monitord's HTTP API.

Every mutating handler calls `Admission.enter()` first; shutdown calls `stop_intake()`. Both go
through the same short critical section under one lock, so their order is total: a request that
entered before stop-intake is admitted and may finish (and answer 202) during the drain; one that
comes after is refused before it touches any state. /readyz reads the same flag under the same
lock. The lock is a plain `threading.Lock` held for a few instructions and never across an
await, so it is safe from the event loop and from any thread.

States: STARTING (not yet accepting: /readyz 503) -> ACCEPTING -> DRAINING (final).

Callers: monitord.surface.http_api (handlers, /readyz), monitord.surface.daemon (open at
start-up end, stop at SIGTERM, waits for admitted work during the drain).
"""

from __future__ import annotations

import asyncio
import enum
import threading
from types import TracebackType


class IntakeState(enum.Enum):
    STARTING = "starting"
    ACCEPTING = "accepting"
    DRAINING = "draining"


class Ticket:
    """Proof that one request was admitted; leaving its `with` block ends the admitted work."""

    def __init__(self, admission: Admission) -> None:
        self._admission: Admission | None = admission

    def __enter__(self) -> Ticket:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        admission, self._admission = self._admission, None
        if admission is not None:
            admission._leave()


class Admission:
    """Admission state, the active-work counter and the event that fires when it reaches zero."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = IntakeState.STARTING
        self._active = 0
        self._idle_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    @property
    def state(self) -> IntakeState:
        with self._lock:
            return self._state

    @property
    def accepting(self) -> bool:
        """What /readyz reports: True only between start-up end and stop-intake."""
        with self._lock:
            return self._state is IntakeState.ACCEPTING

    @property
    def active(self) -> int:
        with self._lock:
            return self._active

    def open_intake(self) -> None:
        """Start-up is complete: begin admitting work (no effect once draining)."""
        with self._lock:
            if self._state is IntakeState.STARTING:
                self._state = IntakeState.ACCEPTING

    def stop_intake(self) -> None:
        """From now on `enter()` refuses; work admitted before this call carries on."""
        with self._lock:
            self._state = IntakeState.DRAINING
            idle = self._active == 0
        if idle:
            self._wake_idle_waiters()

    def enter(self) -> Ticket | None:
        """Admit one unit of work, or None if intake is not open. Use the ticket in `with`."""
        with self._lock:
            if self._state is not IntakeState.ACCEPTING:
                return None
            self._active += 1
        return Ticket(self)

    def _leave(self) -> None:
        with self._lock:
            self._active -= 1
            idle = self._active == 0 and self._state is IntakeState.DRAINING
        if idle:
            self._wake_idle_waiters()

    def _wake_idle_waiters(self) -> None:
        with self._lock:
            waiters, self._idle_waiters = self._idle_waiters, []
        for loop, event in waiters:
            loop.call_soon_threadsafe(event.set)

    async def wait_drained(self, grace_s: float) -> bool:
        """After stop-intake: wait until no admitted work remains; False if `grace_s` ran out."""
        event = asyncio.Event()
        with self._lock:
            if self._state is not IntakeState.DRAINING:
                raise RuntimeError("wait_drained() is only meaningful after stop_intake()")
            if self._active == 0:
                return True
            self._idle_waiters.append((asyncio.get_running_loop(), event))
        try:
            await asyncio.wait_for(event.wait(), timeout=grace_s)
        except TimeoutError:
            return False
        return True

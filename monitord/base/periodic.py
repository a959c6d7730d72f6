"""The periodic-loop helper: one error policy for every root loop of `monitord run`.

`Periodic(name, iteration=…, interval_s=…, book=…)` runs `await iteration()` again and again:
after `interval_s` (or the seconds the iteration returned, if fewer), or at once when
`wake()` was called meanwhile — but, with `min_gap_s`, never sooner than that after the
last iteration ended (wake-ups meanwhile are served by the next one: the reconciler's). Used
by the cleanup worker, the reconciler, the lease renewer, the migration engine's intake and
the local supervisor; the tunnel keeper reports its attempts to the same `LoopBook`
(monitord/remote/tunnel/keeper.py).

The error policy (docs/design.md, "No loop dies"):

- An exception escaping one iteration never ends the loop. Only cancellation does (and
  `close()`, the owner's orderly stop, at the next iteration boundary).
- A `MonitordError` keeps its code; anything else (a `ValueError` from a reply, a
  `KeyError`, a `RecursionError`, a bug) is `INTERNAL`. The first failure of each kind per
  loop is logged as `loop_iteration_failed` — an `INTERNAL` one with its traceback — and
  repeats are only counted, so a failing loop never floods the log; `loop_recovered` says
  when an iteration passed again.
- Every failure is counted (`monitord_loop_errors_total{loop, code}`) and kept in the
  loop's record, which the status document shows as `loops` and `monitord status --check`
  turns into a WARNING (orchestrator/health_check.py).
- After a failure the next iteration waits a back-off — 2^(n-1) x `backoff_base_s` after n
  failures in a row, never longer than the loop's own interval (a loop whose interval bounds
  a lease keeps renewing it) — and wake-ups do not shorten it.

For fault tests only, `MONITORD_LOOP_FAULT=<loop name>:<exception>` (e.g. `lease
renewer:KeyError`) makes every iteration of that loop raise the exception after its work is
done; nothing in monitord.toml can turn it on.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from monitord.base import logs
from orchestrator.errors import ErrorCode, MonitordError, error_for

if TYPE_CHECKING:
    from monitord.base.metrics import Metrics

log = logs.get_logger(__name__)

FAULT_ENV = "MONITORD_LOOP_FAULT"
BACKOFF_BASE_S = 1.0
# The exceptions a fault test may inject by name (MONITORD_LOOP_FAULT).
FAULTS: dict[str, type[Exception]] = {
    "ValueError": ValueError,
    "KeyError": KeyError,
    "OverflowError": OverflowError,
    "RecursionError": RecursionError,
    "TypeError": TypeError,
}

Iteration = Callable[[], Awaitable[float | None]]


@dataclass(frozen=True, slots=True)
class LoopError:
    """A loop's last failure, as the status shows it."""

    code: str
    detail: str
    at: float  # wall clock

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "detail": self.detail, "at": self.at}


@dataclass(slots=True)
class LoopRecord:
    """One loop's counts: iterations run, failures in all and in a row, the last failure."""

    iterations: int = 0
    errors: int = 0
    failing: int = 0  # failures in a row; 0 once an iteration passed
    last_error: LoopError | None = None

    def to_dict(self) -> dict[str, Any]:
        # Not `iterations`: the status document is rebuilt only when `LoopBook.version` moved.
        return {
            "errors": self.errors,
            "failing": self.failing,
            "last_error": self.last_error.to_dict() if self.last_error else None,
        }


class LoopBook:
    """Every root loop's record: the policy's memory, read by the status document."""

    def __init__(
        self, *, metrics: Metrics | None = None, wall: Callable[[], float] = time.time
    ) -> None:
        self._metrics = metrics
        self._wall = wall
        self._records: dict[str, LoopRecord] = {}
        self._logged: set[tuple[str, str]] = set()  # (loop, kind) logged with its traceback
        self.version = 0  # grows with every failure and every recovery (the status key)

    def record(self, loop: str) -> LoopRecord:
        found = self._records.get(loop)
        if found is None:
            found = self._records[loop] = LoopRecord()
        return found

    def passed(self, loop: str) -> None:
        """One iteration of `loop` ended without an exception."""
        record = self.record(loop)
        record.iterations += 1
        if record.failing:
            log.info("loop_recovered", loop=loop, failures=record.failing)
            record.failing = 0
            self.version += 1

    def failed(self, loop: str, error: BaseException) -> MonitordError:
        """One iteration of `loop` raised `error` (not a cancellation): logged once per
        kind, counted, kept. Returns it as a MonitordError (INTERNAL unless it was one)."""
        typed = as_monitord_error(error)
        record = self.record(loop)
        record.iterations += 1
        record.errors += 1
        record.failing += 1
        record.last_error = LoopError(code=str(typed.code), detail=typed.detail, at=self._wall())
        self.version += 1
        if self._metrics is not None:
            self._metrics.loop_errors.labels(loop=loop, code=str(typed.code)).inc()
        kind = str(typed.code) if isinstance(error, MonitordError) else type(error).__name__
        if (loop, kind) not in self._logged:
            self._logged.add((loop, kind))
            if isinstance(error, MonitordError):
                log.warning("loop_iteration_failed", loop=loop, error_code=str(typed.code),
                            detail=typed.detail)
            else:
                log.error("loop_iteration_failed", loop=loop, error_code=str(typed.code),
                          detail=typed.detail, exc_info=error)
        return typed

    def to_status(self) -> dict[str, Any]:
        """The status document's `loops`: each loop's record, by name."""
        return {name: self._records[name].to_dict() for name in sorted(self._records)}


def as_monitord_error(error: BaseException) -> MonitordError:
    """`error` itself if it carries a code; otherwise INTERNAL naming its type."""
    if isinstance(error, MonitordError):
        return error
    return error_for(ErrorCode.INTERNAL, f"{type(error).__name__}: {error}".rstrip(": "))


def injected_fault(loop: str) -> None:
    """Raise the exception MONITORD_LOOP_FAULT names for `loop` (fault tests only)."""
    wanted = os.environ.get(FAULT_ENV)
    if not wanted:
        return
    name, _, kind = wanted.rpartition(":")
    if name == loop and kind in FAULTS:
        raise FAULTS[kind](f"injected by {FAULT_ENV}")


class Periodic:
    """One loop under the error policy; see the module docstring."""

    def __init__(
        self,
        name: str,
        *,
        iteration: Iteration,
        interval_s: float,
        book: LoopBook | None = None,
        backoff_base_s: float = BACKOFF_BASE_S,
        min_gap_s: float = 0.0,
    ) -> None:
        self.name = name
        self._iteration = iteration
        self.interval_s = interval_s
        self.min_gap_s = min_gap_s
        self.book = book if book is not None else LoopBook()
        self._backoff_base_s = backoff_base_s
        self._wake = asyncio.Event()
        self._closed = asyncio.Event()

    @property
    def record(self) -> LoopRecord:
        return self.book.record(self.name)

    def wake(self) -> None:
        """Run the next iteration now (after a failure: once its back-off is over)."""
        self._wake.set()

    def close(self) -> None:
        """End `run()` at the next iteration boundary (an orderly stop, not an error)."""
        self._closed.set()
        self._wake.set()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    async def run(self) -> None:
        """Iterate until cancelled or closed."""
        while not self._closed.is_set():
            self._wake.clear()
            try:
                wait_s = await self._iteration()
                injected_fault(self.name)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.book.failed(self.name, e)
                await self._pause(self._backoff_s())
                continue
            self.book.passed(self.name)
            ended = time.monotonic()
            timeout = self.interval_s if wait_s is None else min(self.interval_s, wait_s)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, timeout)):
                    await self._wake.wait()
            # Woken sooner than min_gap_s after the last iteration: the wake-ups of a burst
            # (a hundred moves ending one after another) are served by one iteration.
            gap_s = ended + self.min_gap_s - time.monotonic()
            if gap_s > 0:
                await self._pause(gap_s)

    def _backoff_s(self) -> float:
        failing = max(1, self.record.failing)
        return min(self.interval_s, self._backoff_base_s * float(2 ** min(failing - 1, 32)))

    async def _pause(self, seconds: float) -> None:
        # Wake-ups do not shorten it (a wake storm must not spin a failing loop); close does.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._closed.wait()

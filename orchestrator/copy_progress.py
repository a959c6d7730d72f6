"""How far a copy in flight is: bytes done of its total, the rate they move at now, and when
it will be done at that rate.

Pure: the caller passes the clock's readings. The rate is measured over the last WINDOW_S
seconds, not since the start, so that a copy whose link slows (or is cut) shows it within
seconds: with nothing moved in the window the rate is 0 and there is no ETA — a stalled
copy never promises an end. Until MIN_SPAN_S has passed there is no rate yet (one chunk's
arrival is not a rate).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

WINDOW_S = 5.0
MIN_SPAN_S = 0.5


@dataclass
class CopyProgress:
    stage: str  # "pre_copy" (the source still runs) or "copy" (after its stop)
    from_side: str  # where the data comes from: "local" or "remote"
    started: float  # the monotonic clock at the start
    started_at: float  # the wall clock at the start (what the status shows)
    total: int | None = None  # None until the copy has listed what it copies
    done: int = 0
    # (at, done) readings; the oldest is the last one from before the window
    _readings: collections.deque[tuple[float, int]] = field(
        default_factory=collections.deque, repr=False)

    def __post_init__(self) -> None:
        self._readings.append((self.started, self.done))

    def advance(self, done: int, total: int, *, now: float) -> None:
        """`done` of `total` bytes are copied at `now`."""
        self.done, self.total = done, total
        self._readings.append((now, done))
        while len(self._readings) > 1 and self._readings[1][0] <= now - WINDOW_S:
            self._readings.popleft()

    def rate(self, now: float) -> float | None:
        """Bytes a second over the window ending `now`; None before MIN_SPAN_S of copying.
        What was done at the window's start is the last reading by then (nothing is assumed
        to have moved between two readings)."""
        if now - self.started < MIN_SPAN_S:
            return None
        since = max(now - WINDOW_S, self.started)
        base = self._readings[0][1]
        for at, done in self._readings:
            if at > since:
                break
            base = done
        return max(0.0, (self.done - base) / (now - since))

    def eta_s(self, now: float) -> float | None:
        """Seconds left at the current rate; None without a rate or while nothing moves."""
        rate = self.rate(now)
        if not rate or self.total is None:
            return None
        return max(0.0, self.total - self.done) / rate

    def view(self, now: float) -> dict[str, Any]:
        """The status document's `copy` of an area (docs/design.md, "Copy progress")."""
        rate, eta = self.rate(now), self.eta_s(now)
        return {
            "stage": self.stage,
            "from": self.from_side,
            "bytes_done": self.done,
            "bytes_total": self.total,
            "started_at": self.started_at,
            "rate_bytes_s": None if rate is None else round(rate),
            "eta_s": None if eta is None else round(eta, 1),
        }

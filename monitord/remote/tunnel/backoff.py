"""Reconnect pacing for the tunnel keeper: exponential backoff with full jitter, capped,
plus a hard cap on attempts per sliding window (default one minute) so no fault can turn
into a reconnect storm. The clock is passed in (`now`), so tests drive it with a fake one.

The first retry after a connection that was up and proven goes at once: a session the VPS
killed (a restart of its sshd, an idle timeout) is the common case, and waiting a random
part of the base delay only lengthens every area's outage. From the second consecutive
failure on the jitter applies, and the per-window cap bounds a link that keeps flapping.
"""

from __future__ import annotations

import random
from collections import deque


class ReconnectBackoff:
    """Decides how long to wait before the next connection attempt."""

    def __init__(
        self,
        *,
        base_s: float,
        cap_s: float,
        max_attempts_per_window: int,
        window_s: float = 60.0,
        rng: random.Random | None = None,
    ) -> None:
        self.base_s = base_s
        self.cap_s = cap_s
        self.max_attempts = max_attempts_per_window
        self.window_s = window_s
        self._rng = rng or random.Random()
        self._failures = 0
        self._was_up = False  # the last connection came up and was proven
        self._attempts: deque[float] = deque()
        self._not_before = 0.0

    @property
    def failures(self) -> int:
        return self._failures

    def record_attempt(self, now: float) -> None:
        self._attempts.append(now)
        self._forget_before(now - self.window_s)

    def record_failure(self, *, at_least_s: float = 0.0, now: float) -> None:
        """One more consecutive failure; `at_least_s` is a floor the cause asks for (e.g. a
        lease conflict asks to come back slowly)."""
        self._failures += 1
        if self._failures > 1:
            self._was_up = False
        self._not_before = now + at_least_s if at_least_s > 0 else 0.0

    def record_success(self) -> None:
        """A connection came up and was proven: the exponential part starts over (the
        per-window cap does not)."""
        self._failures = 0
        self._was_up = True
        self._not_before = 0.0

    def delay(self, now: float) -> float:
        """Seconds to wait from `now` before the next attempt."""
        self._forget_before(now - self.window_s)
        if self._failures == 0 or (self._failures == 1 and self._was_up):
            jittered = 0.0
        else:
            ceiling = min(self.cap_s, self.base_s * 2 ** min(self._failures - 1, 30))
            jittered = self._rng.uniform(0.0, ceiling)
        wait = max(jittered, self._not_before - now)
        if len(self._attempts) >= self.max_attempts:
            # The oldest attempt in the window must age out before another is allowed.
            oldest = self._attempts[len(self._attempts) - self.max_attempts]
            wait = max(wait, oldest + self.window_s - now)
        return max(0.0, wait)

    def _forget_before(self, horizon: float) -> None:
        while self._attempts and self._attempts[0] <= horizon:
            self._attempts.popleft()

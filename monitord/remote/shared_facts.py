"""Facts about the VPS that many preflights ask at once, fetched once.

A service of 100 areas moving together runs 100 preflights within seconds of each other,
and each wanted the same VPS facts: one exec of the probe script (architecture, bin dir,
free space, a write test, the artifacts' SHA-256) and one of `monitord.pyz self-check` — a
login shell and a Python start each, 200 process starts on the VPS for one answer. Worse,
the concurrent write tests raced on the same test file. `SharedFacts.get(key, make)` runs
`make()` once for every caller asking the same key within `max_age_s` of its start, the
callers that arrive while it runs wait for the same result. A failure is handed to those
waiting and never kept (the next caller asks again); a result the caller says not to keep
(`keep`) is not kept either. A producer that is cancelled leaves its waiters to produce the
value themselves, so nobody sees a cancellation that was not theirs.

Used by the migration engine's preflight (monitord/remote/preflight.py), one instance per
engine. Ten seconds is short against anything the facts describe changing by itself, and
every move still checks what it depends on later (the copy verifies its bytes, the agent
refuses a bad request).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Hashable
from typing import Any, TypeVar

T = TypeVar("T")
MAX_AGE_S = 10.0


class _ProducerGone(Exception):
    """The caller producing a value was cancelled before it had one."""


class SharedFacts:
    def __init__(self, *, max_age_s: float = MAX_AGE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._max_age_s = max_age_s
        self._clock = clock
        # key -> (when its fetch started, how long it is good for, the result)
        self._entries: dict[Hashable, tuple[float, float, asyncio.Future[Any]]] = {}

    async def get(self, key: Hashable, make: Callable[[], Awaitable[T]],
                  *, keep: Callable[[T], bool] = lambda _value: True,
                  max_age_s: float | None = None) -> T:
        """`make()`'s result, shared (see the module docstring); `max_age_s` overrides the
        instance's for this key."""
        while True:
            now = self._clock()
            self._prune(now)
            hit = self._entries.get(key)
            if hit is None:
                break
            try:
                value: T = await asyncio.shield(hit[2])
                return value
            except _ProducerGone:
                continue  # its producer was cancelled: produce it here
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._entries[key] = (now, self._max_age_s if max_age_s is None else max_age_s, future)
        try:
            value = await make()
        except asyncio.CancelledError:
            self._forget(key, future, _ProducerGone())
            raise
        except BaseException as e:
            self._forget(key, future, e)
            raise
        future.set_result(value)
        if not keep(value):
            self._entries.pop(key, None)
        return value

    def drop(self, key: Hashable) -> None:
        """Forget a finished value now: the next caller asks again (a fact that failed a
        check, e.g. the free space an operator is about to make, is never served stale)."""
        hit = self._entries.get(key)
        if hit is not None and hit[2].done():
            del self._entries[key]

    def _prune(self, now: float) -> None:
        """Drop the finished entries too old to use (keys name connections: they come and go)."""
        for key, (started, max_age_s, future) in list(self._entries.items()):
            if future.done() and now - started > max_age_s:
                del self._entries[key]

    def _forget(self, key: Hashable, future: asyncio.Future[Any], error: BaseException) -> None:
        if self._entries.get(key, (0.0, 0.0, None))[2] is future:
            del self._entries[key]
        future.set_exception(error)
        future.exception()  # whoever waits gets it; nobody waiting is not an error

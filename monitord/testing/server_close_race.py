"""A connection accepted just as its asyncio server closes must not leak (CPython gh-109564).

asyncio accepts a connection in one callback and makes its transport in a later one. When
the server closes in between — asyncssh closes the listener of a forwarded port with its SSH
connection, and the test VPS's fake daemons reconnect at any moment — `Server._attach()`
asserts that the server still listens. The assertion is raised inside the transport's
constructor, which asyncio swallows (outside debug mode): the half-made transport is
dropped with its socket open, and its `__del__` reports an unclosed transport and socket
wherever the collector happens to run (a test's teardown). A second path of the same race
calls `_wakeup()` twice, the second time on no waiters.

`install()` lets such a transport attach to the closed server like any other (it is then
closed, and detached, by whoever closes the server's connections), and lets a second wake-up
find nothing to wake. Only the test doubles install it (the VPS double, the demo's embedded
VPS); the daemon itself never accepts on a server it is closing.
"""

from __future__ import annotations

import asyncio.base_events
from typing import Any

_Server: Any = asyncio.base_events.Server


def _attach(self: Any) -> None:
    self._active_count += 1  # also after close(): its transport is closed like the others


def _wakeup(self: Any) -> None:
    waiters, self._waiters = self._waiters, None
    for waiter in waiters or ():  # None: woken already, when close() found no connection
        if not waiter.done():
            waiter.set_result(None)


def install() -> None:
    _Server._attach = _attach
    _Server._wakeup = _wakeup

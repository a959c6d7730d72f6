"""The agent client's channels: one per request, the next one opened ahead.

Opening a channel to the agent is a round trip of its own (the SSH channel's open and its
confirmation) before the request can be written, so every agent call cost two. Over a WAN
that is most of an area's downtime: a move makes about four calls while the area is down.
So `ChannelsAhead` keeps one channel open and idle, opened while nothing waits for it; a
request takes it and a new one is opened behind it, and a request that finds none opens
its own as before. One request per channel still (the agent answers and closes).

A channel kept too long is not used: the agent gives a new connection 30 s to send its
request (REQUEST_TIMEOUT_S, monitord/vps/server.py), so one older than MAX_AGE_S is closed
instead, and one
the agent has closed already (its end of file has arrived: a restarted agent, a lost
connection) too. The opening ahead is a task this object owns, cancelled and awaited by
`close()`; one that fails is forgotten (the next request opens its own and meets the
cause).

`fresh(channel)` is the same interface without the opening ahead (tests, tools).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from monitord.base import logs, round_trips

if TYPE_CHECKING:
    from monitord.remote.agent_client import Channel, ChannelReader, ChannelWriter

log = logs.get_logger(__name__)

MAX_AGE_S = 10.0  # an idle channel older than this is not used: a third of the agent's bound

Streams = tuple["ChannelReader", "ChannelWriter"]


@dataclass
class _Opened:
    stack: contextlib.AsyncExitStack
    streams: Streams
    at: float


@contextlib.asynccontextmanager
async def fresh(channel: Channel) -> AsyncIterator[Streams]:
    """A channel opened now (its open one round trip of the work waiting for it)."""
    async with contextlib.AsyncExitStack() as stack:
        with round_trips.exchange():
            streams = await stack.enter_async_context(channel())
        yield streams


class ChannelsAhead:
    """One channel per request, the next one opened ahead (see the module doc)."""

    def __init__(self, channel: Channel, *, clock: Callable[[], float] = time.monotonic,
                 max_age_s: float = MAX_AGE_S) -> None:
        self._channel = channel
        self._clock = clock
        self._max_age_s = max_age_s
        self._idle: _Opened | None = None
        self._opening: asyncio.Task[None] | None = None
        self._closed = False

    @contextlib.asynccontextmanager
    async def channel(self) -> AsyncIterator[Streams]:
        """A channel for one request: the one opened ahead if it is still good, else a
        fresh one; either way the next one is opened behind it."""
        ready = await self._take()
        self._open_ahead()
        if ready is None:
            async with fresh(self._channel) as streams:
                yield streams
            return
        try:
            yield ready.streams
        except BaseException as e:
            # through the channel's own context: its failures are named as for any channel
            if not await ready.stack.__aexit__(type(e), e, e.__traceback__):
                raise
        else:
            await ready.stack.aclose()

    async def close(self) -> None:
        """Cancel the opening ahead, close the idle channel; later requests open their own."""
        self._closed = True
        if self._opening is not None:
            self._opening.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._opening
            self._opening = None
        idle, self._idle = self._idle, None
        if idle is not None:
            await _close_quietly(idle)

    async def _take(self) -> _Opened | None:
        idle, self._idle = self._idle, None
        if idle is None:
            return None
        if self._clock() - idle.at > self._max_age_s or _ended(idle.streams):
            await _close_quietly(idle)
            return None
        return idle

    def _open_ahead(self) -> None:
        if self._closed or self._idle is not None or self._opening is not None:
            return
        self._opening = asyncio.ensure_future(self._open())

    async def _open(self) -> None:
        stack = contextlib.AsyncExitStack()
        try:
            streams = await stack.enter_async_context(self._channel())
        except Exception as e:  # (the next request opens its own and meets the cause)
            log.debug("agent_channel_ahead_failed", error=f"{type(e).__name__}: {e}")
            return
        finally:
            self._opening = None
        if self._closed or self._idle is not None:
            await _close_quietly(_Opened(stack, streams, self._clock()))
            return
        self._idle = _Opened(stack, streams, self._clock())


def _ended(streams: Streams) -> bool:
    """The other end closed it, or this one did (a goodbye closes every channel)."""
    reader, writer = streams
    at_eof = getattr(reader, "at_eof", None)
    is_closing = getattr(writer, "is_closing", None)
    return bool((at_eof is not None and at_eof()) or (is_closing is not None and is_closing()))


async def _close_quietly(opened: _Opened) -> None:
    with contextlib.suppress(Exception):
        await opened.stack.aclose()

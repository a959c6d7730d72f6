"""Closing an SSH connection to the VPS so that the VPS never answers into a dead socket.

asyncssh's `conn.close()` sends every channel's close and the disconnect in one burst and
aborts the socket at once. The VPS reads that burst, answers each close, and those answers
reach a socket that is gone: the peer's kernel resets the connection, and an asyncio peer
logs `socket.send() raised exception.` for each write after the reset. So a goodbye closes
every channel first and waits (bounded) for each acknowledgement — again while new ones
appear — and disconnects only then, when the VPS has nothing left to say.

Used by the tunnel keeper (its working connection, after the forwards are cancelled) and by
the standby (its idle connection and helper).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the SSH side loads after readiness (monitord/remote/ssh_side.py)
    import asyncssh


@dataclass(frozen=True)
class Goodbye:
    closed: int  # channels closed and acknowledged by the VPS
    left: int  # channels still open when the bound ran out: they went with the disconnect


async def say_goodbye(
    conn: asyncssh.SSHClientConnection,
    *,
    timeout_s: float,
    first: Callable[[], Awaitable[None]] | None = None,
) -> Goodbye:
    """Run `first` (e.g. cancelling the forwards), close and await every channel, then
    disconnect; all of it within `timeout_s`. asyncssh lists channels only privately."""
    closed = 0
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            if first is not None:
                await first()
            while channels := list(conn._channels.values()):
                for channel in channels:
                    channel.close()
                await asyncio.gather(*(c.wait_closed() for c in channels))
                closed += len(channels)
    goodbye = Goodbye(closed=closed, left=len(conn._channels))
    conn.close()
    return goodbye

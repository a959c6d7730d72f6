"""One SFTP session per SSH connection, kept open between copies.

Starting an SFTP session costs three round trips in turn (the channel's open, the subsystem
request, the protocol's version exchange): on a WAN about a quarter of a second, and a copy
after the stop that started its own paid it while the area was down. So every copy over a
connection shares that connection's one session: started by whoever needs it first (or
ahead of any move, `warm`), used by any number of copies at once (SFTP requests carry their
own ids), and closed with the connection (the tunnel's goodbye closes every channel).

A copy that fails inside a session stops it being handed out: the next copy starts a fresh
one, so a session left in doubt (a request cut by a timeout, a dead `sftp-server`) is never
reused. It is closed once the last copy using it has left.

Every request on a session counts as a round trip of the work that awaits it
(monitord/base/round_trips.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from monitord.base import round_trips

if TYPE_CHECKING:  # the SSH side loads after readiness (monitord/remote/ssh_side.py)
    import asyncssh

START_TRIPS = 3  # channel open, subsystem request, version exchange
CLOSE_TIMEOUT_S = 2.0


class _Session:
    def __init__(self, sftp: asyncssh.SFTPClient) -> None:
        self.sftp = sftp
        self.users = 0
        self.dropped = False

    async def close_if_unused(self) -> None:
        if self.dropped and self.users == 0:
            self.sftp.exit()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(CLOSE_TIMEOUT_S):
                    await self.sftp.wait_closed()


# The connection's session, or the start of one that copies arriving meanwhile wait for.
_sessions: weakref.WeakKeyDictionary[Any, asyncio.Future[_Session]] = \
    weakref.WeakKeyDictionary()


@contextlib.asynccontextmanager
async def session(conn: asyncssh.SSHClientConnection) -> AsyncIterator[asyncssh.SFTPClient]:
    """The connection's SFTP session, started if there is none (see the module doc)."""
    shared = await _shared(conn)
    shared.users += 1
    try:
        yield shared.sftp
    except BaseException:
        _drop(conn, shared)
        raise
    finally:
        shared.users -= 1
        await shared.close_if_unused()


async def warm(conn: asyncssh.SSHClientConnection) -> None:
    """Start the connection's session ahead of the first copy that would wait for it."""
    await _shared(conn)


async def _shared(conn: asyncssh.SSHClientConnection) -> _Session:
    starting = _sessions.get(conn)
    if starting is None or (starting.done() and (
            starting.cancelled() or starting.exception() is not None)):
        starting = asyncio.get_running_loop().create_future()
        _sessions[conn] = starting
        try:
            with round_trips.exchange(START_TRIPS):
                sftp = await conn.start_sftp_client()
        except BaseException as e:
            _sessions.pop(conn, None)
            # (a copy waiting for this start fails as this one did, never as if cancelled)
            starting.set_exception(e if isinstance(e, Exception)
                                   else ConnectionResetError("the SFTP session's start was cut"))
            starting.exception()  # retrieved here: a start nobody else awaited logs nothing
            raise
        _count_requests(sftp)
        starting.set_result(_Session(sftp))
    return await asyncio.shield(starting)


def _drop(conn: asyncssh.SSHClientConnection, shared: _Session) -> None:
    shared.dropped = True
    current = _sessions.get(conn)
    if current is not None and current.done() and not current.cancelled() \
            and current.exception() is None and current.result() is shared:
        del _sessions[conn]


def _count_requests(sftp: asyncssh.SFTPClient) -> None:
    """Every request of the session is one round trip of the work awaiting it. asyncssh
    sends them all through its handler's `_make_request`; wrapped on this one instance."""
    handler = sftp._handler
    make_request: Callable[..., Awaitable[object]] = handler._make_request

    async def counted(*args: Any) -> object:
        with round_trips.exchange():
            return await make_request(*args)

    handler._make_request = counted  # type: ignore[method-assign,assignment]

"""A connection accepted just as its server closes is a transport like any other.

CPython gh-109564: asyncio makes the transport of an accepted connection in a later step
than the accept; a server closed in between made the transport's constructor fail on an
assertion that asyncio swallows, leaving a half-made transport with its socket open (an
"unclosed transport" at some later test's teardown). monitord/testing/server_close_race.py
is installed by the VPS double; here the race is made certain: the protocol factory, which
runs between the accept and the transport, closes the server.
"""

from __future__ import annotations

import asyncio
import socket

from monitord.testing import server_close_race


class _Recorded(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.BaseTransport | None = None
        self.made = asyncio.Event()
        self.lost = asyncio.Event()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.made.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost.set()


async def test_a_connection_accepted_as_its_server_closes_gets_its_transport() -> None:
    server_close_race.install()
    loop = asyncio.get_running_loop()
    protocol = _Recorded()
    server: asyncio.Server | None = None

    def closing_factory() -> _Recorded:
        assert server is not None
        server.close()  # between the accept and the transport, as asyncssh's listener may
        return protocol

    server = await loop.create_server(closing_factory, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        async with asyncio.timeout(5):
            await protocol.made.wait()  # the transport was made, not dropped half-way
        assert protocol.transport is not None
        protocol.transport.close()
        async with asyncio.timeout(5):
            await protocol.lost.wait()
            await server.wait_closed()  # the last connection's detach woke it, once

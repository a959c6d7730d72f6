"""The fault proxy other tests rely on: it forwards, cuts, black-holes and delays."""

from __future__ import annotations

import asyncio
import contextlib
import time

from tests.integration.tunnel.conftest import EchoServer
from tests.support.tcp_proxy import running_proxy


async def _connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)


async def _close(*writers: asyncio.StreamWriter) -> None:
    for writer in writers:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


class TestFaultProxy:
    """Bytes pass until a fault is injected; each fault does what its name says."""

    async def test_forwards_then_cut_closes_both_sides(self, echo: EchoServer) -> None:
        async with running_proxy("127.0.0.1", echo.port) as proxy:
            reader, writer = await _connect(proxy.port)
            writer.write(b"hello\n")
            assert await asyncio.wait_for(reader.readline(), 5) == b"hello\n"
            await proxy.cut()
            assert await asyncio.wait_for(reader.read(), 5) == b""
            await _close(writer)

    async def test_blackhole_swallows_bytes_and_keeps_the_connection_open(
        self, echo: EchoServer
    ) -> None:
        async with running_proxy("127.0.0.1", echo.port) as proxy:
            reader, writer = await _connect(proxy.port)
            proxy.blackhole()  # right after accept: even a not yet linked connection is hit
            writer.write(b"lost\n")
            try:
                await asyncio.wait_for(reader.readline(), 0.3)
                raise AssertionError("a black-holed connection delivered data")
            except TimeoutError:
                pass
            assert not reader.at_eof()
            fresh_reader, fresh_writer = await _connect(proxy.port)
            fresh_writer.write(b"new\n")
            assert await asyncio.wait_for(fresh_reader.readline(), 5) == b"new\n"
            await _close(writer, fresh_writer)

    async def test_delay_adds_latency_each_way(self, echo: EchoServer) -> None:
        async with running_proxy("127.0.0.1", echo.port) as proxy:
            proxy.set_delay(0.1)
            reader, writer = await _connect(proxy.port)
            started = time.monotonic()
            writer.write(b"slow\n")
            assert await asyncio.wait_for(reader.readline(), 5) == b"slow\n"
            assert time.monotonic() - started >= 0.2
            await _close(writer)

    async def test_refuse_closes_new_connections_at_once(self, echo: EchoServer) -> None:
        async with running_proxy("127.0.0.1", echo.port) as proxy:
            proxy.refuse(True)
            reader, writer = await _connect(proxy.port)
            assert await asyncio.wait_for(reader.read(), 5) == b""
            await _close(writer)
            proxy.heal()
            reader, writer = await _connect(proxy.port)
            writer.write(b"back\n")
            assert await asyncio.wait_for(reader.readline(), 5) == b"back\n"
            await _close(writer)

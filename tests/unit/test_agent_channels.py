"""The agent client's channel opened ahead (monitord/remote/agent_channels.py): a request
takes the channel opened while nothing waited, and so waits one round trip, not two; one
too old, or closed by the agent meanwhile, is never used — the request opens its own."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from monitord.base import round_trips
from monitord.base.round_trips import RoundTrips
from monitord.remote import agent_channels
from monitord.remote.agent_client import AgentClient, unix_channel


class _Agent:
    """An agent on a Unix socket that answers every request `{"ok": true}` and closes;
    `drop_idle()` closes the connections that have not sent a request yet."""

    def __init__(self) -> None:
        self.connections = 0
        self.answered = 0
        self._idle: set[asyncio.StreamWriter] = set()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._idle.add(writer)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            self._idle.discard(writer)
            assert head.startswith(b"GET /livez ")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n{\"ok\":true}")
            self.answered += 1
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # closed before it asked
        finally:
            self._idle.discard(writer)
            writer.close()
            await writer.wait_closed()

    def drop_idle(self) -> None:
        for writer in list(self._idle):
            writer.close()


@pytest.fixture
async def agent(tmp_path: Path) -> AsyncIterator[tuple[_Agent, str]]:
    double = _Agent()
    path = str(tmp_path / "agent.sock")
    server = await asyncio.start_unix_server(double.handle, path)
    try:
        yield double, path
    finally:
        server.close()
        await server.wait_closed()


async def _calls(client: AgentClient, n: int) -> int:
    """Round trips `n` requests in turn waited for."""
    trips = RoundTrips()
    with round_trips.counted_by(trips):
        for _ in range(n):
            await client.call_livez()
    return trips.count


@contextlib.asynccontextmanager
async def _opening_ahead(path: str) -> AsyncIterator[AgentClient]:
    client = AgentClient(channel=unix_channel(path), secret=b"s", open_ahead=True)
    try:
        yield client
    finally:
        await client.close()


class TestOpenedAhead:
    async def test_after_the_first_request_each_waits_one_round_trip(
        self, agent: tuple[_Agent, str]
    ) -> None:
        double, path = agent
        async with _opening_ahead(path) as client:
            assert await _calls(client, 1) == 2  # none opened yet: its own, then the request
            await asyncio.sleep(0.05)  # (the next one opens while nothing waits)
            assert await _calls(client, 1) == 1
        assert double.answered == 2

    async def test_without_opening_ahead_every_request_opens_its_own(
        self, agent: tuple[_Agent, str]
    ) -> None:
        double, path = agent
        client = AgentClient(channel=unix_channel(path), secret=b"s")
        assert await _calls(client, 3) == 6
        assert double.connections == 3

    async def test_a_channel_the_agent_closed_meanwhile_is_not_used(
        self, agent: tuple[_Agent, str]
    ) -> None:
        double, path = agent
        async with _opening_ahead(path) as client:
            await client.call_livez()
            await asyncio.sleep(0.05)
            double.drop_idle()  # e.g. the agent restarted
            await asyncio.sleep(0.05)
            assert await _calls(client, 1) == 2  # a fresh one, and the request succeeds
        assert double.answered == 2

    async def test_a_channel_kept_too_long_is_not_used(self, agent: tuple[_Agent, str]) -> None:
        double, path = agent
        now = [0.0]
        ahead = agent_channels.ChannelsAhead(unix_channel(path), clock=lambda: now[0])
        try:
            for expected in (1, 2):
                async with ahead.channel() as (reader, writer):
                    writer.write(b"GET /livez HTTP/1.1\r\n\r\n")
                    assert (await reader.read()).startswith(b"HTTP/1.1 200")
                await asyncio.sleep(0.05)
                assert double.answered == expected
                now[0] += agent_channels.MAX_AGE_S + 1  # the agent may be about to close it
            # the second request found the one opened ahead too old: it opened its own
            assert double.connections == 4
        finally:
            await ahead.close()

    async def test_close_leaves_no_channel_open(self, agent: tuple[_Agent, str]) -> None:
        double, path = agent
        client = AgentClient(channel=unix_channel(path), secret=b"s", open_ahead=True)
        await client.call_livez()
        await asyncio.sleep(0.05)
        await client.close()
        await asyncio.sleep(0.05)
        assert double.connections == 2 and not double._idle
        assert await _calls(client, 1) == 2  # still usable: its own channel, none ahead
        assert double.connections == 3

"""The WAN link of the fault tier (tests/support/wan_link.py): what lies between the PBX and a
namespace VPS marked `@pytest.mark.link(...)` behaves as a line does — a round trip per
handshake, no more than the line rate, a bounded queue that drops at its tail, the profile's
loss — and the tier's cuts and whole moves still work through it.

Physics gives lower bounds only (a connection cannot be faster than the delay, a transfer
than the rate); how much slower a loaded machine makes them is no business of a test.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import time
from collections.abc import Awaitable
from typing import Any

import pytest

from monitord.testing.stack import Stack
from tests.faults.conftest import FaultStackFactory
from tests.faults.netns_vps import NetnsVps
from tests.support.wan_link import PROFILES, LinkError, LinkProfile

BULK_BYTES = 1 << 20
SINK_PORT = 5001
FLOOD_DATAGRAMS = 2000
DATAGRAM_BYTES = 1200
# Reads a TCP connection to its end and answers with the byte count: the far end of a bulk
# transfer, inside the VPS's namespace.
SINK = f"""
import socket
s = socket.create_server(("0.0.0.0", {SINK_PORT}))
print("listening", flush=True)
c, _ = s.accept()
n = 0
while chunk := c.recv(1 << 16):
    n += len(chunk)
c.sendall(str(n).encode())
c.close()
"""


async def connect_s(vps: NetnsVps) -> float:
    """How long a TCP connection to the VPS's sshd takes to open (a SYN and its SYN-ACK)."""
    began = time.monotonic()
    async with asyncio.timeout(10):
        _, writer = await asyncio.open_connection(vps.vps_address, vps.port)
    took = time.monotonic() - began
    writer.close()
    await writer.wait_closed()
    return took


async def answers_ssh(vps: NetnsVps, *, within_s: float = 2.0) -> bool:
    """Whether the VPS's sshd sends its banner within `within_s`. (A cut link is judged by
    the banner, not the connect: with the PBX's veth down the route falls back to this
    machine's default one, where something may accept any connection.)"""
    try:
        async with asyncio.timeout(within_s):
            reader, writer = await asyncio.open_connection(vps.vps_address, vps.port)
            try:
                return (await reader.readline()).startswith(b"SSH-2.0-")
            finally:
                writer.close()
    except (OSError, TimeoutError):
        return False


async def bulk_send_s(vps: NetnsVps, payload: bytes) -> float:
    """Send `payload` to a sink in the VPS and wait for its count: the transfer's time."""
    sink = await vps.spawn([sys.executable, "-c", SINK], stdout=asyncio.subprocess.PIPE)
    assert sink.stdout is not None
    async with asyncio.timeout(10):
        assert (await sink.stdout.readline()).strip() == b"listening"
    async with asyncio.timeout(60):
        reader, writer = await asyncio.open_connection(vps.vps_address, SINK_PORT)
        began = time.monotonic()
        writer.write(payload)
        await writer.drain()
        writer.write_eof()
        received = int(await reader.read())
        took = time.monotonic() - began
    writer.close()
    await writer.wait_closed()
    assert received == len(payload)
    return took


async def send_datagrams(vps: NetnsVps, count: int, *, gap_s: float) -> None:
    """`count` UDP datagrams to the VPS (no one listens: the wire counts them all the same)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _ in range(count):
            sock.sendto(b"x" * DATAGRAM_BYTES, (vps.vps_address, 9))
            await asyncio.sleep(gap_s)  # 0: a flood, as fast as the sender goes
    finally:
        sock.close()


async def last_downtime_s(stack: Stack) -> float:
    """The downtime of tg's one area in its last move, once monitord has measured it."""
    async def area() -> dict[str, Any]:
        area: dict[str, Any] = (await stack.status())["services"]["tg"]["areas"][0]
        return area

    await stack.wait_until(lambda: _measured(area()), timeout_s=30, what="the downtime")
    return float((await area())["last_downtime_s"])


async def _measured(view: Awaitable[dict[str, Any]]) -> bool:
    return (await view)["last_downtime_s"] is not None


class TestProfiles:
    """A link is named or spelled out; anything else is refused naming what is accepted."""

    def test_the_named_profiles_are_the_documented_links(self) -> None:
        assert not PROFILES["lan"].wired
        assert (PROFILES["wan"].delay_ms, PROFILES["wan"].rate_bit_s) == (40, 20e6)
        far = PROFILES["far"]
        assert (far.delay_ms, far.rate_bit_s, far.loss_pct) == (150, 5e6, 1.0)

    def test_a_spec_gives_each_field_and_a_bad_one_names_itself(self) -> None:
        link = LinkProfile.parse("delay=25ms,rate=2mbit,loss=0.5%,queue=50ms")
        assert (link.delay_ms, link.rate_bit_s, link.loss_pct, link.queue_ms) == (
            25, 2e6, 0.5, 50)
        assert LinkProfile.parse("wan") is PROFILES["wan"]
        with pytest.raises(LinkError, match="rate='fast'"):
            LinkProfile.parse("rate=fast")
        with pytest.raises(LinkError, match="one of lan, wan, far"):
            LinkProfile.parse("moon")


@pytest.mark.link("wan")
class TestWanLink:
    """40 ms each way, 20 Mbit/s: what an office line to a VPS abroad gives."""

    async def test_a_connection_takes_a_round_trip(self, netns_vps: NetnsVps) -> None:
        assert await connect_s(netns_vps) >= netns_vps.link.rtt_s

    async def test_a_transfer_takes_at_least_its_line_time_and_the_queue_stays_bounded(
        self, netns_vps: NetnsVps
    ) -> None:
        took = await bulk_send_s(netns_vps, b"\0" * BULK_BYTES)
        assert took >= netns_vps.link.transfer_floor_s(BULK_BYTES)
        assert netns_vps.wire is not None
        up = (await netns_vps.wire.counters())["a_to_b"]
        assert up["bytes"] >= BULK_BYTES
        assert up["max_backlog_s"] <= netns_vps.link.queue_ms / 1000

    async def test_a_flood_above_the_rate_is_dropped_at_the_tail(
        self, netns_vps: NetnsVps
    ) -> None:
        await send_datagrams(netns_vps, FLOOD_DATAGRAMS, gap_s=0)
        assert netns_vps.wire is not None
        up = (await netns_vps.wire.counters())["a_to_b"]
        assert up["tail_dropped"] > 0
        assert up["max_backlog_s"] <= netns_vps.link.queue_ms / 1000
        assert up["lost"] == 0  # this profile loses nothing at random

    async def test_the_cuts_of_the_fault_tier_work_through_the_wire(
        self, netns_vps: NetnsVps
    ) -> None:
        netns_vps.link_down()
        assert not await answers_ssh(netns_vps)
        netns_vps.link_up()
        assert await answers_ssh(netns_vps)
        netns_vps.black_hole()
        assert not await answers_ssh(netns_vps)
        netns_vps.heal()
        assert await answers_ssh(netns_vps)

    async def test_an_area_moves_there_and_back_one_runner_at_a_time(
        self, fault_stack: FaultStackFactory, netns_vps: NetnsVps
    ) -> None:
        # The tier's teardown asserts the split-brain detector saw no overlap.
        stack = await fault_stack(services={"tg": 1})
        await stack.wait_settled(expect={"tg": "local"}, timeout_s=60)
        for side in ("remote", "local"):
            await stack.place("tg", side)
            await stack.wait_settled(expect={"tg": side}, timeout_s=120)
            # Between the stop on one side and the start on the other lies a round trip.
            assert await last_downtime_s(stack) >= netns_vps.link.rtt_s


@pytest.mark.link("far")
class TestFarLink:
    """150 ms each way, 5 Mbit/s, 1 % lost each way."""

    async def test_frames_are_lost_at_random_and_counted(self, netns_vps: NetnsVps) -> None:
        # Paced under the line rate, so nothing is dropped for the queue's sake.
        await send_datagrams(netns_vps, 1000, gap_s=0.003)
        assert netns_vps.wire is not None
        up = (await netns_vps.wire.counters())["a_to_b"]
        assert up["lost"] > 0
        assert up["tail_dropped"] == 0

"""Processes on the namespace VPS reach the PBX's real nats-server through the tunnel only."""

from __future__ import annotations

import asyncio
import sys

from tests.faults.conftest import FaultStackFactory
from tests.faults.nats_server import PUBLISHER_SCRIPT, NatsServer, next_message, subscribe
from tests.faults.netns_vps import NetnsVps

TIMEOUT_S = 20.0


async def _publish_from_vps(
    vps: NetnsVps, *, address: str, name: str, payload: str
) -> asyncio.subprocess.Process:
    return await vps.spawn(
        [sys.executable, "-c", PUBLISHER_SCRIPT, address, name, "faults.probe", payload],
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )


class TestNatsThroughTheTunnel:
    """A VPS process's NATS message reaches the PBX nats-server via the `nats` reverse forward."""

    async def test_a_vps_process_publishes_to_pbx_nats_through_the_reverse_forward_only(
        self, fault_stack: FaultStackFactory, netns_vps: NetnsVps, nats: NatsServer
    ) -> None:
        stack = await fault_stack(services={"tg": 1})
        await stack.wait_settled(expect={"tg": "local"}, timeout_s=60)

        # The namespace has its own loopback: the PBX's nats port is not there.
        direct = await _publish_from_vps(
            netns_vps, address=nats.address, name="direct", payload="never"
        )
        assert direct.stdin is not None
        direct.stdin.close()
        assert await asyncio.wait_for(direct.wait(), TIMEOUT_S) != 0

        async with subscribe(nats, "faults.probe") as inbox:
            publisher = await _publish_from_vps(
                netns_vps, address="127.0.0.1:4222", name="vps-publisher", payload="hello"
            )
            assert publisher.stdout is not None and publisher.stdin is not None
            line = await asyncio.wait_for(publisher.stdout.readline(), TIMEOUT_S)
            assert line.strip() == b"published"
            assert await next_message(inbox, timeout_s=TIMEOUT_S) == ("faults.probe", b"hello")
            names = {c.get("name") for c in await nats.connections()}
            assert {"vps-publisher", "pbx-subscriber"} <= names
            publisher.stdin.close()
            assert await asyncio.wait_for(publisher.wait(), TIMEOUT_S) == 0

    async def test_remote_daemons_run_in_the_namespace_and_are_heard(
        self, fault_stack: FaultStackFactory, netns_vps: NetnsVps
    ) -> None:
        stack = await fault_stack(services={"tg": 2})
        await stack.place("tg", "remote")
        await stack.wait_settled(expect={"tg": "remote"}, timeout_s=60)
        in_namespace = set(netns_vps.pids())
        for area in stack.areas["tg"]:
            (alive,) = stack.detector.alive(area)
            assert alive.side == "remote"
            assert alive.pid in in_namespace

"""Faults of the namespace VPS beyond the incident: a foreign listener on the NATS port, a
black hole during COPY, a link going down under committed remote areas, and a VPS reboot.
After each, every area ends on exactly one side and (checked by the fixture) no two
processes ever served one area at once."""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import pytest

from monitord.testing.stack import Stack
from tests.faults.conftest import RELEASE_MATRIX, FaultStackFactory
from tests.faults.netns_vps import NetnsVps

L2R = "local_to_remote"
LISTENER_SCRIPT = r"""
import socket, sys
sock = socket.socket()
sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
sock.bind(("127.0.0.1", 4222))
sock.listen()
print("listening", flush=True)
sys.stdin.read()
"""


async def tunnel(stack: Stack) -> dict[str, Any]:
    result = (await stack.status())["tunnel"]
    assert isinstance(result, dict)
    return result


def local_lives_since(stack: Stack, area: str, since: float) -> list[Any]:
    return [
        life for life in stack.detector.lives(area)
        if life.key.side == "local" and life.first_seen >= since
    ]


@pytest.mark.parametrize("netns_vps", RELEASE_MATRIX, indirect=True)
class TestForeignListenerOnTheNatsPort:
    """A process that is no SSH session holding 4222 on the VPS shows as PORT_OCCUPIED, and
    clears when freed (on each Debian release: the diagnosis reads that release's `ss`)."""

    async def test_port_occupied_is_named_in_status_and_recovers_when_freed(
        self, fault_stack: FaultStackFactory, netns_vps: NetnsVps
    ) -> None:
        holder = await netns_vps.spawn(
            [sys.executable, "-c", LISTENER_SCRIPT],
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )
        assert holder.stdout is not None and holder.stdin is not None
        assert (await asyncio.wait_for(holder.stdout.readline(), 10)).strip() == b"listening"

        stack = await fault_stack(services={"tg": 1})

        async def occupied() -> bool:
            state = await tunnel(stack)
            return state["state"] == "port_occupied" and state["last_error_code"] == (
                "PORT_OCCUPIED"
            )

        await stack.wait_until(occupied, timeout_s=30, what="tunnel state port_occupied")
        detail = (await tunnel(stack))["last_error"]
        assert str(holder.pid) in detail, detail  # the holder is named, not guessed

        # Asked to go remote now, the service shows the conflict and its area keeps
        # running locally (a failed preflight never takes a local service down).
        await stack.place("tg", "remote")

        async def service_shows_conflict() -> bool:
            return bool((await stack.status())["services"]["tg"]["state"] == "tunnel_conflict")

        await stack.wait_until(service_shows_conflict, timeout_s=30, what="tg tunnel_conflict")
        (area,) = stack.areas["tg"]
        assert [k.side for k in stack.detector.alive(area)] == ["local"]
        assert stack.committed()[area].get("location", "local") == "local"

        holder.stdin.close()  # the foreign process exits and frees the port
        await asyncio.wait_for(holder.wait(), 10)
        await stack.wait_until(
            lambda: _connected(stack), timeout_s=30, what="tunnel connected once 4222 is free"
        )
        await stack.wait_settled(expect={"tg": "remote"}, timeout_s=60)


async def _connected(stack: Stack) -> bool:
    return bool((await tunnel(stack))["connected"])


class TestBlackHoleDuringCopy:
    """SSH black-holed while an area's data is being copied ends converged, never split."""

    async def test_black_hole_at_copy_rolls_back_then_completes_after_heal(
        self, fault_stack: FaultStackFactory, netns_vps: NetnsVps
    ) -> None:
        stack = await fault_stack(services={"tg": 2}, data_bytes=2 * 1024 * 1024)
        areas = stack.areas["tg"]
        await stack.wait_settled(expect={"tg": "local"}, timeout_s=60)
        assert await stack.stop_monitord() == 0
        await stack.start_monitord(env={"MONITORD_HOLD_AT": f"{L2R}:COPY"})
        await stack.place("tg", "remote")
        await stack.wait_event("hold_point")
        netns_vps.black_hole()
        stack.release_hold()
        # The sources were suppressed for the copy; with the VPS gone they serve again.
        await stack.wait_until(
            lambda: all(
                [k.side for k in stack.detector.alive(area)] == ["local"] for area in areas
            ),
            timeout_s=60, what="every area served locally while SSH is black-holed",
        )
        assert all(stack.committed()[a].get("location", "local") == "local" for a in areas)
        netns_vps.heal()
        await stack.wait_settled(expect={"tg": "remote"}, timeout_s=90)


@pytest.mark.parametrize("netns_vps", RELEASE_MATRIX, indirect=True)
class TestLinkDownUnderRemoteAreas:
    """With the veth down, committed remote areas are never started locally; they come back
    (on each Debian release: the VPS's lease guards, under its python3, stop the daemons)."""

    async def test_link_down_never_starts_the_source_and_recovers_on_link_up(
        self, fault_stack: FaultStackFactory, netns_vps: NetnsVps
    ) -> None:
        stack = await fault_stack(services={"tg": 2})
        areas = stack.areas["tg"]
        await stack.place("tg", "remote")
        await stack.wait_settled(expect={"tg": "remote"}, timeout_s=60)
        cut_at = time.time()
        netns_vps.link_down()
        await stack.wait_until(
            lambda: _disconnected(stack), timeout_s=20, what="the tunnel seen down"
        )
        # Past the area lease: the VPS stopped the daemons, the PBX must not take over.
        await stack.wait_until(
            lambda: not any(stack.detector.alive(a) for a in areas),
            timeout_s=20, what="remote daemons silent",
        )
        netns_vps.link_up()
        await stack.wait_settled(expect={"tg": "remote"}, timeout_s=90)
        assert all(local_lives_since(stack, a, cut_at) == [] for a in areas)


async def _disconnected(stack: Stack) -> bool:
    return not (await tunnel(stack))["connected"]


class TestVpsReboot:
    """After every VPS process dies and sshd comes back, monitord re-provisions and converges."""

    async def test_reboot_reprovisions_regrants_and_converges_remote(
        self, fault_stack: FaultStackFactory, netns_vps: NetnsVps
    ) -> None:
        stack = await fault_stack(services={"tg": 2})
        areas = stack.areas["tg"]
        await stack.place("tg", "remote")
        await stack.wait_settled(expect={"tg": "remote"}, timeout_s=60)
        before = {a: stack.detector.alive(a)[0].pid for a in areas}
        agent_pid_file = stack.vps_dir / "agent.pid"
        agent_before = agent_pid_file.read_text().split()[0]
        (stack.vps_dir / "monitord.pyz").unlink()  # the reboot also lost the agent binary
        rebooted_at = time.time()

        await netns_vps.reboot()

        await stack.wait_settled(expect={"tg": "remote"}, timeout_s=90)
        assert (stack.vps_dir / "monitord.pyz").exists()  # pushed again
        assert agent_pid_file.read_text().split()[0] != agent_before
        in_namespace = set(netns_vps.pids())
        for area in areas:
            (alive,) = stack.detector.alive(area)
            assert alive.side == "remote" and alive.pid != before[area]
            assert alive.pid in in_namespace
            assert local_lives_since(stack, area, rebooted_at) == []

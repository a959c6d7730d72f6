"""A VPS with less memory than an area needs, as a container VPS shows it: an LXC container's
/proc/meminfo is its own (lxcfs bind-mounts one over it), and so is the namespace VPS's here.
A move that does not fit is refused before the source stops and parks with PREFLIGHT_MEMORY,
each part of the need named; once the VPS has the memory, a retry moves it. A move still
under way counts for the next one, whether or not the VPS's figure shows it yet."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from monitord.base import proc_identity
from monitord.testing.stack import Stack
from orchestrator import disk_space, memory_room
from tests.faults.conftest import RELEASE_MATRIX, FaultStackFactory
from tests.faults.netns_vps import NetnsVps
from tests.faults.test_full_disk import run_cli

MIB = disk_space.MIB
RESERVE_MIB = 64  # remote.memory_reserve_mib's default
HOLD_AT_HEALTHCHECK = "local_to_remote:HEALTHCHECK_DESTINATION"


def container_meminfo(stack: Stack, netns_vps: NetnsVps) -> Path:
    """A meminfo file of the VPS's own over its /proc/meminfo (what lxcfs does); written in
    place afterwards (the bind mount holds the inode), the VPS sees each new figure."""
    path = stack.vps_dir / "meminfo"
    path.write_text(Path("/proc/meminfo").read_text())
    netns_vps.in_mounts(["mount", "--bind", str(path), "/proc/meminfo"])
    return path


def set_available(meminfo: Path, available_bytes: int) -> None:
    text = re.sub(r"^MemAvailable:\s+\d+ kB$", f"MemAvailable: {available_bytes // 1024} kB",
                  meminfo.read_text(), flags=re.MULTILINE)
    with meminfo.open("r+") as f:  # the same inode: the bind mount shows it
        f.truncate(0)
        f.write(text)


async def service(stack: Stack, name: str = "tg") -> dict[str, Any]:
    result = (await stack.status())["services"][name]
    assert isinstance(result, dict)
    return result


async def wait_parked(stack: Stack, name: str) -> dict[str, Any]:
    async def parked() -> bool:
        return bool((await service(stack, name))["state"] == "parked")

    await stack.wait_until(parked, timeout_s=60, what=f"{name} parked")
    return await service(stack, name)


def local_daemon_bytes(stack: Stack, area: str) -> int:
    """The resident memory of the area's daemon on the PBX, as the preflight measures it."""
    (life,) = [x for x in stack.detector.lives(area) if x.key.side == "local"]
    identity = proc_identity.read(life.key.pid)
    assert identity is not None
    resident = proc_identity.resident_bytes(identity)
    assert resident is not None and resident > 2 * MIB
    return resident


@pytest.mark.parametrize("netns_vps", RELEASE_MATRIX, indirect=True)
class TestAMoveThatDoesNotFitInMemory:
    """The VPS says 1 MiB more than a lease guard and the reserve: enough for an area whose
    daemon's size were not counted, not for this one's (a Python daemon of some MiB). On
    each Debian release, its agent reading the figure with that release's own python3."""

    async def test_is_refused_before_the_source_stops_and_parks_with_each_part(
        self, fault_stack: FaultStackFactory, netns_vps: NetnsVps
    ) -> None:
        stack = await fault_stack(services={"tg": 1})
        (area,) = stack.areas["tg"]
        await stack.wait_settled(expect={"tg": "local"}, timeout_s=60)
        meminfo = container_meminfo(stack, netns_vps)
        available = memory_room.GUARD_BYTES + RESERVE_MIB * MIB + MIB
        set_available(meminfo, available)

        async def shown() -> bool:  # the status shows the VPS's own figure
            memory = (await stack.status())["vps_memory"]
            return bool(memory) and memory["available_bytes"] == available

        await stack.wait_until(shown, timeout_s=30, what="the VPS's memory in the status")
        code, text = await run_cli("status", "-c", str(stack.config_path))
        assert "vps memory: 69 MiB available of " in text, text
        (life,) = [x for x in stack.detector.lives(area) if x.key.side == "local"]
        resident = local_daemon_bytes(stack, area)

        await stack.place("tg", "remote")

        error = (await wait_parked(stack, "tg"))["last_error"]
        assert error["code"] == "PREFLIGHT_MEMORY", error
        assert error["phase"] == "PREFLIGHT", error
        assert error["available_bytes"] == available, error
        # the daemon as it runs on the PBX (a few pages more or less than a moment later)
        assert abs(error["daemon_bytes"] - resident) < resident // 4, (error, resident)
        assert error["needed_bytes"] == (error["daemon_bytes"] + memory_room.GUARD_BYTES
                                         + RESERVE_MIB * MIB), error
        assert re.fullmatch(  # (the catalogue's action follows the numbers)
            r"VPS: 69\.0 MiB of memory available, [0-9.]+ MiB needed \(its daemon [0-9.]+ MiB"
            r" as resident on the PBX, its lease guard 4\.0 MiB, 64\.0 MiB kept free\):"
            r" [0-9.]+ MiB missing — Free memory on the VPS .*", error["detail"]), error["detail"]
        assert "monitord retry" in error["action"], error
        # The source never stopped: the one local life from before, still alive.
        assert [x.key for x in stack.detector.lives(area)] == [life.key]
        assert [k.side for k in stack.detector.alive(area)] == ["local"]
        assert not [e for e in stack.events("transaction_phase")
                    if e.get("phase") == "SUPPRESS_SOURCE"]

        # The VPS gets the memory (the container's limit raised) and the operator retries.
        set_available(meminfo, 2048 * MIB)
        code, _ = await stack.request("POST", "/v1/services/tg/retry")
        assert code in (200, 202), code
        await stack.wait_settled(expect={"tg": "remote"}, timeout_s=120)


class TestAMoveUnderWayCountsForTheNext:
    """tg's move holds after its daemon started on the VPS; the VPS's figure does not show
    that daemon (the container's meminfo stands still, as a kernel's lags). wa's move would
    fit on that figure alone, by half of tg's need, and is refused: tg's claim counts. Once
    tg's move ended, its claim is over and a retry of wa goes through."""

    async def test_is_refused_while_the_other_holds_its_claim(
        self, fault_stack: FaultStackFactory, netns_vps: NetnsVps
    ) -> None:
        stack = await fault_stack(services={"tg": 1, "wa": 1})
        (tg_area,), (wa_area,) = stack.areas["tg"], stack.areas["wa"]
        await stack.wait_settled(expect={"tg": "local", "wa": "local"}, timeout_s=60)
        assert await stack.stop_monitord() == 0
        await stack.start_monitord(env={"MONITORD_HOLD_AT": HOLD_AT_HEALTHCHECK})
        guard, reserve = memory_room.GUARD_BYTES, RESERVE_MIB * MIB
        tg_need = local_daemon_bytes(stack, tg_area) + guard
        wa_need = local_daemon_bytes(stack, wa_area) + guard
        meminfo = container_meminfo(stack, netns_vps)
        set_available(meminfo, reserve + wa_need + tg_need // 2)

        await stack.place("tg", "remote")
        await stack.wait_event("hold_point", timeout_s=60)
        await stack.place("wa", "remote")
        error = (await wait_parked(stack, "wa"))["last_error"]
        assert error["code"] == "PREFLIGHT_MEMORY", error
        assert abs(error["claimed_bytes"] - tg_need) < tg_need // 4, (error, tg_need)
        assert "moves under way" in error["detail"], error
        assert [k.side for k in stack.detector.alive(wa_area)] == ["local"]

        stack.release_hold()

        async def tg_moved() -> bool:
            status = await stack.status()
            return (not [t for t in status["transactions"] if t["service"] == "tg"]
                    and stack.committed()[tg_area].get("location") == "remote")

        await stack.wait_until(tg_moved, timeout_s=120, what="tg's move ended")
        code, _ = await stack.request("POST", "/v1/services/wa/retry")
        assert code in (200, 202), code
        await stack.wait_settled(expect={"tg": "remote", "wa": "remote"}, timeout_s=120)

"""The original incident, replayed against a real OpenSSH VPS in a network namespace.

Several Telegram areas start migrating to the VPS; once some remote entries exist, SSH is
black-holed (no reset: only keepalives notice); monitord is started a second time next to
the running one, then the first is SIGKILLed and two are started at once; the VPS comes back
with its stale cache. Checked: no second monitord ever runs, the source stays the only owner
until a commit (the detector, which hears remote daemons over the veth even while SSH is
dead, sees no overlap — asserted by the fixture), an area whose VPS copy ran is not started
on its older local data while the VPS is away (no data regression — asserted by the fixture
too), orphans are removed from the agent's cache and processes, and after SSH returns every
area is served on exactly one side.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

from monitord.testing.stack import Stack
from tests.faults.conftest import FaultStackFactory, SpawnMonitord
from tests.faults.monitord_process import MonitordRun, adopt
from tests.faults.netns_vps import NetnsVps

HOLD_AT_HEALTHCHECK = {"MONITORD_HOLD_AT": "local_to_remote:HEALTHCHECK_DESTINATION"}
EXIT_DUPLICATE = 3


def remote_daemon_areas(vps: NetnsVps) -> set[str]:
    """Areas of the fake daemons running inside the VPS namespace (from their command lines)."""
    areas: set[str] = set()
    for pid in vps.pids():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"monitord.testing.fake_daemon" in argv and b"--area" in argv:
            areas.add(argv[argv.index(b"--area") + 1].decode())
    return areas


def remote_entries(stack: Stack) -> set[str]:
    return set(stack.agent_cache())


async def assert_duplicate_refused(run: MonitordRun) -> None:
    """The run exits 3 having logged exactly one duplicate_instance and nothing of a start."""
    assert await run.exit_code(timeout_s=30) == EXIT_DUPLICATE, "\n".join(run.lines[-20:])
    assert len(run.events("duplicate_instance")) == 1
    assert run.events("daemon_starting") == []


async def start_two_at_once(stack: Stack, spawn: SpawnMonitord) -> MonitordRun:
    """Two monitord runs started together: exactly one runs; that one is returned."""
    first, second = await asyncio.gather(spawn(stack), spawn(stack))

    def one_exited() -> bool:
        return not first.running() or not second.running()

    await stack.wait_until(one_exited, timeout_s=30, what="one of two runs to exit")
    loser, winner = (first, second) if not first.running() else (second, first)
    await assert_duplicate_refused(loser)
    assert winner.running(), "\n".join(winner.lines[-20:])
    return winner


async def _ready(stack: Stack) -> bool:
    return (await stack.request("GET", "/readyz"))[0] == 200


async def _tunnel_down(stack: Stack) -> bool:
    return not (await stack.status())["tunnel"]["connected"]


class TestIncidentReplay:
    """After a black-holed SSH, duplicate starts and a stale VPS, every area ends on one side."""

    async def test_incident_replay_converges_without_split_brain_or_second_instance(
        self, fault_stack: FaultStackFactory, netns_vps: NetnsVps, spawn_monitord: SpawnMonitord
    ) -> None:
        stack = await fault_stack(services={"tg": 3}, parallelism=2)
        areas = stack.areas["tg"]
        await stack.wait_settled(expect={"tg": "local"}, timeout_s=60)
        assert await stack.stop_monitord() == 0
        await stack.start_monitord(env=HOLD_AT_HEALTHCHECK)

        # 1. Migrate several tg areas; stop once some remote entries exist.
        await stack.place("tg", "remote")
        await stack.wait_event("hold_point")
        await stack.wait_until(
            lambda: len(remote_daemon_areas(netns_vps) & remote_entries(stack)) >= 2,
            timeout_s=30, what="two remote entries with running daemons",
        )
        assert remote_entries(stack) < set(areas)  # some, not all: the third one waits

        # 2. SSH goes into a black hole. Nothing is committed yet: the source is authoritative.
        assert all(stack.committed()[a].get("location", "local") == "local" for a in areas)
        ran_remotely = remote_daemon_areas(netns_vps) & remote_entries(stack)
        netns_vps.black_hole()
        cut_at = time.time()
        # The detector is not blind meanwhile: a remote daemon is heard over the veth well
        # after the tunnel stopped carrying anything.
        await stack.wait_until(
            lambda: any(
                life.key.side == "remote" and life.last_seen > cut_at + 1.0
                for area in areas for life in stack.detector.lives(area)
            ),
            timeout_s=10, what="a remote daemon heard directly while SSH is black-holed",
        )
        await stack.wait_until(
            lambda: _tunnel_down(stack), timeout_s=20, what="keepalive notices the dead peer"
        )

        # 3. The local stack is started again while it runs: refused.
        await assert_duplicate_refused(await spawn_monitord(stack))
        assert stack.daemon is not None and stack.daemon.returncode is None

        # ... then the running one dies and two start at once: exactly one runs.
        held = stack.daemon
        held.kill()
        assert await stack.wait_monitord_exit(timeout_s=30) == -signal.SIGKILL
        winner = await start_two_at_once(stack, spawn_monitord)
        adopt(stack, winner)
        await stack.wait_until(lambda: _ready(stack), timeout_s=30, what="one monitord ready")

        # While SSH is dead, an area whose VPS copy never ran takes its source back; one
        # whose VPS copy ran (and wrote) stays stopped: its newest data is on the VPS, out of
        # reach, and a source started on its older data would lose those updates.
        def served_as_expected() -> bool:
            for area in areas:
                alive = [k.side for k in stack.detector.alive(area)]
                if alive != ([] if area in ran_remotely else ["local"]):
                    return False
            return True

        await stack.wait_until(
            served_as_expected, timeout_s=60,
            what="fresh areas served locally, the VPS-written ones awaiting their data",
        )

        async def awaiting_data() -> bool:
            return (await stack.status())["services"]["tg"]["state"] == "awaiting_data"

        await stack.wait_until(awaiting_data, timeout_s=30, what="the service awaiting data")
        assert served_as_expected()
        assert remote_daemon_areas(netns_vps) == set()  # their leases lapsed on the VPS
        stale = {a: e["generation"] for a, e in stack.agent_cache().items()}
        assert stale, "the VPS keeps its stale cache entries while cut off"

        # 4. The VPS comes back with that stale config; the operator's wish still stands.
        netns_vps.heal()
        await stack.wait_settled(expect={"tg": "remote"}, timeout_s=90)

        # Orphans are gone: the VPS holds exactly the areas committed there, at the
        # committed generation (the stale entries' generations were never reused).
        committed = stack.committed()
        on_remote = {a for a in areas if committed[a].get("location") == "remote"}
        assert {a: e["generation"] for a, e in stack.agent_cache().items()} == {
            a: committed[a]["generation"] for a in on_remote
        }
        assert all(committed[a]["generation"] > stale[a] for a in stale)
        assert remote_daemon_areas(netns_vps) == on_remote
        status = await stack.status()
        assert status["counts"]["orphan"] == 0
        assert status["cleanup"]["backlog"] == 0
        for area in areas:
            (alive,) = stack.detector.alive(area)
            assert alive.side == committed[area].get("location", "local")

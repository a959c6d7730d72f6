"""A remote daemon's child that leaves its process group (setsid(), as a daemon that
daemonizes does) is stopped with its daemon: the agent runs each area in a cgroup v2 of its
own (monitord/base/cgroup_fence.py), and each fence empties it — the agent's stop, the
guard's own fence when the lease lapses, the death of the guard, and the stop of a guard
adopted after an agent restart."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from monitord.base import cgroup_fence, proc_identity
from monitord.testing.split_brain import Detector
from tests.integration.agent.conftest import area_body
from tests.support.agent_process import AgentProcess, running_agent, vps_command, wait_until
from tests.support.escaped_children import Escapees, killed_at_the_end, require_cgroup_v2

AREA = "9c0c0c0c-0000-4000-8000-00000000000a"
TTL_S = 2.0


@pytest.fixture
def escapees() -> Iterator[Escapees]:
    with killed_at_the_end() as children:
        yield children


async def _started(agent: AgentProcess, detector: Detector, escapees: Escapees, *,
                   ttl_s: float = 30.0) -> tuple[proc_identity.ProcessIdentity, float]:
    """The area created with a daemon that leaves a child behind: that child, and the wall
    time just after the grant answered."""
    body = area_body(agent, detector, area=AREA, generation=1, ttl_s=ttl_s,
                     extra=("--escape-child",))
    status, answer = await agent.request("PUT", f"/v1/areas/{AREA}", json_body=body)
    assert status == 201, answer
    granted_at = time.time()
    return await escapees.found(Path(body["data_dir"])), granted_at


class TestEscapedChildIsFenced:
    """Where the agent owns a cgroup v2, no fence leaves a daemon's escaped child running."""

    @pytest.fixture(autouse=True)
    def _cgroup_v2(self) -> None:
        require_cgroup_v2()

    async def test_a_stop_kills_the_child_that_left_the_daemons_process_group(
        self, agent: AgentProcess, detector: Detector, escapees: Escapees
    ) -> None:
        child, _ = await _started(agent, detector, escapees)
        status, answer = await agent.request("POST", f"/v1/areas/{AREA}/stop?generation=1")
        assert status == 200, answer
        assert not proc_identity.is_same_process(child)

    async def test_a_lapsed_lease_fences_the_escaped_child_within_ttl_plus_one_second(
        self, agent: AgentProcess, detector: Detector, escapees: Escapees
    ) -> None:
        child, granted_at = await _started(agent, detector, escapees, ttl_s=TTL_S)
        await wait_until(lambda: not proc_identity.is_same_process(child), timeout_s=TTL_S + 3,
                         what="the escaped child to be fenced", interval_s=0.02)
        assert time.time() <= granted_at + TTL_S + 1.0 + 0.5  # (+ how late this look is)

    async def test_a_killed_guard_takes_the_escaped_child_with_its_daemon(
        self, agent: AgentProcess, detector: Detector, escapees: Escapees
    ) -> None:
        child, _ = await _started(agent, detector, escapees)
        [process] = (await agent.inventory())["processes"]
        proc_identity.signal_group(process["guard_pid"], signal.SIGKILL)
        await wait_until(lambda: not proc_identity.is_same_process(child), timeout_s=5,
                         what="the escaped child to go with its daemon")
        # (the agent restarts the area: its new daemon's child is killed at the end too)
        await escapees.found(agent.base_dir / "data" / "tg" / AREA, not_this=child.pid)

    async def test_an_adopted_guard_is_fenced_with_the_escaped_child(
        self, tmp_path: Path, detector: Detector, escapees: Escapees
    ) -> None:
        base_dir = tmp_path / "vps"
        async with running_agent(base_dir, kill_daemons_on_exit=False) as first:
            child, _ = await _started(first, detector, escapees)
            await first.kill(signal.SIGKILL)
        async with running_agent(base_dir) as second:
            [process] = (await second.inventory())["processes"]
            assert process["adopted"]
            assert proc_identity.is_same_process(child)
            status, answer = await second.request("DELETE", f"/v1/areas/{AREA}?generation=1")
            assert status == 200, answer
            assert not proc_identity.is_same_process(child)


class TestSelfCheckSaysHow:
    """The self-check (through `monitord check --remote`) says how the agent that ran in its
    dir fences areas, as that agent decided: it runs in its own cgroup, the self-check in the
    SSH login's."""

    async def test_the_fence_line_is_the_agents_own_decision(self, agent: AgentProcess) -> None:
        result = await asyncio.create_subprocess_exec(
            *vps_command("self-check", "--dir", str(agent.base_dir)),
            stdout=asyncio.subprocess.PIPE)
        stdout, _ = await asyncio.wait_for(result.communicate(), timeout=30)
        lines = {line["check"]: line for line in map(json.loads, stdout.decode().splitlines())}
        fences = cgroup_fence.prepare(cgroup_fence.instance_name(str(agent.base_dir.resolve())),
                                      who="the agent")
        assert lines["fence"] == {"check": "fence", "ok": True, "fix": "",
                                  "detail": fences.describe("areas on the VPS")}

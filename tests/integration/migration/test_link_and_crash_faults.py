"""After an SSH cut or a SIGKILL of monitord at any phase boundary, in either direction,
every area ends on exactly one side with no orphans, and no two processes ever served one
area at once (the fixture checks the detector after every test)."""

from __future__ import annotations

import signal

import pytest

from monitord.testing.stack import Stack
from tests.integration.migration.conftest import StackFactory, settle_remote

L2R = "local_to_remote"
R2L = "remote_to_local"
FORWARD_PHASES = (
    "PREFLIGHT",
    "SUPPRESS_SOURCE",
    "COPY",
    "CREATE_DESTINATION",
    "HEALTHCHECK_DESTINATION",
    "COMMIT_LOCATION",
    "CLEANUP_SOURCE",
)
TARGET = {L2R: "remote", R2L: "local"}


async def _prepare(stack_factory: StackFactory, direction: str, env: dict[str, str]) -> Stack:
    """A stack whose one tg area is on the source side, monitord restarted with `env`."""
    stack = await stack_factory(services={"tg": 1})
    if direction == R2L:
        await settle_remote(stack)
    else:
        await stack.wait_settled(expect={"tg": "local"})
    assert await stack.stop_monitord() == 0
    await stack.start_monitord(env=env)
    return stack


class TestSshCutAtEveryPhase:
    """The link dropping at any phase boundary ends converged, never split."""

    @pytest.mark.parametrize("direction", [L2R, R2L])
    @pytest.mark.parametrize("phase", FORWARD_PHASES)
    async def test_ssh_cut_at_phase_converges(
        self, stack_factory: StackFactory, direction: str, phase: str
    ) -> None:
        hold = {"MONITORD_HOLD_AT": f"{direction}:{phase}"}
        stack = await _prepare(stack_factory, direction, hold)
        code, _ = await stack.request(
            "PUT", "/v1/services/tg/placement", {"location": TARGET[direction]}
        )
        assert code in (202, 0)  # 0: PREFLIGHT holds inside the request itself
        await stack.wait_event("hold_point")
        await stack.cut_ssh(for_s=1.0)
        stack.release_hold()
        await stack.wait_settled(expect={"tg": TARGET[direction]}, timeout_s=90)


class TestCrashAtEveryPoint:
    """monitord SIGKILLed at any crash point and started again converges, never split."""

    @pytest.mark.parametrize("direction", [L2R, R2L])
    @pytest.mark.parametrize("point", (*FORWARD_PHASES, "COMMIT_WRITTEN", "DONE"))
    async def test_kill_9_at_point_then_restart_converges(
        self, stack_factory: StackFactory, direction: str, point: str
    ) -> None:
        crash = {"MONITORD_CRASH_AT": f"{direction}:{point}"}
        stack = await _prepare(stack_factory, direction, crash)
        await stack.request("PUT", "/v1/services/tg/placement", {"location": TARGET[direction]})
        assert await stack.wait_monitord_exit(timeout_s=60) == -signal.SIGKILL
        await stack.start_monitord()
        await stack.wait_settled(expect={"tg": TARGET[direction]}, timeout_s=90)

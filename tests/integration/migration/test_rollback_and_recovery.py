"""Rollbacks, recoveries and operator actions end to end (docs/design.md, "Invariants")."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from monitord.testing.stack import Stack
from tests.integration.migration.conftest import (
    StackFactory,
    destination_runs_held_at_healthcheck,
)

L2R = "local_to_remote"


async def _hold(stack: Stack, point: str) -> None:
    """Restart monitord so that it holds at `point` (l2r) until released."""
    assert await stack.stop_monitord() == 0
    await stack.start_monitord(env={"MONITORD_HOLD_AT": f"{L2R}:{point}"})


async def _rollback_cut_off_after_the_destination_ran(stack: Stack, area: str) -> float:
    """Hold a move to the VPS at its health check, cut the VPS off, ask for local again."""
    await destination_runs_held_at_healthcheck(stack, area)
    await stack.partition()
    cut_at = time.time()
    await stack.place("tg", "local")  # the operator gives up: a rollback
    stack.release_hold()
    return cut_at


def _remote_gone_at(stack: Stack, area: str) -> float:
    remote = [life for life in stack.detector.lives(area) if life.key.side == "remote"]
    return max(life.last_seen for life in remote)


class TestRollbackWhileTheVpsIsUnreachable:
    """With the VPS cut off after its copy ran, the source never restarts on older data."""

    async def test_preserve_keeps_the_area_stopped_then_copies_back_after_heal(
        self, stack_factory: StackFactory
    ) -> None:
        stack = await stack_factory(services={"tg": 1}, area_lease_ttl_s=3.0)
        area = stack.areas["tg"][0]
        cut_at = await _rollback_cut_off_after_the_destination_ran(stack, area)

        async def awaiting_data() -> bool:
            service = (await stack.status())["services"]["tg"]
            error = service["last_error"] or {}
            return service["state"] == "awaiting_data" and (
                error.get("code") == "ROLLBACK_DATA_UNREACHABLE"
            )

        await stack.wait_until(awaiting_data, timeout_s=30, what="awaiting_data shown")
        await asyncio.sleep(3.0 * 1.1 + 1.0)  # well past the destination's lease
        assert _remote_gone_at(stack, area) > cut_at, "the VPS copy ran through the cut"
        assert not any(k.side == "local" for k in stack.detector.alive(area)), (
            "the source must not restart while the newest data is out of reach"
        )
        local = [life for life in stack.detector.lives(area) if life.key.side == "local"]
        assert all(life.first_seen < cut_at for life in local)

        await stack.heal()
        await stack.wait_settled(expect={"tg": "local"}, timeout_s=60)
        [restarted] = [
            life for life in stack.detector.lives(area)
            if life.key.side == "local" and life.first_seen > cut_at
        ]
        newest = max(life.records for life in stack.detector.lives(area))
        assert restarted.start_records is not None
        assert restarted.start_records >= max(
            life.records for life in stack.detector.lives(area) if life.key.side == "remote"
        ) > 0
        assert newest >= restarted.start_records
        assert area not in stack.agent_cache()
        assert any(e["event"] == "transaction_phase" and e.get("outcome") == "data_returned"
                   for e in stack.events("transaction_phase"))

    async def test_discard_restarts_the_source_after_the_lease_and_says_so(
        self, stack_factory: StackFactory
    ) -> None:
        stack = await stack_factory(
            services={"tg": 1}, area_lease_ttl_s=3.0, rollback_data="discard"
        )
        area = stack.areas["tg"][0]
        stack.accepted_data_loss.add(area)  # that is what "discard" means
        cut_at = await _rollback_cut_off_after_the_destination_ran(stack, area)
        await stack.wait_until(
            lambda: any(k.side == "local" for k in stack.detector.alive(area)),
            timeout_s=30, what="the source runs again",
        )
        local = [life for life in stack.detector.lives(area) if life.key.side == "local"]
        restarted_at = max(life.first_seen for life in local)
        # The remote daemon kept running through the partition until its lease lapsed on
        # the VPS, and the source came back only after that: one runner at a time still.
        assert restarted_at > _remote_gone_at(stack, area) > cut_at
        [discarded] = stack.events("remote_data_discarded")
        assert (discarded["area"], discarded["kept"], discarded["reason"]) == (
            area, "local", "policy"
        )
        [regression] = [r for r in stack.detector.regressions() if r.area == area]
        assert regression.writer.side == "remote"  # exactly the data given up
        await stack.heal()
        await stack.wait_settled(expect={"tg": "local"}, timeout_s=60)
        assert area not in stack.agent_cache()


async def _three_areas_held_at_copy(stack_factory: StackFactory) -> Stack:
    """Three tg areas moving to the VPS, all held at COPY; the service parks at 2 failures."""
    stack = await stack_factory(services={"tg": 3}, park_after_failures=2)
    await stack.wait_settled(expect={"tg": "local"})
    await _hold(stack, "COPY")
    await stack.place("tg", "remote")
    await stack.wait_until(lambda: len(stack.events("hold_point")) == 3, timeout_s=30,
                           what="three areas held at COPY")
    return stack


def _failed_ends(stack: Stack) -> list[str]:
    return [e["phase"] for e in stack.events("transaction_phase")
            if e.get("phase") in ("ROLLED_BACK", "PARKED")]


class TestOneOutageIsOneFailure:
    """One link outage fails every area in flight and every retry while it lasts; it counts
    once towards parking, so the service moves on by itself once the VPS is back."""

    async def test_three_areas_cut_at_copy_do_not_park_a_service_that_parks_at_two(
        self, stack_factory: StackFactory
    ) -> None:
        stack = await _three_areas_held_at_copy(stack_factory)
        await stack.partition()
        stack.release_hold()

        # Every area rolls back, and retries fail in PREFLIGHT while the VPS stays away
        # (preflight_tunnel_wait_s is 3 s in the stack): more failures than the limit.
        await stack.wait_until(lambda: len(_failed_ends(stack)) >= 5
                               or "PARKED" in _failed_ends(stack),
                               timeout_s=60, what="the areas failed again and again while cut off")
        assert "PARKED" not in _failed_ends(stack)
        await stack.heal()
        await stack.wait_settled(expect={"tg": "remote"}, timeout_s=90)
        parked = [e for e in stack.events("transaction_phase") if e.get("phase") == "PARKED"]
        assert parked == []
        state = json.loads((stack.root / "spool" / "remote_state.json").read_text())
        assert state["tg"]["fail_count"] == 0 and not state["tg"]["parked"]

    async def test_rollbacks_ending_after_the_link_is_back_count_once_too(
        self, stack_factory: StackFactory
    ) -> None:
        """A short cut: the rollbacks wait out the area lease and end over the new
        connection; the failure is judged by when the failing step began."""
        stack = await _three_areas_held_at_copy(stack_factory)
        cut = asyncio.ensure_future(stack.cut_ssh(for_s=1.0))
        await asyncio.sleep(0.2)
        stack.release_hold()
        await cut
        await stack.wait_settled(expect={"tg": "remote"}, timeout_s=90)
        ends = _failed_ends(stack)
        assert "ROLLED_BACK" in ends, "the cut failed no step: nothing was tested"
        assert "PARKED" not in ends


class TestStaleVpsConfig:
    """A VPS that comes back with orphan entries in its cache starts none and loses them."""

    async def test_orphan_entries_of_a_stale_cache_are_removed_and_never_started(
        self, stack_factory: StackFactory
    ) -> None:
        stack = await stack_factory(services={"tg": 2})
        await stack.wait_settled(expect={"tg": "local"})
        assert stack.kill_agent()
        local_area = stack.areas["tg"][0]
        ghost = "0f0e0d0c-0000-4000-8000-00000000dead"
        cache_path = stack.vps_dir / "spool" / "custom_config.json"
        stale = []
        for uuid, generation in ((local_area, 0), (ghost, 5)):
            data_dir = stack.vps_dir / "data" / "tg" / uuid
            data_dir.mkdir(parents=True, exist_ok=True)
            stale.append({
                "uuid": uuid, "service": "tg", "location": "remote", "generation": generation,
                "owner_id": "someone-before-us",
                "command": ["/bin/sleep", "3600"], "data_dir": str(data_dir), "env": {},
                "run_wanted": True, "created_at": time.time() - 3600,
            })
        cache_path.write_text(json.dumps({"custom_daemons": stale}))
        # The reconciler notices the agent is gone, launches it; it loads the stale cache.
        await stack.wait_until(
            lambda: not ({local_area, ghost} & set(stack.agent_cache())), timeout_s=60,
            what="stale entries removed",
        )
        await stack.wait_settled(expect={"tg": "local"}, timeout_s=30)
        assert not [k for k in stack.detector.alive() if k.side == "remote"]
        assert not any(
            e.get("event") == "daemon_started" for e in _agent_events(stack, {local_area, ghost})
        )


def _agent_events(stack: Stack, areas: set[str]) -> list[dict[str, object]]:
    events = []
    for line in (stack.vps_dir / "logs").glob("*.log"):
        for text in line.read_text(errors="replace").splitlines():
            try:
                event = json.loads(text)
            except ValueError:
                continue
            if event.get("area") in areas:
                events.append(event)
    return events


class TestOperatorChangesMidway:
    """A reversal before the commit rolls back; a parked service moves again after retry."""

    async def test_reversal_before_commit_rolls_back_cleanly(
        self, stack_factory: StackFactory
    ) -> None:
        stack = await stack_factory(services={"tg": 2})
        await stack.wait_settled(expect={"tg": "local"})
        await _hold(stack, "COPY")
        await stack.place("tg", "remote")
        await stack.wait_event("hold_point")
        await stack.place("tg", "local")
        stack.release_hold()
        await stack.wait_settled(expect={"tg": "local"}, timeout_s=60)
        code, body = await stack.request("GET", "/v1/transactions")
        assert code == 200
        phases = {t["phase"] for t in body["transactions"]}
        assert phases == {"ROLLED_BACK"}
        assert all(t["last_error_code"] is None for t in body["transactions"])
        state = json.loads((stack.root / "spool" / "remote_state.json").read_text())
        assert state["tg"]["fail_count"] == 0 and not state["tg"]["parked"]

    async def test_parked_service_waits_for_retry_then_moves(
        self, stack_factory: StackFactory
    ) -> None:
        # An outage counts once towards parking (TestOneOutageIsOneFailure): at a limit of 1
        # the first preflight that cannot reach the VPS parks.
        stack = await stack_factory(services={"tg": 1}, park_after_failures=1)
        await stack.wait_settled(expect={"tg": "local"})
        await stack.partition()
        await stack.place("tg", "remote")

        async def parked() -> bool:
            return (await stack.status())["services"]["tg"]["state"] == "parked"

        await stack.wait_until(parked, timeout_s=60, what="tg parked")
        status = await stack.status()
        assert status["services"]["tg"]["last_error"]["code"].startswith("PREFLIGHT_") or (
            status["services"]["tg"]["last_error"]["code"] in ("SSH_UNREACHABLE",)
        )
        state = json.loads((stack.root / "spool" / "remote_state.json").read_text())
        assert state["tg"]["parked"] and state["tg"]["fail_count"] >= 1
        area = stack.areas["tg"][0]
        assert [k.side for k in stack.detector.alive(area)] == ["local"]  # never taken down
        await stack.heal()
        _, before = await stack.request("GET", "/v1/transactions")
        # Observe for longer than the retry back-off (stack: 0.5 s doubling to 5 s): a parked
        # service must not try again by itself, even with the VPS back.
        await asyncio.sleep(6)
        _, after = await stack.request("GET", "/v1/transactions")
        assert after == before
        assert (await stack.status())["services"]["tg"]["state"] == "parked"
        code, _ = await stack.request("POST", "/v1/services/tg/retry")
        assert code == 202
        await stack.wait_settled(expect={"tg": "remote"}, timeout_s=60)


class TestUnhealthyDestination:
    """A destination that starts but never stays up is rolled back; the source runs on."""

    async def test_never_healthy_destination_rolls_back(self, stack_factory: StackFactory) -> None:
        stack = await stack_factory(
            services={"tg": 1},
            remote_daemon_args=("--crash-after", "0.2"),
            min_uptime_s=1.0,
            healthcheck_timeout_s=2.0,
            park_after_failures=1,
        )
        await stack.wait_settled(expect={"tg": "local"})
        await stack.place("tg", "remote")

        async def parked() -> bool:
            return (await stack.status())["services"]["tg"]["state"] == "parked"

        await stack.wait_until(parked, timeout_s=60, what="tg parked after the failed health")
        status = await stack.status()
        assert status["services"]["tg"]["last_error"]["code"] == "HEALTHCHECK_TIMEOUT"
        area = stack.areas["tg"][0]
        await stack.wait_until(
            lambda: [k.side for k in stack.detector.alive(area)] == ["local"], timeout_s=20,
            what="the source runs alone",
        )
        assert stack.committed()[area].get("location", "local") == "local"


class TestAgentUnreachable:
    """The agent dying just before or just after COPY ends converged on the VPS."""

    @pytest.mark.parametrize("point", ["COPY", "CREATE_DESTINATION"])
    async def test_agent_killed_at_point_converges(
        self, stack_factory: StackFactory, point: str
    ) -> None:
        stack = await stack_factory(services={"tg": 1})
        await stack.wait_settled(expect={"tg": "local"})
        await _hold(stack, point)
        await stack.place("tg", "remote")
        await stack.wait_event("hold_point")
        assert stack.kill_agent()
        stack.release_hold()
        await stack.wait_settled(expect={"tg": "remote"}, timeout_s=90)


"""The lease bound a rollback waits for never trusts a grant that may still arrive (the lease
ledger, monitord/engine/lease_ledger.py), and a renewal names only the grants that need it
(the renewer, monitord/engine/lease_renewer.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from structlog.testing import capture_logs

from monitord.engine.lease_ledger import LeaseLedger
from monitord.engine.lease_renewer import LeaseRenewer
from monitord.engine.placement_state import PlacementState
from monitord.remote.agent_client import AgentUnreachable, RenewResult
from monitord.store.state_db import Store
from orchestrator import area_leases
from orchestrator.area_leases import LeasePolicy

POLICY = LeasePolicy(ttl_s=10.0, clock_margin=0.1, safety_margin_s=2.0)


class World:
    def __init__(self) -> None:
        self.now = 100.0
        self.epoch = 1
        self.connected = True
        self.recycled = 0

    async def recycle(self) -> None:
        self.recycled += 1
        self.epoch += 1


@pytest.fixture
async def renewer(tmp_path: Path):  # type: ignore[no-untyped-def]
    world = World()
    async with await Store.open(tmp_path) as store:
        state = PlacementState(store=store, custom_config_path=tmp_path / "custom_config.json")
        ledger = LeaseLedger(
            owner_id="me", policy=POLICY, tunnel_connected=lambda: world.connected,
            connection_epoch=lambda: world.epoch, clock=lambda: world.now,
        )
        yield world, LeaseRenewer(
            state=state, agent=lambda: None, ledger=ledger, recycle=world.recycle
        )


def _deadline(renewer: LeaseRenewer) -> float:
    return area_leases.expired_at(renewer.ledger.lease_for("a", 3), policy=POLICY)


class TestUncertainGrants:
    """A grant with a lost answer keeps the deadline open until its connection is gone."""

    async def test_a_refused_grant_changes_nothing(self, renewer) -> None:  # type: ignore[no-untyped-def]
        world, r = renewer
        r.acknowledge("a", 3)
        before = _deadline(r)
        world.now += 5
        r.grant_failed("a", 3, epoch=world.epoch,
                       error=AgentUnreachable("refused", maybe_delivered=False))
        assert _deadline(r) == before

    async def test_a_lost_answer_moves_the_deadline_until_the_connection_changes(
        self, renewer  # type: ignore[no-untyped-def]
    ) -> None:
        world, r = renewer
        r.acknowledge("a", 3)
        r.grant_failed("a", 3, epoch=world.epoch,
                       error=AgentUnreachable("reset", maybe_delivered=True))
        world.now += 50
        assert _deadline(r) == world.now + 10 * 1.1 + 2  # may have arrived just now
        world.epoch += 1  # the keeper reconnected: the old connection is gone
        world.now += 1
        fixed = _deadline(r)
        world.now += 30
        assert _deadline(r) == fixed == 151 + 13

    async def test_a_grant_failing_with_the_tunnel_down_counts_from_now(self, renewer) -> None:  # type: ignore[no-untyped-def]
        world, r = renewer
        world.connected = False
        r.grant_failed("a", 3, epoch=world.epoch,
                       error=AgentUnreachable("reset", maybe_delivered=True))
        assert _deadline(r) == 100 + 13

    async def test_an_uncertainty_older_than_a_ttl_recycles_the_connection(self, renewer) -> None:  # type: ignore[no-untyped-def]
        world, r = renewer
        r.grant_failed("a", 3, epoch=world.epoch,
                       error=AgentUnreachable("timeout", maybe_delivered=True))
        world.now += 5
        await r._end_long_uncertainty()
        assert world.recycled == 0
        world.now += 6
        await r._end_long_uncertainty()
        assert world.recycled == 1
        assert _deadline(r) == world.now + 13  # resolved by the epoch change, from now on


class _Agent:
    """Answers every renewal `renewed` and remembers what each one named."""

    def __init__(self) -> None:
        self.named: list[dict[str, int]] = []

    async def renew(self, *, owner_id: str, ttl_s: float,
                    areas: dict[str, int]) -> dict[str, RenewResult]:
        self.named.append(dict(areas))
        return {a: RenewResult(area=a, renewed=True, result="renewed", generation=g)
                for a, g in areas.items()}


class TestWhatARenewalNames:
    """A placement change renews at once, but only the areas that need it: one never
    acknowledged, an uncertain one, one acknowledged TTL/6 ago or more."""

    @pytest.fixture
    async def setup(self, tmp_path: Path):  # type: ignore[no-untyped-def]
        world, agent = World(), _Agent()
        async with await Store.open(tmp_path) as store:
            state = PlacementState(store=store, custom_config_path=tmp_path / "c.json")
            runs = {"a": 3, "b": 4}
            state.runs = lambda side: runs  # type: ignore[method-assign]
            ledger = LeaseLedger(
                owner_id="me", policy=POLICY, tunnel_connected=lambda: world.connected,
                connection_epoch=lambda: world.epoch, clock=lambda: world.now,
            )
            renewer = LeaseRenewer(
                state=state, agent=lambda: agent, ledger=ledger,  # type: ignore[arg-type, return-value]
            )
            yield world, agent, renewer, runs

    async def test_a_renewal_right_after_another_names_only_the_new_area(self, setup) -> None:  # type: ignore[no-untyped-def]
        world, agent, renewer, runs = setup
        await renewer.renew_once()
        world.now += 0.5
        runs["c"] = 1  # placed remote meanwhile
        next_due_s = await renewer.renew_once()
        assert agent.named == [{"a": 3, "b": 4}, {"c": 1}]
        assert next_due_s == pytest.approx(POLICY.ttl_s / 3 - 0.5)  # when a and b are due

    async def test_an_area_acknowledged_a_sixth_of_the_ttl_ago_is_named_again(self, setup) -> None:  # type: ignore[no-untyped-def]
        world, agent, renewer, _ = setup
        await renewer.renew_once()
        world.now += POLICY.ttl_s / 6
        await renewer.renew_once()
        assert agent.named[1] == {"a": 3, "b": 4}

    async def test_an_uncertain_grant_is_always_named(self, setup) -> None:  # type: ignore[no-untyped-def]
        world, agent, renewer, _ = setup
        await renewer.renew_once()
        renewer.grant_failed("a", 3, epoch=world.epoch,
                             error=AgentUnreachable("reset", maybe_delivered=True))
        world.now += 0.1
        await renewer.renew_once()
        assert agent.named[1] == {"a": 3}

    async def test_after_a_reconnect_every_grant_is_named(self, setup) -> None:  # type: ignore[no-untyped-def]
        # The VPS may have restarted: its agent starts nothing until it is granted again.
        world, agent, renewer, _ = setup
        await renewer.renew_once()
        world.epoch += 1
        world.now += 0.1
        await renewer.renew_once()
        assert agent.named[1] == {"a": 3, "b": 4}


class _OddAgent:
    """Answers a renewal with what a compromised or confused agent might: an area that
    was not asked (first, so it is met before the real ones), one of those asked left out,
    one answered `renewed` for another generation."""

    async def renew(self, *, owner_id: str, ttl_s: float,
                    areas: dict[str, int]) -> dict[str, RenewResult]:
        return {
            "never-asked": RenewResult(area="never-asked", renewed=True, result="renewed",
                                       generation=1),
            "a": RenewResult(area="a", renewed=True, result="renewed", generation=areas["a"]),
            "c": RenewResult(area="c", renewed=True, result="renewed", generation=99),
        }


class TestAnAnswerThatDoesNotMatchTheRequest:
    """Unknown areas are ignored and logged; an area asked but not answered, or answered for
    another generation, is uncertain (it may have been renewed), never acknowledged."""

    async def test_the_asked_areas_are_booked_and_the_rest_is_ignored(
        self, tmp_path: Path
    ) -> None:
        world = World()
        async with await Store.open(tmp_path) as store:
            state = PlacementState(store=store, custom_config_path=tmp_path / "c.json")
            state.runs = lambda side: {"a": 3, "b": 4, "c": 5}  # type: ignore[method-assign]
            ledger = LeaseLedger(
                owner_id="me", policy=POLICY, tunnel_connected=lambda: world.connected,
                connection_epoch=lambda: world.epoch, clock=lambda: world.now,
            )
            agent = _OddAgent()
            renewer = LeaseRenewer(state=state, agent=lambda: agent,  # type: ignore[arg-type, return-value]
                                   ledger=ledger)
            with capture_logs() as logs:
                await renewer.renew_once()
            assert renewer.last_error is None
            assert ledger.lease_for("a", 3).acknowledged_at == world.now
            assert ledger.oldest_uncertain() == (2, world.now)  # b and c
            assert "never-asked" not in renewer.rejected
            events = {e["event"] for e in logs}
            assert "lease_renewal_unexpected_answer" in events, logs

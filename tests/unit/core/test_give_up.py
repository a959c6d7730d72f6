"""Giving a VPS up: refused until every remote copy is provably fenced, and then the one
explicit way home on the PBX's own (older) copy."""

from __future__ import annotations

import pytest

from orchestrator import give_up
from orchestrator.area_leases import LeasePolicy
from orchestrator.lineage import Lineage
from orchestrator.models import Area, AreaLease, Phase, Side
from orchestrator.phases import Outcome

from .records import transaction

POLICY = LeasePolicy(ttl_s=2.0, clock_margin=0.1, safety_margin_s=0.5)  # bound: ack + 2.7 s
ON_VPS = Area(uuid="a1", service="tg", location=Side.REMOTE, generation=7)
AT_HOME = Area(uuid="a1", service="tg", location=Side.LOCAL, generation=7)
REMOTE_NEWEST = Lineage(area="a1", holders=frozenset({Side.REMOTE}), epoch=4)
LOCAL_NEWEST = Lineage(area="a1", holders=frozenset({Side.LOCAL}), epoch=4)


def _lease(generation: int, acked: float) -> AreaLease:
    return AreaLease(area="a1", generation=generation, owner_id="me", acknowledged_at=acked,
                     ttl=2.0)


def _decide(area: Area, txn: object, lineage: Lineage, now: float, acked: float = 10.0
            ) -> give_up.Decision:
    generations = give_up.remote_generations(area, txn)  # type: ignore[arg-type]
    return give_up.decide(area=area, txn=txn, lineage=lineage,  # type: ignore[arg-type]
                          leases={g: _lease(g, acked) for g in generations}, now=now,
                          policy=POLICY)


class TestRefusedUntilFenced:
    """Nothing is given up while a copy on the VPS could still run under its lease."""

    def test_an_area_committed_to_the_vps_waits_for_its_lease_bound(self) -> None:
        assert _decide(ON_VPS, None, REMOTE_NEWEST, now=12.6) == give_up.NotFenced(
            until=pytest.approx(12.7))
        assert _decide(ON_VPS, None, REMOTE_NEWEST, now=12.7) == give_up.Abandon(outcome=None)

    def test_every_generation_that_could_run_there_counts(self) -> None:
        # a move out that created its destination (generation 8) and rolled back unfenced
        txn = transaction(source=Side.LOCAL, phase=Phase.ROLLBACK, generation=8,
                          rollback_from=Phase.HEALTHCHECK_DESTINATION, cleanup_required=True)
        assert give_up.remote_generations(AT_HOME, txn) == {8}
        leases = {8: _lease(8, acked=20.0)}
        assert give_up.decide(area=AT_HOME, txn=txn, lineage=REMOTE_NEWEST, leases=leases,
                              now=22.0, policy=POLICY) == give_up.NotFenced(until=22.7)

    def test_a_destination_never_created_has_nothing_to_wait_for(self) -> None:
        txn = transaction(source=Side.LOCAL, phase=Phase.ROLLBACK, rollback_from=Phase.COPY,
                          destination_fenced=True)
        assert give_up.remote_generations(AT_HOME, txn) == frozenset()
        assert _decide(AT_HOME, txn, LOCAL_NEWEST, now=0.0) == give_up.NothingThere()

    def test_a_commit_in_flight_is_busy(self) -> None:
        txn = transaction(source=Side.REMOTE, phase=Phase.COMMIT_LOCATION)
        assert isinstance(_decide(ON_VPS, txn, REMOTE_NEWEST, now=99.0), give_up.Busy)


class TestTheWayHome:
    """Once fenced, each state an area can be in has exactly one way home."""

    def test_a_move_home_stuck_on_the_vps_starts_over_without_its_source(self) -> None:
        for phase in (Phase.PREFLIGHT, Phase.SUPPRESS_SOURCE, Phase.ROLLBACK, Phase.PARKED):
            txn = transaction(source=Side.REMOTE, phase=phase, rollback_from=Phase.COPY)
            assert _decide(ON_VPS, txn, REMOTE_NEWEST, now=99.0) == give_up.Abandon(
                outcome=Outcome.SOURCE_ABANDONED)

    def test_an_area_given_up_already_is_not_given_up_again(self) -> None:
        txn = transaction(source=Side.REMOTE, phase=Phase.SUPPRESS_SOURCE, source_abandoned=True)
        assert _decide(ON_VPS, txn, LOCAL_NEWEST, now=99.0) == give_up.NothingThere()
        # recorded, its move home not opened yet
        assert _decide(ON_VPS, None, LOCAL_NEWEST, now=99.0) == give_up.NothingThere()

    def test_a_parked_rollback_waiting_for_the_vpss_data_resumes(self) -> None:
        txn = transaction(source=Side.LOCAL, phase=Phase.PARKED, destination_fenced=True,
                          rollback_from=Phase.HEALTHCHECK_DESTINATION)
        assert _decide(AT_HOME, txn, REMOTE_NEWEST, now=99.0) == give_up.Abandon(
            outcome=Outcome.ROLLBACK_RESUMED)

    def test_an_area_at_home_with_nothing_there_is_left_alone(self) -> None:
        assert _decide(AT_HOME, None, LOCAL_NEWEST, now=99.0) == give_up.NothingThere()


class TestMovesOpenedAfterAGiveUp:
    """An area whose VPS was given up goes home first, whatever is desired."""

    def test_committed_remote_with_the_pbx_alone_holding_its_data_goes_home(self) -> None:
        assert give_up.abandons_source(ON_VPS, LOCAL_NEWEST)
        assert give_up.move_to_open(ON_VPS, LOCAL_NEWEST, desired=Side.REMOTE) is Side.LOCAL

    def test_otherwise_the_desired_side_decides(self) -> None:
        assert not give_up.abandons_source(ON_VPS, REMOTE_NEWEST)
        assert give_up.move_to_open(ON_VPS, REMOTE_NEWEST, desired=Side.REMOTE) is None
        assert give_up.move_to_open(ON_VPS, REMOTE_NEWEST, desired=Side.LOCAL) is Side.LOCAL
        assert give_up.move_to_open(AT_HOME, LOCAL_NEWEST, desired=Side.REMOTE) is Side.REMOTE


class TestTheRefusalSaysWhen:
    def test_the_error_names_the_seconds_and_the_time(self) -> None:
        error = give_up.VpsNotFenced(where="service tg", wait_s=12.2, wall=0.0)
        assert error.code == "VPS_NOT_FENCED" and error.retry_after_s == 13
        assert "in 13 s (at 00:00:13 UTC)" in error.detail

"""The phase table: every allowed move works, every other move is refused and changes nothing."""

from __future__ import annotations

import itertools

import pytest

from orchestrator import phases
from orchestrator.area_leases import LeasePolicy
from orchestrator.lineage import Lineage
from orchestrator.models import AreaLease, Phase, Route, Side, Transaction
from orchestrator.phases import Outcome, StepContext

from .records import transaction

P, Out = Phase, Outcome
L2R, R2L, GIVEN_UP = Route.LOCAL_TO_REMOTE, Route.REMOTE_TO_LOCAL, Route.GIVEN_UP_TO_LOCAL
BOTH = (L2R, R2L)

# The protocol written out independently of the implementation's table construction.
_FORWARD = [
    (P.SUPPRESS_SOURCE, P.COPY),
    (P.COPY, P.CREATE_DESTINATION),
    (P.CREATE_DESTINATION, P.HEALTHCHECK_DESTINATION),
    (P.HEALTHCHECK_DESTINATION, P.COMMIT_LOCATION),
    (P.COMMIT_LOCATION, P.CLEANUP_SOURCE),
]
EXPECTED: set[tuple[Route, Phase, Outcome, Phase]] = set()
for d in BOTH:
    EXPECTED |= {
        (d, P.PREFLIGHT, Out.OK, P.SUPPRESS_SOURCE),
        (d, P.PREFLIGHT, Out.FAILED, P.ROLLED_BACK),
        (d, P.PREFLIGHT, Out.UNREACHABLE, P.ROLLED_BACK),
        (d, P.PREFLIGHT, Out.REVERSE_REQUESTED, P.ROLLED_BACK),
        (d, P.PREFLIGHT, Out.RECOVERED_UNCOMMITTED, P.ROLLED_BACK),
        (d, P.PREFLIGHT, Out.PARK, P.PARKED),
        (d, P.COMMIT_LOCATION, Out.RECOVERED_COMMITTED, P.CLEANUP_SOURCE),
        (d, P.CLEANUP_SOURCE, Out.OK, P.DONE),
        (d, P.CLEANUP_SOURCE, Out.FAILED, P.DONE),
        (d, P.CLEANUP_SOURCE, Out.RECOVERED_COMMITTED, P.CLEANUP_SOURCE),
        (d, P.ROLLBACK, Out.FENCED, P.ROLLBACK),
        (d, P.ROLLBACK, Out.DATA_RETURNED, P.ROLLBACK),
        (d, P.ROLLBACK, Out.DATA_DISCARDED, P.ROLLBACK),
        (d, P.PARKED, Out.ROLLBACK_RESUMED, P.ROLLBACK),
        (d, P.ROLLBACK, Out.FAILED, P.ROLLBACK),
        (d, P.ROLLBACK, Out.RECOVERED_UNCOMMITTED, P.ROLLBACK),
        (d, P.ROLLBACK, Out.OK, P.ROLLED_BACK),
        (d, P.ROLLBACK, Out.PARK, P.PARKED),
        (d, P.PARKED, Out.RETRY_REQUESTED, P.PREFLIGHT),
    }
    for phase, nxt in _FORWARD:
        EXPECTED.add((d, phase, Out.OK, nxt))
        for failure in (Out.FAILED, Out.REVERSE_REQUESTED, Out.RECOVERED_UNCOMMITTED):
            EXPECTED.add((d, phase, failure, P.ROLLBACK))
# Only phases that talk to the VPS can meet an unreachable VPS.
EXPECTED |= {
    (L2R, P.SUPPRESS_SOURCE, Out.UNREACHABLE, P.ROLLBACK),
    (L2R, P.COPY, Out.UNREACHABLE, P.ROLLBACK),
    (L2R, P.CREATE_DESTINATION, Out.UNREACHABLE, P.ROLLBACK),
    (L2R, P.HEALTHCHECK_DESTINATION, Out.UNREACHABLE, P.ROLLBACK),
    (L2R, P.ROLLBACK, Out.UNREACHABLE, P.ROLLBACK),
    (R2L, P.ROLLBACK, Out.UNREACHABLE, P.ROLLBACK),
    (L2R, P.ROLLBACK, Out.LEASE_EXPIRED, P.ROLLBACK),
    (R2L, P.SUPPRESS_SOURCE, Out.UNREACHABLE, P.ROLLBACK),
    (R2L, P.COPY, Out.UNREACHABLE, P.ROLLBACK),
    (R2L, P.CLEANUP_SOURCE, Out.UNREACHABLE, P.DONE),
}
# A VPS given up: a move home starts over without its source, from any phase before the
# commit, and its source is waited out by the lease instead of stopped.
EXPECTED |= {
    (R2L, phase, Out.SOURCE_ABANDONED, P.PREFLIGHT)
    for phase in (P.PREFLIGHT, P.SUPPRESS_SOURCE, P.COPY, P.CREATE_DESTINATION,
                  P.HEALTHCHECK_DESTINATION, P.ROLLBACK, P.PARKED)
}
# Its own route from then on: nothing to roll back to (a failed step is tried again), no
# reversal, and its source waited out by its lease instead of stopped.
EXPECTED |= {
    (GIVEN_UP, P.PREFLIGHT, Out.OK, P.SUPPRESS_SOURCE),
    (GIVEN_UP, P.PREFLIGHT, Out.FAILED, P.ROLLED_BACK),
    (GIVEN_UP, P.PREFLIGHT, Out.UNREACHABLE, P.ROLLED_BACK),
    (GIVEN_UP, P.PREFLIGHT, Out.RECOVERED_UNCOMMITTED, P.ROLLED_BACK),
    (GIVEN_UP, P.PREFLIGHT, Out.PARK, P.PARKED),
    (GIVEN_UP, P.SUPPRESS_SOURCE, Out.LEASE_EXPIRED, P.COPY),
    (GIVEN_UP, P.SUPPRESS_SOURCE, Out.UNREACHABLE, P.SUPPRESS_SOURCE),
    (GIVEN_UP, P.COPY, Out.UNREACHABLE, P.COPY),
    (GIVEN_UP, P.COMMIT_LOCATION, Out.RECOVERED_COMMITTED, P.CLEANUP_SOURCE),
    (GIVEN_UP, P.CLEANUP_SOURCE, Out.OK, P.DONE),
    (GIVEN_UP, P.CLEANUP_SOURCE, Out.FAILED, P.DONE),
    (GIVEN_UP, P.CLEANUP_SOURCE, Out.UNREACHABLE, P.DONE),
    (GIVEN_UP, P.CLEANUP_SOURCE, Out.RECOVERED_COMMITTED, P.CLEANUP_SOURCE),
    (GIVEN_UP, P.PARKED, Out.RETRY_REQUESTED, P.PREFLIGHT),
}
for phase, nxt in _FORWARD:
    EXPECTED.add((GIVEN_UP, phase, Out.OK, nxt))
    for failure in (Out.FAILED, Out.RECOVERED_UNCOMMITTED):
        EXPECTED.add((GIVEN_UP, phase, failure, phase))
ROUTES = (L2R, R2L, GIVEN_UP)
ALL_MOVES = list(itertools.product(ROUTES, Phase, Outcome))
POLICY = LeasePolicy(ttl_s=2.0, clock_margin=0.1, safety_margin_s=0.5)


def step(
    txn: Transaction, outcome: Outcome, ctx: StepContext
) -> tuple[Transaction, tuple[phases.Action, ...]]:
    """The table's move and the actions of the record it gives: the two halves of a step
    (orchestrator/migration_step.py decides the rest)."""
    new = phases.advance(txn, outcome, ctx)
    return new, phases.next_actions(new, ctx)


def _source(route: Route) -> Side:
    return Side.LOCAL if route is L2R else Side.REMOTE


def _record_satisfying_guards(route: Route, phase: Phase, outcome: Outcome) -> Transaction:
    changes: dict[str, object] = {}
    if phase is P.ROLLBACK:
        changes["rollback_from"] = P.HEALTHCHECK_DESTINATION
        changes["destination_fenced"] = outcome in (Out.OK, Out.PARK)
    if phase is P.PARKED and outcome is Out.ROLLBACK_RESUMED:
        changes.update(rollback_from=P.HEALTHCHECK_DESTINATION, destination_fenced=True)
    if route is GIVEN_UP:
        changes["source_abandoned"] = True
    return transaction(source=_source(route), phase=phase, **changes)


def _context_satisfying_guards(outcome: Outcome, phase: Phase = P.ROLLBACK) -> StepContext:
    # A source's lease is of the source generation (7), a destination's of the new one (8).
    waited = 7 if phase is P.SUPPRESS_SOURCE else 8
    lease = AreaLease(area="a1", generation=waited, owner_id="me", acknowledged_at=100.0,
                      ttl=2.0)
    given_up = Lineage(area="a1", holders=frozenset({Side.LOCAL}), epoch=3)
    return StepContext(at=2_000.0, now=10_000.0, policy=POLICY, lease=lease, new_generation=9,
                       lineage=given_up if outcome is Out.SOURCE_ABANDONED else None)


def _id(move: tuple[Route, Phase, Outcome]) -> str:
    return "-".join(str(part) for part in move)


class TestTheTable:
    """The table is exactly the protocol written above, for every route."""

    def test_table_equals_the_written_protocol(self) -> None:
        actual = {
            (d, phase, outcome, target)
            for d, rows in phases.TRANSITIONS.items()
            for phase, moves in rows.items()
            for outcome, target in moves.items()
        }
        assert actual == EXPECTED

    def test_every_phase_has_a_row_on_every_route(self) -> None:
        for d in ROUTES:
            assert set(phases.TRANSITIONS[d]) == set(Phase)

    def test_final_phases_have_no_way_out(self) -> None:
        for d in ROUTES:
            assert not phases.TRANSITIONS[d][P.DONE]
            assert not phases.TRANSITIONS[d][P.ROLLED_BACK]

    def test_no_way_back_after_the_commit(self) -> None:
        for d in ROUTES:
            for phase in (P.CLEANUP_SOURCE, P.DONE):
                targets = set(phases.TRANSITIONS[d][phase].values())
                assert not targets & {P.ROLLBACK, P.ROLLED_BACK, P.PARKED}


class TestAllowedMoves:
    """Every move in the table is performed and lands on the table's phase."""

    @pytest.mark.parametrize(
        "move", [(d, p, o) for d, p, o, _ in sorted(EXPECTED)], ids=_id
    )
    def test_allowed_move_lands_on_its_target(
        self, move: tuple[Route, Phase, Outcome]
    ) -> None:
        route, phase, outcome = move
        record = _record_satisfying_guards(route, phase, outcome)
        new, actions = step(record, outcome,
                                   _context_satisfying_guards(outcome, phase))
        assert new.phase is phases.TRANSITIONS[route][phase][outcome]
        assert new.updated_at == 2_000.0
        assert actions, "every reachable record tells the runtime what to do next"


class TestForbiddenMoves:
    """A move the table lacks raises IllegalTransition and leaves the record untouched."""

    @pytest.mark.parametrize(
        "move",
        [m for m in ALL_MOVES if m not in {(d, p, o) for d, p, o, _ in EXPECTED}],
        ids=_id,
    )
    def test_forbidden_move_is_refused(self, move: tuple[Route, Phase, Outcome]) -> None:
        route, phase, outcome = move
        record = _record_satisfying_guards(route, phase, outcome)
        before = record.model_dump()
        with pytest.raises(phases.IllegalTransition) as raised:
            step(record, outcome, _context_satisfying_guards(outcome, phase))
        assert raised.value.code == "TRANSACTION_CONFLICT"
        assert record.model_dump() == before

    def test_records_cannot_be_mutated_in_place(self) -> None:
        record = transaction()
        with pytest.raises(ValueError):
            record.phase = P.DONE  # type: ignore[misc]


class TestRollbackGuards:
    """A rollback restarts the source only after the destination is fenced or its lease lapsed."""

    def test_source_restart_before_fencing_is_refused(self) -> None:
        record = transaction(phase=P.ROLLBACK, rollback_from=P.CREATE_DESTINATION)
        with pytest.raises(phases.IllegalTransition, match="fenced"):
            step(record, Out.OK, StepContext(at=1.0))

    def test_unreachable_destination_waits_for_the_lease_and_records_cleanup(self) -> None:
        record = transaction(phase=P.HEALTHCHECK_DESTINATION)
        lease = AreaLease(area="a1", generation=8, owner_id="me", acknowledged_at=50.0, ttl=2.0)
        ctx = StepContext(at=5.0, now=51.0, policy=POLICY, lease=lease)
        rolling, actions = step(record, Out.FAILED, ctx)
        assert actions == (
            phases.FenceDestination(
                transaction_id="t-1", service="tg", area="a1", side=Side.REMOTE, generation=8,
                keep_data=True,  # it ran: its data may be the newest
            ),
        )
        waiting, actions = step(rolling, Out.UNREACHABLE, ctx)
        assert waiting.cleanup_required and not waiting.destination_fenced
        enqueue, wait = actions
        assert isinstance(enqueue, phases.EnqueueCleanup)
        assert (enqueue.item.side, enqueue.item.generation) == (Side.REMOTE, 8)
        assert isinstance(wait, phases.WaitLeaseExpiry)
        assert wait.until == pytest.approx(50.0 + 2.0 * 1.1 + 0.5)
        assert not any(isinstance(a, phases.RestartSource) for a in actions)

    def test_lease_expiry_before_the_deadline_is_refused(self) -> None:
        record = transaction(
            phase=P.ROLLBACK, rollback_from=P.CREATE_DESTINATION, cleanup_required=True
        )
        lease = AreaLease(area="a1", generation=8, owner_id="me", acknowledged_at=50.0, ttl=2.0)
        just_before = StepContext(at=5.0, now=50.0 + 2.2 + 0.5 - 0.001, policy=POLICY, lease=lease)
        with pytest.raises(phases.IllegalTransition, match="lapsed"):
            step(record, Out.LEASE_EXPIRED, just_before)
        at_deadline = StepContext(at=5.0, now=50.0 + 2.2 + 0.5, policy=POLICY, lease=lease)
        fenced, actions = step(record, Out.LEASE_EXPIRED, at_deadline)
        assert fenced.destination_fenced
        assert isinstance(actions[-1], phases.RestartSource)
        assert actions[-1].generation == 7

    def test_an_unknown_grant_is_assumed_now_once_and_the_deadline_then_holds(self) -> None:
        record = transaction(
            phase=P.ROLLBACK, rollback_from=P.CREATE_DESTINATION, cleanup_required=True
        )
        stale = AreaLease(area="a1", generation=7, owner_id="me", acknowledged_at=0.0, ttl=2.0)
        for known in (None, stale):
            (_, wait) = phases.next_actions(
                record, StepContext(at=1.0, now=40.0, policy=POLICY, lease=known)
            )
            assert isinstance(wait, phases.WaitLeaseExpiry)
            assert (wait.lease.generation, wait.lease.acknowledged_at) == (8, 40.0)
            assert wait.until == pytest.approx(40.0 + 2.2 + 0.5)
        later = StepContext(at=1.0, now=41.0, policy=POLICY, lease=wait.lease)
        (_, again) = phases.next_actions(record, later)
        assert isinstance(again, phases.WaitLeaseExpiry)
        assert again.until == wait.until, "passing the lease back keeps the deadline fixed"

    def test_lease_of_another_generation_proves_nothing(self) -> None:
        record = transaction(
            phase=P.ROLLBACK, rollback_from=P.CREATE_DESTINATION, cleanup_required=True
        )
        old = AreaLease(area="a1", generation=7, owner_id="me", acknowledged_at=0.0, ttl=2.0)
        with pytest.raises(phases.IllegalTransition, match="generation"):
            step(record, Out.LEASE_EXPIRED, StepContext(at=1, now=99, lease=old))

    def test_destination_that_was_never_created_needs_no_lease_wait(self) -> None:
        record = transaction(phase=P.COPY)
        rolling, _ = step(record, Out.FAILED, StepContext(at=1.0))
        cleaned, actions = step(rolling, Out.UNREACHABLE, StepContext(at=1.0))
        assert cleaned.destination_fenced and cleaned.cleanup_required
        assert isinstance(actions[0], phases.EnqueueCleanup)
        assert isinstance(actions[1], phases.RestartSource)

    def test_rollback_from_suppress_source_restarts_the_source_at_once(self) -> None:
        record = transaction(phase=P.SUPPRESS_SOURCE)
        rolling, actions = step(record, Out.FAILED, StepContext(at=1.0, error_code="X"))
        assert rolling.destination_fenced
        assert [type(a) for a in actions] == [phases.RestartSource]

    def test_local_destination_that_will_not_stop_is_retried_not_waited_out(self) -> None:
        record = transaction(source=Side.REMOTE, phase=P.ROLLBACK, rollback_from=P.COPY)
        again, actions = step(record, Out.FAILED, StepContext(at=1.0))
        assert not again.destination_fenced and not again.cleanup_required
        assert [type(a) for a in actions] == [phases.FenceDestination]


class TestPreflight:
    """A failed preflight never stops or suppresses the source."""

    @pytest.mark.parametrize("direction", BOTH, ids=str)
    @pytest.mark.parametrize("outcome", [Out.FAILED, Out.UNREACHABLE, Out.PARK], ids=str)
    def test_preflight_failure_performs_no_stop(
        self, direction: Route, outcome: Outcome
    ) -> None:
        record = transaction(source=_source(direction))
        _, actions = step(record, outcome, StepContext(at=1.0, error_code="PREFLIGHT_ARCH"))
        stopping = (phases.SuppressSource, phases.FenceDestination, phases.CleanupSource)
        assert not any(isinstance(a, stopping) for a in actions)


class TestRetryAndErrors:
    """Retrying a parked transaction needs a fresh generation; errors are recorded."""

    def test_retry_without_a_new_generation_is_refused(self) -> None:
        parked = transaction(phase=P.PARKED)
        with pytest.raises(phases.IllegalTransition):
            step(parked, Out.RETRY_REQUESTED, StepContext(at=1.0, new_generation=8))

    def test_retry_starts_over_with_the_new_generation(self) -> None:
        parked = transaction(phase=P.PARKED, last_error_code="PREFLIGHT_ARCH", attempt=5)
        new, actions = step(parked, Out.RETRY_REQUESTED, StepContext(at=1, new_generation=9))
        assert (new.phase, new.generation, new.attempt) == (P.PREFLIGHT, 9, 6)
        assert new.last_error_code is None
        assert isinstance(actions[0], phases.RunPreflight)

    def test_failure_records_code_and_detail(self) -> None:
        ctx = StepContext(at=3.0, error_code="COPY_INCOMPLETE", error_detail="3 of 4 files")
        new, _ = step(transaction(phase=P.COPY), Out.FAILED, ctx)
        assert (new.last_error_code, new.last_error_detail) == ("COPY_INCOMPLETE", "3 of 4 files")
        assert new.rollback_from is P.COPY

    def test_failed_source_cleanup_rolls_forward_into_a_cleanup_item(self) -> None:
        new, actions = step(
            transaction(phase=P.CLEANUP_SOURCE), Out.FAILED, StepContext(at=3.0)
        )
        assert new.phase is P.DONE and new.cleanup_required
        enqueue = actions[0]
        assert isinstance(enqueue, phases.EnqueueCleanup)
        assert (enqueue.item.side, enqueue.item.generation) == (Side.LOCAL, 7)


class TestRollbackReturnsTheNewestData:
    """A rollback after the destination ran copies its data back before the source starts."""

    REMOTE_WROTE = Lineage(area="a1", holders=frozenset({Side.REMOTE}), epoch=2)

    def _fenced(self) -> Transaction:
        return transaction(
            phase=P.ROLLBACK, rollback_from=P.HEALTHCHECK_DESTINATION, destination_fenced=True
        )

    def test_the_source_is_not_restarted_while_the_destination_holds_the_newest_data(
        self,
    ) -> None:
        ctx = StepContext(at=1.0, lineage=self.REMOTE_WROTE)
        actions = phases.next_actions(self._fenced(), ctx)
        assert not any(isinstance(a, phases.RestartSource) for a in actions)
        (back,) = [a for a in actions if isinstance(a, phases.ReturnData)]
        assert (back.source, back.destination) == (Side.REMOTE, Side.LOCAL)
        assert (back.source_generation, back.destination_generation) == (8, 7)

    def test_the_destination_is_fenced_keeping_its_data_and_cleaned_up_by_the_queue(
        self,
    ) -> None:
        ctx = StepContext(at=1.0, lineage=self.REMOTE_WROTE)
        actions = phases.next_actions(self._fenced(), ctx)
        (item,) = [a.item for a in actions if isinstance(a, phases.EnqueueCleanup)]
        assert (item.side, item.generation) == (Side.REMOTE, 8)

    def test_data_returned_lets_the_source_restart(self) -> None:
        back = Lineage(area="a1", holders=frozenset({Side.REMOTE, Side.LOCAL}), epoch=2)
        record, actions = step(
            self._fenced(), Out.DATA_RETURNED, StepContext(at=2.0, lineage=back)
        )
        assert record.phase is P.ROLLBACK and record.data_wait_since is None
        assert isinstance(actions[-1], phases.RestartSource)

    def test_finishing_the_rollback_before_the_data_is_back_is_refused(self) -> None:
        with pytest.raises(phases.IllegalTransition, match="newest data"):
            step(self._fenced(), Out.OK, StepContext(at=1.0, lineage=self.REMOTE_WROTE))

    def test_a_failed_copy_back_keeps_the_source_stopped_and_remembers_since_when(self) -> None:
        ctx = StepContext(at=10.0, lineage=self.REMOTE_WROTE)
        waiting, actions = step(self._fenced(), Out.UNREACHABLE, ctx)
        assert waiting.data_wait_since == 10.0
        assert any(isinstance(a, phases.ReturnData) for a in actions)
        later, _ = step(
            waiting, Out.UNREACHABLE, StepContext(at=20.0, lineage=self.REMOTE_WROTE)
        )
        assert later.data_wait_since == 10.0, "the wait is measured from the first failure"

    def test_a_rollback_before_the_destination_ran_restarts_the_source_at_once(self) -> None:
        copied = Lineage(area="a1", holders=frozenset({Side.LOCAL, Side.REMOTE}), epoch=1)
        record = transaction(phase=P.ROLLBACK, rollback_from=P.COPY, destination_fenced=True)
        actions = phases.next_actions(record, StepContext(at=1.0, lineage=copied))
        assert isinstance(actions[-1], phases.RestartSource)
        assert not any(isinstance(a, phases.ReturnData) for a in actions)


class TestARollbackParkedForItsData:
    """A rollback that parked waiting for its data is resumed, never started over."""

    REMOTE_WROTE = Lineage(area="a1", holders=frozenset({Side.REMOTE}), epoch=2)

    def _parked(self) -> Transaction:
        return transaction(
            phase=P.PARKED, rollback_from=P.HEALTHCHECK_DESTINATION, destination_fenced=True,
            data_wait_since=3.0, last_error_code="ROLLBACK_DATA_UNREACHABLE",
        )

    def test_a_retry_that_would_start_over_is_refused(self) -> None:
        ctx = StepContext(at=9.0, new_generation=9, lineage=self.REMOTE_WROTE)
        with pytest.raises(phases.IllegalTransition, match="resumed"):
            step(self._parked(), Out.RETRY_REQUESTED, ctx)

    def test_resuming_goes_back_to_returning_the_data(self) -> None:
        ctx = StepContext(at=9.0, lineage=self.REMOTE_WROTE)
        resumed, actions = step(self._parked(), Out.ROLLBACK_RESUMED, ctx)
        assert resumed.phase is P.ROLLBACK and resumed.data_wait_since is None
        assert any(isinstance(a, phases.ReturnData) for a in actions)

    def test_only_a_parked_rollback_can_be_resumed(self) -> None:
        parked_preflight = transaction(phase=P.PARKED, last_error_code="PREFLIGHT_ARCH")
        with pytest.raises(phases.IllegalTransition, match="only a rollback"):
            step(parked_preflight, Out.ROLLBACK_RESUMED, StepContext(at=1.0))


class TestGivingTheVpsUp:
    """A move home from a given-up VPS never asks its source: it waits the lease out."""

    def _abandoned(self, phase: Phase = P.ROLLBACK, **changes: object) -> Transaction:
        return transaction(source=Side.REMOTE, phase=phase, **changes)

    def _ctx(self, **changes: object) -> StepContext:
        base = _context_satisfying_guards(Out.SOURCE_ABANDONED)
        return StepContext(**{**{f: getattr(base, f) for f in base.__dataclass_fields__},
                              **changes})

    def test_a_give_up_needs_the_lineage_to_record_it_first(self) -> None:
        record = self._abandoned(rollback_from=P.COPY, destination_fenced=True)
        with pytest.raises(phases.IllegalTransition, match="lineage"):
            phases.advance(record, Out.SOURCE_ABANDONED, self._ctx(lineage=Lineage(
                area="a1", holders=frozenset({Side.REMOTE}))))
        with pytest.raises(phases.IllegalTransition, match="lineage"):
            phases.advance(record, Out.SOURCE_ABANDONED, self._ctx(lineage=None))

    def test_a_give_up_needs_a_new_generation(self) -> None:
        record = self._abandoned(rollback_from=P.COPY, destination_fenced=True)
        with pytest.raises(phases.IllegalTransition, match="generation"):
            phases.advance(record, Out.SOURCE_ABANDONED, self._ctx(new_generation=8))

    def test_a_move_home_stuck_on_its_source_starts_over_without_it(self) -> None:
        record = self._abandoned(rollback_from=P.COPY, destination_fenced=True,
                                 last_error_code="SSH_UNREACHABLE", data_wait_since=5.0)
        new = phases.advance(record, Out.SOURCE_ABANDONED, self._ctx())
        assert (new.phase, new.generation, new.attempt) == (P.PREFLIGHT, 9, 2)
        assert new.source_abandoned and new.rollback_from is None
        assert not new.destination_fenced and new.data_wait_since is None

    def test_its_source_is_waited_out_by_the_source_generations_lease(self) -> None:
        record = self._abandoned(P.SUPPRESS_SOURCE, source_abandoned=True)
        ctx = self._ctx(now=42.0, lease=AreaLease(area="a1", generation=7, owner_id="me",
                                                   acknowledged_at=40.0, ttl=2.0))
        (action,) = phases.next_actions(record, ctx)
        assert isinstance(action, phases.WaitLeaseExpiry)
        assert action.lease.generation == 7 and action.until == pytest.approx(40 + 2.2 + 0.5)
        with pytest.raises(phases.IllegalTransition, match="not provably lapsed"):
            phases.advance(record, Out.LEASE_EXPIRED, ctx)
        assert phases.advance(record, Out.LEASE_EXPIRED, self._ctx(
            now=43.0, lease=action.lease)).phase is P.COPY

    def test_a_lease_of_another_generation_ends_no_wait(self) -> None:
        record = self._abandoned(P.SUPPRESS_SOURCE, source_abandoned=True)
        other = AreaLease(area="a1", generation=8, owner_id="me", acknowledged_at=0.0, ttl=2.0)
        with pytest.raises(phases.IllegalTransition, match="generation 8"):
            phases.advance(record, Out.LEASE_EXPIRED, self._ctx(now=50.0, lease=other))

    def test_a_source_that_was_not_given_up_is_never_waited_out(self) -> None:
        record = self._abandoned(P.SUPPRESS_SOURCE)
        (action,) = phases.next_actions(record, self._ctx())
        assert isinstance(action, phases.SuppressSource)
        with pytest.raises(phases.IllegalTransition, match="no move from SUPPRESS_SOURCE"):
            phases.advance(record, Out.LEASE_EXPIRED, self._ctx(now=10_000.0, lease=AreaLease(
                area="a1", generation=7, owner_id="me", acknowledged_at=0.0, ttl=2.0)))

    def test_a_failure_after_the_give_up_retries_instead_of_rolling_back(self) -> None:
        for phase in (P.COPY, P.CREATE_DESTINATION, P.HEALTHCHECK_DESTINATION):
            record = self._abandoned(phase, source_abandoned=True)
            new = phases.advance(record, Out.FAILED, self._ctx(error_code="DAEMON_START_FAILED"))
            assert new.phase is phase and new.last_error_code == "DAEMON_START_FAILED"

    def test_a_move_out_cannot_be_given_up_this_way(self) -> None:
        record = transaction(source=Side.LOCAL, phase=P.ROLLBACK, rollback_from=P.COPY)
        with pytest.raises(phases.IllegalTransition):
            phases.advance(record, Out.SOURCE_ABANDONED, self._ctx())

"""The outcome rewrites the migration engine used to decide itself, as pure table-tested
rules (orchestrator/rules.py): what a failed step reports, how a rollback that completed
after an error ends, when a passed preflight takes its move slot and checks again, and
which grant a LEASE_EXPIRED outcome is judged by."""

from __future__ import annotations

import pytest

from orchestrator import phases, rules
from orchestrator.errors import ErrorCode
from orchestrator.models import AreaLease, Phase, Side
from orchestrator.phases import Outcome

from .records import transaction

IDS = {"transaction_id": "t-1", "service": "tg", "area": "a1"}  # every action names these
PARK_AT = 3
WAIT_S = 900.0
NOW = 10_000.0

# (phase, source, error code, consecutive failures incl. this one, data_wait_since) -> outcome
FAILED_STEP: list[tuple[Phase, Side, str, int, float | None, Outcome]] = [
    # a failed preflight counts towards parking, an unreachable VPS included
    (Phase.PREFLIGHT, Side.LOCAL, ErrorCode.PREFLIGHT_AGENT, 1, None, Outcome.FAILED),
    (Phase.PREFLIGHT, Side.LOCAL, ErrorCode.PREFLIGHT_AGENT, PARK_AT, None, Outcome.PARK),
    # ... except a cause retrying cannot fix (a full disk): it parks at the first failure
    (Phase.PREFLIGHT, Side.LOCAL, ErrorCode.PREFLIGHT_DISK_SPACE, 1, None, Outcome.PARK),
    (Phase.PREFLIGHT, Side.REMOTE, ErrorCode.LOCAL_DISK_FULL, 1, None, Outcome.PARK),
    (Phase.PREFLIGHT, Side.LOCAL, ErrorCode.REMOTE_PERMISSION_DENIED, 1, None, Outcome.PARK),
    # in a later phase it fails the step like any other: the rollback runs first
    (Phase.COPY, Side.LOCAL, ErrorCode.REMOTE_DISK_FULL, 1, None, Outcome.FAILED),
    (Phase.PREFLIGHT, Side.LOCAL, ErrorCode.SSH_UNREACHABLE, 1, None, Outcome.UNREACHABLE),
    (Phase.PREFLIGHT, Side.LOCAL, ErrorCode.SSH_UNREACHABLE, PARK_AT, None, Outcome.PARK),
    (Phase.PREFLIGHT, Side.REMOTE, ErrorCode.AGENT_UNREACHABLE, 2, None, Outcome.UNREACHABLE),
    # later phases: unreachable where the table has that edge, else a plain failure
    (Phase.COPY, Side.LOCAL, ErrorCode.SSH_TIMEOUT, PARK_AT, None, Outcome.UNREACHABLE),
    (Phase.COPY, Side.LOCAL, ErrorCode.INTERNAL, PARK_AT, None, Outcome.FAILED),
    (Phase.HEALTHCHECK_DESTINATION, Side.LOCAL, ErrorCode.SSH_UNREACHABLE, 1, None,
     Outcome.UNREACHABLE),
    (Phase.HEALTHCHECK_DESTINATION, Side.REMOTE, ErrorCode.SSH_UNREACHABLE, 1, None,
     Outcome.FAILED),  # remote_to_local has no UNREACHABLE edge there
    (Phase.CLEANUP_SOURCE, Side.REMOTE, ErrorCode.AGENT_UNREACHABLE, 1, None,
     Outcome.UNREACHABLE),
    # a rollback waiting for the destination's data parks once rollback_data_wait_s passed
    (Phase.ROLLBACK, Side.LOCAL, ErrorCode.ROLLBACK_DATA_UNREACHABLE, 1, NOW - WAIT_S,
     Outcome.PARK),
    (Phase.ROLLBACK, Side.LOCAL, ErrorCode.ROLLBACK_DATA_UNREACHABLE, 1, NOW - WAIT_S + 1,
     Outcome.UNREACHABLE),
    (Phase.ROLLBACK, Side.LOCAL, ErrorCode.INTERNAL, 1, NOW - 1, Outcome.FAILED),
    (Phase.ROLLBACK, Side.LOCAL, ErrorCode.INTERNAL, PARK_AT, None, Outcome.FAILED),
]


class TestTheOutcomeOfAFailedStep:
    """Preflight failures count towards parking (a cause retrying cannot fix parks at once);
    a data wait parks at its bound; an unreachable side takes the table's UNREACHABLE edge
    where there is one."""

    @pytest.mark.parametrize(("phase", "source", "code", "failures", "waited", "expected"),
                             FAILED_STEP)
    def test_table(self, phase: Phase, source: Side, code: str, failures: int,
                   waited: float | None, expected: Outcome) -> None:
        txn = transaction(phase=phase, source=source, data_wait_since=waited)
        assert rules.outcome_for_error(
            txn, error_code=code, consecutive_failures=failures,
            park_after_failures=PARK_AT, at=NOW, rollback_data_wait_s=WAIT_S,
        ) is expected

    def test_every_outcome_it_gives_is_one_the_table_accepts_or_park(self) -> None:
        for phase, source, code, failures, waited, _ in FAILED_STEP:
            txn = transaction(phase=phase, source=source, data_wait_since=waited)
            outcome = rules.outcome_for_error(
                txn, error_code=code, consecutive_failures=failures,
                park_after_failures=PARK_AT, at=NOW, rollback_data_wait_s=WAIT_S,
            )
            assert outcome in phases.allowed(txn) or outcome is Outcome.PARK

    def test_unreachable_codes_are_the_ones_that_are_never_retried_in_place(self) -> None:
        assert rules.UNREACHABLE_CODES == {
            ErrorCode.SSH_UNREACHABLE, ErrorCode.SSH_TIMEOUT, ErrorCode.AGENT_UNREACHABLE,
            ErrorCode.ROLLBACK_DATA_UNREACHABLE,
        }


# (phase, outcome observed, last_error_code, consecutive failures) -> outcome fed to the table
SETTLED: list[tuple[Phase, Outcome, str | None, int, Outcome]] = [
    (Phase.ROLLBACK, Outcome.OK, "SSH_UNREACHABLE", 1, Outcome.OK),
    (Phase.ROLLBACK, Outcome.OK, "SSH_UNREACHABLE", PARK_AT, Outcome.PARK),
    (Phase.ROLLBACK, Outcome.OK, None, PARK_AT, Outcome.OK),  # no error: nothing counts
    (Phase.ROLLBACK, Outcome.FAILED, "INTERNAL", PARK_AT, Outcome.FAILED),
    (Phase.COPY, Outcome.OK, "INTERNAL", PARK_AT, Outcome.OK),
    (Phase.PREFLIGHT, Outcome.OK, None, PARK_AT, Outcome.OK),
    # a rollback after a cause retrying cannot fix parks at once (the source runs again)
    (Phase.ROLLBACK, Outcome.OK, "REMOTE_DISK_FULL", 1, Outcome.PARK),
    (Phase.ROLLBACK, Outcome.OK, "LOCAL_DISK_FULL", 1, Outcome.PARK),
    (Phase.ROLLBACK, Outcome.OK, "NAME_TOO_LONG", 1, Outcome.PARK),
    (Phase.ROLLBACK, Outcome.FAILED, "REMOTE_DISK_FULL", 1, Outcome.FAILED),
    (Phase.ROLLBACK, Outcome.OK, "COPY_INCOMPLETE", 1, Outcome.OK),  # transient: retried
]


class TestTheOutcomeTheTableIsFed:
    """A rollback that completed after an error parks the service at the limit, or at once
    after a cause retrying cannot fix; every other observed outcome goes to the table
    unchanged."""

    @pytest.mark.parametrize(("phase", "observed", "last_error", "failures", "expected"),
                             SETTLED)
    def test_table(self, phase: Phase, observed: Outcome, last_error: str | None,
                   failures: int, expected: Outcome) -> None:
        txn = transaction(phase=phase, last_error_code=last_error)
        assert rules.settled_outcome(
            txn, observed, consecutive_failures=failures, park_after_failures=PARK_AT
        ) is expected


class TestAPassedPreflightTakesItsMoveSlot:
    """Only a preflight that passed takes the slot; after waiting for it, the checks run
    once more, marked `again` (without the pre-copy)."""

    @pytest.mark.parametrize(("phase", "outcome", "failed", "takes"), [
        (Phase.PREFLIGHT, Outcome.OK, False, True),
        (Phase.PREFLIGHT, Outcome.OK, True, False),
        (Phase.PREFLIGHT, Outcome.FAILED, True, False),
        (Phase.COPY, Outcome.OK, False, False),
    ])
    def test_table(self, phase: Phase, outcome: Outcome, failed: bool, takes: bool) -> None:
        assert rules.takes_move_slot(transaction(phase=phase), outcome, failed=failed) is takes

    def test_the_checks_again_are_the_preflight_actions_marked_again(self) -> None:
        txn = transaction(phase=Phase.PREFLIGHT)
        first = (phases.RunPreflight(source=Side.LOCAL, destination=Side.REMOTE, **IDS),
                 phases.CheckHealth(side=Side.LOCAL, generation=7, **IDS))
        assert rules.preflight_again(first) == (
            phases.RunPreflight(source=Side.LOCAL, destination=Side.REMOTE, again=True, **IDS),
        )
        assert txn.phase is Phase.PREFLIGHT


class TestTheGrantALeaseExpiryIsJudgedBy:
    """The grant waited out, unless a later one was learnt meanwhile."""

    WAITED = AreaLease(area="a1", generation=8, owner_id="me", acknowledged_at=100.0, ttl=30.0)

    @pytest.mark.parametrize(("known_at", "judged_at"), [
        (None, 100.0), (90.0, 100.0), (100.0, 100.0), (120.0, 120.0),
    ])
    def test_table(self, known_at: float | None, judged_at: float) -> None:
        known = None if known_at is None else self.WAITED.model_copy(
            update={"acknowledged_at": known_at})
        wait = phases.WaitLeaseExpiry(until=200.0, lease=self.WAITED, **IDS)
        judged = rules.lease_to_judge((wait,), known=known)
        assert judged.acknowledged_at == judged_at

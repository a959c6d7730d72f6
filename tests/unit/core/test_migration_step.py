"""One step of a move, decided by orchestrator/migration_step.py: the order of its rules and
the memory it keeps between records (the engine and the model both run exactly this)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from orchestrator import migration_step, phases
from orchestrator.area_leases import LeasePolicy
from orchestrator.migration_step import (
    Idle,
    Memory,
    Perform,
    Record,
    Result,
    Seen,
    StepRules,
    TakeSlot,
)
from orchestrator.models import AreaLease, Phase, Side
from orchestrator.phases import Outcome
from orchestrator.rules import LinkEpoch

from .records import transaction

POLICY = LeasePolicy(ttl_s=2.0, clock_margin=0.1, safety_margin_s=0.5)
BOUNDS = StepRules(park_after_failures=3, retry_backoff_base_s=1.0, retry_backoff_cap_s=8.0,
                   rollback_data_wait_s=60.0, policy=POLICY)
UP = LinkEpoch(connections=4, connected=True)


def seen(**changes: object) -> Seen:
    base = Seen(at=2_000.0, now=50.0, desired=Side.REMOTE, link=UP)
    return replace(base, **changes)  # type: ignore[arg-type]


def decide(txn: object, looked: Seen, memory: Memory | None = None) -> migration_step.Decision:
    return migration_step.decide(txn, looked, memory or Memory(), BOUNDS)  # type: ignore[arg-type]


class TestAStepInOrder:
    def test_a_wish_reversed_before_the_commit_rolls_back_before_anything_is_performed(
        self,
    ) -> None:
        record = transaction(phase=Phase.COPY)
        decision = decide(record, seen(desired=Side.LOCAL))
        assert isinstance(decision, Record)
        assert decision.outcome is Outcome.REVERSE_REQUESTED
        assert decision.record.phase is Phase.ROLLBACK

    def test_otherwise_the_phase_s_actions_are_performed(self) -> None:
        decision = decide(transaction(phase=Phase.COPY), seen())
        assert isinstance(decision, Perform)
        assert [type(a) for a in decision.actions] == [phases.CopyData]
        assert decision.memory.began_in == {"t-1": 4}, "the link the step began on"

    def test_a_passed_preflight_takes_its_move_slot_and_checks_again_if_it_waited(
        self,
    ) -> None:
        record = transaction()
        first = decide(record, seen())
        assert isinstance(first, Perform)
        passed = Result(actions=first.actions, outcome=Outcome.OK)
        slot = decide(record, seen(result=passed))
        assert isinstance(slot, TakeSlot)
        assert [a.again for a in slot.recheck if isinstance(a, phases.RunPreflight)] == [True]
        stored = decide(record, seen(result=slot.free))
        assert isinstance(stored, Record) and stored.record.phase is Phase.SUPPRESS_SOURCE

    def test_nothing_reported_is_nothing_stored(self) -> None:
        assert isinstance(decide(transaction(), seen(result=Result(actions=()))), Idle)

    def test_an_unreachable_vps_takes_the_unreachable_edge(self) -> None:
        record = transaction(phase=Phase.HEALTHCHECK_DESTINATION)
        failed = Result(actions=(), error_code="AGENT_UNREACHABLE", error_detail="gone")
        decision = decide(record, seen(result=failed))
        assert isinstance(decision, Record)
        assert decision.outcome is Outcome.UNREACHABLE
        assert decision.record.phase is Phase.ROLLBACK
        assert decision.record.last_error_detail == "gone"

    def test_a_lease_expiry_is_judged_by_the_grant_waited_out(self) -> None:
        record = transaction(phase=Phase.ROLLBACK, rollback_from=Phase.HEALTHCHECK_DESTINATION,
                             cleanup_required=True)
        known = AreaLease(area="a1", generation=8, owner_id="me", acknowledged_at=40.0, ttl=2.0)
        first = decide(record, seen(leases={8: known}, now=41.0))
        assert isinstance(first, Perform)
        (wait,) = [a for a in first.actions if isinstance(a, phases.WaitLeaseExpiry)]
        assert wait.lease == known
        expired = Result(actions=first.actions, outcome=Outcome.LEASE_EXPIRED)
        with pytest.raises(phases.IllegalTransition, match="not provably lapsed"):
            decide(record, seen(leases={8: known}, now=41.0, result=expired))
        later = decide(record, seen(leases={8: known}, now=wait.until, result=expired))
        assert isinstance(later, Record) and later.record.destination_fenced

    def test_a_failed_rollback_step_is_looked_at_again_after_a_pause(self) -> None:
        record = transaction(phase=Phase.ROLLBACK, rollback_from=Phase.COPY)
        failed = Result(actions=(), error_code="DAEMON_STOP_FAILED")
        decision = decide(record, seen(result=failed))
        assert isinstance(decision, Record) and decision.pause
        assert decision.record.phase is Phase.ROLLBACK


class TestTheMemory:
    def _rolled_back(self, memory: Memory, *, link: LinkEpoch, area: str = "a1"
                     ) -> Record:
        """One move that failed unreachable at its copy and then rolled back."""
        record = transaction(phase=Phase.COPY, area=area, transaction_id=f"t-{area}")
        began = decide(record, seen(link=UP), memory)
        assert isinstance(began, Perform)
        failed = decide(record, seen(link=link, result=Result(
            actions=began.actions, error_code="SSH_UNREACHABLE")), began.memory)
        assert isinstance(failed, Record)
        rolling = failed.record
        done = decide(rolling, seen(link=link, result=Result(
            actions=(), outcome=Outcome.FENCED)), failed.memory)
        assert isinstance(done, Record)
        restarted = decide(done.record, seen(link=link, result=Result(
            actions=(), outcome=Outcome.OK)), done.memory)
        assert isinstance(restarted, Record) and restarted.ended
        assert restarted.record.phase is Phase.ROLLED_BACK
        return restarted

    def test_an_end_after_a_failure_counts_and_backs_the_area_off(self) -> None:
        steady = UP  # the link never went away: the VPS itself failed
        ended = self._rolled_back(Memory(), link=steady)
        assert ended.memory.failures_of("tg") == 1
        assert not ended.memory.may_open("a1", now=50.0)
        assert ended.memory.may_open("a1", now=50.0 + BOUNDS.retry_backoff_base_s)

    def test_one_link_outage_counts_once_however_many_areas_it_hits(self) -> None:
        reconnected = LinkEpoch(connections=5, connected=True)
        first = self._rolled_back(Memory(), link=reconnected, area="a1")
        second = self._rolled_back(first.memory, link=reconnected, area="a2")
        assert second.memory.failures_of("tg") == 1
        over_a_steady_link = self._rolled_back(
            self._rolled_back(Memory(), link=UP, area="a1").memory, link=UP, area="a2")
        assert over_a_steady_link.memory.failures_of("tg") == 2

    def test_a_success_forgets_the_failures_and_the_operator_clears_the_back_off(
        self,
    ) -> None:
        ended = self._rolled_back(Memory(), link=UP)
        forgiven = ended.memory.forgiven("tg", areas=["a1"])
        assert forgiven.failures_of("tg") == 0 and forgiven.may_open("a1", now=50.0)
        record = transaction(phase=Phase.CLEANUP_SOURCE)
        done = decide(record, seen(result=Result(actions=(), outcome=Outcome.OK)),
                      ended.memory)
        assert isinstance(done, Record) and done.record.phase is Phase.DONE
        assert done.memory.failures_of("tg") == 0

    def test_the_failures_come_back_from_the_stored_history_after_a_restart(self) -> None:
        history = [  # newest first
            {"service": "tg", "phase": "ROLLED_BACK", "last_error_code": "COPY_INCOMPLETE"},
            {"service": "tg", "phase": "PARKED", "last_error_code": "PREFLIGHT_ARCH"},
            {"service": "tg", "phase": "DONE", "last_error_code": None},
            {"service": "tg", "phase": "ROLLED_BACK", "last_error_code": "COPY_INCOMPLETE"},
            {"service": "wa", "phase": "ROLLED_BACK", "last_error_code": None},
        ]
        memory = Memory.from_history(history)
        assert (memory.failures_of("tg"), memory.failures_of("wa")) == (2, 0)

    def test_the_limit_parks_a_rollback_that_completes(self) -> None:
        memory = Memory(failures={"tg": BOUNDS.park_after_failures - 1})
        record = transaction(phase=Phase.ROLLBACK, rollback_from=Phase.COPY,
                             destination_fenced=True, last_error_code="COPY_INCOMPLETE")
        decision = decide(record, seen(result=Result(actions=(), outcome=Outcome.OK)), memory)
        assert isinstance(decision, Record)
        assert decision.outcome is Outcome.PARK and decision.record.phase is Phase.PARKED

"""The safety rules: generations are issued once, one side at a time, crash and reversal rules."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrator import area_leases, rules
from orchestrator.area_leases import LeasePolicy
from orchestrator.lineage import Lineage
from orchestrator.models import Area, AreaLease, Phase, Side, Transaction
from orchestrator.phases import Outcome

from .profiles import PROFILE
from .records import transaction


class TestGenerationLedger:
    """A generation is issued once per area, above anything committed, and survives storage."""

    def test_issue_grows_from_the_committed_floor(self) -> None:
        ledger, first = rules.GenerationLedger().issue("a1", floor=7)
        ledger, second = ledger.issue("a1", floor=7)
        assert (first, second) == (8, 9)

    def test_a_rolled_back_generation_is_never_issued_again(self) -> None:
        ledger, rolled_back = rules.GenerationLedger().issue("a1", floor=1)
        _, retry = ledger.issue("a1", floor=1)  # committed generation did not move
        assert retry > rolled_back

    def test_areas_are_independent(self) -> None:
        ledger, _ = rules.GenerationLedger().issue("a1")
        _, other = ledger.issue("a2")
        assert other == 1

    def test_issuing_leaves_the_old_ledger_unchanged(self) -> None:
        ledger = rules.GenerationLedger()
        ledger.issue("a1")
        assert ledger.highest == {}

    def test_storage_round_trip(self) -> None:
        ledger, _ = rules.GenerationLedger().issue("a1", floor=4)
        restored = rules.GenerationLedger.from_storage(ledger.to_storage())
        assert restored.to_storage() == {"a1": 5}

    @PROFILE
    @given(st.lists(st.tuples(st.sampled_from(["a1", "a2", "a3"]), st.integers(0, 20))))
    def test_issued_generations_are_unique_and_increasing(
        self, requests: list[tuple[str, int]]
    ) -> None:
        ledger = rules.GenerationLedger()
        issued: dict[str, list[int]] = {}
        for area, floor in requests:
            ledger, generation = ledger.issue(area, floor=floor)
            assert generation > floor
            issued.setdefault(area, []).append(generation)
        for generations in issued.values():
            assert generations == sorted(set(generations))


def _every_transaction_shape() -> list[Transaction]:
    shapes = []
    for source, phase, fenced in itertools.product(Side, Phase, (False, True)):
        shapes.append(transaction(source=source, phase=phase, destination_fenced=fenced))
    return shapes


class TestOneSideAtATime:
    """For every transaction state the rules let an area run on at most one side."""

    @pytest.mark.parametrize("txn", _every_transaction_shape(), ids=repr)
    def test_local_and_remote_wanted_sets_never_share_an_area(self, txn: Transaction) -> None:
        committed = [Area(uuid="a1", service="tg", location=Side.LOCAL, generation=7)]
        for holders in ({Side.LOCAL}, {Side.REMOTE}, {Side.LOCAL, Side.REMOTE}):
            lineages = {"a1": Lineage(area="a1", holders=frozenset(holders), epoch=1)}
            runs = {
                side: rules.desired_runs(
                    side=side, authoritative=committed, transactions=[txn], lineages=lineages
                )
                for side in Side
            }
            assert not set(runs[Side.LOCAL]) & set(runs[Side.REMOTE])

    def test_handover_window_runs_nowhere(self) -> None:
        committed = [Area(uuid="a1", service="tg", location=Side.LOCAL, generation=7)]
        for phase in (Phase.SUPPRESS_SOURCE, Phase.COPY):
            txn = transaction(phase=phase)
            for side in Side:
                assert "a1" not in rules.desired_runs(
                    side=side, authoritative=committed, transactions=[txn], lineages={}
                )

    def test_rollback_keeps_the_source_down_until_the_destination_is_fenced(self) -> None:
        committed = [Area(uuid="a1", service="tg", location=Side.LOCAL, generation=7)]
        waiting = transaction(phase=Phase.ROLLBACK, rollback_from=Phase.CREATE_DESTINATION)
        fenced = waiting.model_copy(update={"destination_fenced": True})
        local = {
            name: rules.desired_runs(
                side=Side.LOCAL, authoritative=committed, transactions=[t], lineages={}
            )
            for name, t in (("waiting", waiting), ("fenced", fenced))
        }
        assert "a1" not in local["waiting"]
        assert local["fenced"] == {"a1": 7}

    def test_remote_lease_is_granted_from_create_destination_on(self) -> None:
        committed = [Area(uuid="a1", service="tg", location=Side.LOCAL, generation=7)]
        txn = transaction(phase=Phase.CREATE_DESTINATION)
        claimed = {"a1": Lineage(area="a1", holders=frozenset({Side.REMOTE}), epoch=1)}
        grants = rules.desired_runs(
            side=Side.REMOTE, authoritative=committed, transactions=[txn], lineages=claimed
        )
        assert grants == {"a1": 8}

    def test_areas_without_a_transaction_run_where_committed(self) -> None:
        committed = [
            Area(uuid="a1", service="tg", location=Side.LOCAL, generation=3),
            Area(uuid="a2", service="tg", location=Side.REMOTE, generation=4),
        ]
        assert rules.desired_runs(
            side=Side.REMOTE, authoritative=committed, transactions=[], lineages={}
        ) == {"a2": 4}

    def test_nothing_runs_on_a_side_that_does_not_alone_hold_the_newest_data(self) -> None:
        committed = [Area(uuid="a1", service="tg", location=Side.LOCAL, generation=7)]
        fenced = transaction(
            phase=Phase.ROLLBACK, rollback_from=Phase.HEALTHCHECK_DESTINATION,
            destination_fenced=True,
        )
        for holders, runs in (({Side.REMOTE}, {}), ({Side.LOCAL, Side.REMOTE}, {}),
                              ({Side.LOCAL}, {"a1": 7})):
            lineages = {"a1": Lineage(area="a1", holders=frozenset(holders), epoch=3)}
            assert rules.desired_runs(
                side=Side.LOCAL, authoritative=committed, transactions=[fenced],
                lineages=lineages,
            ) == runs


class TestCrashRecovery:
    """After a restart the committed location decides: roll forward or roll back."""

    def test_commit_written_rolls_forward(self) -> None:
        txn = transaction(phase=Phase.COMMIT_LOCATION)
        committed = Area(uuid="a1", service="tg", location=Side.REMOTE, generation=8)
        assert rules.recovery_outcome(txn, committed=committed) is Outcome.RECOVERED_COMMITTED

    def test_commit_not_written_rolls_back(self) -> None:
        txn = transaction(phase=Phase.COMMIT_LOCATION)
        committed = Area(uuid="a1", service="tg", location=Side.LOCAL, generation=7)
        assert rules.recovery_outcome(txn, committed=committed) is Outcome.RECOVERED_UNCOMMITTED

    def test_final_and_parked_records_need_no_recovery(self) -> None:
        committed = Area(uuid="a1", service="tg", location=Side.LOCAL, generation=7)
        for phase in (Phase.DONE, Phase.ROLLED_BACK, Phase.PARKED):
            assert rules.recovery_outcome(transaction(phase=phase), committed=committed) is None


class TestReversal:
    """Reversing the desired location rolls back before the commit, queues a move after it."""

    def test_before_commit_it_is_a_rollback(self) -> None:
        decision = rules.reversal(transaction(phase=Phase.COPY), desired=Side.LOCAL)
        assert decision == rules.Reversal(
            outcome=Outcome.REVERSE_REQUESTED, new_transaction_after=False
        )

    def test_after_commit_it_is_a_new_transaction(self) -> None:
        decision = rules.reversal(transaction(phase=Phase.CLEANUP_SOURCE), desired=Side.LOCAL)
        assert decision == rules.Reversal(outcome=None, new_transaction_after=True)

    def test_asking_for_the_destination_again_changes_nothing(self) -> None:
        decision = rules.reversal(transaction(phase=Phase.COPY), desired=Side.REMOTE)
        assert decision == rules.Reversal(outcome=None, new_transaction_after=False)


class TestParking:
    """The Nth consecutive failure parks the service (default 5)."""

    def test_default_limit_is_five(self) -> None:
        outcomes = [rules.failure_outcome(consecutive_failures=n) for n in range(1, 7)]
        assert outcomes == [Outcome.FAILED] * 4 + [Outcome.PARK] * 2

    def test_rollback_completion_parks_at_the_limit(self) -> None:
        assert rules.rollback_completion_outcome(consecutive_failures=2, park_after_failures=3) is (
            Outcome.OK
        )
        assert rules.rollback_completion_outcome(consecutive_failures=3, park_after_failures=3) is (
            Outcome.PARK
        )


class TestOneOutageCountsOnce:
    """`link_outage` names the outage an unreachable failure belongs to; anything else, and a
    failure over a link that stayed up, is a failure of its own (None)."""

    @pytest.mark.parametrize(("code", "began_in", "link", "outage"), [
        # the link dropped after the step began: that outage, whether it is back or not
        ("SSH_UNREACHABLE", 3, rules.LinkEpoch(connections=3, connected=False), 3),
        ("AGENT_UNREACHABLE", 3, rules.LinkEpoch(connections=4, connected=True), 3),
        ("ROLLBACK_DATA_UNREACHABLE", 3, rules.LinkEpoch(connections=5, connected=False), 3),
        # the VPS was never reached since the step began (a retry while it is away)
        ("SSH_TIMEOUT", 0, rules.LinkEpoch(connections=0, connected=False), 0),
        # the link stayed up all along: the agent itself failed, counted on its own
        ("AGENT_UNREACHABLE", 3, rules.LinkEpoch(connections=3, connected=True), None),
        # not an unreachable side: counted on its own whatever the link did
        ("HEALTHCHECK_TIMEOUT", 3, rules.LinkEpoch(connections=4, connected=False), None),
        ("REMOTE_DISK_FULL", 3, rules.LinkEpoch(connections=3, connected=False), None),
        (None, 3, rules.LinkEpoch(connections=3, connected=False), None),
        # nothing known: no VPS configured, or the step's start was not seen
        ("SSH_UNREACHABLE", 3, None, None),
        ("SSH_UNREACHABLE", None, rules.LinkEpoch(connections=3, connected=False), None),
    ])
    def test_the_outage_of_a_failure(
        self, code: str | None, began_in: int | None, link: rules.LinkEpoch | None,
        outage: int | None,
    ) -> None:
        assert rules.link_outage(code, step_began_in=began_in, link=link) == outage


class TestLeaseArithmetic:
    """A remote lease counts as lapsed only after ack + ttl * (1 + margin) + safety."""

    POLICY = LeasePolicy(ttl_s=30.0, clock_margin=0.1, safety_margin_s=2.0)
    LEASE = AreaLease(area="a1", generation=8, owner_id="me", acknowledged_at=1_000.0, ttl=30.0)

    def test_expiry_formula(self) -> None:
        assert area_leases.expired_at(self.LEASE, policy=self.POLICY) == pytest.approx(1_035.0)

    def test_not_expired_a_moment_before(self) -> None:
        assert not area_leases.provably_expired(self.LEASE, now=1_034.999, policy=self.POLICY)
        assert area_leases.provably_expired(self.LEASE, now=1_035.0, policy=self.POLICY)

    def test_after_restart_the_acknowledgement_is_assumed_to_be_now(self) -> None:
        lease = area_leases.after_restart(
            area="a1", generation=8, owner_id="me", now=5.0, policy=self.POLICY
        )
        assert lease.acknowledged_at == 5.0 and lease.ttl == 30.0

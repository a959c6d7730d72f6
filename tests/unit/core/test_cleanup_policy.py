"""Cleanup items finish only on verified absence, back off when failing, and never get dropped."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrator import cleanup_policy
from orchestrator.cleanup_policy import CleanupPolicy, Done, RemoveAt, SideObservation
from orchestrator.models import CleanupItem, Side

from .profiles import PROFILE

POLICY = CleanupPolicy(base_s=2.0, cap_s=240.0, stuck_after_attempts=5)


def item(generation: int = 4, attempts: int = 0) -> CleanupItem:
    return CleanupItem(
        id="c1", service="tg", area="a1", side=Side.REMOTE, generation=generation,
        attempts=attempts, next_attempt_at=0.0, created_at=0.0,
    )


def seen(entries: Iterable[int] = (), processes: Iterable[int] = ()) -> SideObservation:
    return SideObservation(
        side=Side.REMOTE, area="a1",
        entry_generations=frozenset(entries), process_generations=frozenset(processes),
    )


class TestVerifiedAbsence:
    """An item is done only when the side holds neither process nor entry at its generation."""

    def test_entry_at_the_generation_means_remove(self) -> None:
        decision = cleanup_policy.decide(item(), seen(entries={4}))
        assert decision == RemoveAt(item_id="c1", side=Side.REMOTE, area="a1", generation=4)

    def test_process_alone_at_the_generation_means_remove(self) -> None:
        assert isinstance(cleanup_policy.decide(item(), seen(processes={4})), RemoveAt)

    def test_nothing_at_the_generation_means_done(self) -> None:
        assert cleanup_policy.decide(item(), seen()) == Done(item_id="c1")

    def test_a_newer_generation_is_not_ours_and_is_left_running(self) -> None:
        assert cleanup_policy.decide(item(), seen(entries={5}, processes={5})) == Done(item_id="c1")

    def test_an_observation_of_another_area_is_refused(self) -> None:
        other = SideObservation(side=Side.REMOTE, area="a2")
        with pytest.raises(cleanup_policy.ObservationMismatch):
            cleanup_policy.decide(item(), other)

    @PROFILE
    @given(
        generation=st.integers(0, 6),
        entries=st.sets(st.integers(0, 6)),
        processes=st.sets(st.integers(0, 6)),
    )
    def test_removal_only_ever_names_the_items_generation(
        self, generation: int, entries: set[int], processes: set[int]
    ) -> None:
        decision = cleanup_policy.decide(item(generation), seen(entries, processes))
        if isinstance(decision, RemoveAt):
            assert decision.generation == generation
        else:
            assert generation not in entries | processes


class TestBackoff:
    """Failures back off exponentially up to a cap; the caller's jitter spreads retries."""

    def test_delay_doubles_per_attempt(self) -> None:
        delays = [cleanup_policy.backoff_delay(n, jitter=0.0, policy=POLICY) for n in (1, 2, 3, 4)]
        assert delays == [1.0, 2.0, 4.0, 8.0]

    def test_delay_is_capped(self) -> None:
        assert cleanup_policy.backoff_delay(50, jitter=0.999, policy=POLICY) <= POLICY.cap_s
        assert cleanup_policy.backoff_delay(10_000, jitter=0.0, policy=POLICY) == POLICY.cap_s / 2

    def test_jitter_outside_its_range_is_refused(self) -> None:
        with pytest.raises(ValueError):
            cleanup_policy.backoff_delay(1, jitter=1.0, policy=POLICY)

    @PROFILE
    @given(attempts=st.integers(0, 200), jitter=st.floats(0.0, 0.999))
    def test_delay_stays_within_half_and_full_ceiling(self, attempts: int, jitter: float) -> None:
        delay = cleanup_policy.backoff_delay(attempts, jitter=jitter, policy=POLICY)
        assert POLICY.base_s / 2 <= delay <= POLICY.cap_s

    def test_a_failure_is_counted_and_rescheduled_never_dropped(self) -> None:
        failed = cleanup_policy.after_failure(
            item(attempts=2), now=100.0, jitter=0.0, error="SSH_UNREACHABLE", policy=POLICY
        )
        assert failed.attempts == 3
        assert failed.next_attempt_at == 100.0 + 4.0
        assert failed.last_error == "SSH_UNREACHABLE"
        assert failed.id == "c1" and failed.generation == 4
        assert not cleanup_policy.is_due(failed, now=103.9)
        assert cleanup_policy.is_due(failed, now=104.0)


class TestStuckItems:
    """A long-failing item is flagged for manual action but stays in the queue."""

    def test_item_becomes_stuck_after_the_configured_attempts(self) -> None:
        current = item()
        flags = []
        for _ in range(6):
            current = cleanup_policy.after_failure(
                current, now=0.0, jitter=0.5, error="AGENT_UNREACHABLE", policy=POLICY
            )
            flags.append(cleanup_policy.is_stuck(current, policy=POLICY))
        assert flags == [False, False, False, False, True, True]

"""What to do with one cleanup item: act, finish, back off, or call for help.

A cleanup item names one thing to remove on one side at one generation. The cleanup worker
in `monitord/` observes that side for the item's area and asks `decide()`:

* `Done` only on VERIFIED absence: the observation shows neither a process nor an entry at
  the item's generation (a newer generation being there does not matter: it is not ours);
* otherwise `RemoveAt(side, area, generation)` — always exactly the item's generation, so a
  newer generation is never touched (the agent deletes only at the named generation too).

A failed attempt is recorded with `after_failure()`: exponential backoff from `base_s`,
capped at `cap_s`, spread by a jitter value in [0, 1) that the caller draws (the core has no
randomness). Items are never dropped; once `attempts` reaches `stuck_after_attempts` the item
is flagged CLEANUP_STUCK (`is_stuck`) for manual action and keeps being retried at the cap.
Taking due items and completing one is the store's job, done with indexes (O(log n)).
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.models import CleanupItem, Side


@dataclass(frozen=True, slots=True, kw_only=True)
class CleanupPolicy:
    """Backoff and escalation settings of the cleanup worker."""

    base_s: float = 2.0
    cap_s: float = 300.0
    stuck_after_attempts: int = 10


@dataclass(frozen=True, slots=True, kw_only=True)
class SideObservation:
    """What one side holds for one area right now: entry and process generations."""

    side: Side
    area: str
    entry_generations: frozenset[int] = frozenset()
    process_generations: frozenset[int] = frozenset()


@dataclass(frozen=True, slots=True, kw_only=True)
class Done:
    """The side verifiably holds nothing at the item's generation: complete the item."""

    item_id: str


@dataclass(frozen=True, slots=True, kw_only=True)
class RemoveAt:
    """Stop and remove the area on `side` at exactly `generation`."""

    item_id: str
    side: Side
    area: str
    generation: int


class ObservationMismatch(ValueError):
    """The observation is of another side or area than the item names."""


def decide(item: CleanupItem, observation: SideObservation) -> Done | RemoveAt:
    """Done on verified absence at the item's generation, else remove exactly that generation."""
    if (observation.side, observation.area) != (item.side, item.area):
        raise ObservationMismatch(
            f"item {item.id} is for {item.side}/{item.area}, "
            f"observation is of {observation.side}/{observation.area}"
        )
    present = item.generation in observation.entry_generations or (
        item.generation in observation.process_generations
    )
    if not present:
        return Done(item_id=item.id)
    return RemoveAt(item_id=item.id, side=item.side, area=item.area, generation=item.generation)


def backoff_delay(attempts: int, *, jitter: float, policy: CleanupPolicy) -> float:
    """Seconds before attempt `attempts + 1`: exponential, capped, jitter in [0, 1) spreads it.

    Half the delay is fixed and half is jittered, so the delay never shrinks to zero and
    a large backlog of items failing together does not retry in one burst.
    """
    if not 0.0 <= jitter < 1.0:
        raise ValueError(f"jitter must be in [0, 1), got {jitter}")
    exponent = max(attempts - 1, 0)
    ceiling = policy.cap_s if exponent >= 64 else min(policy.cap_s, policy.base_s * 2.0**exponent)
    return ceiling * (0.5 + 0.5 * jitter)


def after_failure(
    item: CleanupItem, *, now: float, jitter: float, error: str, policy: CleanupPolicy
) -> CleanupItem:
    """The item after one more failed attempt: attempts + 1, next_attempt_at pushed back."""
    attempts = item.attempts + 1
    delay = backoff_delay(attempts, jitter=jitter, policy=policy)
    return item.model_copy(
        update={"attempts": attempts, "next_attempt_at": now + delay, "last_error": error}
    )


def is_due(item: CleanupItem, *, now: float) -> bool:
    return item.next_attempt_at <= now


def is_stuck(item: CleanupItem, *, policy: CleanupPolicy) -> bool:
    """Failing for long enough that the status must ask for a manual check (CLEANUP_STUCK)."""
    return item.attempts >= policy.stuck_after_attempts

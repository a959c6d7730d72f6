"""Builders of realistic records for the orchestrator tests (no logic under test here)."""

from __future__ import annotations

from orchestrator.models import Phase, Side, Transaction


def transaction(
    *,
    source: Side = Side.LOCAL,
    phase: Phase = Phase.PREFLIGHT,
    generation: int = 8,
    source_generation: int = 7,
    **changes: object,
) -> Transaction:
    """A transaction of area 'a1' of service 'tg' moving away from `source`."""
    return Transaction(
        transaction_id="t-1",
        service="tg",
        area="a1",
        source=source,
        destination=source.other,
        phase=phase,
        generation=generation,
        source_generation=source_generation,
        started_at=1_000.0,
        updated_at=1_000.0,
    ).model_copy(update=changes)

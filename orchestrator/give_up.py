"""Giving a VPS up: the operator's way home when the VPS will not come back.

A provider outage or a closed account leaves areas committed to a VPS that never answers:
their move home cannot stop the source, a rollback cannot fetch the data the VPS wrote.
Giving the VPS up trades that data for the PBX's own (older) copy, explicitly and only once
nothing can run there any more:

1. Allowed only once every remote copy of the area is provably fenced: the area lease of
   every generation that could run on the VPS lapsed (`last acknowledged grant + TTL ×
   (1 + margin) + safety`, on the local monotonic clock: orchestrator/area_leases.py).
   Until then `decide()` says `NotFenced(until)`, and nothing is recorded.
2. Recorded first in the lineage: the PBX holds the newest data from now on
   (`lineage.discarded(keep=LOCAL)`, a new epoch), which removes the area from every grant
   to the VPS (`rules.desired_runs`) — a VPS that returns finds its areas ungranted and
   fenced by generation, and its copies are only ever cleaned up, never started.
3. Then the area's transaction goes home: a move home in flight starts over as a give-up
   (`Outcome.SOURCE_ABANDONED`, a new generation: its source is waited out by its lease,
   never asked), a rollback waiting for the VPS's data restarts its source on the PBX's
   copy, and an area simply committed to the VPS gets a give-up move home opened by the
   engine (`abandons_source`).

Called by monitord/engine/operator_verbs.py (the give-up), monitord/engine/migration_engine.py
(what to open) and the model checker's world (tests/unit/core/world.py).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from orchestrator import area_leases, phases
from orchestrator.area_leases import LeasePolicy
from orchestrator.errors import ErrorCode, PermanentError
from orchestrator.lineage import Lineage
from orchestrator.models import (
    FORWARD_PHASES,
    Area,
    AreaLease,
    Phase,
    Route,
    Side,
    Transaction,
    reached,
)
from orchestrator.phases import Outcome


@dataclass(frozen=True, slots=True)
class NothingThere:
    """Nothing of the area is on the VPS, or it was given up already: nothing to give up."""


@dataclass(frozen=True, slots=True)
class Busy:
    """A move is writing its commit: ask again in a moment."""

    detail: str


@dataclass(frozen=True, slots=True)
class NotFenced:
    """A remote copy may still run until local monotonic `until`."""

    until: float


@dataclass(frozen=True, slots=True)
class Abandon:
    """Give the VPS's data up (the lineage first), then feed `outcome` to the area's
    transaction, if any (None: the transaction, or the engine, goes on by itself)."""

    outcome: Outcome | None


Decision = NothingThere | Busy | NotFenced | Abandon


def remote_generations(area: Area, txn: Transaction | None) -> frozenset[int]:
    """Every generation of the area that could run on the VPS: the committed one when it is
    committed there, a move's remote source, and a move's remote destination once it could
    have been created and is not proven fenced."""
    generations = set()
    if area.location is Side.REMOTE:
        generations.add(area.generation)
    if txn is not None and txn.is_active:
        if txn.route is Route.REMOTE_TO_LOCAL:  # a source given up already is not counted
            generations.add(txn.source_generation)
        if txn.destination is Side.REMOTE and not txn.destination_fenced:
            started = txn.rollback_from or txn.phase
            if started in FORWARD_PHASES and reached(started, Phase.CREATE_DESTINATION):
                generations.add(txn.generation)
    return frozenset(generations)


def decide(
    *,
    area: Area,
    txn: Transaction | None,
    lineage: Lineage,
    leases: Mapping[int, AreaLease],
    now: float,
    policy: LeasePolicy,
) -> Decision:
    """What giving the VPS up means for one area now. `leases`: the best-known lease of each
    of `remote_generations(area, txn)` (after a restart, one assumed at start-up)."""
    active = txn if txn is not None and txn.is_active else None
    given_up = active is not None and active.route is Route.GIVEN_UP_TO_LOCAL
    if given_up or abandons_source(area, lineage):
        return NothingThere()  # given up already: its move home is on its way
    generations = remote_generations(area, active)
    if not generations and Side.REMOTE not in lineage.holders:
        return NothingThere()
    if active is not None and active.phase in (Phase.COMMIT_LOCATION, Phase.CLEANUP_SOURCE):
        return Busy(f"area {area.uuid} is finishing its move to {active.destination.value}")
    until = max(
        (area_leases.expired_at(leases[g], policy=policy) for g in generations), default=now
    )
    if until > now:
        return NotFenced(until=until)
    if active is None:
        return Abandon(outcome=None)
    if active.source is Side.REMOTE:
        return Abandon(outcome=Outcome.SOURCE_ABANDONED)
    if phases.parked_rollback(active):
        return Abandon(outcome=Outcome.ROLLBACK_RESUMED)
    return Abandon(outcome=None)  # a move out: its rollback, or the reversal, takes it home


def abandons_source(area: Area, lineage: Lineage) -> bool:
    """A move home opened now must be a give-up: the area is committed to the VPS, but the
    PBX alone holds its newest data — which only a give-up records."""
    return area.location is Side.REMOTE and lineage.holders == {Side.LOCAL}


def move_to_open(area: Area, lineage: Lineage, *, desired: Side) -> Side | None:
    """Where a transaction opened for `area` now must go, or None for no move. An area whose
    VPS was given up goes home first, whatever is desired: its data is on the PBX alone, and
    a move back out (if desired) follows as a move like any other."""
    if abandons_source(area, lineage):
        return Side.LOCAL
    return desired if desired is not area.location else None


class VpsNotFenced(PermanentError):
    """A give-up asked before every remote copy is provably fenced; `retry_after_s` says when
    it will be allowed (and `allowed_at`, wall time)."""

    def __init__(self, *, where: str, wait_s: float, wall: float) -> None:
        self.retry_after_s = max(1, int(wait_s + 0.999))
        self.allowed_at = wall + self.retry_after_s
        at = time.strftime("%H:%M:%S UTC", time.gmtime(self.allowed_at))
        super().__init__(
            ErrorCode.VPS_NOT_FENCED,
            f"a copy of {where} on the VPS may still run under its area lease; giving the VPS"
            f" up is allowed in {self.retry_after_s} s (at {at})",
        )

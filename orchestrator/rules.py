"""The safety rules (docs/design.md, "Transactions: phases and outcomes") as pure functions.

1. Before COMMIT_LOCATION the source is authoritative. A failure rolls back: fence the
   destination at ITS generation, then let the source run. If the destination cannot be
   reached, a cleanup item is recorded and the source runs again only after the
   destination's area lease has provably lapsed (area_leases.provably_expired; enforced
   by the guard in phases.advance).
2. After the commit only roll forward (the table has no way back from CLEANUP_SOURCE).
3. Generations are issued once (`GenerationLedger`): the highest issued per area only
   grows, and only when a migration starts; a rolled-back generation is never reused.
4. Crash recovery resumes or rolls back by the committed location (`recovery_outcome`).
5. Preflight failure never stops the source (the table sends PREFLIGHT failures straight
   to ROLLED_BACK, whose only action is Finish); `failure_outcome` parks the service after
   `park_after_failures` consecutive failures until an operator retries; the failures one
   link outage causes count once (`link_outage`).
6. A reversal of the desired location before the commit becomes a rollback, after the
   commit a new transaction (`reversal`).
7. What a step's result becomes before the table sees it: a failed step's outcome
   (`outcome_for_error`: counts towards parking in PREFLIGHT, parks a rollback whose data
   wait outlasted its bound, takes the UNREACHABLE edge for an unreachable side), a
   rollback completed after an error (`settled_outcome`), a passed preflight taking its move
   slot and checking again (`takes_move_slot`, `preflight_again`) and the grant a lease
   expiry is judged by (`lease_to_judge`). The engine performs; these decide.

`desired_runs(side=...)` is the single answer to "which areas may run on this side, at which
generation": the local supervisor's wanted set and the remote grants (lease renewals) are
both computed from it, so no code path can start a source the rules have suppressed, nor
an area on a side that does not hold its newest data (orchestrator/lineage.py).

Called by orchestrator/migration_step.py (the step), monitord/engine/placement_state.py (what
may run, for the supervisor and the lease renewer) and monitord/engine/migration_engine.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Self

from orchestrator import lineage, phases
from orchestrator.errors import ErrorCode
from orchestrator.lineage import Lineage
from orchestrator.models import Area, AreaLease, Phase, Side, Transaction
from orchestrator.phases import Outcome

DEFAULT_PARK_AFTER_FAILURES = 5
# Codes that say the other side could not be reached (not that it answered no): such a step
# is not retried in place, and the table's UNREACHABLE edge is taken where it has one.
UNREACHABLE_CODES = frozenset(
    {ErrorCode.SSH_UNREACHABLE, ErrorCode.SSH_TIMEOUT, ErrorCode.AGENT_UNREACHABLE,
     ErrorCode.ROLLBACK_DATA_UNREACHABLE}
)

# Causes that retrying cannot fix, only an operator (a full disk, a VPS without the memory,
# a refused path, a name too long): a step failing with one parks the service at once, with
# the catalogue's action — in PREFLIGHT before anything stopped, and after a copy once its
# rollback let the source run again — instead of stopping the source again for each of
# park_after_failures tries.
PARK_AT_ONCE_CODES = frozenset(
    {ErrorCode.PREFLIGHT_DISK_SPACE, ErrorCode.PREFLIGHT_MEMORY, ErrorCode.REMOTE_DISK_FULL,
     ErrorCode.LOCAL_DISK_FULL, ErrorCode.REMOTE_PERMISSION_DENIED,
     ErrorCode.LOCAL_PERMISSION_DENIED, ErrorCode.NAME_TOO_LONG}
)


@dataclass(frozen=True, slots=True)
class GenerationLedger:
    """The highest generation ever issued per area (kept durably by the store)."""

    highest: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))

    def issue(self, area: str, *, floor: int = 0) -> tuple[Self, int]:
        """(new ledger, a generation never issued before for `area`, above `floor`).

        `floor` is the generation committed in custom_config.json: a legacy file may carry a
        generation the ledger never saw, and a new one must exceed it too.
        """
        generation = max(self.highest.get(area, 0), floor) + 1
        return type(self)(MappingProxyType({**self.highest, area: generation})), generation

    def to_storage(self) -> dict[str, int]:
        return dict(self.highest)

    @classmethod
    def from_storage(cls, data: Mapping[str, Any]) -> Self:
        return cls(MappingProxyType({str(k): int(v) for k, v in data.items()}))


def _l2r_destination_runs(phase: Phase) -> bool:
    return phase in (
        Phase.CREATE_DESTINATION,
        Phase.HEALTHCHECK_DESTINATION,
        Phase.COMMIT_LOCATION,
        Phase.CLEANUP_SOURCE,
    )


def source_may_run(txn: Transaction) -> bool:
    """The source may run: not yet suppressed, or the rollback fenced the destination."""
    if txn.phase in (Phase.PREFLIGHT, Phase.PARKED, Phase.ROLLED_BACK):
        return True
    return txn.phase is Phase.ROLLBACK and txn.destination_fenced


def destination_may_run(txn: Transaction) -> bool:
    """The destination may run: created and not being rolled back."""
    return _l2r_destination_runs(txn.phase) or txn.phase is Phase.DONE


def desired_runs(
    *,
    side: Side,
    authoritative: Iterable[Area],
    transactions: Iterable[Transaction],
    lineages: Mapping[str, Lineage],
) -> Mapping[str, int]:
    """area -> generation of every area that may run on `side` right now.

    Areas in no active transaction run where they are committed, at the committed
    generation. An area in an active transaction runs on its source while the source may
    run and on its destination while the destination may run, never both (the phases where
    both are false are exactly the handover window). On top of that, nothing runs on a side
    that does not alone hold the area's newest data (`lineage.may_run`); an area missing
    from `lineages` holds it where it is committed.
    """
    committed = {area.uuid: area for area in authoritative}
    result = {uuid: area.generation for uuid, area in committed.items() if area.location is side}
    for txn in transactions:
        if not txn.is_active:
            continue
        result.pop(txn.area, None)
        if txn.source is side and source_may_run(txn):
            result[txn.area] = txn.source_generation
        elif txn.destination is side and destination_may_run(txn):
            result[txn.area] = txn.generation
    return {
        uuid: generation
        for uuid, generation in result.items()
        if lineage.may_run(lineage_of(uuid, lineages=lineages, committed=committed), side)
    }


def lineage_of(area: str, *, lineages: Mapping[str, Lineage], committed: Mapping[str, Area]
               ) -> Lineage:
    """The area's recorded lineage, or the default for one never recorded."""
    recorded = lineages.get(area)
    if recorded is not None:
        return recorded
    placed = committed.get(area)
    if placed is None:  # not in custom_config.json: nothing may run it
        return Lineage(area=area, holders=frozenset())
    return lineage.default_for(placed)


def reverted(committed: Mapping[str, Area], found: Iterable[Area]) -> list[tuple[Area, Area]]:
    """(as found, as committed) for each area custom_config.json now names at an older
    generation than the one committed: a stale write (a writer put back a copy of the file
    it read before a commit). Generations only grow, so the committed one is the truth and
    the file's is never acted on."""
    return [(area, committed[area.uuid]) for area in found
            if area.uuid in committed and area.generation < committed[area.uuid].generation]


def recovery_outcome(txn: Transaction, *, committed: Area) -> Outcome | None:
    """The outcome to apply to an active transaction found after a restart.

    The committed location in custom_config.json decides: committed to the destination at
    this transaction's generation -> roll forward; anything else -> roll back. None for a
    record that needs no recovery step (final or parked).
    """
    if not txn.is_active or txn.phase is Phase.PARKED:
        return None
    is_committed = committed.location is txn.destination and committed.generation == txn.generation
    if is_committed:
        return Outcome.RECOVERED_COMMITTED
    return Outcome.RECOVERED_UNCOMMITTED


@dataclass(frozen=True, slots=True)
class Reversal:
    """What a change of the desired location means for an active transaction.

    `outcome`: apply this to the transaction now (a rollback), or None.
    `new_transaction_after`: start a new transaction back once this one is DONE.
    """

    outcome: Outcome | None
    new_transaction_after: bool


def reversal(txn: Transaction, *, desired: Side) -> Reversal:
    """Before the commit a reversal is a rollback; after it, a new transaction."""
    if not txn.is_active or desired is txn.destination:
        return Reversal(outcome=None, new_transaction_after=False)
    if not phases.reversible(txn):
        # A give-up is not undone half-way: the source's data is gone; a new move follows.
        return Reversal(outcome=None, new_transaction_after=True)
    if txn.phase.is_committed:
        return Reversal(outcome=None, new_transaction_after=True)
    if txn.phase in (Phase.ROLLBACK, Phase.PARKED):
        return Reversal(outcome=None, new_transaction_after=False)  # already going back
    return Reversal(outcome=Outcome.REVERSE_REQUESTED, new_transaction_after=False)


@dataclass(frozen=True, slots=True)
class LinkEpoch:
    """The tunnel as the engine sees it: `connections` made so far, and whether it is up."""

    connections: int
    connected: bool


def link_outage(
    error_code: str | None, *, step_began_in: int | None, link: LinkEpoch | None
) -> int | None:
    """The link outage a failed transaction belongs to, or None: a failure of its own.

    A transaction whose failing step began while the tunnel's `step_began_in`-th connection
    was the last one, and which could not reach the VPS, with the link down now or
    reconnected since, failed because that link went away (or never came back). Every area
    of a service a single outage hits fails the same way, and so does each retry while it
    lasts: the engine counts such failures once per outage towards parking (rule 5), so one
    cut does not park a service with many areas in flight, while a VPS that answers over a
    steady link but keeps failing is still counted per failure."""
    if error_code not in UNREACHABLE_CODES or step_began_in is None or link is None:
        return None
    if link.connected and link.connections == step_began_in:
        return None
    return step_began_in


def failure_outcome(
    *, consecutive_failures: int, park_after_failures: int = DEFAULT_PARK_AFTER_FAILURES
) -> Outcome:
    """How a failed preflight (or a completed rollback) ends: retry later, or park.

    `consecutive_failures` counts the failure being reported.
    """
    return Outcome.PARK if consecutive_failures >= park_after_failures else Outcome.FAILED


def rollback_completion_outcome(
    *, consecutive_failures: int, park_after_failures: int = DEFAULT_PARK_AFTER_FAILURES
) -> Outcome:
    """How a rollback ends once the source runs again: ROLLED_BACK, or PARKED at the limit."""
    if consecutive_failures >= park_after_failures:
        return Outcome.PARK
    return Outcome.OK


def outcome_for_error(
    txn: Transaction,
    *,
    error_code: str,
    consecutive_failures: int,
    park_after_failures: int,
    at: float,
    rollback_data_wait_s: float,
) -> Outcome:
    """The outcome a step of `txn` that failed with `error_code` reports (rule 7).

    Every failed preflight counts towards parking (`consecutive_failures` counts this one),
    an unreachable VPS included (the engine counts an outage once: `link_outage`). A
    rollback waiting for the destination's newer data since `txn.data_wait_since` parks once
    `rollback_data_wait_s` passed (wall `at`): the area stays stopped, bounded, and an
    operator chooses. Otherwise an unreachable side takes the
    UNREACHABLE edge where the table has one, and anything else is FAILED."""
    if txn.phase is Phase.PREFLIGHT and error_code in PARK_AT_ONCE_CODES:
        return Outcome.PARK
    if txn.phase is Phase.PREFLIGHT:
        outcome = failure_outcome(
            consecutive_failures=consecutive_failures, park_after_failures=park_after_failures
        )
        if outcome is Outcome.PARK:
            return outcome
    waited = txn.data_wait_since
    if txn.phase is Phase.ROLLBACK and waited is not None and at - waited >= rollback_data_wait_s:
        return Outcome.PARK
    if error_code in UNREACHABLE_CODES and Outcome.UNREACHABLE in phases.allowed(txn):
        return Outcome.UNREACHABLE
    return Outcome.FAILED


def settled_outcome(
    txn: Transaction, outcome: Outcome, *, consecutive_failures: int, park_after_failures: int
) -> Outcome:
    """The outcome the table is fed for what a step of `txn` observed: a rollback that
    completed after an error ends ROLLED_BACK, or PARKED at the limit
    (`rollback_completion_outcome`) or at once after a cause retrying cannot fix
    (`PARK_AT_ONCE_CODES`); any other outcome unchanged."""
    if txn.phase is Phase.ROLLBACK and outcome is Outcome.OK and txn.last_error_code:
        if txn.last_error_code in PARK_AT_ONCE_CODES:
            return Outcome.PARK
        return rollback_completion_outcome(
            consecutive_failures=consecutive_failures, park_after_failures=park_after_failures
        )
    return outcome


def takes_move_slot(txn: Transaction, outcome: Outcome, *, failed: bool) -> bool:
    """A passed preflight: the area takes its move slot before the next phase is stored
    (monitord/engine/move_slots.py), and checks again if that meant waiting."""
    return txn.phase is Phase.PREFLIGHT and not failed and outcome is Outcome.OK


def preflight_again(actions: Iterable[phases.Action]) -> tuple[phases.Action, ...]:
    """The checks to run once more after waiting for the move slot: the preflight actions,
    marked `again` (the checks without the pre-copy, right before the source stops)."""
    return tuple(dataclasses.replace(a, again=True) for a in actions
                 if isinstance(a, phases.RunPreflight))


def lease_to_judge(actions: Iterable[phases.Action], *, known: AreaLease | None) -> AreaLease:
    """The grant a LEASE_EXPIRED outcome is judged by: the one the WaitLeaseExpiry among
    `actions` waited out, or `known` if it was acknowledged later (learnt meanwhile)."""
    waited = next(a.lease for a in actions if isinstance(a, phases.WaitLeaseExpiry))
    later = known is not None and known.acknowledged_at > waited.acknowledged_at
    return known if later and known is not None else waited


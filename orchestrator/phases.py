"""The migration state machine: one table of allowed phase moves, `advance()` that applies
an outcome to a transaction, and `next_actions()` that says what to do for a record.

Theory of operation
-------------------
A transaction (models.Transaction) moves one area from its source side to its destination
side through the phases of the table below. The runtime never decides where to go: it
performs the actions it is handed, observes what happened, and orchestrator/migration_step.py
names the result as an `Outcome` and feeds it to `advance()`. The whole protocol is

    TRANSITIONS[route][phase][outcome] -> next phase

in the spirit of h11's EVENT_TRIGGERED_TRANSITIONS (a route is a direction, and a move
home from a VPS given up is a route of its own: models.Route). A pair that the table lacks is not a
move: `advance()` raises `IllegalTransition` and the caller's record stays what it was (the
records are frozen values, so "unchanged" is literal). The two directions share the
shape of the happy path but differ where the sides differ: only a remote destination can
be unreachable while it is fenced, so only local->remote rollbacks wait for a lease to
lapse (`LEASE_EXPIRED`); a local destination that will not stop is retried instead.

Besides the table, four guards protect the safety rules (orchestrator/rules.py explains
them): a rollback may restart the source only once the destination is fenced
(`destination_fenced`) and only once the source holds the newest data again
(orchestrator/lineage.py); a lease counts as lapsed only when area_leases.provably_expired()
says so at the `now` passed in; a retry out of PARKED needs a freshly issued generation.

What to do in a phase is derived from the record alone (`next_actions()`), so after a
crash the runtime resumes by asking for the next actions of the stored record: every
action is idempotent and generation-checked. docs/phases.md is generated from this table.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType

from orchestrator import area_leases, lineage
from orchestrator.area_leases import LeasePolicy
from orchestrator.errors import ErrorCode, PermanentError
from orchestrator.lineage import Lineage
from orchestrator.models import (
    AreaLease,
    CleanupAction,
    CleanupItem,
    Phase,
    Route,
    Side,
    Transaction,
    reached,
)


class Outcome(StrEnum):
    """What the runtime observed after performing a phase's actions, or what happened to it."""

    OK = "ok"  # the phase's actions succeeded and were verified
    FAILED = "failed"  # they failed (the record keeps the error code and detail)
    UNREACHABLE = "unreachable"  # the VPS could not be reached to perform them
    FENCED = "fenced"  # rollback: the destination is verified stopped and removed
    LEASE_EXPIRED = "lease_expired"  # rollback: the destination's lease provably lapsed
    RECOVERED_UNCOMMITTED = "recovered_uncommitted"  # restart found the commit not written
    RECOVERED_COMMITTED = "recovered_committed"  # restart found the commit written
    REVERSE_REQUESTED = "reverse_requested"  # the operator asked for the source side again
    PARK = "park"  # failed too often: stop trying until an operator retries
    RETRY_REQUESTED = "retry_requested"  # the operator's retry of a parked service
    ROLLBACK_RESUMED = "rollback_resumed"  # the operator's retry of a rollback parked for data
    DATA_RETURNED = "data_returned"  # rollback: the destination's data is back at the source
    DATA_DISCARDED = "data_discarded"  # rollback: the destination's newer data was given up
    SOURCE_ABANDONED = "source_abandoned"  # the operator gave the VPS up: a move home from it


OUTCOME_MEANINGS: Mapping[Outcome, str] = MappingProxyType({
    Outcome.OK: "the phase's actions succeeded and were verified",
    Outcome.FAILED: "they failed; the record keeps the error code and detail",
    Outcome.UNREACHABLE: "the VPS could not be reached to perform them",
    Outcome.FENCED: "rollback: the destination is verified stopped and removed at its generation",
    Outcome.LEASE_EXPIRED: "rollback: the destination's area lease has provably lapsed",
    Outcome.RECOVERED_UNCOMMITTED: "after a restart, custom_config.json shows no commit",
    Outcome.RECOVERED_COMMITTED: "after a restart, custom_config.json shows the commit",
    Outcome.REVERSE_REQUESTED: "the operator asked for the source side again",
    Outcome.PARK: "failed too often: stop retrying until an operator asks",
    Outcome.RETRY_REQUESTED: "the operator's retry of a parked service (new generation)",
    Outcome.ROLLBACK_RESUMED: "the operator's retry (or discard) of a rollback that parked"
                              " waiting for its data: the rollback goes on where it stopped",
    Outcome.DATA_RETURNED: "rollback: the data the destination wrote is copied back, verified",
    Outcome.DATA_DISCARDED: "rollback: the destination's newer data was given up (by policy"
                            " or the operator's override)",
    Outcome.SOURCE_ABANDONED: "the operator gave the VPS up: the move home starts again (new"
                              " generation) without its source, fenced by its lease alone",
})


class IllegalTransition(PermanentError):
    """A move the phase table (or one of its guards) does not allow; nothing was changed."""

    def __init__(self, detail: str) -> None:
        super().__init__(ErrorCode.TRANSACTION_CONFLICT, detail)


_O = Outcome
_P = Phase
_BEFORE_COMMIT_FAILURES = (_O.FAILED, _O.REVERSE_REQUESTED, _O.RECOVERED_UNCOMMITTED)


def _forward(next_phase: Phase, *, unreachable: bool) -> dict[Outcome, Phase]:
    moves = {_O.OK: next_phase} | {outcome: _P.ROLLBACK for outcome in _BEFORE_COMMIT_FAILURES}
    if unreachable:
        moves[_O.UNREACHABLE] = _P.ROLLBACK
    return moves


def _table(route: Route) -> Mapping[Phase, Mapping[Outcome, Phase]]:
    if route is Route.GIVEN_UP_TO_LOCAL:
        return _given_up(_table(Route.REMOTE_TO_LOCAL))
    l2r = route is Route.LOCAL_TO_REMOTE
    # Which phases talk to the VPS (and can therefore meet an unreachable VPS):
    # local->remote: all up to the destination's health check; remote->local: the
    # source's stop and the download, then the source's cleanup after the commit.
    rows: dict[Phase, dict[Outcome, Phase]] = {
        _P.PREFLIGHT: {
            _O.OK: _P.SUPPRESS_SOURCE,
            _O.FAILED: _P.ROLLED_BACK,
            _O.UNREACHABLE: _P.ROLLED_BACK,
            _O.REVERSE_REQUESTED: _P.ROLLED_BACK,
            _O.RECOVERED_UNCOMMITTED: _P.ROLLED_BACK,
            _O.PARK: _P.PARKED,
        },
        _P.SUPPRESS_SOURCE: _forward(_P.COPY, unreachable=True),
        _P.COPY: _forward(_P.CREATE_DESTINATION, unreachable=True),
        _P.CREATE_DESTINATION: _forward(_P.HEALTHCHECK_DESTINATION, unreachable=l2r),
        _P.HEALTHCHECK_DESTINATION: _forward(_P.COMMIT_LOCATION, unreachable=l2r),
        _P.COMMIT_LOCATION: {
            **_forward(_P.CLEANUP_SOURCE, unreachable=False),
            _O.RECOVERED_COMMITTED: _P.CLEANUP_SOURCE,
        },
        _P.CLEANUP_SOURCE: {
            _O.OK: _P.DONE,
            _O.FAILED: _P.DONE,  # rolls forward: the leftovers become a cleanup item
            _O.RECOVERED_COMMITTED: _P.CLEANUP_SOURCE,
            **({} if l2r else {_O.UNREACHABLE: _P.DONE}),
        },
        _P.DONE: {},
        _P.ROLLBACK: {
            _O.FENCED: _P.ROLLBACK,
            _O.DATA_RETURNED: _P.ROLLBACK,
            _O.DATA_DISCARDED: _P.ROLLBACK,
            _O.FAILED: _P.ROLLBACK,
            _O.RECOVERED_UNCOMMITTED: _P.ROLLBACK,
            _O.OK: _P.ROLLED_BACK,
            _O.PARK: _P.PARKED,
            # Both directions may meet an unreachable VPS here: fencing a remote destination,
            # or returning the data to a remote source.
            _O.UNREACHABLE: _P.ROLLBACK,
            **({_O.LEASE_EXPIRED: _P.ROLLBACK} if l2r else {}),
        },
        _P.ROLLED_BACK: {},
        _P.PARKED: {_O.RETRY_REQUESTED: _P.PREFLIGHT, _O.ROLLBACK_RESUMED: _P.ROLLBACK},
    }
    if not l2r:
        # A VPS given up (orchestrator/give_up.py): a move home from it starts over without
        # its source, from any phase before the commit, on the table of its own route.
        for phase in _ABANDONABLE:
            rows[phase][_O.SOURCE_ABANDONED] = _P.PREFLIGHT
    return MappingProxyType({phase: MappingProxyType(moves) for phase, moves in rows.items()})


def _given_up(home: Mapping[Phase, Mapping[Outcome, Phase]]
              ) -> Mapping[Phase, Mapping[Outcome, Phase]]:
    """A move home from a VPS given up: the move home's table, except that there is nothing
    to roll back to (the source's data is given up): a step that fails is tried again, the
    move is not reversed, and its source is waited out by its lease instead of stopped."""
    rows: dict[Phase, dict[Outcome, Phase]] = {}
    for phase, moves in home.items():
        rows[phase] = {
            outcome: phase if target is _P.ROLLBACK else target
            for outcome, target in moves.items()
            if outcome not in _NOT_GIVEN_UP and phase is not _P.ROLLBACK
        }
    rows[_P.SUPPRESS_SOURCE][_O.LEASE_EXPIRED] = _P.COPY
    return MappingProxyType({phase: MappingProxyType(moves) for phase, moves in rows.items()})


# The phases of a move home that a give-up of its VPS restarts (everything before the commit).
_ABANDONABLE = (
    _P.PREFLIGHT, _P.SUPPRESS_SOURCE, _P.COPY, _P.CREATE_DESTINATION,
    _P.HEALTHCHECK_DESTINATION, _P.ROLLBACK, _P.PARKED,
)
# What a move home from a VPS given up never meets: it is not reversed, not given up again,
# and never in a rollback to resume.
_NOT_GIVEN_UP = frozenset({_O.REVERSE_REQUESTED, _O.SOURCE_ABANDONED, _O.ROLLBACK_RESUMED})


TRANSITIONS: Mapping[Route, Mapping[Phase, Mapping[Outcome, Phase]]] = MappingProxyType(
    {route: _table(route) for route in Route}
)


# ---------------------------------------------------------------------------- actions


@dataclass(frozen=True, slots=True, kw_only=True)
class Action:
    """Something the runtime must do (and verify) for one transaction's area."""

    transaction_id: str
    service: str
    area: str


@dataclass(frozen=True, slots=True, kw_only=True)
class RunPreflight(Action):
    """The preflight checks (monitord/remote/preflight.py); no side effects on either side.
    `again`: the checks once more, without the pre-copy, right before the source stops
    (after the area waited for its turn to move). `source_given_up`: the source is a VPS
    given up: nothing is asked of it, and nothing copied from it."""

    source: Side
    destination: Side
    again: bool = False
    source_given_up: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class SuppressSource(Action):
    """Durably mark the source suppressed, stop its daemon at `generation`, verify it gone."""

    side: Side
    generation: int


@dataclass(frozen=True, slots=True, kw_only=True)
class CopyData(Action):
    """Copy the area's data to a staging dir, verify its manifest, rename into place;
    `own_copy`: the source is a VPS given up: restore the PBX's own copy instead."""

    source: Side
    destination: Side
    generation: int
    own_copy: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class CreateDestination(Action):
    """Create the destination entry at `generation` and start it.

    A remote destination is created with an area lease of `lease_ttl_s` (None for local);
    the runtime records the grant's time when the agent's answer arrives, on its own
    monotonic clock. With the answer lost, the grant is uncertain and counts as "now" for as
    long as the connection that carried it lives (see WaitLeaseExpiry).
    """

    side: Side
    generation: int
    lease_ttl_s: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckHealth(Action):
    """Wait for the destination to run for the minimum uptime (and pass its probe)."""

    side: Side
    generation: int


@dataclass(frozen=True, slots=True, kw_only=True)
class CommitLocation(Action):
    """Write custom_config.json: the area's location and generation (the commit point)."""

    location: Side
    generation: int


@dataclass(frozen=True, slots=True, kw_only=True)
class CleanupSource(Action):
    """Remove the source's leftovers at its generation and clear its suppression."""

    side: Side
    generation: int


@dataclass(frozen=True, slots=True, kw_only=True)
class FenceDestination(Action):
    """Stop the destination at ITS generation only and verify it gone.

    `keep_data`: the destination may have run and written newer data than the source's, so
    its data (and remote entry) stay until that data is back at the source; otherwise the
    entry and data are removed at once."""

    side: Side
    generation: int
    keep_data: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class ReturnData(Action):
    """Copy the fenced destination's data back to the source (same manifest and checks as
    COPY), then report Outcome.DATA_RETURNED. The source starts only on the newest data."""

    source: Side  # where the newest data is now: the transaction's destination
    destination: Side  # the transaction's source
    source_generation: int
    destination_generation: int


@dataclass(frozen=True, slots=True, kw_only=True)
class EnqueueCleanup(Action):
    """Durably record a cleanup item (idempotent: the item's key is unique)."""

    item: CleanupItem


@dataclass(frozen=True, slots=True, kw_only=True)
class WaitLeaseExpiry(Action):
    """Wait until local monotonic `until`, then report Outcome.LEASE_EXPIRED.

    `lease` is the grant being waited out. When the runtime knew no grant of this
    generation (StepContext.lease was None or of another generation) it is a conservative
    one assumed at `now`: the runtime must keep it and pass it back as StepContext.lease,
    or the deadline would move with every call. `ask`: the VPS may be asked whether the
    entry is gone already (never a VPS given up).
    """

    until: float
    lease: AreaLease
    ask: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class RestartSource(Action):
    """Let the source run again at its generation (local: clear suppression; remote: grant)."""

    side: Side
    generation: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Park(Action):
    """Stop retrying this service until an operator asks; show why."""

    error_code: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Finish(Action):
    """Nothing left to do for this transaction."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StepContext:
    """What `advance()` and `next_actions()` need besides the record: times, the error,
    the lease and policy.

    `at` is wall time (updated_at); `now` is the local monotonic clock; `lease` is the
    destination's area lease as last acknowledged (after a restart: area_leases.after_restart).
    """

    at: float
    now: float = 0.0
    policy: LeasePolicy = field(default_factory=LeasePolicy)
    lease: AreaLease | None = None
    error_code: str | None = None
    error_detail: str | None = None
    new_generation: int | None = None
    lineage: Lineage | None = None  # the area's data lineage; None: the source holds it


# ---------------------------------------------------------------------------- step


def allowed(txn: Transaction) -> Mapping[Outcome, Phase]:
    """The outcomes the table accepts for this record's route and phase."""
    return TRANSITIONS[txn.route][txn.phase]


def reversible(txn: Transaction) -> bool:
    """The record's route can be reversed at all (a move home from a VPS given up cannot:
    the data its source had is given up)."""
    return Outcome.REVERSE_REQUESTED in TRANSITIONS[txn.route][Phase.PREFLIGHT]


def loops_on_failure(txn: Transaction) -> bool:
    """A failure in this phase sends the record back to the same phase (a rollback's step,
    any step of a move home from a VPS given up): it is looked at again after a pause."""
    return allowed(txn).get(Outcome.FAILED) is txn.phase


def judged_lease_generation(txn: Transaction) -> int | None:
    """The generation whose area lease this record's steps are judged by: a move home from a
    VPS given up waits its source's out; a move to the VPS may have to wait its
    destination's; None: no lease of the VPS matters to it."""
    if txn.route is Route.GIVEN_UP_TO_LOCAL:
        return txn.source_generation
    if txn.destination is Side.REMOTE:
        return txn.generation
    return None


def _destination_could_run(txn: Transaction) -> bool:
    return txn.rollback_from is not None and reached(txn.rollback_from, Phase.CREATE_DESTINATION)


def _guard(txn: Transaction, outcome: Outcome, ctx: StepContext) -> None:
    where = f"{txn.transaction_id} ({txn.direction}) in {txn.phase}"
    if txn.phase is Phase.ROLLBACK and outcome in (Outcome.OK, Outcome.PARK):
        if not txn.destination_fenced:
            raise IllegalTransition(f"{where}: source may not run before the destination is fenced")
    if txn.phase is Phase.ROLLBACK and outcome is Outcome.OK and awaits_data(txn, ctx.lineage):
        raise IllegalTransition(f"{where}: source may not run before the newest data is back")
    if outcome is Outcome.LEASE_EXPIRED:
        waited = _lease_waited(txn)
        if ctx.lease is None or not area_leases.provably_expired(
            ctx.lease, now=ctx.now, policy=ctx.policy
        ):
            raise IllegalTransition(f"{where}: the {waited} lease has not provably lapsed")
        expected = txn.source_generation if waited == "source's" else txn.generation
        if ctx.lease.generation != expected:
            raise IllegalTransition(f"{where}: lease is for generation {ctx.lease.generation}")
    if outcome is Outcome.SOURCE_ABANDONED:
        if ctx.new_generation is None or ctx.new_generation <= txn.generation:
            raise IllegalTransition(f"{where}: a give-up needs a newly issued generation")
        if ctx.lineage is None or ctx.lineage.holders != {txn.destination}:
            # The give-up is recorded in the lineage first: that stops every grant to the VPS.
            raise IllegalTransition(f"{where}: the VPS's data is not given up in the lineage")
    if outcome is Outcome.RETRY_REQUESTED:
        if ctx.new_generation is None or ctx.new_generation <= txn.generation:
            raise IllegalTransition(f"{where}: a retry needs a newly issued generation")
        if parked_rollback(txn) and awaits_data(txn, ctx.lineage):
            # Starting over would abandon the newest data where the rollback left it.
            raise IllegalTransition(f"{where}: a rollback waiting for its data is resumed")
    if outcome is Outcome.ROLLBACK_RESUMED and not parked_rollback(txn):
        raise IllegalTransition(f"{where}: only a rollback that parked can be resumed")


def _updates(
    txn: Transaction, outcome: Outcome, target: Phase, ctx: StepContext
) -> dict[str, object]:
    changes: dict[str, object] = {"phase": target, "updated_at": ctx.at}
    if ctx.error_code is not None:
        changes["last_error_code"] = ctx.error_code
        changes["last_error_detail"] = ctx.error_detail
    if outcome is Outcome.ROLLBACK_RESUMED:
        changes["data_wait_since"] = None  # a new wait, measured from its first failure
    elif outcome is Outcome.SOURCE_ABANDONED:
        changes.update(_fresh_attempt(txn, ctx), source_abandoned=True)
    elif target is Phase.ROLLBACK and txn.phase is not Phase.ROLLBACK:
        # Nothing can run at the destination before CREATE_DESTINATION was entered.
        changes["rollback_from"] = txn.phase
        changes["destination_fenced"] = not reached(txn.phase, Phase.COPY)
    elif txn.phase is Phase.ROLLBACK:
        if outcome in (Outcome.FENCED, Outcome.LEASE_EXPIRED):
            changes["destination_fenced"] = True
        elif outcome in (Outcome.DATA_RETURNED, Outcome.DATA_DISCARDED):
            changes["data_wait_since"] = None
        elif (
            outcome in (Outcome.FAILED, Outcome.UNREACHABLE)
            and txn.destination_fenced
            and awaits_data(txn, ctx.lineage)
        ):
            # The copy-back failed: the source stays stopped; remember since when.
            if txn.data_wait_since is None:
                changes["data_wait_since"] = ctx.at
        elif outcome in (Outcome.UNREACHABLE, Outcome.FAILED) and txn.destination is Side.REMOTE:
            # The destination could not be fenced: a cleanup item takes over removing it,
            # and the source waits for its lease to lapse if it could ever have run.
            changes["cleanup_required"] = True
            if not _destination_could_run(txn):
                changes["destination_fenced"] = True
    elif txn.phase is Phase.CLEANUP_SOURCE and outcome in (Outcome.FAILED, Outcome.UNREACHABLE):
        changes["cleanup_required"] = True
    elif outcome is Outcome.RETRY_REQUESTED:
        changes.update(_fresh_attempt(txn, ctx), last_error_code=None, last_error_detail=None)
    return changes


def _fresh_attempt(txn: Transaction, ctx: StepContext) -> dict[str, object]:
    """A transaction starting over (a retry, a give-up): the next attempt at a newly issued
    generation, with nothing of the previous attempt's rollback left."""
    return {
        "attempt": txn.attempt + 1,
        "generation": ctx.new_generation,
        "rollback_from": None,
        "destination_fenced": False,
        "cleanup_required": False,
        "data_wait_since": None,
    }


def advance(txn: Transaction, outcome: Outcome, ctx: StepContext) -> Transaction:
    """The record after `outcome`; raises IllegalTransition (record untouched) if not allowed."""
    target = allowed(txn).get(outcome)
    if target is None:
        raise IllegalTransition(
            f"{txn.transaction_id} ({txn.direction}): no move from {txn.phase} on {outcome}"
        )
    _guard(txn, outcome, ctx)
    return txn.model_copy(update=_updates(txn, outcome, target, ctx))


def cleanup_item_for(txn: Transaction, *, side: Side, generation: int, at: float) -> CleanupItem:
    """The cleanup item a transaction leaves behind; its id makes enqueueing idempotent."""
    is_destination = side is txn.destination
    action = CleanupAction.REMOVE_AREA if is_destination else CleanupAction.REMOVE_LEFTOVERS
    return CleanupItem(
        id=f"{txn.transaction_id}:{side}:{generation}:{action}",
        service=txn.service,
        area=txn.area,
        side=side,
        generation=generation,
        action=action,
        next_attempt_at=at,
        created_at=at,
    )


def next_actions(txn: Transaction, ctx: StepContext) -> tuple[Action, ...]:
    """What the runtime must do next for this record, derived from the record alone."""
    ids = {"transaction_id": txn.transaction_id, "service": txn.service, "area": txn.area}
    dest_side, dest_gen = txn.destination, txn.generation
    src_side, src_gen = txn.source, txn.source_generation
    given_up = txn.route is Route.GIVEN_UP_TO_LOCAL
    match txn.phase:
        case Phase.PREFLIGHT:
            return (RunPreflight(transaction_id=txn.transaction_id, service=txn.service,
                                 area=txn.area, source=txn.source, destination=txn.destination,
                                 source_given_up=given_up),)
        case Phase.SUPPRESS_SOURCE:
            if given_up:
                # A source on a VPS given up is never asked: its lease is waited out.
                return (_lease_wait(txn, ctx, generation=src_gen, ask=False),)
            return (SuppressSource(**ids, side=src_side, generation=src_gen),)
        case Phase.COPY:
            return (
                CopyData(
                    **ids,
                    source=txn.source,
                    destination=txn.destination,
                    generation=txn.generation,
                    own_copy=given_up,
                ),
            )
        case Phase.CREATE_DESTINATION:
            ttl = ctx.policy.ttl_s if dest_side is Side.REMOTE else None
            return (
                CreateDestination(**ids, side=dest_side, generation=dest_gen, lease_ttl_s=ttl),
            )
        case Phase.HEALTHCHECK_DESTINATION:
            return (CheckHealth(**ids, side=dest_side, generation=dest_gen),)
        case Phase.COMMIT_LOCATION:
            return (CommitLocation(**ids, location=txn.destination, generation=txn.generation),)
        case Phase.CLEANUP_SOURCE:
            return (CleanupSource(**ids, side=src_side, generation=src_gen),)
        case Phase.DONE:
            if txn.cleanup_required:
                item = cleanup_item_for(
                    txn, side=txn.source, generation=txn.source_generation, at=ctx.at
                )
                return (EnqueueCleanup(**ids, item=item), Finish(**ids))
            return (Finish(**ids),)
        case Phase.ROLLED_BACK:
            return (Finish(**ids),)
        case Phase.PARKED:
            return (Park(**ids, error_code=txn.last_error_code),)
        case Phase.ROLLBACK:
            return _rollback_actions(txn, ctx)
    raise AssertionError(f"unhandled phase {txn.phase}")  # pragma: no cover


def parked_rollback(txn: Transaction) -> bool:
    """A PARKED record that parked in the middle of its rollback (the destination fenced,
    the source not yet restarted), as opposed to one parked after failed preflights."""
    return txn.phase is Phase.PARKED and txn.rollback_from is not None and txn.destination_fenced


def awaits_data(txn: Transaction, current: Lineage | None) -> bool:
    """A rollback whose source does not hold the newest data: the destination ran and wrote,
    so the data must come back (or be given up) before the source may start."""
    return current is not None and not lineage.may_claim(current, txn.source)


def _rollback_actions(txn: Transaction, ctx: StepContext) -> tuple[Action, ...]:
    ids = {"transaction_id": txn.transaction_id, "service": txn.service, "area": txn.area}
    actions: list[Action] = []
    kept_data = _destination_could_run(txn)
    if txn.cleanup_required or (txn.destination_fenced and kept_data):
        # The destination's leftovers (entry, data) go by the durable cleanup queue, which
        # never deletes a side's data while that side holds the newest copy.
        item = cleanup_item_for(txn, side=txn.destination, generation=txn.generation, at=ctx.at)
        actions.append(EnqueueCleanup(**ids, item=item))
    if txn.destination_fenced and awaits_data(txn, ctx.lineage):
        actions.append(
            ReturnData(
                **ids,
                source=txn.destination,
                destination=txn.source,
                source_generation=txn.generation,
                destination_generation=txn.source_generation,
            )
        )
    elif txn.destination_fenced:
        actions.append(RestartSource(**ids, side=txn.source, generation=txn.source_generation))
    elif txn.cleanup_required:
        actions.append(_lease_wait(txn, ctx, generation=txn.generation))
    else:
        actions.append(
            FenceDestination(
                **ids, side=txn.destination, generation=txn.generation, keep_data=kept_data
            )
        )
    return tuple(actions)


def _lease_waited(txn: Transaction) -> str:
    """Whose lease a LEASE_EXPIRED ends: a given-up source's, or a rollback's destination's."""
    return "source's" if txn.phase is Phase.SUPPRESS_SOURCE else "destination's"


def _lease_wait(
    txn: Transaction, ctx: StepContext, *, generation: int, ask: bool = True
) -> WaitLeaseExpiry:
    """Wait out the VPS's lease of `generation`: the grant the runtime knows, else one assumed
    at `now` (after a restart nothing earlier is known; assuming now is conservative)."""
    lease = ctx.lease
    if lease is None or lease.generation != generation:
        lease = area_leases.after_restart(
            area=txn.area, generation=generation, owner_id="unknown", now=ctx.now,
            policy=ctx.policy,
        )
    until = area_leases.expired_at(lease, policy=ctx.policy)
    return WaitLeaseExpiry(transaction_id=txn.transaction_id, service=txn.service,
                           area=txn.area, until=until, lease=lease, ask=ask)

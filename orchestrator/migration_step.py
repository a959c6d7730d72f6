"""One step of a migration, decided in one place: the engine and the model both run it.

A runtime drives a stored record by asking `decide()` until it says what to store:

    decide(record, seen)                 -> Perform(actions)   perform them, in order
    decide(record, seen + their Result)  -> TakeSlot(recheck)  a passed preflight: take the
                                                               area's move slot; if that meant
                                                               waiting, perform `recheck`
                                         -> Record(record')    store it, then the next step
                                         -> Idle()             nothing to store (Finish, Park,
                                                               a lease wait not over)

Everything between "what is stored" and "what is stored next" is decided here, in this
order: a reversal of the operator's wish (a rollback before the commit: rules.reversal),
the actions of the phase (phases.next_actions), the move slot and the second preflight
(rules.takes_move_slot, rules.preflight_again), what a failed step means
(rules.outcome_for_error), the grant a lease expiry is judged by (rules.lease_to_judge), a
rollback completed after an error (rules.settled_outcome) and the table itself
(phases.advance). What the rules need to remember between records — consecutive failures
per service, a link outage counted once, the back-off before an area tries again — is a
frozen `Memory` the runtime keeps and gets back updated.

monitord's migration engine (monitord/engine/migration_engine.py) and the model checker
(tests/unit/core/world.py) are the two runtimes: both perform what this returns
and store what it says, so the model checks the engine's own decisions.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TypeVar

from orchestrator import phases, rules
from orchestrator.area_leases import LeasePolicy
from orchestrator.lineage import Lineage
from orchestrator.models import AreaLease, Phase, Side, Transaction
from orchestrator.phases import Action, Outcome, StepContext

_V = TypeVar("_V")


def _empty() -> Mapping[str, _V]:
    return MappingProxyType({})


def _frozen(items: Mapping[str, _V]) -> Mapping[str, _V]:
    return MappingProxyType(dict(items))


@dataclass(frozen=True, slots=True, kw_only=True)
class StepRules:
    """The configured bounds the step is decided by ([monitord] and the lease policy)."""

    park_after_failures: int = rules.DEFAULT_PARK_AFTER_FAILURES
    retry_backoff_base_s: float = 5.0
    retry_backoff_cap_s: float = 300.0
    rollback_data_wait_s: float = 900.0
    policy: LeasePolicy = field(default_factory=LeasePolicy)


@dataclass(frozen=True, slots=True)
class Memory:
    """What the rules remember between records, per service and area (volatile: a restart
    rebuilds the failures from the stored history and forgets the rest).

    `failures`: consecutive failed moves per service (parking counts them); `counted_outage`:
    the link outage last counted per service (one outage counts once: rules.link_outage);
    `began_in`: per transaction, the link's connection count when its failing step began;
    `not_before`: per area, the monotonic time before which no new move opens.
    """

    failures: Mapping[str, int] = field(default_factory=_empty)
    counted_outage: Mapping[str, int] = field(default_factory=_empty)
    began_in: Mapping[str, int] = field(default_factory=_empty)
    not_before: Mapping[str, float] = field(default_factory=_empty)

    @classmethod
    def from_history(cls, history: Iterable[Mapping[str, object]]) -> Memory:
        """The failures a restart finds: per service, the moves that ended failed (rolled
        back or parked with an error) since its last success. `history` is newest first."""
        failures: dict[str, int] = {}
        succeeded: set[str] = set()
        for record in history:
            service, phase = str(record["service"]), record["phase"]
            if service in succeeded:
                continue
            if phase == Phase.DONE.value:
                succeeded.add(service)
            elif phase in (Phase.ROLLED_BACK.value, Phase.PARKED.value) and record.get(
                "last_error_code"
            ):
                failures[service] = failures.get(service, 0) + 1
        return cls(failures=_frozen(failures))

    def failures_of(self, service: str) -> int:
        return self.failures.get(service, 0)

    def may_open(self, area: str, *, now: float) -> bool:
        """No back-off holds `area` at monotonic `now`."""
        return self.not_before.get(area, 0.0) <= now

    def forgiven(self, service: str, *, areas: Iterable[str] = ()) -> Memory:
        """The operator's word (a retry, a give-up): the service's failures forgotten and
        the back-offs of `areas` cleared."""
        failures = {**self.failures, service: 0}
        outages = {k: v for k, v in self.counted_outage.items() if k != service}
        return replace(self.cleared(areas), failures=_frozen(failures),
                       counted_outage=_frozen(outages))

    def cleared(self, areas: Iterable[str]) -> Memory:
        """The back-offs of `areas` cleared: they may open a move at once."""
        gone = set(areas)
        return replace(self, not_before=_frozen(
            {k: v for k, v in self.not_before.items() if k not in gone}))

    def _began(self, transaction_id: str, connections: int) -> Memory:
        return replace(self, began_in=_frozen({**self.began_in, transaction_id: connections}))


@dataclass(frozen=True, slots=True, kw_only=True)
class Result:
    """What performing a Perform's (or a TakeSlot's) actions gave: an outcome, or the code
    and detail of the error they failed with; neither when they reported nothing."""

    actions: tuple[Action, ...]
    outcome: Outcome | None = None
    error_code: str | None = None
    error_detail: str | None = None
    slot_taken: bool = False  # the move slot is held (after a TakeSlot)


@dataclass(frozen=True, slots=True, kw_only=True)
class Seen:
    """What the runtime sees when it asks: its clocks, the operator's wish, the area's
    lineage, the grants it knows by generation, the link, and what it just performed."""

    at: float  # wall time (a record's updated_at)
    now: float  # local monotonic time
    desired: Side | None = None  # None: the area is not in custom_config.json
    lineage: Lineage | None = None
    leases: Mapping[int, AreaLease] = field(default_factory=dict)
    link: rules.LinkEpoch | None = None  # None: no VPS configured
    result: Result | None = None


@dataclass(frozen=True, slots=True)
class Perform:
    actions: tuple[Action, ...]
    memory: Memory


@dataclass(frozen=True, slots=True)
class TakeSlot:
    """Take the move slot before the source stops; `free`: what to report if it was free at
    once; `recheck`: what to perform (and report) if taking it meant waiting."""

    recheck: tuple[Action, ...]
    free: Result


@dataclass(frozen=True, slots=True, kw_only=True)
class Record:
    """Store `record` (before anything of the next step starts) and keep `memory`."""

    record: Transaction
    memory: Memory
    outcome: Outcome
    ended: bool  # final or parked
    destination_healthy: bool = False  # its health check passed: the area's downtime ends
    source_restarted: bool = False  # a rollback let its source run again
    pause: bool = False  # failed back into the same phase: look again after a pause


@dataclass(frozen=True, slots=True)
class Idle:
    """Nothing to store: the record is final or parked, or its wait is not over."""


Decision = Perform | TakeSlot | Record | Idle


def decide(txn: Transaction, seen: Seen, memory: Memory, bounds: StepRules) -> Decision:
    """The next thing to do for the stored record `txn`. Raises phases.IllegalTransition
    (nothing decided) when what was seen is not a move the table allows."""
    if seen.result is None:
        return _begin(txn, seen, memory, bounds)
    return _conclude(txn, seen, seen.result, memory, bounds)


def _begin(txn: Transaction, seen: Seen, memory: Memory, bounds: StepRules) -> Decision:
    if seen.desired is not None:
        reversal = rules.reversal(txn, desired=seen.desired)
        if reversal.outcome is not None:
            return advance(txn, reversal.outcome, seen, memory, bounds)
    if seen.link is not None and txn.last_error_code is None:
        # Kept from the step that failed through its rollback: the outage is judged by when
        # the failing step began, not by when the rollback's last step did.
        memory = memory._began(txn.transaction_id, seen.link.connections)
    return Perform(phases.next_actions(txn, _context(txn, seen, bounds)), memory)


def _conclude(
    txn: Transaction, seen: Seen, result: Result, memory: Memory, bounds: StepRules
) -> Decision:
    code = result.error_code
    if code is None and result.outcome is None:
        return Idle()
    if code is None and result.outcome is not None:
        if not result.slot_taken and rules.takes_move_slot(txn, result.outcome, failed=False):
            return TakeSlot(recheck=rules.preflight_again(result.actions),
                            free=replace(result, slot_taken=True))
        outcome = result.outcome
    else:
        outcome = rules.outcome_for_error(
            txn, error_code=str(code),
            consecutive_failures=_failures_with(memory, txn, code, seen.link),
            park_after_failures=bounds.park_after_failures, at=seen.at,
            rollback_data_wait_s=bounds.rollback_data_wait_s,
        )
    lease = None
    if outcome is Outcome.LEASE_EXPIRED:
        lease = rules.lease_to_judge(result.actions, known=_known_lease(txn, seen.leases))
    return advance(txn, outcome, seen, memory, bounds, error_code=code,
                   error_detail=result.error_detail, lease=lease, performed=result.actions)


def advance(
    txn: Transaction,
    outcome: Outcome,
    seen: Seen,
    memory: Memory,
    bounds: StepRules,
    *,
    error_code: str | None = None,
    error_detail: str | None = None,
    new_generation: int | None = None,
    lease: AreaLease | None = None,
    performed: tuple[Action, ...] = (),
) -> Record:
    """The record after `outcome` (settled first: a rollback completed after an error ends
    rolled back or parked), with the memory counting its end. Also what recovery and the
    operator's verbs feed their outcomes through."""
    outcome = rules.settled_outcome(
        txn, outcome,
        consecutive_failures=_failures_with(memory, txn, txn.last_error_code, seen.link),
        park_after_failures=bounds.park_after_failures,
    )
    ctx = _context(txn, seen, bounds, error_code=error_code, error_detail=error_detail,
                   new_generation=new_generation, lease=lease)
    new = phases.advance(txn, outcome, ctx)
    ended = not new.is_active or new.phase is Phase.PARKED
    if ended:
        memory = _count_end(memory, new, seen, bounds)
    passed = error_code is None
    return Record(
        record=new, memory=memory, outcome=outcome, ended=ended,
        destination_healthy=passed and _any(performed, phases.CheckHealth),
        source_restarted=passed and _any(performed, phases.RestartSource),
        pause=not passed and new.phase is txn.phase and phases.loops_on_failure(txn),
    )


def _any(actions: tuple[Action, ...], kind: type[Action]) -> bool:
    return any(isinstance(action, kind) for action in actions)


def _known_lease(txn: Transaction, leases: Mapping[int, AreaLease]) -> AreaLease | None:
    """The grant the step is judged by (phases.judged_lease_generation), as known."""
    generation = phases.judged_lease_generation(txn)
    return None if generation is None else leases.get(generation)


def _context(
    txn: Transaction,
    seen: Seen,
    bounds: StepRules,
    *,
    error_code: str | None = None,
    error_detail: str | None = None,
    new_generation: int | None = None,
    lease: AreaLease | None = None,
) -> StepContext:
    return StepContext(
        at=seen.at, now=seen.now, policy=bounds.policy,
        lease=lease if lease is not None else _known_lease(txn, seen.leases),
        error_code=error_code, error_detail=error_detail, new_generation=new_generation,
        lineage=seen.lineage,
    )


def _outage_of(memory: Memory, txn: Transaction, error_code: str | None,
               link: rules.LinkEpoch | None) -> int | None:
    began_in = memory.began_in.get(txn.transaction_id)
    return rules.link_outage(error_code, step_began_in=began_in, link=link)


def _failures_with(memory: Memory, txn: Transaction, error_code: str | None,
                   link: rules.LinkEpoch | None) -> int:
    """The service's consecutive failures once this failure of `txn` is counted."""
    return _failures_with_outage(memory, txn.service, _outage_of(memory, txn, error_code, link))


def _failures_with_outage(memory: Memory, service: str, outage: int | None) -> int:
    counted = outage is not None and memory.counted_outage.get(service) == outage
    return memory.failures_of(service) + (0 if counted else 1)


def _count_end(memory: Memory, txn: Transaction, seen: Seen, bounds: StepRules) -> Memory:
    """Consecutive failures per service, and the back-off before this area tries again."""
    outage = _outage_of(memory, txn, txn.last_error_code, seen.link)
    began_in = {k: v for k, v in memory.began_in.items() if k != txn.transaction_id}
    memory = replace(memory, began_in=_frozen(began_in))
    if txn.phase is Phase.DONE:
        return memory.forgiven(txn.service)
    if txn.last_error_code is None:
        return memory
    count = _failures_with_outage(memory, txn.service, outage)
    outages = dict(memory.counted_outage)
    if outage is not None:
        outages[txn.service] = outage
    delay = min(bounds.retry_backoff_cap_s,
                bounds.retry_backoff_base_s * 2 ** (max(1, count) - 1))
    return replace(
        memory,
        failures=_frozen({**memory.failures, txn.service: count}),
        counted_outage=_frozen(outages),
        not_before=_frozen({**memory.not_before, txn.area: seen.now + delay}),
    )

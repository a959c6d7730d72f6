"""The migration engine: drives every area's transaction through the phase table.

A root task ("migration engine"). It never decides a move itself: `orchestrator.phases`
says what to do next for a stored record, `PhaseActions` does it, and the engine feeds the
observed outcome back, persisting each new record BEFORE the next step starts (docs/design.md,
"Transactions: phases and outcomes", rule 1). Concretely, per area:

    record --next_actions--> actions --perform--> outcome --step--> record' --store--> ...

- New transactions come from the operator's wishes (`record_placement`, the HTTP intake)
  and from the periodic tick (wishes not yet satisfied, retries after a back-off). Their
  generation is issued durably by the store and never reused.
- On start-up, `recover()` applies `rules.recovery_outcome` to every unfinished record: the
  committed location in custom_config.json decides roll-forward or roll-back.
- Services run independently; areas of one service with bounded parallelism
  (`services.<name>.parallelism` out of service at once, as many more preparing:
  monitord/engine/move_slots.py).
- A wish reversed mid-transaction becomes a rollback at the next step boundary
  (`rules.reversal`); after the commit it becomes a new transaction.
- `park_after_failures` consecutive failures park the service until `retry()`.
- `stop()` lets each runner finish its current step (bounded), then cancels; every record
  on disk is a valid point to resume from.
- Every transaction's area downtime is recorded (`DowntimeLog`, table `area_downtime`): from
  the moment its source lost the permission to run (the SUPPRESS_SOURCE record stored) to the
  destination's health check passing, or, after a rollback, to the source's first healthy
  moment (watched by a task the engine owns). docs/design.md, "Observability".
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import statistics
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from monitord.base import logs
from monitord.base.metrics import Metrics
from monitord.engine import crash_points, txn_log
from monitord.engine.lease_renewer import LeaseRenewer
from monitord.engine.move_slots import Held, MoveSlots
from monitord.engine.phase_actions import PhaseActions
from monitord.engine.placement_state import PlacementState
from monitord.store.state_db import Store
from orchestrator import errors, give_up, phases, rules
from orchestrator.area_leases import LeasePolicy
from orchestrator.errors import ErrorCode, MonitordError, PermanentError, TransientError
from orchestrator.models import Area, AreaLease, Phase, Side, Transaction
from orchestrator.phases import Outcome

log = logs.get_logger(__name__)

TASK_NAME = "migration engine"
TICK_S = 1.0
STOP_GRACE_S = 5.0
STEP_RETRY_BASE_S = 0.5
STEP_RETRY_CAP_S = 15.0
STEP_ATTEMPTS = 3  # tries of one step on a transient (not "unreachable") error
UNREACHABLE_CODES = frozenset(
    {ErrorCode.SSH_UNREACHABLE, ErrorCode.SSH_TIMEOUT, ErrorCode.AGENT_UNREACHABLE,
     ErrorCode.ROLLBACK_DATA_UNREACHABLE}
)
# Phases whose own failure sends the record back to itself (retry after a pause).
SELF_LOOPING = frozenset({Phase.ROLLBACK})
# After a rollback restarted its source: how long to wait for its first healthy moment (the
# end of the area's downtime), and the pause between two health checks that did not pass.
SOURCE_WATCH_S = 600.0
SOURCE_WATCH_PAUSE_S = 1.0
OUTCOMES = ("done", "rolled_back", "parked")

@dataclass(frozen=True, slots=True, kw_only=True)
class AreaDowntime:
    """One transaction's downtime record (`state.db` table `area_downtime`).

    `stopped_at` (wall) is when the source lost the permission to run; `healthy_at` and
    `healthy_side` when, and on which side, the area was first healthy again (the destination's
    health check, or the source's after a rollback); `downtime_s` the time between, on the
    monotonic clock when both ends happened in this process. `move_id` groups the transactions
    opened together for one service (one placement request or one tick)."""

    transaction_id: str
    service: str
    area: str
    direction: str
    move_id: str
    stopped_at: float | None = None
    healthy_at: float | None = None
    healthy_side: str | None = None
    downtime_s: float | None = None
    outcome: str | None = None  # done, rolled_back or parked, once the transaction ended
    finished_at: float | None = None

    @classmethod
    def first(cls, txn: Transaction, *, move_id: str) -> AreaDowntime:
        return cls(transaction_id=txn.transaction_id, service=txn.service, area=txn.area,
                   direction=txn.direction.value, move_id=move_id)

    @classmethod
    def from_storage(cls, row: Mapping[str, Any]) -> AreaDowntime:
        fields: dict[str, Any] = {f.name: row.get(f.name) for f in dataclasses.fields(cls)}
        return cls(**fields)

    def to_storage(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class DowntimeLog:
    """Per-area downtime of every transaction: written to `state.db` at each mark, observed
    once in `monitord_area_downtime_seconds` when final, logged as `area_downtime`; and, for
    the status, the ended records of each service's last move.

    Called by the engine only: `opened` (transaction stored), `source_stopped` (SUPPRESS_SOURCE
    stored), `healthy` (a health check passed), `rollback_started`, `resumed`, `ended`."""

    def __init__(
        self,
        *,
        store: Store,
        metrics: Metrics,
        on_change: Callable[[], None],
        wall: Callable[[], float],
        clock: Callable[[], float],
    ) -> None:
        self.store = store
        self.metrics = metrics
        self._on_change = on_change
        self._wall = wall
        self._clock = clock
        self._records: dict[str, AreaDowntime] = {}  # transactions still in PlacementState
        self._stopped: dict[str, float] = {}  # transaction_id -> monotonic stop (this process)
        self._moves: dict[str, tuple[str, dict[str, AreaDowntime]]] = {}  # service -> last move

    async def load(self, active: list[Transaction]) -> None:
        """The records of the active transactions and each service's last move (start-up)."""
        for row in await self.store.downtimes([t.transaction_id for t in active]):
            record = AreaDowntime.from_storage(row)
            self._records[record.transaction_id] = record
        for service, rows in (await self.store.last_moves()).items():
            records = [AreaDowntime.from_storage(r) for r in rows]
            self._moves[service] = (records[-1].move_id,
                                    {r.transaction_id: r for r in records})
        self._on_change()

    def _get(self, txn: Transaction) -> AreaDowntime:
        found = self._records.get(txn.transaction_id)
        if found is None:  # a transaction from before downtime records: a move of its own
            found = AreaDowntime.first(txn, move_id=txn.transaction_id)
        return found

    async def _put(self, record: AreaDowntime, *, active: bool = True) -> None:
        await self.store.put_downtime(record.to_storage())
        if active:
            self._records[record.transaction_id] = record
        move = self._moves.get(record.service)
        if move is not None and record.transaction_id in move[1]:
            move[1][record.transaction_id] = record
        self._on_change()

    async def opened(self, txn: Transaction, *, move_id: str) -> None:
        await self._put(AreaDowntime.first(txn, move_id=move_id))

    async def source_stopped(self, txn: Transaction) -> None:
        """The source may no longer run: its supervisor or agent stops it from now on."""
        self._stopped[txn.transaction_id] = self._clock()
        await self._put(dataclasses.replace(
            self._get(txn), stopped_at=self._wall(), healthy_at=None, healthy_side=None,
            downtime_s=None,
        ))

    async def _ended_record(self, txn: Transaction) -> AreaDowntime:
        """The record of a transaction that may have ended already (a watched rollback)."""
        if txn.transaction_id in self._records:
            return self._records[txn.transaction_id]
        move = self._moves.get(txn.service)
        if move is not None and txn.transaction_id in move[1]:
            return move[1][txn.transaction_id]
        rows = await self.store.downtimes([txn.transaction_id])
        return AreaDowntime.from_storage(rows[0]) if rows else self._get(txn)

    async def healthy(self, txn: Transaction, *, side: Side, at: float, now: float) -> None:
        """`side` passed its health check at wall `at` (monotonic `now`)."""
        record = await self._ended_record(txn)
        if record.stopped_at is None:
            return  # nothing was stopped by this transaction (or not recorded): no downtime
        stopped = self._stopped.get(txn.transaction_id)
        downtime = now - stopped if stopped is not None else at - record.stopped_at
        record = dataclasses.replace(record, healthy_at=at, healthy_side=side.value,
                                     downtime_s=max(0.0, downtime))
        ended = record.outcome in ("rolled_back", "parked")  # a rollback's source, watched
        await self._put(record, active=txn.transaction_id in self._records)
        if ended:
            await self._final(record)

    async def rollback_started(self, txn: Transaction) -> None:
        """A destination that passed its health check is no end of the downtime any more:
        it now runs until the source is healthy again."""
        record = self._get(txn)
        if record.healthy_at is not None:
            await self._put(dataclasses.replace(record, healthy_at=None, healthy_side=None,
                                                downtime_s=None))

    async def resumed(self, txn: Transaction, *, fresh: bool) -> None:
        """A PARKED transaction goes on: a retry from PREFLIGHT (`fresh`: a new attempt with
        its own downtime) or a rollback resumed (its downtime goes on)."""
        record = dataclasses.replace(self._get(txn), outcome=None, finished_at=None)
        if fresh:
            self._stopped.pop(txn.transaction_id, None)
            record = dataclasses.replace(record, stopped_at=None, healthy_at=None,
                                         healthy_side=None, downtime_s=None)
        await self._put(record)

    async def ended(self, txn: Transaction) -> None:
        """DONE, ROLLED_BACK or PARKED: the record joins its service's last move."""
        record = dataclasses.replace(self._get(txn), outcome=txn.phase.value.lower(),
                                     finished_at=txn.updated_at)
        await self._put(record, active=txn.is_active)
        if not txn.is_active:
            self._records.pop(txn.transaction_id, None)
            if txn.phase is Phase.DONE:
                self._stopped.pop(txn.transaction_id, None)
        move = self._moves.get(record.service)
        if move is None or (move[0] != record.move_id):
            rows = await self.store.move_downtimes(record.move_id)
            move = (record.move_id,
                    {r.transaction_id: r for r in map(AreaDowntime.from_storage, rows)})
            self._moves[record.service] = move
        move[1][record.transaction_id] = record
        self._on_change()
        if txn.phase is Phase.DONE and record.downtime_s is not None:
            await self._final(record)

    def unmeasured(self, txn: Transaction) -> None:
        """A watched source was not seen healthy: its downtime stays open in its record."""
        self._stopped.pop(txn.transaction_id, None)

    async def _final(self, record: AreaDowntime) -> None:
        assert record.downtime_s is not None
        self._stopped.pop(record.transaction_id, None)
        self.metrics.area_downtime.labels(
            service=record.service, direction=record.direction
        ).observe(record.downtime_s)
        fields = {"transaction_id": record.transaction_id, "service": record.service,
                  "area": record.area, "direction": record.direction,
                  "outcome": record.outcome, "healthy_side": record.healthy_side,
                  "downtime_s": round(record.downtime_s, 4)}
        log.info("area_downtime", **fields)
        await self.store.record_event("area_downtime", fields)

    def last_move(self, service: str) -> dict[str, Any] | None:
        """The status's `last_move` of a service, or None before its first ended transaction."""
        move = self._moves.get(service)
        if move is None:
            return None
        move_id, records = move
        ended = sorted((r for r in records.values() if r.outcome is not None),
                       key=lambda r: r.finished_at or 0.0)
        if not ended:
            return None
        latest = ended[-1]
        downtimes = sorted(r.downtime_s for r in ended if r.downtime_s is not None)
        outcomes = dict.fromkeys(OUTCOMES, 0)
        for r in ended:
            outcomes[str(r.outcome)] = outcomes.get(str(r.outcome), 0) + 1
        return {
            "move_id": move_id,
            "transaction_id": latest.transaction_id,
            "direction": latest.direction,
            "finished_at": latest.finished_at,
            "areas": len(ended),
            "in_flight": sum(1 for r in self._records.values()
                             if r.move_id == move_id and r.outcome is None),
            "outcomes": outcomes,
            "downtime_s": {
                "max": round(downtimes[-1], 3),
                "p50": round(statistics.median(downtimes), 3),
                "measured": len(downtimes),
            } if downtimes else None,
        }


class MigrationEngine:
    def __init__(
        self,
        *,
        state: PlacementState,
        actions: PhaseActions,
        store: Store,
        metrics: Metrics,
        policy: LeasePolicy,
        renewer: LeaseRenewer | None,
        parallelism: dict[str, int],
        park_after_failures: int,
        retry_backoff_base_s: float,
        retry_backoff_cap_s: float,
        rollback_data_wait_s: float = 900.0,
        vps_lost_after_s: float | None = None,
        vps_lost_services: frozenset[str] = frozenset(),
        vps_unreachable_since: Callable[[], float | None] = lambda: None,
        on_finished: Callable[[Transaction], None] = lambda txn: None,
        wall: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.state = state
        self.actions = actions
        self.store = store
        self.metrics = metrics
        self.policy = policy
        self.renewer = renewer
        self.park_after_failures = park_after_failures
        self.retry_backoff_base_s = retry_backoff_base_s
        self.retry_backoff_cap_s = retry_backoff_cap_s
        self.rollback_data_wait_s = rollback_data_wait_s
        # Services that give a lost VPS up by themselves (on_vps_lost = "home"), after that long
        self.vps_lost_after_s = vps_lost_after_s
        self.vps_lost_services = vps_lost_services
        self._vps_unreachable_since = vps_unreachable_since
        self._vps_lost_logged: set[str] = set()
        self.on_finished = on_finished
        self._wall = wall
        self._clock = clock
        self._slots = {name: MoveSlots(n) for name, n in parallelism.items()}
        self._runners: dict[str, asyncio.Task[None]] = {}
        self._failures: dict[str, int] = defaultdict(int)  # consecutive, per service
        self._not_before: dict[str, float] = {}  # area -> monotonic time of the next try
        self._wake = asyncio.Event()
        self.intake_lock = asyncio.Lock()
        self._stopping = False
        self._recovered = False
        self._internal_seen: set[tuple[str, str]] = set()  # logged with a traceback once
        self.last_errors: dict[str, dict[str, Any]] = {}  # service -> last error shown
        # Grows whenever something the status document shows from the engine (or its
        # placement state) changed: the status API rebuilds its document only then.
        self.status_version = 0
        state.add_listener(self._status_changed)
        self.downtime = DowntimeLog(store=store, metrics=metrics, on_change=self._status_changed,
                                    wall=wall, clock=clock)
        self._watchers: set[asyncio.Task[None]] = set()  # rolled-back sources, until healthy

    # -- lifecycle ---------------------------------------------------------------------------

    async def recover(self) -> None:
        """Resume or roll back what a previous run left unfinished.

        docs/design.md, "Transactions: phases and outcomes", rule 3 (recovery).
        """
        if self._recovered:
            return
        self._recovered = True
        await self.downtime.load(list(self.state.transactions.values()))
        history = await self.store.list_transactions(limit=5000)
        self._count_failures(history)
        for record in history:
            txn = Transaction.from_storage(record)
            if txn.phase is Phase.DONE and txn.cleanup_required:
                # The DONE record was written; its cleanup item may not have been (idempotent).
                for action in phases.next_actions(txn, self._ctx(txn)):
                    if isinstance(action, phases.EnqueueCleanup):
                        with txn_log.step(txn):
                            await self.actions.perform(txn, action)
        for txn in list(self.state.transactions.values()):
            committed = self.state.committed.get(txn.area)
            if committed is None:
                continue
            outcome = rules.recovery_outcome(txn, committed=committed)
            if outcome is not None:
                txn_log.bound(txn).info(
                    "transaction_recovering", phase=txn.phase.value, outcome=outcome.value
                )
                await self._advance(txn, outcome)

    def _count_failures(self, history: list[dict[str, Any]]) -> None:
        # Newest first: count failed ends per service until the last success.
        seen_success: set[str] = set()
        for record in history:
            service, phase = record["service"], record["phase"]
            if service in seen_success:
                continue
            if phase == Phase.DONE.value:
                seen_success.add(service)
            elif phase in (Phase.ROLLED_BACK.value, Phase.PARKED.value) and record.get(
                "last_error_code"
            ):
                self._failures[service] += 1

    async def run(self) -> None:
        await self.recover()
        while not self._stopping:
            self._wake.clear()
            await self._give_up_lost_vps()
            await self._open_due()
            self._start_runners()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(TICK_S):
                    await self._wake.wait()

    def wake(self) -> None:
        self._wake.set()

    def _status_changed(self) -> None:
        self.status_version += 1

    def last_move(self, service: str) -> dict[str, Any] | None:
        """The last move of `service` for the status: docs/operator.md, "The status document"."""
        return self.downtime.last_move(service)

    def failures(self, service: str) -> int:
        """Consecutive failed migrations of a service (the remote_state fail_count)."""
        return self._failures.get(service, 0)

    async def stop(self) -> None:
        """Finish the current steps (bounded), then cancel what is left."""
        self._stopping = True
        self._wake.set()
        runners = [t for t in self._runners.values() if not t.done()]
        if runners:
            _, pending = await asyncio.wait(runners, timeout=STOP_GRACE_S)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        watchers = list(self._watchers)
        for task in watchers:
            task.cancel()  # a downtime not measured yet stays open in its record
        await asyncio.gather(*watchers, return_exceptions=True)

    # -- intake (HTTP) -------------------------------------------------------------------

    async def record_placement(self, *, service: str, area: str | None, location: str) -> list[str]:
        """Durably record a wish and open its transactions; returns their ids (for 202).

        The caller has checked custom_config.json for this request (the operator facade, the
        one check per request): `area`, if given, is one of the committed areas."""
        wanted = Side(location)
        async with self.intake_lock:
            targets = [self.state.committed[area]] if area else self.state.areas_of(service)
            for target in targets:
                txn = self.state.transactions.get(target.uuid)
                if txn is not None and txn.phase is Phase.COMMIT_LOCATION \
                        and txn.destination is not wanted:
                    raise PermanentError(
                        ErrorCode.TRANSACTION_CONFLICT,
                        f"area {target.uuid} is committing its move to {txn.destination.value};"
                        " ask again in a moment"
                    )
            await self.state.record_desired(service=service, area=area, location=wanted)
            opened = await self._open_for(targets)
        self._wake.set()
        involved = {t.uuid for t in targets}
        return opened + [
            t.transaction_id
            for t in self.state.transactions.values()
            if t.area in involved and t.transaction_id not in opened
        ]

    async def retry(self, service: str) -> list[str]:
        """The operator's retry: leave PARKED with fresh generations; clear back-offs."""
        async with self.intake_lock:
            self._failures[service] = 0
            for area in self.state.areas_of(service):
                self._not_before.pop(area.uuid, None)
            resumed = []
            for txn in list(self.state.transactions.values()):
                if txn.service != service or txn.phase is not Phase.PARKED:
                    continue
                if phases.parked_rollback(txn) and phases.awaits_data(
                    txn, self.state.lineage(txn.area)
                ):
                    # It parked waiting for the destination's data: try to bring it back.
                    await self._advance(txn, Outcome.ROLLBACK_RESUMED)
                    resumed.append(txn.transaction_id)
                    continue
                committed = self.state.committed[txn.area]
                generation = await self.store.issue_generation(
                    txn.area, floor=max(committed.generation, txn.generation)
                )
                await self._advance(txn, Outcome.RETRY_REQUESTED, new_generation=generation)
                resumed.append(txn.transaction_id)
            self.last_errors.pop(service, None)
            self._status_changed()
        self._wake.set()
        return resumed

    async def discard_remote_data(self, service: str, *, area: str | None = None) -> list[str]:
        """The operator's override: rollbacks of `service` (or of one area) that wait for
        the destination's newer data give it up and restart their source on its own data.

        Recorded as a `remote_data_discarded` event per area. Raises TRANSACTION_CONFLICT
        when no rollback of that service (area) waits for data."""
        async with self.intake_lock:
            waiting = [
                txn for txn in self.state.transactions.values()
                if txn.service == service and (area is None or txn.area == area)
                and txn.phase in (Phase.ROLLBACK, Phase.PARKED) and txn.destination_fenced
                and phases.awaits_data(txn, self.state.lineage(txn.area))
            ]
            if not waiting:
                where = f"area {area}" if area else f"service {service}"
                raise PermanentError(
                    ErrorCode.TRANSACTION_CONFLICT,
                    f"no rollback of {where} waits for data on the other side",
                )
            for txn in waiting:
                await self.actions.discard_data(txn, keep=txn.source, reason="operator")
                self._not_before.pop(txn.area, None)
                if txn.phase is Phase.PARKED:  # the rollback goes on: restart the source
                    await self._advance(txn, Outcome.ROLLBACK_RESUMED)
        self._wake.set()
        self._start_runners()
        return [txn.transaction_id for txn in waiting]

    async def give_up_remote(
        self, service: str, *, area: str | None = None, reason: str = "operator"
    ) -> list[str]:
        """The operator gives the VPS up for `service` (or one area): its areas start on the
        PBX's own copy and the data they wrote on the VPS is lost (orchestrator/give_up.py).

        Refused, changing nothing, while any remote copy could still run (VPS_NOT_FENCED,
        saying when it will be allowed), while an area commits a move (TRANSACTION_CONFLICT)
        or when nothing of it is on the VPS. Otherwise the loss is recorded per area
        (lineage first, `remote_data_abandoned` event), the wish becomes "local", and each
        area's transaction goes home; returns their ids."""
        async with self.intake_lock:
            targets = [self.state.committed[area]] if area else self.state.areas_of(service)
            for target in targets:  # no step may finish on a record decided on below
                await self._halt_runner(target.uuid)
            now = self._clock()
            decisions = {
                target.uuid: give_up.decide(
                    area=target, txn=self.state.transactions.get(target.uuid),
                    lineage=self.state.lineage(target.uuid),
                    leases=self._remote_leases(target), now=now, policy=self.policy,
                )
                for target in targets
            }
            where = f"area {area}" if area else f"service {service}"
            for decision in decisions.values():
                if isinstance(decision, give_up.Busy):
                    self._start_runners()
                    raise PermanentError(ErrorCode.TRANSACTION_CONFLICT,
                                         f"{decision.detail}; ask again in a moment")
            until = max((d.until for d in decisions.values()
                         if isinstance(d, give_up.NotFenced)), default=None)
            if until is not None:
                self._start_runners()
                raise give_up.VpsNotFenced(where=where, wait_s=until - now, wall=self._wall())
            abandoned = {uuid: d for uuid, d in decisions.items()
                         if isinstance(d, give_up.Abandon)}
            if not abandoned:
                self._start_runners()
                raise PermanentError(ErrorCode.TRANSACTION_CONFLICT,
                                     f"nothing of {where} is on the VPS: nothing to give up")
            self._failures[service] = 0
            self.last_errors.pop(service, None)
            await self.state.record_desired(service=service, area=area, location=Side.LOCAL)
            for uuid, decision in abandoned.items():
                committed = self.state.committed[uuid]
                await self.actions.abandon_remote_data(
                    committed, reason=reason, generations=give_up.remote_generations(
                        committed, self.state.transactions.get(uuid)),
                )
                self._not_before.pop(uuid, None)
                txn = self.state.transactions.get(uuid)
                if txn is None or decision.outcome is None:
                    continue
                generation = None
                if decision.outcome is Outcome.SOURCE_ABANDONED:
                    generation = await self.store.issue_generation(
                        uuid, floor=max(committed.generation, txn.generation)
                    )
                await self._advance(txn, decision.outcome, new_generation=generation)
            await self._open_for([self.state.committed[uuid] for uuid in abandoned])
            self._status_changed()
        self._wake.set()
        self._start_runners()
        return [
            t.transaction_id for t in self.state.transactions.values() if t.area in abandoned
        ]

    async def _give_up_lost_vps(self) -> None:
        """`[monitord] vps_lost_after_s`: the services with `on_vps_lost = "home"` give the
        VPS up by themselves once it has been unreachable that long — with the same proof of
        fencing as an operator's give-up (refused, and asked again next tick, until then)."""
        since = self._vps_unreachable_since()
        if self.vps_lost_after_s is None or since is None:
            self._vps_lost_logged.clear()
            return
        lost_s = self._clock() - since
        if lost_s < self.vps_lost_after_s:
            return
        for service in sorted(self.vps_lost_services):
            if self.give_up_view(service) is None:
                continue
            try:
                ids = await self.give_up_remote(service, reason="policy")
            except MonitordError as e:
                if service not in self._vps_lost_logged:  # once per outage, not every tick
                    self._vps_lost_logged.add(service)
                    log.critical("vps_lost_give_up_waiting", service=service,
                                 error_code=e.code, detail=e.detail,
                                 unreachable_s=round(lost_s, 1))
                continue
            log.critical("vps_lost_given_up", service=service, transaction_ids=ids,
                         unreachable_s=round(lost_s, 1))

    def give_up_view(self, service: str) -> dict[str, Any] | None:
        """What giving the VPS up would do for `service` now, for the status: how many areas
        would go home and from when (wall time) it is allowed; None when nothing is there."""
        now, wall = self._clock(), self._wall()
        areas, until = 0, now
        for area in self.state.areas_of(service):
            decision = give_up.decide(
                area=area, txn=self.state.transactions.get(area.uuid),
                lineage=self.state.lineage(area.uuid), leases=self._remote_leases(area),
                now=now, policy=self.policy,
            )
            if isinstance(decision, give_up.NotFenced):
                until = max(until, decision.until)
            if isinstance(decision, give_up.Abandon | give_up.NotFenced):
                areas += 1
        if not areas:
            return None
        return {"areas": areas, "allowed_at": round(wall + (until - now), 3)}

    async def _halt_runner(self, area: str) -> None:
        """Stop the area's runner wherever it is (a step is crash-safe: the stored record
        decides what happens next, as after a restart) and take the record as stored."""
        task = self._runners.pop(area, None)
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await self.state.reread(area)

    def _remote_leases(self, area: Area) -> dict[int, AreaLease]:
        """The best-known lease of every generation of `area` that could run on the VPS."""
        txn = self.state.transactions.get(area.uuid)
        generations = give_up.remote_generations(area, txn)
        if self.renewer is None:
            return {g: AreaLease(area=area.uuid, generation=g, owner_id="unknown",
                                 acknowledged_at=float("-inf"), ttl=self.policy.ttl_s)
                    for g in generations}
        return {g: self.renewer.lease_for(area.uuid, g) for g in generations}

    # -- opening transactions -----------------------------------------------------------

    async def _open_due(self) -> None:
        if self.state.corrupt is not None:
            return
        async with self.intake_lock:
            await self._open_for(list(self.state.committed.values()))

    async def _open_for(self, areas: list[Area]) -> list[str]:
        parked = self.state.parked_services()
        now = self._clock()
        opened = []
        moves: dict[str, str] = {}  # service -> the move these transactions make together
        for area in areas:
            if area.service in parked or area.service not in self._slots:
                continue
            if area.uuid in self.state.transactions:
                continue
            wanted = give_up.move_to_open(area, self.state.lineage(area.uuid),
                                          desired=self.state.desired_location(area))
            if wanted is None or self._not_before.get(area.uuid, 0.0) > now:
                continue
            move_id = moves.setdefault(area.service, uuid.uuid4().hex)
            opened.append(await self._open(area, destination=wanted, move_id=move_id))
        return opened

    async def _open(self, area: Area, *, destination: Side, move_id: str) -> str:
        generation = await self.store.issue_generation(area.uuid, floor=area.generation)
        at = self._wall()
        txn = Transaction(
            transaction_id=uuid.uuid4().hex,
            service=area.service,
            area=area.uuid,
            source=area.location,
            destination=destination,
            generation=generation,
            source_generation=area.generation,
            started_at=at,
            updated_at=at,
            source_abandoned=give_up.abandons_source(area, self.state.lineage(area.uuid)),
        )
        await self.state.save(txn)
        await self.downtime.opened(txn, move_id=move_id)
        await self._event("transaction_started", txn)
        await crash_points.reached(txn.phase.value, direction=txn.direction.value,
                                   area=txn.area)
        return txn.transaction_id

    # -- runners --------------------------------------------------------------------------

    def _start_runners(self) -> None:
        for area, txn in list(self.state.transactions.items()):
            if txn.phase is Phase.PARKED or self._stopping:
                continue
            task = self._runners.get(area)
            if task is None or task.done():
                task = asyncio.create_task(
                    self._drive(area), name=f"migration:{txn.service}:{area[:8]}"
                )
                task.add_done_callback(self._runner_done)
                self._runners[area] = task

    def _runner_done(self, task: asyncio.Task[None]) -> None:
        # A runner that died of a bug is logged loudly; the next tick starts it again from
        # the stored record (every step is idempotent).
        if not task.cancelled() and task.exception() is not None:
            log.error("migration_runner_crashed", task=task.get_name(),
                      exc_info=task.exception())

    async def _drive(self, area: str) -> None:
        txn = self.state.transactions.get(area)
        if txn is None:
            return
        preparing = txn.phase is Phase.PREFLIGHT
        async with self._slots[txn.service].held(preparing=preparing) as slot:
            pause = STEP_RETRY_BASE_S
            while not self._stopping:
                txn = self.state.transactions.get(area)
                if txn is None or txn.phase is Phase.PARKED:
                    return
                try:
                    progressed, failed = await self._step(txn, slot)
                except phases.IllegalTransition as e:
                    # The table refused what we observed (e.g. a lease deadline moved while
                    # we waited): nothing was written; decide again from the stored record.
                    txn_log.bound(txn).warning(
                        "step_refused", phase=txn.phase.value, detail=e.detail
                    )
                    progressed, failed = True, True
                if not progressed:
                    return  # Finish or Park
                if failed:
                    await self._pause(pause)
                    pause = min(STEP_RETRY_CAP_S, pause * 2)
                else:
                    pause = STEP_RETRY_BASE_S

    async def _step(self, txn: Transaction, slot: Held) -> tuple[bool, bool]:
        """One step of one record: (something happened, it failed and looped back). A
        passed preflight takes its move slot before the next phase is stored, and checks
        again if that meant waiting (monitord/engine/move_slots.py)."""
        committed = self.state.committed.get(txn.area)
        if committed is not None:
            reversal = rules.reversal(txn, desired=self.state.desired_location(committed))
            if reversal.outcome is not None:
                await self._advance(txn, reversal.outcome)
                return True, False
        actions = phases.next_actions(txn, self._ctx(txn))
        outcome, error = await self._perform(txn, actions)
        if outcome is None:
            return False, False
        if txn.phase is Phase.PREFLIGHT and error is None and outcome is Outcome.OK:
            if await slot.to_move():
                again = tuple(dataclasses.replace(a, again=True) for a in actions
                              if isinstance(a, phases.RunPreflight))
                outcome, error = await self._perform(txn, again)
                if outcome is None:
                    return False, False
        if error is None and any(isinstance(a, phases.CheckHealth) for a in actions):
            # The destination's first healthy moment: the end of the area's downtime.
            await self.downtime.healthy(txn, side=txn.destination, at=self._wall(),
                                        now=self._clock())
        lease = None
        if outcome is Outcome.LEASE_EXPIRED:
            # Judge the deadline by the grant waited out, or a later one learnt meanwhile.
            waited = next(a.lease for a in actions if isinstance(a, phases.WaitLeaseExpiry))
            known = self._ctx(txn).lease
            later = known is not None and known.acknowledged_at > waited.acknowledged_at
            lease = known if later else waited
        new = await self._advance(txn, outcome, error=error, lease=lease)
        if error is None and any(isinstance(a, phases.RestartSource) for a in actions):
            self._watch_source(new)
        looping = txn.phase in SELF_LOOPING or txn.source_abandoned
        return True, error is not None and new.phase is txn.phase and looping

    # -- downtime after a rollback ----------------------------------------------------------

    def _watch_source(self, txn: Transaction) -> None:
        """The rollback let its source run again; its downtime ends when the source is first
        healthy (the same check as HEALTHCHECK_DESTINATION), watched off the runner's path."""
        task = asyncio.create_task(self._source_healthy(txn),
                                   name=f"downtime:{txn.service}:{txn.area[:8]}")
        self._watchers.add(task)
        task.add_done_callback(self._watcher_done)

    def _watcher_done(self, task: asyncio.Task[None]) -> None:
        self._watchers.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("downtime_watch_crashed", task=task.get_name(),
                      exc_info=task.exception())

    async def _source_healthy(self, txn: Transaction) -> None:
        deadline = self._clock() + SOURCE_WATCH_S
        while self._clock() < deadline and not self._stopping:
            current = self.state.transactions.get(txn.area)
            if current is not None and current.transaction_id != txn.transaction_id \
                    and current.phase is not Phase.PREFLIGHT:
                break  # a newer transaction stopped the source again before it was healthy
            try:
                await self.actions.check_health(txn, side=txn.source,
                                                generation=txn.source_generation)
            except MonitordError:
                await asyncio.sleep(SOURCE_WATCH_PAUSE_S)  # not healthy (yet): look again
                continue
            await self.downtime.healthy(txn, side=txn.source, at=self._wall(),
                                        now=self._clock())
            return
        self.downtime.unmeasured(txn)
        txn_log.bound(txn).warning("area_downtime_unmeasured",
                                   reason="the source was not seen healthy after the rollback")

    async def _pause(self, seconds: float) -> None:
        # Bounded; stop() cancels a runner that is still pausing after its grace period.
        await asyncio.sleep(seconds)

    async def _perform(
        self, txn: Transaction, actions: tuple[phases.Action, ...]
    ) -> tuple[Outcome | None, MonitordError | None]:
        outcome: Outcome | None = None
        for action in actions:
            if isinstance(action, phases.Finish | phases.Park):
                return None, None
            try:
                outcome = await self._perform_with_retries(txn, action)
            except MonitordError as e:
                self._record_error(txn, e)
                return self._outcome_for_error(txn, e), e
            except Exception as e:
                # Not one of ours (an OSError, a bug): classified INTERNAL with the traceback
                # logged, so the step fails like any other, counts towards parking and shows
                # in the status — never a runner that dies and restarts every tick.
                internal = self._internal_error(txn, e)
                self._record_error(txn, internal)
                return self._outcome_for_error(txn, internal), internal
        return outcome, None

    async def _perform_with_retries(self, txn: Transaction, action: phases.Action) -> Outcome:
        delay = STEP_RETRY_BASE_S
        for attempt in range(1, STEP_ATTEMPTS + 1):
            try:
                with txn_log.step(txn):
                    return await self.actions.perform(txn, action)
            except TransientError as e:
                if e.code in UNREACHABLE_CODES or attempt == STEP_ATTEMPTS or self._stopping:
                    raise
                txn_log.bound(txn).info(
                    "step_retry", phase=txn.phase.value, error_code=e.code, attempt=attempt
                )
                await asyncio.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")  # pragma: no cover

    def _outcome_for_error(self, txn: Transaction, error: MonitordError) -> Outcome:
        if txn.phase is Phase.PREFLIGHT:
            # Every failed preflight counts towards parking, an unreachable VPS included.
            outcome = rules.failure_outcome(
                consecutive_failures=self._failures[txn.service] + 1,
                park_after_failures=self.park_after_failures,
            )
            if outcome is Outcome.PARK:
                return outcome
        waited = txn.data_wait_since
        if txn.phase is Phase.ROLLBACK and waited is not None:
            # The newest data is out of reach: the area stays stopped, bounded by
            # rollback_data_wait_s; then the service parks and an operator chooses.
            if self._wall() - waited >= self.rollback_data_wait_s:
                return Outcome.PARK
        allowed = phases.allowed(txn)
        if error.code in UNREACHABLE_CODES and Outcome.UNREACHABLE in allowed:
            return Outcome.UNREACHABLE
        return Outcome.FAILED

    # -- advancing ------------------------------------------------------------------------

    def _ctx(
        self,
        txn: Transaction,
        *,
        error: MonitordError | None = None,
        new_generation: int | None = None,
        lease: AreaLease | None = None,
    ) -> phases.StepContext:
        if lease is None and self.renewer is not None:
            if txn.destination is Side.REMOTE:
                lease = self.renewer.lease_for(txn.area, txn.generation)
            elif txn.source_abandoned:  # its SUPPRESS_SOURCE waits out the source's lease
                lease = self.renewer.lease_for(txn.area, txn.source_generation)
        return phases.StepContext(
            at=self._wall(),
            now=self._clock(),
            policy=self.policy,
            lease=lease,
            error_code=str(error.code) if error else None,
            error_detail=error.detail if error else None,
            new_generation=new_generation,
            lineage=self.state.lineage(txn.area),
        )

    async def _advance(
        self,
        txn: Transaction,
        outcome: Outcome,
        *,
        error: MonitordError | None = None,
        new_generation: int | None = None,
        lease: AreaLease | None = None,
    ) -> Transaction:
        if txn.phase is Phase.ROLLBACK and outcome is Outcome.OK and txn.last_error_code:
            outcome = rules.rollback_completion_outcome(
                consecutive_failures=self._failures[txn.service] + 1,
                park_after_failures=self.park_after_failures,
            )
        ctx = self._ctx(txn, error=error, new_generation=new_generation, lease=lease)
        new = phases.advance(txn, outcome, ctx)
        ended = not new.is_active or new.phase is Phase.PARKED
        if ended:
            self._count_end(new)  # before saving: the projection written on save shows it
        await self.state.save(new)
        await self._note_downtime(txn, new, ended=ended)
        await self._event("transaction_phase", new, outcome=outcome.value,
                          previous=txn.phase.value)
        if new.phase is not txn.phase:
            await crash_points.reached(new.phase.value, direction=new.direction.value,
                                       area=new.area)
        if ended:
            self._finished(new)
        return new

    async def _note_downtime(self, old: Transaction, new: Transaction, *, ended: bool) -> None:
        if new.phase is Phase.SUPPRESS_SOURCE and old.phase is not Phase.SUPPRESS_SOURCE:
            # Just stored: from now on the source may not run (the supervisor stops a local
            # one at once, SuppressSource stops a remote one). The downtime starts here.
            await self.downtime.source_stopped(new)
        elif new.phase is Phase.ROLLBACK and old.phase is not Phase.ROLLBACK:
            if old.phase is Phase.PARKED:
                await self.downtime.resumed(new, fresh=False)
            else:
                await self.downtime.rollback_started(new)
        elif old.phase is Phase.PARKED and new.phase is not Phase.PARKED:
            await self.downtime.resumed(new, fresh=True)
        if ended:
            await self.downtime.ended(new)

    def _count_end(self, txn: Transaction) -> None:
        """Consecutive failures per service, and the back-off before this area tries again."""
        if txn.phase is Phase.DONE:
            self._failures[txn.service] = 0
            self.last_errors.pop(txn.service, None)
            self._status_changed()
        elif txn.last_error_code is not None:
            self._failures[txn.service] += 1
            count = self._failures[txn.service]
            delay = min(self.retry_backoff_cap_s, self.retry_backoff_base_s * 2 ** (count - 1))
            self._not_before[txn.area] = self._clock() + delay

    def _finished(self, txn: Transaction) -> None:
        if txn.phase is Phase.ROLLED_BACK or (
            txn.phase is Phase.PARKED and txn.rollback_from is not None
        ):
            self.metrics.rollbacks.labels(service=txn.service).inc()
        self.metrics.migration_duration.labels(
            service=txn.service,
            destination=txn.destination.value,
            outcome=txn.phase.value.lower(),
        ).observe(max(0.0, txn.updated_at - txn.started_at))
        self.on_finished(txn)

    def _internal_error(self, txn: Transaction, error: Exception) -> MonitordError:
        key = (txn.transaction_id, type(error).__name__)
        if key not in self._internal_seen:
            self._internal_seen.add(key)
            txn_log.bound(txn).error("phase_internal_error", phase=txn.phase.value,
                                     error_code="INTERNAL", exc_info=error)
        return errors.error_for(
            ErrorCode.INTERNAL, f"{type(error).__name__}: {error}".rstrip(": ")
        )

    def _record_error(self, txn: Transaction, error: MonitordError) -> None:
        try:
            action = errors.lookup(str(error.code)).action
        except errors.UnknownErrorCode:  # an unknown code is still shown, without advice
            action = ""
        self.last_errors[txn.service] = {
            "code": str(error.code),
            "detail": error.detail,
            "phase": txn.phase.value,
            "area": txn.area,
            "at": self._wall(),
            "action": action,
        }
        self._status_changed()
        txn_log.bound(txn).warning(
            "phase_failed", phase=txn.phase.value, error_code=str(error.code), detail=error.detail
        )

    async def _event(self, event: str, txn: Transaction, **extra: Any) -> None:
        fields = {
            **txn_log.identity(txn),
            "phase": txn.phase.value,
            "error_code": txn.last_error_code,
            **extra,
        }
        log.info(event, **fields)
        await self.store.record_event(event, fields)

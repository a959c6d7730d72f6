"""The migration engine: drives every area's transaction, one stored record at a time.

A root task ("migration engine"). It decides nothing itself: for each stored record it asks
`orchestrator.migration_step.decide()`, performs what that says (`PhaseActions`), reports
what happened, and stores the record the core returns BEFORE the next step starts
(docs/design.md, "Transactions: phases and outcomes", rule 1). Per area:

    record --decide--> actions --perform--> result --decide--> record' --store--> ...

The rules' memory between records (consecutive failures per service, a link outage counted
once, back-offs) is the core's frozen `Memory`, kept here and replaced by what each
decision returns.

- New transactions come from the operator's wishes (`record_placement`, the HTTP intake)
  and from the periodic tick (wishes not yet satisfied, retries after a back-off). Their
  generation is issued durably by the store and never reused.
- On start-up, `recover()` applies `rules.recovery_outcome` to every unfinished record: the
  committed location in custom_config.json decides roll-forward or roll-back.
- Services run independently; areas of one service with bounded parallelism
  (`services.<name>.parallelism` out of service at once, as many more preparing:
  monitord/engine/move_slots.py).
- The operator's verbs (retry, discard, give up, the VPS-lost policy) are in
  monitord/engine/operator_verbs.py, on top of `apply`, `halted` and `open_for`.
- `stop()` lets each runner finish its current step (bounded), then cancels; every record
  on disk is a valid point to resume from. Runners and source watchers are children of two
  task owners (monitord/base/task_owner.py) that the root task closes when it ends.
- Every transaction's area downtime is recorded (`DowntimeLog` in
  monitord/engine/downtime_log.py, table `area_downtime`): from
  the moment its source lost the permission to run (the SUPPRESS_SOURCE record stored) to the
  destination's health check passing, or, after a rollback, to the source's first healthy
  moment (watched by a task the engine owns). docs/design.md, "Observability".
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Any

from monitord.base import logs, round_trips
from monitord.base.metrics import Metrics
from monitord.base.periodic import LoopBook, Periodic
from monitord.base.task_owner import TaskOwner
from monitord.engine import crash_points, txn_log
from monitord.engine.downtime_log import DowntimeLog
from monitord.engine.lease_ledger import LeaseLedger
from monitord.engine.move_slots import Held, MoveSlots
from monitord.engine.phase_actions import PhaseActions
from monitord.engine.placement_state import PlacementState
from monitord.store.state_db import Store
from orchestrator import errors, give_up, migration_step, models, phases, rules
from orchestrator.errors import ErrorCode, MonitordError, PermanentError, TransientError
from orchestrator.migration_step import Memory, Record, Result, StepRules, TakeSlot
from orchestrator.models import Area, Phase, Side, Transaction
from orchestrator.phases import Outcome

log = logs.get_logger(__name__)

TASK_NAME = "migration engine"
TICK_S = 1.0
STOP_GRACE_S = 5.0
STEP_RETRY_BASE_S = 0.5
STEP_RETRY_CAP_S = 15.0
STEP_ATTEMPTS = 3  # tries of one step on a transient (not "unreachable") error
# After a rollback restarted its source: how long to wait for its first healthy moment (the
# end of the area's downtime), and the pause between two health checks that did not pass.
SOURCE_WATCH_S = 600.0
SOURCE_WATCH_PAUSE_S = 1.0


class MigrationEngine:
    def __init__(
        self,
        *,
        state: PlacementState,
        actions: PhaseActions,
        store: Store,
        metrics: Metrics,
        bounds: StepRules,
        parallelism: dict[str, int],
        leases: LeaseLedger | None = None,
        link_epoch: Callable[[], rules.LinkEpoch | None] | None = None,
        on_finished: Callable[[Transaction], None] | None = None,
        wall: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
        loops: LoopBook | None = None,
    ) -> None:
        self.state = state
        self.actions = actions
        self.store = store
        self.metrics = metrics
        self.bounds = bounds
        self.leases = leases  # the grants acknowledged (None: no VPS configured)
        self._link_epoch = link_epoch
        self._on_finished = on_finished
        self.wall = wall
        self.clock = clock
        self.started_at = clock()  # (no lease on the VPS was renewed by this run before it)
        self.memory = Memory()
        self._slots = {name: MoveSlots(n) for name, n in parallelism.items()}
        self._runners: dict[str, asyncio.Task[None]] = {}  # area -> its runner (latest)
        self._runner_tasks = TaskOwner(f"{TASK_NAME}: runners")
        # Rolled-back sources, until healthy (their downtime's end).
        self._watcher_tasks = TaskOwner(f"{TASK_NAME}: watchers")
        self._exhausted: set[str] = set()  # areas at the last generation, logged once
        # Run at every tick before new transactions open (the VPS-lost policy).
        self._tick_hooks: list[Callable[[], Awaitable[None]]] = []
        # The intake: opens due transactions and starts their runners every tick, under the
        # root loops' error policy (monitord/base/periodic.py).
        self.loop = Periodic(TASK_NAME, iteration=self._intake, interval_s=TICK_S, book=loops)
        self.intake_lock = asyncio.Lock()
        self._stopping = False
        self._recovered = False
        self._internal_seen: set[tuple[str, str]] = set()  # logged with a traceback once
        self.last_errors: dict[str, dict[str, Any]] = {}  # service -> last error shown
        # Grows whenever something the status document shows from the engine (or its
        # placement state) changed: the status API rebuilds its document only then.
        self.status_version = 0
        state.add_listener(self.status_changed)
        self.downtime = DowntimeLog(store=store, metrics=metrics, on_change=self.status_changed,
                                    wall=wall, clock=clock)

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
        self.memory = Memory.from_history(history)
        for record in history:
            txn = Transaction.from_storage(record)
            if txn.phase is Phase.DONE and txn.cleanup_required:
                # The DONE record was written; its cleanup item may not have been (idempotent).
                decision = migration_step.decide(txn, self._seen(txn), self.memory, self.bounds)
                pending = decision.actions if isinstance(decision, migration_step.Perform) else ()
                for action in pending:
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
                await self.apply(txn, outcome)

    async def run(self) -> None:
        """The root task body: recovery (once), then the intake every tick until `stop()`;
        the runners and watchers end with it."""
        try:
            await self.loop.run()
        finally:
            await self._runner_tasks.close()
            await self._watcher_tasks.close()

    def add_tick_hook(self, hook: Callable[[], Awaitable[None]]) -> None:
        self._tick_hooks.append(hook)

    async def _intake(self) -> None:
        await self.recover()  # a no-op once start-up recovered
        if self._stopping:
            return
        for hook in self._tick_hooks:
            await hook()
        await self._open_due()
        self.start_runners()

    def wake(self) -> None:
        self.loop.wake()

    def status_changed(self) -> None:
        self.status_version += 1

    def last_move(self, service: str) -> dict[str, Any] | None:
        """The last move of `service` for the status: docs/operator.md, "The status document"."""
        return self.downtime.last_move(service)

    def failures(self, service: str) -> int:
        """Consecutive failed migrations of a service (the remote_state fail_count)."""
        return self.memory.failures_of(service)

    def forgive(self, service: str, *, areas: Iterable[str] = ()) -> None:
        """The operator's word: the service's failures, its last error and the back-offs of
        `areas` are forgotten."""
        self.memory = self.memory.forgiven(service, areas=areas)
        self.last_errors.pop(service, None)
        self.status_changed()

    def clear_back_offs(self, areas: Iterable[str]) -> None:
        self.memory = self.memory.cleared(areas)

    async def stop(self) -> None:
        """Finish the current steps (bounded), then cancel what is left."""
        self._stopping = True
        self.loop.close()
        await self._runner_tasks.wait(self._runner_tasks.running(), timeout_s=STOP_GRACE_S)
        await self._runner_tasks.close()
        # A downtime not measured yet stays open in its record.
        await self._watcher_tasks.close()

    # -- intake (HTTP) -------------------------------------------------------------------

    async def record_placement(self, *, service: str, area: str | None, location: str) -> list[str]:
        """Durably record a wish and open its transactions; returns their ids (for 202).

        The caller has checked custom_config.json for this request (the operator facade, the
        one check per request): `area`, if given, is one of the committed areas."""
        wanted = Side(location)
        async with self.intake_lock:
            targets = [self.state.committed[area]] if area else self.state.areas_of(service)
            if area and not models.can_move(targets[0]) and targets[0].location is not wanted:
                raise PermanentError(
                    ErrorCode.AREA_ENTRY_INVALID,
                    f"area {area} is at generation {targets[0].generation}, the last one"
                    " (2^63 - 1): no move can follow it",
                )
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
            opened = await self.open_for(targets)
        self.loop.wake()
        involved = {t.uuid for t in targets}
        return opened + [
            t.transaction_id
            for t in self.state.transactions.values()
            if t.area in involved and t.transaction_id not in opened
        ]

    @asynccontextmanager
    async def halted(self, areas: Iterable[str]) -> AsyncIterator[None]:
        """No step of these areas runs inside: their runners are stopped wherever they are
        (a step is crash-safe: the stored record decides what happens next, as after a
        restart) and their records taken as stored; the runners start again on the way out,
        whatever happened inside."""
        try:
            for area in areas:
                task = self._runners.pop(area, None)
                if task is not None and not task.done():
                    await self._runner_tasks.cancel([task])
                await self.state.reread(area)
            yield
        finally:
            self.start_runners()

    # -- opening transactions -----------------------------------------------------------

    async def _open_due(self) -> None:
        if self.state.corrupt is not None:
            return
        async with self.intake_lock:
            await self.open_for(list(self.state.committed.values()))

    async def open_for(self, areas: list[Area]) -> list[str]:
        """Open a transaction for each of `areas` that is not where it should be and may
        move now; returns their ids."""
        parked = self.state.parked_services()
        now = self.clock()
        opened = []
        moves: dict[str, str] = {}  # service -> the move these transactions make together
        for area in areas:
            if area.service in parked or area.service not in self._slots:
                continue
            if area.uuid in self.state.transactions or area.uuid in self.state.held:
                continue  # (a held area's move opens once it is released: state_loss.py)
            if not models.can_move(area):
                self._no_generation_left(area)
                continue
            wanted = give_up.move_to_open(area, self.state.lineage(area.uuid),
                                          desired=self.state.desired_location(area))
            if wanted is None or not self.memory.may_open(area.uuid, now=now):
                continue
            move_id = moves.setdefault(area.service, uuid.uuid4().hex)
            opened.append(await self._open(area, destination=wanted, move_id=move_id))
        return opened

    def _no_generation_left(self, area: Area) -> None:
        """An area at the last generation stays where it is; logged once per area."""
        if area.uuid in self._exhausted:
            return
        self._exhausted.add(area.uuid)
        log.warning("area_generation_exhausted", area=area.uuid, generation=area.generation,
                    error_code=ErrorCode.AREA_ENTRY_INVALID)

    async def _open(self, area: Area, *, destination: Side, move_id: str) -> str:
        generation = await self.store.issue_generation(area.uuid, floor=area.generation)
        at = self.wall()
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

    def start_runners(self) -> None:
        for area, txn in list(self.state.transactions.items()):
            if txn.phase is Phase.PARKED or self._stopping:
                continue
            task = self._runners.get(area)
            if task is None or task.done():
                # A runner that dies of a bug is logged by its owner (task_crashed); the next
                # tick starts it again from the stored record (every step is idempotent).
                self._runners[area] = self._runner_tasks.spawn(
                    f"migration:{txn.service}:{area[:8]}", self._drive(area)
                )

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
                    stored = await self._step(txn, slot)
                except phases.IllegalTransition as e:
                    # The table refused what we observed (e.g. a lease deadline moved while
                    # we waited): nothing was written; decide again from the stored record.
                    txn_log.bound(txn).warning(
                        "step_refused", phase=txn.phase.value, detail=e.detail
                    )
                    await self._pause(pause)
                    pause = min(STEP_RETRY_CAP_S, pause * 2)
                    continue
                if stored is None:
                    return  # Finish or Park
                if stored.pause:
                    await self._pause(pause)
                    pause = min(STEP_RETRY_CAP_S, pause * 2)
                else:
                    pause = STEP_RETRY_BASE_S

    async def _step(self, txn: Transaction, slot: Held) -> Record | None:
        """One step of one record: ask, perform, record. Returns what was stored (None:
        nothing to store)."""
        decision = self._decide(txn, None)
        while not isinstance(decision, Record | migration_step.Idle):
            if isinstance(decision, TakeSlot):
                waited = await slot.to_move()
                result = await self._perform(txn, decision.recheck, slot_taken=True) \
                    if waited else decision.free
            else:
                result = await self._perform(txn, decision.actions)
            decision = self._decide(txn, result)
        if isinstance(decision, migration_step.Idle):
            return None
        if decision.destination_healthy:
            # The destination's first healthy moment: the end of the area's downtime.
            await self.downtime.healthy(txn, side=txn.destination, at=self.wall(),
                                        now=self.clock())
        new = await self._store(txn, decision)
        if decision.source_restarted:
            self._watch_source(new)
        return decision

    def _decide(self, txn: Transaction, result: Result | None) -> migration_step.Decision:
        decision = migration_step.decide(txn, self._seen(txn, result), self.memory, self.bounds)
        if isinstance(decision, migration_step.Perform | Record):
            self.memory = decision.memory
        return decision

    def _seen(self, txn: Transaction, result: Result | None = None) -> migration_step.Seen:
        committed = self.state.committed.get(txn.area)
        leases = {} if self.leases is None else {
            g: self.leases.lease_for(txn.area, g) for g in (txn.generation, txn.source_generation)
        }
        return migration_step.Seen(
            at=self.wall(), now=self.clock(),
            desired=None if committed is None else self.state.desired_location(committed),
            lineage=self.state.lineage(txn.area), leases=leases,
            link=None if self._link_epoch is None else self._link_epoch(), result=result,
        )

    # -- downtime after a rollback ----------------------------------------------------------

    def _watch_source(self, txn: Transaction) -> None:
        """The rollback let its source run again; its downtime ends when the source is first
        healthy (the same check as HEALTHCHECK_DESTINATION), watched off the runner's path."""
        if self._watcher_tasks.closed:
            return  # stopping: the downtime stays open in its record
        self._watcher_tasks.spawn(f"downtime:{txn.service}:{txn.area[:8]}",
                                  self._source_healthy(txn))

    async def _source_healthy(self, txn: Transaction) -> None:
        deadline = self.clock() + SOURCE_WATCH_S
        failure: str | None = None  # the first error not of ours, logged once
        while self.clock() < deadline and not self._stopping:
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
            except Exception as e:
                # Not one of ours (a bug, a reply a parser let through): INTERNAL, logged
                # with its traceback once, and looked at again like a source not healthy
                # yet — a watcher that died would leave the downtime open without a word.
                if failure is None:
                    failure = f"{type(e).__name__}: {e}"[:200]
                    txn_log.bound(txn).error("area_downtime_watch_failed",
                                             error_code="INTERNAL", detail=failure,
                                             exc_info=e)
                await asyncio.sleep(SOURCE_WATCH_PAUSE_S)
                continue
            await self.downtime.healthy(txn, side=txn.source, at=self.wall(),
                                        now=self.clock())
            return
        self.downtime.unmeasured(txn)
        reason = "the source was not seen healthy after the rollback"
        txn_log.bound(txn).warning(
            "area_downtime_unmeasured",
            reason=reason if failure is None else f"{reason} (its health check: {failure})")

    async def _pause(self, seconds: float) -> None:
        # Bounded; stop() cancels a runner that is still pausing after its grace period.
        await asyncio.sleep(seconds)

    # -- performing -------------------------------------------------------------------------

    async def _perform(
        self, txn: Transaction, actions: tuple[phases.Action, ...], *, slot_taken: bool = False
    ) -> Result:
        """Perform `actions` in order; what the last one reported, or the error that ended
        them (recorded for the status)."""
        outcome: Outcome | None = None
        for action in actions:
            if isinstance(action, phases.Finish | phases.Park):
                return Result(actions=actions, slot_taken=slot_taken)
            try:
                outcome = await self._perform_with_retries(txn, action)
            except MonitordError as e:
                return self._failed(txn, actions, e, slot_taken=slot_taken)
            except Exception as e:
                # Not one of ours (an OSError, a bug): classified INTERNAL with the traceback
                # logged, so the step fails like any other, counts towards parking and shows
                # in the status — never a runner that dies and restarts every tick.
                return self._failed(txn, actions, self._internal_error(txn, e),
                                    slot_taken=slot_taken)
        return Result(actions=actions, outcome=outcome, slot_taken=slot_taken)

    def _failed(self, txn: Transaction, actions: tuple[phases.Action, ...],
                error: MonitordError, *, slot_taken: bool) -> Result:
        self._record_error(txn, error)
        return Result(actions=actions, error_code=str(error.code), error_detail=error.detail,
                      slot_taken=slot_taken)

    async def _perform_with_retries(self, txn: Transaction, action: phases.Action) -> Outcome:
        delay = STEP_RETRY_BASE_S
        for attempt in range(1, STEP_ATTEMPTS + 1):
            try:
                with txn_log.step(txn), round_trips.counted_by(self.downtime.trips_for(txn)):
                    return await self.actions.perform(txn, action)
            except TransientError as e:
                if e.code in rules.UNREACHABLE_CODES or attempt == STEP_ATTEMPTS \
                        or self._stopping:
                    raise
                txn_log.bound(txn).info(
                    "step_retry", phase=txn.phase.value, error_code=e.code, attempt=attempt
                )
                await asyncio.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")  # pragma: no cover

    # -- recording --------------------------------------------------------------------------

    async def apply(
        self, txn: Transaction, outcome: Outcome, *, new_generation: int | None = None
    ) -> Transaction:
        """Feed `outcome` (recovery's, an operator's) through the core and store the record."""
        decision = migration_step.advance(txn, outcome, self._seen(txn), self.memory,
                                          self.bounds, new_generation=new_generation)
        self.memory = decision.memory
        return await self._store(txn, decision)

    async def _store(self, txn: Transaction, decision: Record) -> Transaction:
        new = decision.record
        if new.phase is Phase.DONE:
            self.last_errors.pop(new.service, None)
            self.status_changed()
        await self.state.save(new)
        await self._note_downtime(txn, new, ended=decision.ended)
        await self._event("transaction_phase", new, outcome=decision.outcome.value,
                          previous=txn.phase.value)
        if new.phase is not txn.phase:
            await crash_points.reached(new.phase.value, direction=new.direction.value,
                                       area=new.area)
        if decision.ended:
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
        if self._on_finished is not None:
            self._on_finished(txn)

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
            "at": self.wall(),
            "action": action,
            **error.facts,  # e.g. a shortage's needed and free bytes (orchestrator/disk_space.py)
        }
        self.status_changed()
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

"""The migration engine: drives every area's transaction through the phase table.

A root task ("migration engine"). It never decides a move itself: `orchestrator.phases`
says what to do next for a stored record, `PhaseActions` does it, `orchestrator.rules` says
what a result means (a failed step's outcome, a rollback completed after an error, a passed
preflight's move slot and second check, the grant a lease expiry is judged by), and the
engine feeds that outcome back, persisting each new record BEFORE the next step starts
(docs/design.md, "Transactions: phases and outcomes", rule 1). Concretely, per area:

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
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from monitord.base import logs
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
from orchestrator import errors, give_up, models, phases, rules
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
# Phases whose own failure sends the record back to itself (retry after a pause).
SELF_LOOPING = frozenset({Phase.ROLLBACK})
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
        policy: LeasePolicy,
        leases: LeaseLedger | None,
        parallelism: dict[str, int],
        park_after_failures: int,
        retry_backoff_base_s: float,
        retry_backoff_cap_s: float,
        rollback_data_wait_s: float = 900.0,
        vps_lost_after_s: float | None = None,
        vps_lost_services: frozenset[str] = frozenset(),
        vps_unreachable_since: Callable[[], float | None] = lambda: None,
        link_epoch: Callable[[], rules.LinkEpoch | None] = lambda: None,
        on_finished: Callable[[Transaction], None] = lambda txn: None,
        wall: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
        loops: LoopBook | None = None,
    ) -> None:
        self.state = state
        self.actions = actions
        self.store = store
        self.metrics = metrics
        self.policy = policy
        self.leases = leases  # the grants acknowledged (None: no VPS configured)
        self.park_after_failures = park_after_failures
        self.retry_backoff_base_s = retry_backoff_base_s
        self.retry_backoff_cap_s = retry_backoff_cap_s
        self.rollback_data_wait_s = rollback_data_wait_s
        # Services that give a lost VPS up by themselves (on_vps_lost = "home"), after that long
        self.vps_lost_after_s = vps_lost_after_s
        self.vps_lost_services = vps_lost_services
        self._vps_unreachable_since = vps_unreachable_since
        self._vps_lost_logged: set[str] = set()
        self._link_epoch = link_epoch
        self.on_finished = on_finished
        self._wall = wall
        self._clock = clock
        self._slots = {name: MoveSlots(n) for name, n in parallelism.items()}
        self._runners: dict[str, asyncio.Task[None]] = {}  # area -> its runner (latest)
        self._runner_tasks = TaskOwner(f"{TASK_NAME}: runners")
        # Rolled-back sources, until healthy (their downtime's end).
        self._watcher_tasks = TaskOwner(f"{TASK_NAME}: watchers")
        self._failures: dict[str, int] = defaultdict(int)  # consecutive, per service
        # One link outage fails every area in flight: counted once (rules.link_outage).
        self._step_began_in: dict[str, int] = {}  # transaction id -> the link's connections
        self._counted_outage: dict[str, int] = {}  # service -> the outage last counted
        self._not_before: dict[str, float] = {}  # area -> monotonic time of the next try
        self._exhausted: set[str] = set()  # areas at the last generation, logged once
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
        state.add_listener(self._status_changed)
        self.downtime = DowntimeLog(store=store, metrics=metrics, on_change=self._status_changed,
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
        """The root task body: recovery (once), then the intake every tick until `stop()`;
        the runners and watchers end with it."""
        try:
            await self.loop.run()
        finally:
            await self._runner_tasks.close()
            await self._watcher_tasks.close()

    async def _intake(self) -> None:
        await self.recover()  # a no-op once start-up recovered
        if self._stopping:
            return
        await self._give_up_lost_vps()
        await self._open_due()
        self._start_runners()

    def wake(self) -> None:
        self.loop.wake()

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
            opened = await self._open_for(targets)
        self.loop.wake()
        involved = {t.uuid for t in targets}
        return opened + [
            t.transaction_id
            for t in self.state.transactions.values()
            if t.area in involved and t.transaction_id not in opened
        ]

    async def retry(self, service: str) -> list[str]:
        """The operator's retry: leave PARKED with fresh generations; clear back-offs."""
        async with self.intake_lock:
            self._reset_failures(service)
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
        self.loop.wake()
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
        self.loop.wake()
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
            # No step may finish on a record decided on below; a refusal restarts them.
            for target in targets:
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
            self._reset_failures(service)
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
        self.wake()
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
            view = self.give_up_view(service)
            if view is None:
                continue
            if view["allowed_at"] > self._wall():
                # Not provably fenced yet: asking now would only halt its runners to refuse.
                if service not in self._vps_lost_logged:  # once per outage, not every tick
                    self._vps_lost_logged.add(service)
                    log.critical("vps_lost_give_up_waiting", service=service,
                                 allowed_at=view["allowed_at"], unreachable_s=round(lost_s, 1))
                continue
            try:
                ids = await self.give_up_remote(service, reason="policy")
            except MonitordError as e:  # a commit being written: asked again next tick
                log.warning("vps_lost_give_up_refused", service=service, error_code=e.code,
                            detail=e.detail)
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
            await self._runner_tasks.cancel([task])
        await self.state.reread(area)

    def _remote_leases(self, area: Area) -> dict[int, AreaLease]:
        """The best-known lease of every generation of `area` that could run on the VPS."""
        txn = self.state.transactions.get(area.uuid)
        generations = give_up.remote_generations(area, txn)
        if self.leases is None:
            return {g: AreaLease(area=area.uuid, generation=g, owner_id="unknown",
                                 acknowledged_at=float("-inf"), ttl=self.policy.ttl_s)
                    for g in generations}
        return {g: self.leases.lease_for(area.uuid, g) for g in generations}

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
            if not models.can_move(area):
                self._no_generation_left(area)
                continue
            wanted = give_up.move_to_open(area, self.state.lineage(area.uuid),
                                          desired=self.state.desired_location(area))
            if wanted is None or self._not_before.get(area.uuid, 0.0) > now:
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
        link = self._link_epoch()
        if link is not None and txn.last_error_code is None:
            # Kept from the step that failed through its rollback: the outage is judged by
            # when the failing step began, not by when the rollback's last step did.
            self._step_began_in[txn.transaction_id] = link.connections
        actions = phases.next_actions(txn, self._ctx(txn))
        outcome, error = await self._perform(txn, actions)
        if outcome is None:
            return False, False
        if rules.takes_move_slot(txn, outcome, failed=error is not None):
            if await slot.to_move():
                outcome, error = await self._perform(txn, rules.preflight_again(actions))
                if outcome is None:
                    return False, False
        if error is None and any(isinstance(a, phases.CheckHealth) for a in actions):
            # The destination's first healthy moment: the end of the area's downtime.
            await self.downtime.healthy(txn, side=txn.destination, at=self._wall(),
                                        now=self._clock())
        lease = None
        if outcome is Outcome.LEASE_EXPIRED:
            lease = rules.lease_to_judge(actions, known=self._ctx(txn).lease)
        new = await self._advance(txn, outcome, error=error, lease=lease)
        if error is None and any(isinstance(a, phases.RestartSource) for a in actions):
            self._watch_source(new)
        looping = txn.phase in SELF_LOOPING or txn.source_abandoned
        return True, error is not None and new.phase is txn.phase and looping

    # -- downtime after a rollback ----------------------------------------------------------

    def _watch_source(self, txn: Transaction) -> None:
        """The rollback let its source run again; its downtime ends when the source is first
        healthy (the same check as HEALTHCHECK_DESTINATION), watched off the runner's path."""
        if self._watcher_tasks.closed:
            return  # stopping: the downtime stays open in its record
        self._watcher_tasks.spawn(f"downtime:{txn.service}:{txn.area[:8]}",
                                  self._source_healthy(txn))

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
                if e.code in rules.UNREACHABLE_CODES or attempt == STEP_ATTEMPTS \
                        or self._stopping:
                    raise
                txn_log.bound(txn).info(
                    "step_retry", phase=txn.phase.value, error_code=e.code, attempt=attempt
                )
                await asyncio.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")  # pragma: no cover

    def _outcome_for_error(self, txn: Transaction, error: MonitordError) -> Outcome:
        return rules.outcome_for_error(
            txn, error_code=str(error.code),
            consecutive_failures=self._failures_with(txn, str(error.code)),
            park_after_failures=self.park_after_failures, at=self._wall(),
            rollback_data_wait_s=self.rollback_data_wait_s,
        )

    # -- advancing ------------------------------------------------------------------------

    def _ctx(
        self,
        txn: Transaction,
        *,
        error: MonitordError | None = None,
        new_generation: int | None = None,
        lease: AreaLease | None = None,
    ) -> phases.StepContext:
        if lease is None and self.leases is not None:
            if txn.destination is Side.REMOTE:
                lease = self.leases.lease_for(txn.area, txn.generation)
            elif txn.source_abandoned:  # its SUPPRESS_SOURCE waits out the source's lease
                lease = self.leases.lease_for(txn.area, txn.source_generation)
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
        outcome = rules.settled_outcome(
            txn, outcome, consecutive_failures=self._failures_with(txn, txn.last_error_code),
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

    def _outage_of(self, txn: Transaction, error_code: str | None) -> int | None:
        began_in = self._step_began_in.get(txn.transaction_id)
        return rules.link_outage(error_code, step_began_in=began_in, link=self._link_epoch())

    def _failures_with(self, txn: Transaction, error_code: str | None) -> int:
        """The service's consecutive failures once this failure of `txn` is counted."""
        return self._failures_with_outage(txn.service, self._outage_of(txn, error_code))

    def _failures_with_outage(self, service: str, outage: int | None) -> int:
        counted = outage is not None and self._counted_outage.get(service) == outage
        return self._failures[service] + (0 if counted else 1)

    def _reset_failures(self, service: str) -> None:
        self._failures[service] = 0
        self._counted_outage.pop(service, None)

    def _count_end(self, txn: Transaction) -> None:
        """Consecutive failures per service, and the back-off before this area tries again."""
        outage = self._outage_of(txn, txn.last_error_code)
        self._step_began_in.pop(txn.transaction_id, None)
        if txn.phase is Phase.DONE:
            self._reset_failures(txn.service)
            self.last_errors.pop(txn.service, None)
            self._status_changed()
        elif txn.last_error_code is not None:
            self._failures[txn.service] = self._failures_with_outage(txn.service, outage)
            if outage is not None:
                self._counted_outage[txn.service] = outage
            count = max(1, self._failures[txn.service])
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
            **error.facts,  # e.g. a shortage's needed and free bytes (orchestrator/disk_space.py)
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

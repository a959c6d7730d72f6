"""The reconcile loop: make both sides match the authoritative placement.

A root task ("reconciler"). A pass runs on every tunnel (re)connect, every
`monitord.reconcile_interval_s`, and after each finished transaction. It observes the local
supervisor and (when the tunnel is up) the agent, asks `orchestrator.planner.plan()` and
performs the actions: remove orphan remote entries and stop orphan processes at their
generation, create missing remote entries for areas committed remote. Drift before and
after is kept for the status, the metrics and the event log.

A pass holds the migration engine's intake lock, so no transaction opens between the
observation and the actions; areas in an active transaction are never touched (the planner
leaves them to the engine). Passes run under the root loops' error policy
(monitord/base/periodic.py): one that raises is counted and shown, and the next runs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from monitord.base import logs
from monitord.base.metrics import Metrics
from monitord.base.periodic import LoopBook, Periodic
from monitord.engine.area_side import AreaSide
from monitord.engine.placement_state import PlacementState
from monitord.local.supervisor import LocalSupervisor
from monitord.remote.agent_client import to_remote_inventory
from monitord.store.state_db import Store
from orchestrator import planner
from orchestrator.errors import ErrorCode, MonitordError
from orchestrator.models import CleanupItem, LocalInventory, ProcessInfo, RemoteInventory, Side

if TYPE_CHECKING:  # the SSH side loads after readiness (monitord/remote/ssh_side.py)
    from monitord.remote.remote_link import RemoteLink

log = logs.get_logger(__name__)

TASK_NAME = "reconciler"
# Every move that ends wakes a pass, and a pass asks the agent for its whole inventory: a
# hundred areas moving were a hundred inventories of up to a hundred areas. Wake-ups this
# close after a pass are served by the next one (what a pass finds is never urgent: the
# moves themselves fence and clean up; this catches what they could not).
MIN_PASS_GAP_S = 1.0


@dataclass(frozen=True)
class DriftReport:
    at: float
    before: dict[str, int]
    after: dict[str, int]
    actions: int
    remote_observed: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "at": self.at,
            "before": sum(self.before.values()),
            "after": sum(self.after.values()),
            "before_by_kind": self.before,
            "after_by_kind": self.after,
            "actions": self.actions,
            "remote_observed": self.remote_observed,
        }


class Reconciler:
    def __init__(
        self,
        *,
        state: PlacementState,
        store: Store,
        supervisor: LocalSupervisor,
        link: RemoteLink | None,
        sides: Mapping[Side, AreaSide],
        metrics: Metrics,
        intake_lock: asyncio.Lock,
        interval_s: float,
        legacy_grace_s: float,
        wall: Callable[[], float] = time.time,
        loops: LoopBook | None = None,
    ) -> None:
        self.state = state
        self.store = store
        self.supervisor = supervisor
        self.link = link
        self.sides = sides
        self.metrics = metrics
        self.intake_lock = intake_lock
        self.interval_s = interval_s
        self.legacy_grace_s = legacy_grace_s
        self._wall = wall
        self.loop = Periodic(TASK_NAME, iteration=self._pass, interval_s=interval_s, book=loops,
                             min_gap_s=MIN_PASS_GAP_S)
        self._first_seen: dict[tuple[str, int], float] = {}
        self.last: DriftReport | None = None
        self.remote_inventory: dict[str, Any] | None = None
        self.remote_inventory_at: float | None = None  # wall clock of that answer
        # Restarts the agent reported, summed per service as they grew (monotonic, for
        # monitord_area_restarts_total; the agent's own count restarts with each entry).
        self.remote_restarts_by_service: dict[str, int] = {}
        self._restarts_seen: dict[tuple[str, int], int] | None = None  # None: not looked yet
        self.orphans_by_service: dict[str, int] = {}

    def wake(self) -> None:
        self.loop.wake()

    async def run(self) -> None:
        """The root task body: a pass now, then on every wake-up and every interval."""
        await self.loop.run()

    async def _pass(self) -> None:
        await self.run_once()

    async def run_once(self) -> DriftReport:
        await self.state.reload_committed()
        # The network is asked outside the intake lock: a hung agent must never keep an
        # operator's placement waiting. Only the decision (and a start, below) holds it.
        remote = await self._observe_remote()
        await self.state.settle_held(remote, remote_configured=self.link is not None)
        items = [CleanupItem.from_storage(r) for r in await self.store.list_cleanup(limit=100_000)]
        async with self.intake_lock:
            plan = planner.plan(
                authoritative=self.state.committed.values(),
                transactions=self.state.transactions.values(),
                cleanup_items=items,
                local_inventory=self._observe_local(),
                remote_inventory=remote,
                now=self._wall(),
                legacy_grace_s=self.legacy_grace_s,
                held=self.state.held,
            )
        for action in plan.actions:
            if isinstance(action, planner.CreateRemoteEntry):
                # A start: no transaction may open for the area until it is done (its
                # SUPPRESS_SOURCE would race the start).
                async with self.intake_lock:
                    await self._perform(action)
            else:
                # Removals and stops are generation-checked and never touch what may run;
                # _perform skips an area that a transaction took meanwhile.
                await self._perform(action)
        report = DriftReport(
            at=self._wall(),
            before=asdict(plan.drift_before),
            after=asdict(plan.drift_after_expected),
            actions=len(plan.actions),
            remote_observed=remote is not None,
        )
        self.last = report
        orphans: dict[str, int] = {}
        for action in plan.actions:
            if not isinstance(action, planner.CreateRemoteEntry):
                orphans[action.service] = orphans.get(action.service, 0) + 1
        self.orphans_by_service = orphans
        self.metrics.drift.set(plan.drift_after_expected.total)
        if plan.actions or plan.drift_before.total:
            log.info("reconciled", drift_before=plan.drift_before.total,
                     drift_after=plan.drift_after_expected.total, actions=len(plan.actions),
                     remote_observed=remote is not None)
            await self.store.record_event("reconciled", report.to_dict())
        return report

    async def _observe_remote(self) -> RemoteInventory | None:
        if self.link is None or not self.link.connected():
            return None
        try:
            raw = await self.link.agent.inventory_raw()
        except MonitordError as e:
            log.warning("reconcile_inventory_failed", error_code=e.code, detail=e.detail)
            if e.code == ErrorCode.AGENT_UNREACHABLE and self.link.connected():
                # The tunnel is up but the agent is not answering: it may have died.
                await self.link.ensure_agent()
            return None
        self.remote_inventory = raw
        now = self._wall()
        self.remote_inventory_at = now
        self._count_restarts(raw)
        # Legacy grace counts from the first time this owner saw the entry, unless the agent
        # says when it appeared: an agent restart must not restart the clock.
        for entry in raw.get("entries", []):
            key = (entry["area"], int(entry.get("generation", 0)))
            first = self._first_seen.setdefault(key, now)
            entry.setdefault("created_at", first)
        return to_remote_inventory(raw, now=now)

    def _count_restarts(self, raw: dict[str, Any]) -> None:
        """Add what each entry's restart count grew by since the last look (the first look
        only learns the counts: what happened before this monitord started is not new)."""
        seen: dict[tuple[str, int], int] = {}
        before = self._restarts_seen
        for entry in raw.get("entries", []):
            key = (entry["area"], int(entry.get("generation", 0)))
            seen[key] = restarts = int(entry.get("restarts", 0) or 0)
            grown = 0 if before is None else restarts - before.get(key, 0)
            if grown > 0:
                service = str(entry.get("service") or "?")
                self.remote_restarts_by_service[service] = \
                    self.remote_restarts_by_service.get(service, 0) + grown
        self._restarts_seen = seen

    def _observe_local(self) -> LocalInventory:
        return LocalInventory(
            processes=tuple(
                ProcessInfo(area=v.area, service=v.service, generation=v.generation, pid=v.pid,
                            started_at=v.started_at or self._wall())
                for v in self.supervisor.inventory()
                if v.pid
            )
        )

    async def _perform(self, action: planner.PlanAction) -> None:
        if action.area in self.state.transactions:
            return  # a transaction opened meanwhile owns it now
        fields = {"service": action.service, "area": action.area, "side": action.side.value,
                  "generation": action.generation, "action": type(action).__name__}
        try:
            match action:
                case planner.RemoveRemoteEntry():
                    # Where its data there is the newest, only the process is fenced.
                    await self.sides[Side.REMOTE].remove_unless_newest(
                        area=action.area, generation=action.generation,
                        lineage=self.state.lineage(action.area),
                    )
                case planner.StopProcess(side=side):
                    await self.sides[side].stop_at(area=action.area, generation=action.generation)
                case planner.CreateRemoteEntry():
                    # A start like any other: only on the newest data (raises DATA_NOT_NEWEST).
                    await self.state.claim_data(action.area, Side.REMOTE)
                    await self.sides[Side.REMOTE].start(
                        service=action.service, area=action.area, generation=action.generation
                    )
        except MonitordError as e:
            log.warning("reconcile_action_failed", error_code=e.code, detail=e.detail, **fields)
            return
        log.info("reconcile_action", **fields)

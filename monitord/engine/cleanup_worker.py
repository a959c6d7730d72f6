"""The cleanup worker: works the durable cleanup queue down.

A root task ("cleanup worker"). It runs right after every tunnel (re)connect (a reconnect
hook wakes it) and every `monitord.cleanup_interval_s`. For each due item it observes the
item's side, asks `orchestrator.cleanup_policy.decide()`, and:

- completes the item only on verified absence (no process and no entry at that generation);
- otherwise removes exactly that generation (the agent deletes only at the named generation,
  and locally a process is stopped only if it runs at that generation), observes again, and
  completes or reschedules with capped, jittered back-off;
- never drops an item: one failing for `stuck_after_attempts` is reported CLEANUP_STUCK;
- removes the given-up VPS copies set aside longer than `abandoned_data_keep_s`
  (monitord/engine/abandoned_data.py).

Taking due items and completing one are indexed store operations (O(log n)). The passes run
under the root loops' error policy (monitord/base/periodic.py): a pass that raises — a full
disk, a bug — is counted and shown, and the next pass runs after a back-off.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping

from monitord.base import logs
from monitord.base.metrics import Metrics
from monitord.base.periodic import LoopBook, Periodic
from monitord.engine.abandoned_data import AbandonedData
from monitord.engine.area_side import AreaSide
from monitord.store.state_db import Store
from orchestrator import cleanup_policy
from orchestrator.cleanup_policy import CleanupPolicy, SideObservation
from orchestrator.errors import ErrorCode, MonitordError, error_for
from orchestrator.lineage import Lineage
from orchestrator.models import CleanupAction, CleanupItem, Side

# What each side holds of a batch's areas (None: that side cannot be observed now).
Observed = dict[Side, dict[str, SideObservation] | None]

log = logs.get_logger(__name__)

TASK_NAME = "cleanup worker"
BATCH = 200


class CleanupWorker:
    def __init__(
        self,
        *,
        store: Store,
        sides: Mapping[Side, AreaSide],
        metrics: Metrics,
        interval_s: float,
        lineage_of: Callable[[str], Lineage],
        policy: CleanupPolicy | None = None,
        wall: Callable[[], float] = time.time,
        jitter: Callable[[], float] = random.random,
        loops: LoopBook | None = None,
        abandoned: AbandonedData | None = None,
    ) -> None:
        self.store = store
        self.sides = sides
        self.metrics = metrics
        self.interval_s = interval_s
        # Which sides hold an area's newest data (PlacementState.lineage): never deleted.
        self._lineage_of = lineage_of
        self.policy = policy or CleanupPolicy()
        self._wall = wall
        self._jitter = jitter
        # Given-up VPS copies set aside: removed here once kept long enough.
        self.abandoned = abandoned
        self.loop = Periodic(TASK_NAME, iteration=self._pass, interval_s=interval_s, book=loops)
        self.stuck = 0
        self.backlog = 0
        self.backlog_by_service: dict[str, int] = {}
        self.passes = 0

    def wake(self) -> None:
        self.loop.wake()

    async def run(self) -> None:
        """The root task body: a pass now, then on every wake-up and every interval; the
        forensic fetches it started end with it."""
        try:
            await self.loop.run()
        finally:
            if self.abandoned is not None:
                await self.abandoned.close()

    async def _pass(self) -> None:
        await self.run_once()
        if self.abandoned is not None:
            await self.abandoned.expire()

    async def run_once(self) -> int:
        """Process every item due now; returns how many were completed."""
        completed = 0
        while True:
            raw = await self.store.take_due(self._wall(), BATCH)
            if not raw:
                break
            items = [CleanupItem.from_storage(r) for r in raw]
            observed = await self._observe(items)
            for item in items:
                if await self._process(item, observed):
                    completed += 1
            if len(raw) < BATCH:
                break
        await self._publish()
        self.passes += 1
        return completed

    async def _publish(self) -> None:
        self.backlog = await self.store.cleanup_backlog()
        self.metrics.cleanup_backlog.set(self.backlog)
        items = [CleanupItem.from_storage(i) for i in await self.store.list_cleanup(limit=1000)]
        self.stuck = sum(1 for item in items if cleanup_policy.is_stuck(item, policy=self.policy))
        by_service: dict[str, int] = {}
        for item in items:
            by_service[item.service] = by_service.get(item.service, 0) + 1
        self.backlog_by_service = by_service
        self.metrics.cleanup_stuck.set(self.stuck)

    async def _observe(self, items: list[CleanupItem]) -> Observed:
        """One look per side at the batch's areas (one agent inventory for the VPS)."""
        observed: Observed = {}
        for side in {item.side for item in items}:
            observed[side] = await self.sides[side].observe(
                {item.area for item in items if item.side is side}
            )
        return observed

    async def _process(self, item: CleanupItem, observed: Observed) -> bool:
        try:
            seen = _seen(item, observed)
            decision = cleanup_policy.decide(item, seen)
            if isinstance(decision, cleanup_policy.RemoveAt):
                await self._remove(item)
                observed = {item.side: await self.sides[item.side].observe({item.area})}
                decision = cleanup_policy.decide(item, _seen(item, observed))
            if isinstance(decision, cleanup_policy.Done):
                await self.store.complete(item.id)
                log.info("cleanup_done", service=item.service, area=item.area,
                         side=item.side.value, generation=item.generation,
                         action=item.action.value, attempts=item.attempts)
                return True
            raise error_for(ErrorCode.CLEANUP_STUCK, "still present after removal")
        except MonitordError as e:
            delay = cleanup_policy.backoff_delay(
                item.attempts, jitter=self._jitter(), policy=self.policy
            )
            await self.store.reschedule(
                item.id, next_attempt_at=self._wall() + delay, last_error=f"{e.code}: {e.detail}"
            )
            if cleanup_policy.is_stuck(item, policy=self.policy):
                log.error("cleanup_stuck", service=item.service, area=item.area,
                          side=item.side.value, generation=item.generation,
                          attempts=item.attempts, error_code=ErrorCode.CLEANUP_STUCK,
                          detail=e.detail)
            return False

    async def _remove(self, item: CleanupItem) -> None:
        """Remove exactly the item's generation on its side (never a newer one), and its data
        only when that side does not hold the area's newest data."""
        side = self.sides[item.side]
        if item.action is CleanupAction.STOP_PROCESS:
            await side.stop_at(area=item.area, generation=item.generation)
            return
        removed = await side.remove_unless_newest(
            area=item.area, generation=item.generation, lineage=self._lineage_of(item.area)
        )
        if not removed:
            # The newest data is there (a rollback has not brought it back yet): the process
            # is fenced, entry and data are kept; come back later.
            raise error_for(
                ErrorCode.CLEANUP_STUCK,
                f"{item.area}: its newest data is still on {item.side.value}; kept for now",
            )


def _seen(item: CleanupItem, observed: Observed) -> SideObservation:
    """The item's side as observed; SSH_UNREACHABLE while that side cannot be looked at."""
    view = observed.get(item.side)
    if view is None:
        raise error_for(ErrorCode.SSH_UNREACHABLE, "the VPS is not reachable now")
    return view[item.area]

"""The cleanup worker drains the durable queue completely, again and again."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from monitord.base.config import Config, MonitordSection
from monitord.base.metrics import Metrics
from monitord.engine.cleanup_worker import CleanupWorker
from monitord.engine.local_side import LocalSide
from monitord.local.supervisor import LocalSupervisor
from monitord.store.state_db import Store
from orchestrator.cleanup_policy import CleanupPolicy
from orchestrator.lineage import Lineage
from orchestrator.models import Side

ITEMS = 2000
CYCLES = 3


class TestDrainCycles:
    """Every cycle of 2 000 items ends with an empty queue: none lost, none done twice."""

    async def test_queue_drains_completely_three_times_in_a_row(self, tmp_path: Path) -> None:
        supervisor = LocalSupervisor(state_dir=tmp_path / "supervisor")
        async with await Store.open(tmp_path / "work") as store:
            completed: list[str] = []
            real_complete = store.complete

            async def counting_complete(item_id: str) -> bool:
                done = await real_complete(item_id)
                if done:
                    completed.append(item_id)
                return done

            store.complete = counting_complete  # type: ignore[method-assign]
            config = Config(monitord=MonitordSection(work_dir=tmp_path / "work"), services={})
            local = LocalSide(config=config, supervisor=supervisor, runs=dict, link=None)
            worker = CleanupWorker(
                store=store, sides={Side.LOCAL: local}, metrics=Metrics(),
                interval_s=60.0, policy=CleanupPolicy(),
                # the queue alone: no area's newest data is on a side being cleaned
                lineage_of=lambda area: Lineage(area=area, holders=frozenset()),
            )
            tasks_before = asyncio.all_tasks()
            for cycle in range(CYCLES):
                enqueued = set()
                now = time.time()
                for i in range(ITEMS):
                    item = await store.enqueue_cleanup(
                        service="tg", area=f"area-{cycle}-{i}", side="local",
                        generation=i % 7, action="remove_area", now=now,
                    )
                    enqueued.add(item["id"])
                assert await store.cleanup_backlog() == ITEMS
                before = len(completed)
                assert await worker.run_once() == ITEMS
                done_now = completed[before:]
                assert set(done_now) == enqueued and len(done_now) == len(enqueued)
                assert await store.cleanup_backlog() == 0
                assert await store.take_due(time.time() + 3600, 10) == []
            assert len(completed) == len(set(completed)) == ITEMS * CYCLES
            assert worker.backlog == 0 and worker.stuck == 0
            assert asyncio.all_tasks() == tasks_before  # nothing left running
            assert not any(lock.locked() for lock in supervisor._locks.values())

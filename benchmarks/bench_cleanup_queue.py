"""Cleanup queue figures: operations per second of the real `Store` at a
backlog of 1 k and of 100 k queued items; the 100 k rate is given as a ratio against the
1 k rate measured in the same run (flat cost means a ratio near 1).

For each backlog size a fresh `state.db` is created by `Store.open()`, then filled in ONE
SQLite transaction through a separate connection (the store's triggers keep its backlog
counter right), so filling 100 k items does not cost 100 k fsyncs. The backlog items are all
backing off (due an hour or more from now), which is what a large backlog looks like: a VPS
unreachable for a long time. Then, through the real Store API (each call its own durable
transaction, WAL + synchronous=FULL, as in production), batches of fresh items are
- `enqueue`d (due now),
- claimed with `take_due(now, limit=TAKE_LIMIT)` until none is due,
- `complete`d one by one.

Every operation waits for an fsync, and fsync latency on a shared disk drifts by several
times within seconds. So the two stores stay open side by side and take turns, batch by
batch (`ROUNDS` rounds, the first size alternating), and each figure is the median of its
rounds. Besides the wall-clock rate (what a caller sees, fsync included) each figure carries
the CPU time per operation (`time.process_time`, all threads), which the disk does not
disturb: a scan that grows with the backlog would show there first.

Called by `python -m benchmarks`; the unit smoke test calls `measure()` with small sizes.
Not a test: nothing here is pass/fail.
"""

from __future__ import annotations

import asyncio
import sqlite3
import statistics
import tempfile
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from monitord.store.state_db import Store

BACKLOGS = (1_000, 100_000)
ROUNDS = 10
OPS_PER_ROUND = 100
TAKE_LIMIT = 10
OPERATIONS = ("enqueue", "take_due", "complete")


def _fill(db_path: Path, *, backlog: int, now: float) -> None:
    """Queue `backlog` items, all due in the future, in one transaction."""
    rows = (
        (uuid.uuid4().hex, "tg", f"area-{i:07d}", "remote", 1 + i % 7, "remove_area",
         3 + i % 5, now + 3600 + i, "SSH_UNREACHABLE: backing off", now - 86400 + i)
        for i in range(backlog)
    )
    conn = sqlite3.connect(db_path, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(
            "INSERT INTO cleanup_items (id, service, area, side, generation, action, attempts, "
            "next_attempt_at, last_error, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            rows,
        )
        conn.execute("COMMIT")
    finally:
        conn.close()


async def _open_filled(work_dir: Path, *, backlog: int, now: float) -> Store:
    from monitord.store.state_db import Store

    store = await Store.open(work_dir)
    await store.close()
    await asyncio.to_thread(_fill, work_dir / "state.db", backlog=backlog, now=now)
    store = await Store.open(work_dir)
    queued = await store.cleanup_backlog()
    if queued != backlog:
        await store.close()
        raise RuntimeError(f"filled {backlog} items but the store counts {queued}")
    return store


class _Clock:
    """Wall and CPU seconds of one timed block."""

    def __enter__(self) -> _Clock:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.wall
        self.cpu = time.process_time() - self.cpu


async def _round(
    store: Store, *, ops: int, now: float, tag: str
) -> dict[str, tuple[float, float]]:
    """One batch through the queue: per-item (wall s, cpu s) of each operation."""
    with _Clock() as enqueue:
        for i in range(ops):
            await store.enqueue_cleanup(service="chats", area=f"{tag}-{i:05d}", side="local",
                                        generation=2, action="remove_leftovers", now=now)
    claimed: list[str] = []
    with _Clock() as take:
        while batch := await store.take_due(now, TAKE_LIMIT):
            claimed.extend(item["id"] for item in batch)
    if len(claimed) != ops:
        raise RuntimeError(f"take_due handed out {len(claimed)} items, expected {ops}")
    with _Clock() as complete:
        for item_id in claimed:
            await store.complete(item_id)
    return {name: (clock.wall / ops, clock.cpu / ops)
            for name, clock in zip(OPERATIONS, (enqueue, take, complete), strict=True)}


async def measure(
    tmp: Path,
    *,
    backlogs: tuple[int, int] = BACKLOGS,
    rounds: int = ROUNDS,
    ops_per_round: int = OPS_PER_ROUND,
) -> list[dict[str, Any]]:
    """Figures for the two backlog sizes: the first is the reference of the second."""
    now = time.time()
    stores = {size: await _open_filled(tmp / f"q{size}", backlog=size, now=now)
              for size in backlogs}
    samples: dict[int, dict[str, list[tuple[float, float]]]] = {
        size: defaultdict(list) for size in backlogs
    }
    try:
        for number in range(rounds):
            order = backlogs if number % 2 == 0 else tuple(reversed(backlogs))
            for size in order:
                timings = await _round(stores[size], ops=ops_per_round, now=now,
                                       tag=f"r{number}")
                for name, timing in timings.items():
                    samples[size][name].append(timing)
        for size, store in stores.items():
            if await store.cleanup_backlog() != size:
                raise RuntimeError(f"the {size} backlog did not return to its size")
    finally:
        for store in stores.values():
            await store.close()

    small, large = backlogs
    figures = []
    for name in OPERATIONS:
        ref_wall = statistics.median(w for w, _ in samples[small][name])
        ref_cpu = statistics.median(c for _, c in samples[small][name])
        wall = statistics.median(w for w, _ in samples[large][name])
        cpu = statistics.median(c for _, c in samples[large][name])
        figures.append({
            "benchmark": f"cleanup_queue_{name}",
            "backlog": large,
            "ops_per_s": round(1 / wall, 1),
            "reference": f"same operation at a backlog of {small}",
            "reference_ops_per_s": round(1 / ref_wall, 1),
            "ratio": round(ref_wall / wall, 3),
            "cpu_us_per_op": round(cpu * 1e6, 1),
            "reference_cpu_us_per_op": round(ref_cpu * 1e6, 1),
            "cpu_ratio": round(ref_cpu / cpu, 3) if cpu > 0 else None,
            "ops": rounds * ops_per_round,
            "rounds": rounds,
            "take_limit": TAKE_LIMIT if name == "take_due" else None,
        })
    return figures


def run() -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="bench-cleanup-") as tmp:
        return asyncio.run(measure(Path(tmp)))

"""Reconcile pass figures: time of one `orchestrator.planner.plan()` pass
over generated inventories of 1 k, 10 k and 100 k areas, given per area. Linear growth means
flat per-area time: each size's per-area time is reported as a ratio against the 1 k one
measured in the same run.

The generated installation looks like a busy real one (fractions of the area count):
half the areas committed local (each with its local process), half committed remote (each
with its agent entry and remote process); 2 % in an active transaction; 1 % remote orphans
at an older generation (entry + process) with cleanup items for half of them; 1 % local
orphan processes of areas committed remote; 1 % areas committed remote with no entry (to be
created); 0.5 % legacy entries nobody knows. Inputs are built before the clock starts; only
`plan()` is timed, the median of `REPEATS` passes.

Per-area time also grows when the inputs outgrow the CPU caches, whatever the algorithm. To
tell the two apart, every size also times a FLOOR over the same inputs: the least any
planner must do (index the committed areas, the busy areas and the cleanup keys, then look
up every entry and process once). `ratio_to_floor` staying flat across sizes means the
planner grows like that linear pass; `ratio` (per-area time against the 1 k pass) shows the
growth a caller sees.

Called by `python -m benchmarks`; the unit smoke test calls `measure()` with small sizes.
Not a test: nothing here is pass/fail.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

SIZES = (1_000, 10_000, 100_000)
REPEATS = 5
LEGACY_GRACE_S = 300.0


@dataclass(frozen=True)
class _Inputs:
    """Keyword arguments of one `plan()` call (built once, reused by every repeat)."""

    arguments: dict[str, Any]
    entries: int
    processes: int


def _inputs(size: int, *, now: float) -> _Inputs:
    from orchestrator.models import (
        Area,
        CleanupItem,
        LocalInventory,
        Phase,
        ProcessInfo,
        RemoteEntry,
        RemoteInventory,
        Side,
        Transaction,
    )

    services = ("tg", "chats", "max")
    areas: list[Area] = []
    transactions: list[Transaction] = []
    cleanup: list[CleanupItem] = []
    entries: list[RemoteEntry] = []
    remote_procs: list[ProcessInfo] = []
    local_procs: list[ProcessInfo] = []
    pid = 1000
    for i in range(size):
        uid = f"{i:08d}-0000-4000-8000-{i:012d}"
        service = services[i % len(services)]
        remote = i % 2 == 1
        generation = 1 + i % 5
        areas.append(Area(uuid=uid, service=service,
                          location=Side.REMOTE if remote else Side.LOCAL, generation=generation))
        pid += 1
        process = ProcessInfo(area=uid, service=service, generation=generation, pid=pid,
                              started_at=now - 600)
        missing_entry = remote and i % 100 == 3
        if remote and not missing_entry:
            entries.append(RemoteEntry(area=uid, service=service, generation=generation,
                                       owner_id="owner", lease_expires_at=now + 30,
                                       created_at=now - 600))
            remote_procs.append(process)
        elif not remote:
            local_procs.append(process)
        if i % 50 == 0:
            transactions.append(Transaction(
                transaction_id=f"t{i}", service=service, area=uid, source=Side.LOCAL,
                destination=Side.REMOTE, phase=Phase.COPY, generation=generation + 1,
                started_at=now - 5, updated_at=now - 1, source_generation=generation,
            ))
        if i % 100 == 7 and generation > 1:  # a remote orphan at an older generation
            old = generation - 1
            entries.append(RemoteEntry(area=uid, service=service, generation=old,
                                       owner_id="owner", created_at=now - 900))
            pid += 1
            remote_procs.append(ProcessInfo(area=uid, service=service, generation=old,
                                            pid=pid, started_at=now - 900))
            if i % 200 == 7:
                cleanup.append(CleanupItem(id=f"c{i}", service=service, area=uid,
                                           side=Side.REMOTE, generation=old,
                                           next_attempt_at=now + 10, created_at=now - 100))
        if remote and i % 100 == 9:  # a local process of an area that lives remote
            pid += 1
            local_procs.append(ProcessInfo(area=uid, service=service, generation=generation,
                                           pid=pid, started_at=now - 60))
        if i % 200 == 11:  # a legacy entry no inventory knows
            entries.append(RemoteEntry(area=f"legacy-{i}", service=service, generation=1,
                                       created_at=now - 3600))
    arguments = {
        "authoritative": tuple(areas),
        "transactions": tuple(transactions),
        "cleanup_items": tuple(cleanup),
        "local_inventory": LocalInventory(processes=tuple(local_procs)),
        "remote_inventory": RemoteInventory(entries=tuple(entries),
                                            processes=tuple(remote_procs)),
        "now": now,
        "legacy_grace_s": LEGACY_GRACE_S,
    }
    return _Inputs(arguments=arguments, entries=len(entries),
                   processes=len(local_procs) + len(remote_procs))


def _floor_pass(arguments: dict[str, Any]) -> int:
    """The least work of a reconcile pass: index the inputs, look up each thing once."""
    committed = {area.uuid: area for area in arguments["authoritative"]}
    busy = {txn.area for txn in arguments["transactions"] if txn.is_active}
    keys = {(item.area, item.side, item.generation) for item in arguments["cleanup_items"]}
    remote = arguments["remote_inventory"]
    things = (*remote.entries, *remote.processes, *arguments["local_inventory"].processes)
    differ = 0
    for thing in things:
        area = committed.get(thing.area)
        if thing.area in busy or (thing.area, "remote", thing.generation) in keys:
            continue
        if area is None or area.generation != thing.generation:
            differ += 1
    return differ


def _median_time(call: Callable[[], object], *, repeats: int) -> tuple[float, object]:
    """Median seconds of `repeats` calls, and the last call's result."""
    timings: list[float] = []
    result: object = None
    gc.collect()
    for _ in range(repeats):
        started = time.perf_counter()
        result = call()
        timings.append(time.perf_counter() - started)
    return statistics.median(timings), result


def measure(
    *, sizes: tuple[int, ...] = SIZES, repeats: int = REPEATS
) -> list[dict[str, Any]]:
    """One figure per size; the first size is the reference of every figure."""
    from orchestrator import planner

    now = time.time()
    per_area: dict[int, float] = {}
    figures = []
    for size in sizes:
        inputs = _inputs(size, now=now)
        floor_s, _ = _median_time(partial(_floor_pass, inputs.arguments), repeats=repeats)
        seconds, result = _median_time(partial(planner.plan, **inputs.arguments),
                                       repeats=repeats)
        assert isinstance(result, planner.Plan)
        per_area[size] = seconds / size
        reference = per_area[sizes[0]]
        figures.append({
            "benchmark": "reconcile_pass",
            "areas": size,
            "remote_entries": inputs.entries,
            "processes": inputs.processes,
            "actions": len(result.actions),
            "pass_ms": round(seconds * 1000, 2),
            "us_per_area": round(per_area[size] * 1e6, 3),
            "reference": f"per-area time of a pass over {sizes[0]} areas",
            "reference_us_per_area": round(reference * 1e6, 3),
            "ratio": round(per_area[size] / reference, 3),
            "floor_us_per_area": round(floor_s / size * 1e6, 3),
            "ratio_to_floor": round(seconds / floor_s, 2),
            "repeats": repeats,
        })
    return figures


def run() -> list[dict[str, Any]]:
    return measure()

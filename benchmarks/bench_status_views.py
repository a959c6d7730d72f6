"""Status document figure: the per-area part of `GET /v1/status` that grows with the VPS's
inventory — every remote area's process view (orchestrator/area_health.py: the agent's
inventory indexed once, each area looked up in it, the view as a document) — at 100 and
1000 remote areas, per area. Linear growth means flat per-area time: the 1000-area figure's
`ratio` is its per-area time against the 100-area one measured in the same run (a lookup by
scanning the inventory's lists, as before, made it 2.97: 76 ms at 1000 areas).

The inventory is what an agent reports for that many running areas (an entry and a live
process each); it is built before the clock starts. The median of `REPEATS` builds.

Called by `python -m benchmarks`; the unit smoke test calls `measure()` with small sizes.
Not a test: nothing here is pass/fail.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

SIZES = (100, 1000)
REPEATS = 15


def _inventory(areas: int) -> dict[str, Any]:
    names = [f"00000000-0000-4000-8000-{i:012d}" for i in range(areas)]
    return {
        "entries": [{"area": a, "service": "tg", "generation": 2, "restarts": 0}
                    for a in names],
        "processes": [{"area": a, "service": "tg", "generation": 2, "pid": 1000 + i,
                       "alive": True, "uptime_s": 60.0} for i, a in enumerate(names)],
    }


def _views(inventory: dict[str, Any]) -> list[dict[str, Any]]:
    from orchestrator import area_health

    index = area_health.index_inventory(inventory)
    return [area_health.remote_process(index, area=entry["area"], generation=2, as_of=1e9,
                                       min_uptime_s=5.0).to_dict()
            for entry in inventory["entries"]]


def _per_area_s(areas: int, repeats: int) -> float:
    inventory = _inventory(areas)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        _views(inventory)
        times.append(time.perf_counter() - started)
    return statistics.median(times) / areas


def measure(*, sizes: tuple[int, ...] = SIZES, repeats: int = REPEATS) -> list[dict[str, Any]]:
    reference = _per_area_s(sizes[0], repeats)
    figures = []
    for areas in sizes:
        per_area = reference if areas == sizes[0] else _per_area_s(areas, repeats)
        figures.append({
            "benchmark": "status_remote_area_views",
            "areas": areas,
            "per_area_us": round(per_area * 1e6, 2),
            "document_part_ms": round(per_area * areas * 1000, 2),
            "reference": f"per-area time at {sizes[0]} areas, same run",
            "ratio": round(per_area / reference, 2),
        })
    return figures


def run() -> list[dict[str, Any]]:
    return measure()

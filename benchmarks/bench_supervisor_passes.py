"""Local supervisor figure: the CPU the supervisor spends while every area moves away, per
area, at 100 and 300 areas. Linear growth means flat per-area CPU: the 300-area figure's
`ratio` is its per-area CPU against the 100-area one measured in the same run.

The areas run (`/bin/sleep`, started and settled before the clock starts); then the wanted
set loses one area at a time, as a move away takes each, and every area's move makes
`NOTIFICATIONS` calls of `set_desired` a few milliseconds apart, the first without the area
and the others with the same set again (the engine notifies the supervisor at every phase of
every move; only the source's stop changes what runs here) — until every daemon is
stopped. The CPU time of this process
(the supervisor and its loop, nothing else runs here) over that stretch.

Called by `python -m benchmarks`; the unit smoke test calls `measure()` with small sizes.
Not a test: nothing here is pass/fail.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.waiting import until

SIZES = (100, 300)
NOTIFICATIONS = 5
NOTIFICATION_GAP_S = 0.005
WAIT_S = 120.0  # for every daemon to start, and for the last ones to stop


async def _move_away_cpu_s(root: Path, areas: int) -> float:
    from monitord.local.supervisor import AreaRun, LocalSupervisor

    supervisor = LocalSupervisor(state_dir=root / "state", stop_grace_s=1.0)
    runs = {}
    for i in range(areas):
        area = f"0a0a0a0a-0000-4000-8000-{i:012d}"
        runs[area] = AreaRun(service="tg", area=area, generation=1,
                             command=("/bin/sleep", "3600"), data_dir=str(root / str(i)))
    try:
        supervisor.set_desired(runs)
        await supervisor.start()
        await until(lambda: sum(1 for view in supervisor.inventory() if view.pid) == areas,
                    timeout_s=WAIT_S, what=f"{areas} daemons running")
        wanted = dict(runs)
        started = time.process_time()
        for area in runs:
            del wanted[area]
            for _ in range(NOTIFICATIONS):
                supervisor.set_desired(dict(wanted))
                await asyncio.sleep(NOTIFICATION_GAP_S)
        await until(lambda: not any(view.pid for view in supervisor.inventory()),
                    timeout_s=WAIT_S, what="stop of every daemon")
        return time.process_time() - started
    finally:
        await supervisor.close()
        await supervisor.stop_all(grace_s=0.5)


async def measure(tmp: Path, *, sizes: tuple[int, ...] = SIZES) -> list[dict[str, Any]]:
    per_area = {areas: await _move_away_cpu_s(tmp / f"s{areas}", areas) / areas
                for areas in sizes}
    reference = per_area[sizes[0]]
    return [{
        "benchmark": "supervisor_move_away_cpu",
        "areas": areas,
        "cpu_s": round(per_area[areas] * areas, 3),
        "per_area_ms": round(per_area[areas] * 1000, 2),
        "notifications_per_area": NOTIFICATIONS,
        "reference": f"per-area CPU at {sizes[0]} areas, same run",
        "ratio": round(per_area[areas] / reference, 2),
    } for areas in sizes]


async def run() -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="bench-sup-") as tmp:
        return await measure(Path(tmp))

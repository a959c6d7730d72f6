"""A stand-in for `monitord run` in the survivor tests: runs a LocalSupervisor on a state dir
with the AreaRuns given as JSON, prints `ready` once every area runs and is recorded, then
waits to be killed. `python -m tests.integration.supervisor.supervisor_host STATE_DIR RUNS_JSON`."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from monitord.base import logs
from monitord.local.supervisor import AreaRun, LocalSupervisor
from tests.support.agent_process import wait_until


def _recorded(state_dir: Path, area: str, pid: int | None) -> bool:
    """Whether the area's record names that pid: a daemon runs (and shows in the inventory)
    a moment before its record is written, and the tests kill this process right after
    `ready` — as a crash between the two would, which is another test's case."""
    try:
        record = json.loads((state_dir / "records" / f"{area}.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(record["identity"]["pid"] == pid)


async def main(state_dir: Path, runs_json: str) -> None:
    logs.configure("json")  # events to stderr; stdout carries only "ready"
    runs = [AreaRun(**{**item, "command": tuple(item["command"])})
            for item in json.loads(runs_json)]
    supervisor = LocalSupervisor(state_dir=state_dir)
    supervisor.set_desired({run.area: run for run in runs})
    await supervisor.start()
    await wait_until(
        lambda: all(view.state == "running" and _recorded(state_dir, view.area, view.pid)
                    for view in supervisor.inventory()),
        timeout_s=20,
        what="every area running and recorded",
    )
    print("ready", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), sys.argv[2]))

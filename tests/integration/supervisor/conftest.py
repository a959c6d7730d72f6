"""Fixtures for the local supervisor tests: a detector, a supervisor on a temp state dir
(everything it started is stopped on teardown), AreaRuns of the fake daemon (started as a
module, or through a script: tests/support/script_daemons.py), and a supervisor in another
process killed with -9."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from monitord.local.supervisor import AreaRun, LocalSupervisor
from monitord.testing.split_brain import Detector
from tests.support import script_daemons

REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
async def detector() -> AsyncIterator[Detector]:
    async with Detector() as found:
        yield found


@pytest.fixture
async def supervisor(tmp_path: Path) -> AsyncIterator[LocalSupervisor]:
    found = LocalSupervisor(
        state_dir=tmp_path / "state", stop_grace_s=1.0, backoff_base_s=0.2, backoff_cap_s=0.8
    )
    try:
        yield found
    finally:
        await found.close()
        assert await found.stop_all(grace_s=0.5)


def fake_run(
    detector: Detector,
    data_root: Path,
    *,
    area: str,
    generation: int = 1,
    side: str = "local",
    extra: tuple[str, ...] = (),
    min_uptime_s: float = 3.0,
) -> AreaRun:
    data_dir = data_root / area
    command = (sys.executable, "-m", "monitord.testing.fake_daemon", "--area", area,
               "--data", str(data_dir), "--side", side, "--generation", str(generation),
               "--heartbeat", detector.address, *extra)
    return AreaRun(service="tg", area=area, generation=generation, command=command,
                   data_dir=str(data_dir), min_uptime_s=min_uptime_s)


def script_run(
    detector: Detector,
    data_root: Path,
    *,
    kind: str,
    area: str,
    generation: int = 1,
    extra: tuple[str, ...] = (),
) -> AreaRun:
    """An AreaRun of the fake daemon started through a script of `kind`
    (script_daemons.KINDS), written into `data_root/bin`."""
    script = script_daemons.write(kind, data_root / "bin")
    data_dir = data_root / area
    command = (*script.head, "--area", area, "--data", str(data_dir), "--side", "local",
               "--generation", str(generation), "--heartbeat", detector.address, *extra)
    return AreaRun(service="tg", area=area, generation=generation, command=command,
                   data_dir=str(data_dir), env=script.env)


async def host_killed_with_sigkill(state_dir: Path, runs: list[AreaRun]) -> None:
    """Run a supervisor in another process until its areas run, then kill it with -9."""
    payload = json.dumps([{**dataclasses.asdict(run), "env": dict(run.env)} for run in runs])
    host = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.integration.supervisor.supervisor_host",
        str(state_dir), payload, cwd=REPO_ROOT, stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert host.stdout is not None
        line = await asyncio.wait_for(host.stdout.readline(), timeout=20)
        assert line.strip() == b"ready"
    finally:
        host.send_signal(signal.SIGKILL)
        await asyncio.wait_for(host.wait(), timeout=10)

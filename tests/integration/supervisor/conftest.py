"""Fixtures for the local supervisor tests: a detector, a supervisor on a temp state dir
(everything it started is stopped on teardown), and AreaRuns of the fake daemon."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from monitord.local.supervisor import AreaRun, LocalSupervisor
from monitord.testing.split_brain import Detector


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

"""Fixtures for the agent tests: a split-brain detector and a real agent on a temp dir."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from monitord.testing.split_brain import Detector
from tests.support.agent_process import AgentProcess, running_agent

OWNER = "owner-pbx-01"


@pytest.fixture
async def detector() -> AsyncIterator[Detector]:
    async with Detector() as found:
        yield found


@pytest.fixture
async def agent(tmp_path: Path) -> AsyncIterator[AgentProcess]:
    async with running_agent(tmp_path / "vps") as started:
        yield started


def fake_daemon_argv(
    *, area: str, data_dir: Path, generation: int, detector: Detector, extra: tuple[str, ...] = ()
) -> list[str]:
    return [sys.executable, "-m", "monitord.testing.fake_daemon", "--area", area,
            "--data", str(data_dir), "--side", "remote", "--generation", str(generation),
            "--heartbeat", detector.address, *extra]


def area_body(
    agent: AgentProcess,
    detector: Detector,
    *,
    area: str,
    generation: int,
    owner_id: str = OWNER,
    ttl_s: float = 10.0,
    extra: tuple[str, ...] = (),
) -> dict[str, Any]:
    data_dir = agent.base_dir / "data" / "tg" / area
    return {
        "service": "tg",
        "generation": generation,
        "owner_id": owner_id,
        "lease_ttl_s": ttl_s,
        "command": fake_daemon_argv(area=area, data_dir=data_dir, generation=generation,
                                    detector=detector, extra=extra),
        "data_dir": str(data_dir),
        "env": {},
    }

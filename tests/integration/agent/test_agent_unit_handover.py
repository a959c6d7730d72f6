"""One supervisor for the agent: where the monitord-agent unit runs it, `agent-launch` hands
over to the unit (an upgrade is the unit restarting the new pyz; no second agent outside it),
and the unit's agent takes over from one started outside it — the areas keep running.

systemd cannot be PID 1 here: `_Unit` plays the unit's part as systemd would with the unit's
own lines — ExecStart's command with `--supervised-by systemd`, Restart=always after 0.5 s —
around the real agent and the real `agent-launch`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp

from monitord.remote import artifact
from monitord.testing.split_brain import Detector
from monitord.testing.stack import kill_processes_under
from tests.support.agent_process import (
    SYSTEM_PYTHON,
    kill_left_processes,
    unix_session,
    wait_until,
    write_secret,
)

SECRET = "unit-handover-secret"
OWNER = "owner-pbx-01"


class _Unit:
    """Restart=always around `python3 -I PYZ agent --dir DIR --supervised-by systemd`."""

    def __init__(self, pyz: Path, base: Path) -> None:
        self.pyz, self.base = pyz, base
        self.pids: list[int] = []
        self._task: asyncio.Task[None] | None = None
        self._proc: asyncio.subprocess.Process | None = None

    async def _run(self) -> None:
        while True:
            self._proc = await asyncio.create_subprocess_exec(
                SYSTEM_PYTHON, "-I", str(self.pyz), "agent", "--dir", str(self.base),
                "--log-format", "json", "--supervised-by", "systemd",
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self.pids.append(self._proc.pid)
            await self._proc.wait()
            await asyncio.sleep(0.5)  # RestartSec

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[_Unit]:
        self._task = asyncio.create_task(self._run())
        try:
            yield self
        finally:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            if self._proc is not None and self._proc.returncode is None:
                self._proc.terminate()
                await self._proc.wait()


def _launch(pyz: Path, base: Path, *, path: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": path} if path else None
    return subprocess.run(
        [SYSTEM_PYTHON, "-I", "-S", str(pyz), "agent-launch", "--dir", str(base),
         "--log-format", "json"], capture_output=True, text=True, timeout=60, env=env)


def _agent_pid(base: Path) -> int:
    return int((base / "agent.pid").read_text().split()[0])


async def _ready(base: Path) -> bool:
    try:
        address = (base / "agent.address").read_text().strip()
        async with unix_session(address) as session, session.get(
            "http://agent/readyz", headers={"Authorization": f"Bearer {SECRET}"},
            timeout=aiohttp.ClientTimeout(total=2),
        ) as response:
            return response.status == 200
    except (OSError, aiohttp.ClientError, TimeoutError):
        return False


async def _create_area(base: Path, detector: Detector) -> int:
    address = (base / "agent.address").read_text().strip()
    data = base / "data" / "a1"
    async with unix_session(address) as session, session.put(
        "http://agent/v1/areas/a1", json={
            "service": "tg", "generation": 3, "owner_id": OWNER, "lease_ttl_s": 60,
            "command": [sys.executable, "-m", "monitord.testing.fake_daemon", "--area", "a1",
                        "--data", str(data), "--side", "remote", "--generation", "3",
                        "--heartbeat", detector.address],
            "data_dir": str(data), "env": {}},
        headers={"Authorization": f"Bearer {SECRET}"}, timeout=aiohttp.ClientTimeout(total=15),
    ) as response:
        assert response.status < 300, await response.text()
    assert await detector.wait_for(lambda d: bool(d.alive("a1")), timeout_s=20)
    return detector.alive("a1")[0].pid


def _fake_systemctl(where: Path) -> str:
    """A PATH whose `systemctl show` says the agent's unit is installed and enabled."""
    where.mkdir()
    tool = where / "systemctl"
    tool.write_text("#!/bin/sh\nprintf 'LoadState=loaded\\nUnitFileState=enabled\\n'\n")
    tool.chmod(0o755)
    return f"{where}:/usr/bin:/bin"


class TestOneSupervisor:
    async def test_an_upgrade_is_the_unit_restarting_the_new_code_and_areas_keep_running(
        self, tmp_path: Path
    ) -> None:
        base = tmp_path / "opt"
        write_secret(base, SECRET)
        pyz = artifact.build(base).path
        try:
            async with Detector() as detector, _Unit(pyz, base).running() as unit:
                await wait_until(lambda: _ready(base), timeout_s=30, what="the unit's agent")
                assert (base / "agent.supervisor").read_text().strip() == "systemd"
                daemon = await _create_area(base, detector)
                same = await asyncio.to_thread(_launch, pyz, base)
                assert same.returncode == 0 and len(unit.pids) == 1, same.stderr

                newer = tmp_path / "monitord.pyz.new"
                shutil.copy(pyz, newer)
                with zipfile.ZipFile(newer, "a") as archive:  # another build
                    archive.writestr("BUILD", "next\n")
                newer.replace(pyz)  # provisioning renames the new artifact into place
                upgraded = await asyncio.to_thread(_launch, pyz, base)
                assert upgraded.returncode == 0, upgraded.stderr
                assert "agent_restarted_by_unit" in upgraded.stderr
                assert len(unit.pids) == 2 and _agent_pid(base) == unit.pids[-1], \
                    "the unit's agent, not one started outside it"
                assert [k.pid for k in detector.alive("a1")] == [daemon]
                assert detector.overlaps() == []
        finally:
            kill_left_processes(base)
            kill_processes_under(base)

    async def test_the_units_agent_takes_over_from_one_started_outside_it(
        self, tmp_path: Path
    ) -> None:
        base = tmp_path / "opt"
        write_secret(base, SECRET)
        pyz = artifact.build(base).path
        try:
            async with Detector() as detector:
                assert (await asyncio.to_thread(_launch, pyz, base)).returncode == 0
                outside = _agent_pid(base)
                daemon = await _create_area(base, detector)
                async with _Unit(pyz, base).running() as unit:
                    await wait_until(lambda: _agent_pid_is(base, unit), timeout_s=30,
                                     what="the unit's agent holding the dir")
                    await wait_until(lambda: _ready(base), timeout_s=30, what="it ready")
                    assert _agent_pid(base) != outside
                    assert (base / "agent.supervisor").read_text().strip() == "systemd"
                    assert [k.pid for k in detector.alive("a1")] == [daemon]
                    # with the unit there, agent-launch starts nothing of its own
                    again = await asyncio.to_thread(_launch, pyz, base)
                    assert again.returncode == 0 and _agent_pid(base) == unit.pids[-1]
        finally:
            kill_left_processes(base)
            kill_processes_under(base)

    async def test_with_the_unit_installed_launch_waits_for_it_instead_of_starting_one(
        self, tmp_path: Path
    ) -> None:
        base = tmp_path / "opt"
        write_secret(base, SECRET)
        pyz = artifact.build(base).path
        path = _fake_systemctl(tmp_path / "bin")
        unit = _Unit(pyz, base)
        try:
            async def the_unit_a_moment_later() -> None:
                await asyncio.sleep(1.0)
                async with unit.running():
                    await asyncio.sleep(30)

            starter = asyncio.create_task(the_unit_a_moment_later())
            launched = await asyncio.to_thread(_launch, pyz, base, path=path)
            assert launched.returncode == 0, launched.stderr
            assert "agent_started_by_unit" in launched.stderr
            assert _agent_pid(base) == unit.pids[-1]
            starter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starter
        finally:
            kill_left_processes(base)
            kill_processes_under(base)


async def _agent_pid_is(base: Path, unit: _Unit) -> bool:
    try:
        return bool(unit.pids) and _agent_pid(base) == unit.pids[-1]
    except (OSError, ValueError):
        return False

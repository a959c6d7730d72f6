"""Upgrading the agent replaces the process, never the areas it runs."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import aiohttp

from monitord.remote import artifact
from monitord.testing.split_brain import Detector
from monitord.testing.stack import kill_processes_under
from tests.support.agent_process import (
    SYSTEM_PYTHON,
    kill_left_processes,
    unix_session,
    write_secret,
)

SECRET = "upgrade-test-secret"
OWNER = "owner-pbx-01"


def _launch(pyz: Path, base_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [SYSTEM_PYTHON, "-I", "-S", str(pyz), "agent-launch", "--dir", str(base_dir),
         "--log-format", "json"],
        capture_output=True, text=True, timeout=60,
    )


def _agent_pid(base_dir: Path) -> int:
    return int((base_dir / "agent.pid").read_text().split()[0])


async def _call(base_dir: Path, method: str, path: str, body: object = None) -> dict[str, object]:
    address = (base_dir / "agent.address").read_text().strip()
    async with unix_session(address) as session, session.request(
        method, f"http://agent{path}", json=body,
        headers={"Authorization": f"Bearer {SECRET}"}, timeout=aiohttp.ClientTimeout(total=15),
    ) as response:
        assert response.status < 300, await response.text()
        result: dict[str, object] = await response.json()
        return result


class TestUpgradeWhileRemote:
    """A new artifact's launcher replaces the old agent, which leaves its daemons running for the
    new one to adopt; the same artifact's launcher changes nothing."""

    async def test_new_artifact_replaces_the_agent_and_adopts_the_running_area(
        self, tmp_path: Path
    ) -> None:
        base = tmp_path / "opt"
        write_secret(base, SECRET)
        old = artifact.build(base)
        new_pyz = tmp_path / "next" / "monitord.pyz"
        new_pyz.parent.mkdir()
        shutil.copy(old.path, new_pyz)
        with zipfile.ZipFile(new_pyz, "a") as archive:  # a different build of the same code
            archive.writestr("BUILD", "next\n")
        try:
            async with Detector() as detector:
                assert (await asyncio.to_thread(_launch, old.path, base)).returncode == 0
                first_agent = _agent_pid(base)
                area, data = "a1", base / "data" / "a1"
                await _call(base, "PUT", f"/v1/areas/{area}", {
                    "service": "tg", "generation": 3, "owner_id": OWNER, "lease_ttl_s": 60,
                    "command": [sys.executable, "-m", "monitord.testing.fake_daemon",
                                "--area", area, "--data", str(data), "--side", "remote",
                                "--generation", "3", "--heartbeat", detector.address],
                    "data_dir": str(data), "env": {},
                })
                assert await detector.wait_for(lambda d: bool(d.alive(area)), timeout_s=20)
                daemon_pid = detector.alive(area)[0].pid

                new_pyz.replace(old.path)  # provisioning renames the new artifact into place
                upgraded = await asyncio.to_thread(_launch, old.path, base)
                assert upgraded.returncode == 0, upgraded.stderr
                assert "agent_upgrading" in upgraded.stderr
                second_agent = _agent_pid(base)
                assert second_agent != first_agent
                inventory = await _call(base, "GET", "/v1/inventory")
                procs = inventory["processes"]
                assert isinstance(procs, list)
                running = [(p["area"], p["pid"], p["alive"]) for p in procs]
                assert running == [(area, daemon_pid, True)]
                assert [k.pid for k in detector.alive(area)] == [daemon_pid]
                assert detector.overlaps() == []

                again = await asyncio.to_thread(_launch, old.path, base)
                assert again.returncode == 0 and "agent_upgrading" not in again.stderr
                assert _agent_pid(base) == second_agent
        finally:
            kill_left_processes(base)
            kill_processes_under(base)

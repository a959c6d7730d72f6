"""One agent per VPS dir: a second `monitord agent` exits 3, `agent-launch` is idempotent, and
the agent (with its lease guards) runs from the single-file zipapp as it is pushed."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
import zipapp
from pathlib import Path

from monitord.base import proc_identity, singleton
from monitord.testing.split_brain import Detector
from tests.integration.agent.conftest import area_body
from tests.support.agent_process import (
    AgentProcess,
    agent_command,
    kill_left_processes,
    running_agent,
    wait_until,
    write_secret,
)

REPO_ROOT = Path(__file__).resolve().parents[3]
AREA = "c0ffee00-0000-4000-8000-000000000001"


async def _run(argv: list[str], *, env: dict[str, str] | None = None) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT, env=env,
    )
    output, _ = await asyncio.wait_for(process.communicate(), timeout=30)
    assert process.returncode is not None
    return process.returncode, output.decode(errors="replace")


def _events(output: str) -> list[dict[str, object]]:
    found = []
    for line in output.splitlines():
        if line.startswith("{"):
            found.append(json.loads(line))
    return found


class TestSingleAgentPerDir:
    """A second agent on the same dir exits with code 3 and a duplicate_instance event."""

    async def test_second_agent_on_one_dir_exits_3_naming_the_holder(
        self, agent: AgentProcess
    ) -> None:
        status, output = await _run(agent_command(agent.base_dir, listen="127.0.0.1:0"))
        assert status == 3, output
        events = [e for e in _events(output) if e["event"] == "duplicate_instance"]
        assert len(events) == 1
        assert events[0]["holder_pid"] == agent.process.pid
        assert events[0]["error_code"] == "DUPLICATE_INSTANCE"
        assert (await agent.request("GET", "/readyz"))[0] == 200

    async def test_agent_launch_starts_one_agent_and_then_succeeds_quietly(
        self, tmp_path: Path
    ) -> None:
        base_dir = tmp_path / "vps"
        write_secret(base_dir, "launch-secret")
        launch = [sys.executable, "-m", "monitord", "agent-launch", "--dir", str(base_dir),
                  "--listen", "127.0.0.1:0", "--log-format", "json"]
        try:
            results = await asyncio.gather(_run(launch), _run(launch))
            assert [status for status, _ in results] == [0, 0], results
            holder = singleton.read_holder_pid(base_dir / "agent.pid")
            assert holder is not None and proc_identity.is_alive(holder)
            status, output = await _run(launch)
            assert (status, output) == (0, "")
            assert singleton.read_holder_pid(base_dir / "agent.pid") == holder
        finally:
            holder = singleton.read_holder_pid(base_dir / "agent.pid")
            if holder is not None:
                os.kill(holder, signal.SIGTERM)
                await wait_until(lambda: not proc_identity.is_alive(holder), timeout_s=10,
                                 what="the launched agent to stop")
            kill_left_processes(base_dir)


class TestZipapp:
    """The agent and its lease guards run from monitord.pyz, the artifact pushed to the VPS."""

    async def test_agent_from_the_zipapp_runs_and_fences_a_daemon(
        self, tmp_path: Path, detector: Detector
    ) -> None:
        source = tmp_path / "pyz-src"
        shutil.copytree(REPO_ROOT / "monitord", source / "monitord",
                        ignore=shutil.ignore_patterns("__pycache__"))
        (source / "__main__.py").write_text(
            "import sys\nfrom monitord.surface.cli import main\nsys.exit(main())\n"
        )
        pyz = tmp_path / "vps" / "monitord.pyz"
        pyz.parent.mkdir()
        zipapp.create_archive(source, pyz)
        argv = [sys.executable, str(pyz), "agent", "--dir", str(pyz.parent)]
        async with running_agent(pyz.parent, command=argv) as agent:
            body = area_body(agent, detector, area=AREA, generation=1, ttl_s=30)
            assert (await agent.request("PUT", f"/v1/areas/{AREA}", json_body=body))[0] == 201
            assert await detector.wait_for(lambda d: d.alive(AREA), timeout_s=10)
            guard_pid = (await agent.inventory())["processes"][0]["guard_pid"]
            environ = Path(f"/proc/{guard_pid}/environ").read_bytes().split(b"\0")
            pythonpath = next(e for e in environ if e.startswith(b"PYTHONPATH="))
            assert pythonpath.split(b"=", 1)[1].split(b":")[0] == str(pyz).encode()
            status, _ = await agent.request("POST", f"/v1/areas/{AREA}/stop?generation=1")
            assert status == 200
            assert detector.alive(AREA) == []

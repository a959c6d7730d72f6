"""One agent per VPS dir: a second `monitord agent` exits 3, `agent-launch` is idempotent, and
the agent (with its lease guards) runs from the single-file zipapp as it is pushed."""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from monitord.base import proc_identity, singleton
from monitord.testing.split_brain import Detector
from tests.integration.agent.conftest import area_body
from tests.support.agent_process import (
    SYSTEM_PYTHON,
    AgentProcess,
    agent_command,
    built_pyz,
    kill_left_processes,
    vps_command,
    wait_until,
    write_secret,
)

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
        status, output = await _run(agent_command(agent.base_dir))
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
        launch = vps_command("agent-launch", "--dir", str(base_dir), "--log-format", "json")
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

    async def test_agent_launch_waits_for_an_agent_still_starting_to_say_its_version(
        self, tmp_path: Path
    ) -> None:
        """An agent another launcher just started holds the lock a moment before it writes
        its version; meanwhile the file says the previous agent's (or nothing). A launcher
        that looked then took it for an old agent and stopped it (its launcher failed,
        DAEMON_START_FAILED): it waits for the holder to say its version (or be ready)."""
        from monitord.vps import cli

        base_dir = tmp_path / "vps"
        write_secret(base_dir, "launch-secret")
        wanted = "sha256:" + hashlib.sha256(built_pyz().read_bytes()).hexdigest()
        (base_dir / cli.VERSION_NAME).write_text("sha256:the-previous-agent\n")
        # An agent starting: it holds the lock, writes its version 1 s later (its argv names
        # `agent` and the dir, as the launcher's check for an agent of this dir wants).
        starting = (
            "import sys, time\n"
            "from pathlib import Path\n"
            "from monitord.base import atomic_file, singleton\n"
            "base = Path(sys.argv[2])\n"
            "with singleton.acquire(base, name='agent'):\n"
            "    print('held', flush=True)\n"
            "    time.sleep(1.0)\n"
            "    version = (sys.argv[3] + '\\n').encode()\n"
            "    atomic_file.atomic_write_bytes(base / 'agent.version', version)\n"
            "    time.sleep(60)\n"
        )
        holder = await asyncio.create_subprocess_exec(
            sys.executable, "-c", starting, "agent", str(base_dir), wanted,
            stdout=asyncio.subprocess.PIPE)
        try:
            assert holder.stdout is not None
            assert await asyncio.wait_for(holder.stdout.readline(), 30) == b"held\n"
            status, output = await _run(
                vps_command("agent-launch", "--dir", str(base_dir), "--log-format", "json"))
            assert (status, output) == (0, ""), output
            assert holder.returncode is None, "the starting agent was stopped"
        finally:
            holder.kill()
            await holder.wait()
            kill_left_processes(base_dir)  # (an agent a failing launcher started instead)

    async def test_agent_launch_starts_again_after_a_lock_held_only_for_a_moment(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Another launcher's probe (`is_held` takes the lock for an instant) can make the
        launched agent find the lock held and exit 3 while nobody holds it a moment later:
        the launcher starts the agent again instead of failing. The launcher runs here, in
        this process, so that the lock can be held exactly across its first agent's start."""
        from monitord.base import log_sink
        from monitord.vps import cli, entry

        base_dir = tmp_path / "vps"
        write_secret(base_dir, "launch-secret")
        real_spawn = log_sink.spawn_logged
        spawned: list[int] = []
        popens: list[subprocess.Popen[bytes]] = []  # reaped at the end, as the CLI's exit would

        def spawn_while_probed(*args: object, **kwargs: object):  # type: ignore[no-untyped-def]
            if spawned:
                child, sink = real_spawn(*args, **kwargs)  # type: ignore[arg-type]
                spawned.append(child.pid)
                popens.extend(p for p in (child, sink) if p is not None)
                return child, sink
            with open(base_dir / "agent.lock", "a", encoding="ascii") as probe:
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
                child, sink = real_spawn(*args, **kwargs)  # type: ignore[arg-type]
                spawned.append(child.pid)
                popens.extend(p for p in (child, sink) if p is not None)
                assert child.wait(timeout=30) == cli.EXIT_DUPLICATE
            return child, sink

        monkeypatch.setattr(log_sink, "spawn_logged", spawn_while_probed)
        try:
            status = await asyncio.to_thread(
                entry.main, ["agent-launch", "--dir", str(base_dir), "--log-format", "json"])
            assert status == cli.EXIT_OK
            assert len(spawned) == 2
            holder = singleton.read_holder_pid(base_dir / "agent.pid")
            assert holder == spawned[1] and proc_identity.is_alive(holder)
        finally:
            holder = singleton.read_holder_pid(base_dir / "agent.pid")
            if holder is not None and proc_identity.is_alive(holder):
                os.kill(holder, signal.SIGTERM)
                await wait_until(lambda: not proc_identity.is_alive(holder), timeout_s=10,
                                 what="the launched agent to stop")
            kill_left_processes(base_dir)
            for process in popens:
                await asyncio.to_thread(process.wait, 10)


class TestZipapp:
    """The agent and its lease guards run from monitord.pyz under the VPS's bare system
    Python in isolated mode — every test of this directory does (tests/support/agent_process)."""

    async def test_guards_run_from_the_pyz_under_the_isolated_system_python(
        self, agent: AgentProcess, detector: Detector
    ) -> None:
        body = area_body(agent, detector, area=AREA, generation=1, ttl_s=30)
        assert (await agent.request("PUT", f"/v1/areas/{AREA}", json_body=body))[0] == 201
        assert await detector.wait_for(lambda d: d.alive(AREA), timeout_s=10)
        pyz = str(built_pyz())
        agent_argv = Path(f"/proc/{agent.process.pid}/cmdline").read_bytes().split(b"\0")
        python = [SYSTEM_PYTHON.encode(), b"-I", b"-S", pyz.encode()]
        assert agent_argv[:5] == [*python, b"agent"]
        guard_pid = (await agent.inventory())["processes"][0]["guard_pid"]
        guard_argv = Path(f"/proc/{guard_pid}/cmdline").read_bytes().split(b"\0")
        # forked by the agent's fork server (its argv), or started as a command while that
        # server was still starting: the same interpreter and flags either way
        assert guard_argv[:4] == python
        assert guard_argv[4] in (b"guard-forkserver", b"lease-guard")
        environ = Path(f"/proc/{guard_pid}/environ").read_bytes().split(b"\0")
        assert not any(e.startswith(b"PYTHONPATH=") for e in environ)
        status, _ = await agent.request("POST", f"/v1/areas/{AREA}/stop?generation=1")
        assert status == 200
        assert detector.alive(AREA) == []

    async def test_once_its_fork_server_listens_the_agent_forks_its_guards(
        self, agent: AgentProcess, detector: Detector
    ) -> None:
        """The production path (the pyz, the isolated system Python): a guard forked by the
        agent's fork server guards and stops its daemon like one started as a command."""
        await wait_until((agent.base_dir / "run" / ".guards.sock").exists, timeout_s=10,
                         what="the agent's fork server to listen")
        body = area_body(agent, detector, area=AREA, generation=1, ttl_s=30)
        assert (await agent.request("PUT", f"/v1/areas/{AREA}", json_body=body))[0] == 201
        assert await detector.wait_for(lambda d: d.alive(AREA), timeout_s=10)
        guard_pid = (await agent.inventory())["processes"][0]["guard_pid"]
        guard_argv = Path(f"/proc/{guard_pid}/cmdline").read_bytes().split(b"\0")
        assert guard_argv[4] == b"guard-forkserver"
        assert Path(f"/proc/{guard_pid}/comm").read_text().strip() == "lease-guard"
        status, _ = await agent.request("POST", f"/v1/areas/{AREA}/stop?generation=1")
        assert status == 200
        assert detector.alive(AREA) == []
        assert not proc_identity.is_alive(guard_pid)

"""Lease guards forked from the agent's fork server (monitord/vps/guard_forkserver.py): they
are the same guards as started by command — own session, the daemon as their child, fencing
on a lapse — only smaller; and a fork server that is gone costs speed, never a guard."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from monitord.base import group_stop, proc_identity
from monitord.vps import area_runner
from monitord.vps.area_runner import AreaRunner, GuardHandle
from monitord.vps.lease_table import AreaSpec

AREA = "9a7e0c2e-0000-4000-8000-00000000000f"


def _spec(tmp_path: Path, *, generation: int = 1) -> AreaSpec:
    return AreaSpec(area=AREA, service="tg", generation=generation, owner_id="o",
                    command=("sleep", "60"), data_dir=str(tmp_path / "data"))


def _private_dirty_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Private_Dirty:"):
            return int(line.split()[1])
    raise AssertionError(f"no Private_Dirty in /proc/{pid}/smaps_rollup")


async def _until(check, *, what: str, timeout_s: float = 10.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)
    return found


@asynccontextmanager
async def _runner(tmp_path: Path) -> AsyncIterator[AreaRunner]:
    runner = AreaRunner(base_dir=tmp_path / "agent", stop_grace_s=2.0, fence_grace_s=0.5)
    handles: list[GuardHandle] = []
    runner.spawned = handles  # type: ignore[attr-defined]
    runner.ensure_forkserver()  # as the agent's start does
    try:
        await _until(runner.forkserver_socket.exists, what="the fork server never listened")
        yield runner
    finally:
        for handle in handles:
            if not handle.exited():
                proc_identity.signal_group(handle.pid, signal.SIGKILL)
            if handle.daemon is not None:
                proc_identity.signal_group(handle.daemon.pid, signal.SIGKILL)
            if handle.popen is not None:  # reaped, as the agent's tick does
                handle.popen.wait(timeout=10)
            if handle.cgroup is not None:  # (a guard killed leaves its daemon's cgroup)
                await group_stop.empty_cgroup(handle.cgroup, timeout_s=2.0)
        runner.close()


def _spawn(runner: AreaRunner, spec: AreaSpec) -> GuardHandle:
    handle = runner.spawn(spec)
    runner.spawned.append(handle)  # type: ignore[attr-defined]
    return handle


async def test_a_forked_guard_is_a_guard_of_its_own(tmp_path: Path) -> None:
    async with _runner(tmp_path) as runner:
        spec = _spec(tmp_path)
        runner.grant(spec, ttl_s=60.0)
        handle = _spawn(runner, spec)
        assert handle.popen is None, "the guard was started as a command, not forked"
        guard = handle.pid
        assert os.getsid(guard) == guard and os.getpgid(guard) == guard
        assert proc_identity.parent_of(guard) != os.getpid()  # not ours, nor the server's child
        assert Path(f"/proc/{guard}/comm").read_text().strip() == "lease-guard"
        daemon = await _until(lambda: runner.daemon_pids([handle])[guard],
                              what="the forked guard never started its daemon")
        assert proc_identity.parent_of(daemon) == guard
        assert Path(f"/proc/{daemon}/cwd").resolve() == Path(spec.data_dir).resolve()
        record = json.loads((runner.run_dir / f"{AREA}.json").read_text())
        assert area_runner.recorded_command(record, handle.identity) == spec.command
        runner.learn_daemons([handle])
        assert await runner.stop(handle, fence=True)  # the lapse path: lease revoked
        assert not proc_identity.is_same_process(handle.identity)
        assert proc_identity.read(daemon) is None
        log = (runner.logs_dir / f"{AREA}.log")
        await _until(lambda: log.exists() and "fence_done" in log.read_text(),
                     what="the guard's own lines never reached the area's log")


async def test_a_forked_guard_costs_a_fraction_of_a_started_one(tmp_path: Path) -> None:
    """What the fork server is for: its guards share its pages. Private memory, not timing."""
    async with _runner(tmp_path) as runner:
        spec = _spec(tmp_path)
        runner.grant(spec, ttl_s=60.0)
        forked = _spawn(runner, spec)
        await _until(lambda: runner.daemon_pids([forked])[forked.pid],
                     what="the forked guard never started its daemon")
        assert forked.popen is None
        forked_kib = _private_dirty_kib(forked.pid)  # (shared: with the server, while it runs)
        runner._stop_forkserver()  # the next guard is started as a command
        other = AreaSpec(area=AREA[:-1] + "e", service="tg", generation=1, owner_id="o",
                         command=("sleep", "60"), data_dir=str(tmp_path / "data2"))
        runner.grant(other, ttl_s=60.0)
        started = _spawn(runner, other)
        assert started.popen is not None
        await _until(lambda: runner.daemon_pids([started])[started.pid],
                     what="the started guard never started its daemon")
        started_kib = _private_dirty_kib(started.pid)
        assert forked_kib * 2 < started_kib, (forked_kib, started_kib)


async def test_without_its_fork_server_the_runner_starts_guards_and_a_new_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(area_runner, "_FORKSERVER_RETRY_S", 0.0)
    async with _runner(tmp_path) as runner:
        server = runner._forkserver
        assert server is not None
        os.kill(server.pid, signal.SIGKILL)
        server.wait(timeout=10)
        spec = _spec(tmp_path)
        runner.grant(spec, ttl_s=60.0)
        handle = _spawn(runner, spec)
        assert handle.popen is not None  # as a command: the area does not wait for a server
        await _until(lambda: runner.daemon_pids([handle])[handle.pid],
                     what="the started guard never started its daemon")
        runner.learn_daemons([handle])  # the agent's tick: a new fork server
        assert runner._forkserver is not server and runner._forkserver is not None
        await _until(lambda: runner.forkserver_socket.exists()
                     and os.stat(runner.forkserver_socket).st_ino != 0,
                     what="no new fork server listened")
        assert await runner.stop(handle, fence=False)
        runner.grant(_spec(tmp_path, generation=2), ttl_s=60.0)
        again = await _until(lambda: _forked_spawn(runner, _spec(tmp_path, generation=2)),
                             what="the new fork server never forked a guard")
        assert again.popen is None


def _forked_spawn(runner: AreaRunner, spec: AreaSpec) -> GuardHandle | None:
    """Spawn once the new server answers (until then a spawn would start a command)."""
    try:
        os.stat(runner.forkserver_socket)
    except FileNotFoundError:
        return None
    return _spawn(runner, spec)


async def test_the_fork_server_ends_with_its_agent(tmp_path: Path) -> None:
    """A fork server whose agent died (it is re-parented) exits: a new agent starts its own."""
    agent = await asyncio.create_subprocess_exec(
        sys.executable, "-c",
        "import sys, time; sys.path.insert(0, sys.argv[1])\n"
        "from pathlib import Path\n"
        "from monitord.vps.area_runner import AreaRunner\n"
        "r = AreaRunner(base_dir=Path(sys.argv[2]), stop_grace_s=1, fence_grace_s=0.5)\n"
        "r.ensure_forkserver()\n"
        "print(r._forkserver.pid, flush=True); time.sleep(60)",
        area_runner.package_root(), str(tmp_path / "agent"),
        stdout=asyncio.subprocess.PIPE,
    )
    assert agent.stdout is not None
    server = int(await asyncio.wait_for(agent.stdout.readline(), 10))
    identity = proc_identity.read(server)
    assert identity is not None
    agent.kill()
    await agent.wait()
    await _until(lambda: not proc_identity.is_same_process(identity),
                 what="the fork server outlived its agent")


async def test_a_guard_whose_spawn_was_not_confirmed_starts_nothing(tmp_path: Path) -> None:
    """The agent may give up on a spawn (a time-out, the server dying) after the guard was
    forked: it then starts the guard as a command. The forked one must not start a second
    daemon: a guard starts its daemon only once the agent, knowing its pid, said go."""
    async with _runner(tmp_path) as runner:
        spec = _spec(tmp_path)
        runner.grant(spec, ttl_s=60.0)
        log_r, log_w = os.pipe()
        daemon_file = tmp_path / "daemon"
        identity = None
        argv = ["--lease-file", str(runner.lease_path(AREA)), "--daemon-file", str(daemon_file),
                "--", "sleep", "60"]
        request = json.dumps({"argv": argv, "env": dict(os.environ),
                              "cwd": str(tmp_path)}).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
                conn.settimeout(10)
                conn.connect(str(runner.forkserver_socket))
                socket.send_fds(conn, [request], [log_w])
                pid = int(json.loads(conn.recv(4096))["pid"])
                identity = proc_identity.read(pid)
            # (the connection is closed: no go)
            if identity is not None:
                await _until(lambda: not proc_identity.is_same_process(identity),
                             what="the unconfirmed guard kept running")
            await asyncio.sleep(0.3)
            assert not daemon_file.exists(), "an unconfirmed guard started its daemon"
        finally:
            if identity is not None and proc_identity.is_same_process(identity):
                proc_identity.signal_group(pid, signal.SIGKILL)  # (its daemon dies with it)
            os.close(log_r)
            os.close(log_w)

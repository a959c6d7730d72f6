"""The life of `monitord run`: start-up order, SIGTERM drain, root-task guarding, systemd, launch.

Most tests run the real CLI as a subprocess. The drain and root-task tests run `Daemon.serve()`
in this process with a test component plugged in through the component registry: the component
supplies a placement intake whose write waits on an asyncio.Event (a test double of the intake
interface), because the order "admitted, then stop-intake, then the write finishes" cannot be
forced from outside a real process.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from structlog.testing import capture_logs

from monitord.base import config as config_module
from monitord.base import logs, singleton
from monitord.surface.components import Assembly, RuntimeContext
from monitord.surface.daemon import Daemon
from monitord.surface.sdnotify import Notifier
from tests.support import daemon_process

# --- in-process daemon with test components ------------------------------------------------------


class GatedIntake:
    """Placement intake double: signals `entered`, finishes only after `release`."""

    def __init__(self, journal: list[str]) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.journal = journal

    async def record_placement(self, *, service: str, area: str | None, location: str) -> list[str]:
        self.entered.set()
        await asyncio.wait_for(self.release.wait(), timeout=10)
        self.journal.append(f"recorded {service} {location}")
        return ["tx-test"]


class RecordingComponent:
    """A component that journals start/stop, optionally with a gated intake or a failing task."""

    def __init__(self, name: str, journal: list[str], *, gated: bool = False, die: bool = False):
        self.name = name
        self.journal = journal
        self.placement_intake = GatedIntake(journal) if gated else None
        self.die = die

    async def start(self, ctx: RuntimeContext) -> None:
        self.journal.append(f"start {self.name}")
        ctx.tasks.spawn(f"{self.name}-loop", self._loop())

    async def _loop(self) -> None:
        if self.die:
            raise RuntimeError("the loop broke")
        await asyncio.Event().wait()

    async def stop(self) -> None:
        self.journal.append(f"stop {self.name}")


COMPONENTS: dict[str, RecordingComponent] = {}


def assemble(ctx: RuntimeContext) -> Assembly:
    """The test components in start order; the second one's gated intake takes placements."""
    second = COMPONENTS["second"]
    return Assembly(components=[COMPONENTS["first"], second], intake=second.placement_intake)


@asynccontextmanager
async def serving_in_process(
    tmp_path: Path, *, notifier: Notifier | None = None
) -> AsyncIterator[tuple[Daemon, asyncio.Task[int], daemon_process.ApiClient]]:
    """Daemon.serve() as a task of this loop; yields once /readyz is 200."""
    config_path = daemon_process.write_config(tmp_path)
    config = config_module.load(config_path)
    daemon = Daemon(config, assemble=assemble, notifier=notifier or Notifier(None))
    serving = asyncio.create_task(daemon.serve(), name="daemon-under-test")
    client = daemon_process.ApiClient(f"http://{config.http.listen}",
                                      work_dir=config.monitord.work_dir)
    try:
        await _until(lambda: client.status_of("/readyz"), 200)
        yield daemon, serving, client
    finally:
        if not serving.done():
            daemon.request_stop("test over")
            await asyncio.wait_for(serving, timeout=20)


async def _until(probe: Any, expected: Any, *, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await probe() == expected:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"condition not reached within {timeout_s} s")


@pytest.fixture
def journal() -> list[str]:
    entries: list[str] = []
    COMPONENTS.clear()
    COMPONENTS["first"] = RecordingComponent("first", entries)
    COMPONENTS["second"] = RecordingComponent("second", entries, gated=True)
    return entries


class TestGracefulStop:
    """A stop closes intake first, lets admitted work finish, then stops components in reverse."""

    async def test_admitted_request_gets_202_during_drain_and_components_stop_after_it(
        self, tmp_path: Path, journal: list[str]
    ) -> None:
        async with serving_in_process(tmp_path) as (daemon, serving, client):
            intake = COMPONENTS["second"].placement_intake
            assert intake is not None
            admitted = asyncio.create_task(
                client.request("PUT", "/v1/services/tg/placement", json_body={"location": "remote"})
            )
            await asyncio.wait_for(intake.entered.wait(), timeout=5)

            daemon.request_stop("SIGTERM")
            await _until(lambda: client.status_of("/readyz"), 503)
            late = await client.request(
                "PUT", "/v1/services/tg/placement", json_body={"location": "local"}
            )
            assert late[0] == 503 and late[1]["error"]["code"] == "DRAINING"
            assert await client.status_of("/livez") == 200
            assert journal == ["start first", "start second"]  # nothing stopped mid-request

            intake.release.set()
            status, body = await asyncio.wait_for(admitted, timeout=5)
            assert (status, body["transaction_ids"]) == (202, ["tx-test"])
            assert await asyncio.wait_for(serving, timeout=10) == 0
        assert journal == [
            "start first",
            "start second",
            "recorded tg remote",
            "stop second",
            "stop first",
        ]
        assert not singleton.is_held(tmp_path / "work")

    async def test_signal_handlers_are_restored_after_serve(
        self, tmp_path: Path, journal: list[str]
    ) -> None:
        before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        async with serving_in_process(tmp_path) as (_, serving, _client):
            assert signal.getsignal(signal.SIGTERM) != before[signal.SIGTERM]
            COMPONENTS["second"].placement_intake = None
            os.kill(os.getpid(), signal.SIGTERM)
            assert await asyncio.wait_for(serving, timeout=10) == 0
        assert {s: signal.getsignal(s) for s in before} == before

    async def test_second_sigint_forces_exit_without_waiting_for_the_drain(
        self, tmp_path: Path, journal: list[str]
    ) -> None:
        async with serving_in_process(tmp_path) as (daemon, serving, client):
            intake = COMPONENTS["second"].placement_intake
            assert intake is not None
            admitted = asyncio.create_task(
                client.request("PUT", "/v1/services/tg/placement", json_body={"location": "remote"})
            )
            await asyncio.wait_for(intake.entered.wait(), timeout=5)
            os.kill(os.getpid(), signal.SIGINT)
            await _until(lambda: client.status_of("/readyz"), 503)
            os.kill(os.getpid(), signal.SIGINT)
            assert await asyncio.wait_for(serving, timeout=10) == 1
            assert daemon.force_exit
            with pytest.raises(aiohttp.ClientError):
                await admitted  # the unfinished request was cut off, never answered 202
        assert "recorded tg remote" not in journal
        assert not singleton.is_held(tmp_path / "work")


class TestRootTaskGuard:
    """A root task that dies makes the daemon log it, stop everything and exit 1."""

    async def test_a_dying_root_task_stops_the_daemon(
        self, tmp_path: Path, journal: list[str]
    ) -> None:
        COMPONENTS["second"] = RecordingComponent("second", journal, die=True)
        config = config_module.load(daemon_process.write_config(tmp_path))
        daemon = Daemon(config, assemble=assemble, notifier=Notifier(None))
        with capture_logs() as captured:
            assert await asyncio.wait_for(daemon.serve(), timeout=20) == 1
        [died] = [e for e in captured if e["event"] == "root_task_died"]
        assert died["task"] == "second-loop" and died["reason"] == "exception"
        assert journal[-2:] == ["stop second", "stop first"]
        assert not daemon.liveness.healthy
        assert not singleton.is_held(tmp_path / "work")


# --- the real process ---------------------------------------------------------------------------


class TestRealProcess:
    """`monitord run` serves readiness, stops cleanly on SIGTERM and can be started again."""

    async def test_sigterm_exits_0_releases_the_lock_and_allows_a_restart(
        self, tmp_path: Path
    ) -> None:
        config_path = daemon_process.write_config(tmp_path)
        async with daemon_process.running_daemon(tmp_path, config_path=config_path) as daemon:
            assert await daemon.status_of("/livez") == 200
            assert singleton.is_held(tmp_path / "work")
            assert await daemon.stop() == 0
        assert [e["event"] for e in daemon.events()][-2:] == ["daemon_stopping", "daemon_stopped"]
        assert not singleton.is_held(tmp_path / "work")
        assert not (tmp_path / "work" / "monitord.pid").exists()
        async with daemon_process.running_daemon(tmp_path, config_path=config_path) as again:
            assert await again.status_of("/readyz") == 200

    async def test_occupied_http_port_fails_start_up_with_exit_1_and_frees_the_lock(
        self, tmp_path: Path
    ) -> None:
        with socket.socket() as squatter:
            squatter.bind(("127.0.0.1", 0))
            squatter.listen()
            port = squatter.getsockname()[1]
            config_path = daemon_process.write_config(tmp_path, port=port)
            daemon = await daemon_process.DaemonProcess.start(config_path)
            try:
                assert await daemon.wait_exit() == 1
            finally:
                await daemon.close()
        [failed] = daemon.events("daemon_start_failed")
        assert failed["error_code"] == "DAEMON_START_FAILED" and str(port) in failed["detail"]
        assert "Traceback" not in "\n".join(daemon.lines)
        assert not singleton.is_held(tmp_path / "work")


class TestSystemdNotify:
    """Under systemd the daemon sends READY=1 once serving, WATCHDOG=1 pings and STOPPING=1."""

    async def test_ready_watchdog_and_stopping_reach_a_real_notify_socket(
        self, tmp_path: Path
    ) -> None:
        notify_path = tmp_path / "notify.sock"
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
            notify.bind(str(notify_path))
            notify.setblocking(False)
            loop = asyncio.get_running_loop()

            async def next_message() -> str:
                data = await asyncio.wait_for(loop.sock_recv(notify, 4096), timeout=10)
                return data.decode()

            env = {"NOTIFY_SOCKET": str(notify_path), "WATCHDOG_USEC": "400000"}
            async with daemon_process.running_daemon(tmp_path, env=env) as daemon:
                messages = [await next_message()]
                while not any("WATCHDOG=1" in m for m in messages):
                    messages.append(await next_message())
                ready = next(m for m in messages if "READY=1" in m)
                assert f"MAINPID={daemon.pid}" in ready
                assert messages.index(ready) < len(messages) - 1
                assert await daemon.stop() == 0
            tail: list[str] = []
            while not any("STOPPING=1" in m for m in tail):
                tail.append(await next_message())

    def test_abstract_socket_names_and_missing_socket_are_handled(self) -> None:
        assert Notifier.from_environ({}).ready()  # no NOTIFY_SOCKET: a no-op that succeeds
        assert not Notifier("/nonexistent/notify.sock").watchdog()  # reported, not raised
        assert Notifier.from_environ({"WATCHDOG_USEC": "10000000"}).watchdog_interval_s(30) == 5


class TestRepeatLimiter:
    """A repeating error is logged once per interval, the next line counting the held-back ones."""

    def test_repeats_inside_the_interval_are_counted_not_logged(self) -> None:
        now = [100.0]
        limiter = logs.RepeatLimiter(10.0, clock=lambda: now[0])
        log = logs.get_logger("test")
        with capture_logs() as captured:
            for _ in range(50):
                limiter.log(log, "error", "tunnel_down", error_code="SSH_UNREACHABLE")
                now[0] += 0.1  # 50 tries in 5 s
            now[0] = 111.0
            limiter.log(log, "error", "tunnel_down", error_code="SSH_UNREACHABLE")
        assert [(e["event"], e.get("repeated")) for e in captured] == [
            ("tunnel_down", None),
            ("tunnel_down", 49),
        ]

    def test_different_error_codes_are_limited_separately(self) -> None:
        limiter = logs.RepeatLimiter(10.0, clock=lambda: 0.0)
        log = logs.get_logger("test")
        with capture_logs() as captured:
            limiter.log(log, "warning", "lease", error_code="TUNNEL_LEASE_CONFLICT")
            limiter.log(log, "warning", "lease", error_code="PORT_OCCUPIED")
            limiter.log(log, "warning", "lease", error_code="PORT_OCCUPIED")
        assert [e["error_code"] for e in captured] == ["TUNNEL_LEASE_CONFLICT", "PORT_OCCUPIED"]


class TestLaunch:
    """`monitord launch` starts one detached daemon and is a quiet no-op when one runs."""

    def test_launch_twice_starts_exactly_one_daemon(self, tmp_path: Path) -> None:
        config_path = daemon_process.write_config(tmp_path)
        work_dir = tmp_path / "work"

        def launch() -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, "-m", "monitord", "launch", "-c", str(config_path)],
                capture_output=True, text=True, timeout=60,
            )

        first = launch()
        try:
            assert first.returncode == 0, first.stderr
            pid = singleton.read_holder_pid(work_dir / "monitord.pid")
            assert pid is not None and singleton.is_held(work_dir)
            second = launch()
            assert (second.returncode, second.stdout, second.stderr) == (0, "", "")
            assert singleton.read_holder_pid(work_dir / "monitord.pid") == pid
            assert (work_dir / "monitord.log").exists()
        finally:
            holder = singleton.read_holder_pid(work_dir / "monitord.pid")
            if holder is not None:
                os.kill(holder, signal.SIGTERM)
            deadline = time.monotonic() + 15
            while singleton.is_held(work_dir) and time.monotonic() < deadline:
                time.sleep(0.05)
        assert not singleton.is_held(work_dir)

    def test_launch_with_a_bad_config_exits_2(self, tmp_path: Path) -> None:
        bad = tmp_path / "bad.toml"
        bad.write_text("[http]\nlisten = 8224\n")
        result = subprocess.run(
            [sys.executable, "-m", "monitord", "launch", "-c", str(bad)],
            capture_output=True, text=True, timeout=60,
        )
        assert result.returncode == 2 and "http.listen" in result.stderr
        assert "Traceback" not in result.stderr

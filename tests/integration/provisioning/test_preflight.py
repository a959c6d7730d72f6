"""Preflight against the in-process VPS, the pushed pyz's real self-check under the system
python3, and a stand-in agent on a Unix socket reached over the SSH connection: each check
fails on its own with its own code, and no failure touches a local daemon."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import asyncssh
import pytest
from aiohttp import web

from monitord.base.config import Config, RemoteSection, ServiceSection
from monitord.remote import agent_channel, provisioning
from monitord.remote.agent_client import AgentClient
from monitord.remote.preflight import (
    AreaNeed,
    CheckStatus,
    PreflightReport,
    TunnelOwnerView,
    TunnelView,
    run_preflight,
    warm,
)
from monitord.remote.provisioning import LocalArtifact
from monitord.remote.shared_facts import SharedFacts
from monitord.testing.vps_server import VpsServer
from orchestrator.disk_space import Usage
from orchestrator.errors import ErrorCode
from orchestrator.memory_room import Need
from tests.support.agent_process import SYSTEM_PYTHON

TIMEOUT = 30.0
SERVICE = "tg"
ALL_FORWARDS_READY = {"nats": True, "license": True}
READY_TUNNEL = TunnelView(owner=TunnelOwnerView(ours=True), forwards_ready=ALL_FORWARDS_READY)
MIB = 1024 * 1024


@dataclass
class StandInAgent:
    """The agent's /livez, /v1/inventory and /v1/host on a Unix socket, reached over SSH."""

    secret: bytes
    conn: asyncssh.SSHClientConnection
    socket_path: str = ""
    runner: web.AppRunner | None = None
    requests: list[str] = field(default_factory=list)
    # GET /v1/host's answer (None: the route is missing): a VPS with 1 GiB, 600 MiB available
    host: dict[str, object] | None = field(default_factory=lambda: {
        "mem_total_bytes": 1024 * MIB, "mem_available_bytes": 600 * MIB})

    def client(self, secret: bytes | None = None) -> AgentClient:
        @contextlib.asynccontextmanager
        async def session() -> AsyncIterator[asyncssh.SSHClientConnection]:
            yield self.conn

        channel = agent_channel.over_ssh(session, self.socket_path)
        return AgentClient(channel=channel, secret=secret or self.secret, timeout_s=5.0)

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


@pytest.fixture
async def local_daemon() -> AsyncIterator[asyncio.subprocess.Process]:
    """A local process standing in for a messenger daemon that must survive any preflight."""
    process = await asyncio.create_subprocess_exec("sleep", "600", start_new_session=True)
    try:
        yield process
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        await asyncio.wait_for(process.wait(), TIMEOUT)


@pytest.fixture
def secret() -> bytes:
    return secrets.token_hex(16).encode()


@pytest.fixture
async def agent(
    conn: asyncssh.SSHClientConnection, secret: bytes, tmp_path: Path
) -> AsyncIterator[StandInAgent]:
    stand_in = StandInAgent(secret=secret, conn=conn, socket_path=str(tmp_path / "agent.sock"))

    async def livez(request: web.Request) -> web.Response:
        stand_in.requests.append(request.path)
        return web.json_response({"status": "alive"})

    async def inventory(request: web.Request) -> web.Response:
        stand_in.requests.append(request.path)
        if request.headers.get("Authorization") != f"Bearer {secret.decode()}":
            return web.json_response({"error": {"code": "AGENT_UNAUTHORIZED"}}, status=401)
        return web.json_response({"entries": [], "processes": []})

    async def host(request: web.Request) -> web.Response:
        stand_in.requests.append(request.path)
        if request.headers.get("Authorization") != f"Bearer {secret.decode()}":
            return web.json_response({"error": {"code": "AGENT_UNAUTHORIZED"}}, status=401)
        if stand_in.host is None:  # an agent older than the route
            return web.json_response({"error": {"code": "AGENT_ROUTE_MISSING"}}, status=404)
        return web.json_response(stand_in.host)

    app = web.Application()
    app.router.add_get("/livez", livez)
    app.router.add_get("/v1/inventory", inventory)
    app.router.add_get("/v1/host", host)
    stand_in.runner = web.AppRunner(app)
    await stand_in.runner.setup()
    await web.UnixSite(stand_in.runner, stand_in.socket_path).start()
    try:
        yield stand_in
    finally:
        await stand_in.stop()


@pytest.fixture
def config(remote: RemoteSection) -> Config:
    service = ServiceSection(
        command=("/bin/sleep", "600"), local_data_dir="/tmp/tg/{area}",
        remote_data_dir="{remote_bin_dir}/data/tg/{area}",
    )
    # The pushed pyz as a VPS runs it, so the agent check runs the real self-check.
    pushed = remote.model_copy(update={
        "remote_python": SYSTEM_PYTHON,
        "remote_monitord": RemoteSection.model_fields["remote_monitord"].default,
    })
    return Config(remote=pushed, services={SERVICE: service})


@pytest.fixture
async def provisioned(
    conn: asyncssh.SSHClientConnection, remote: RemoteSection,
    artifacts: list[LocalArtifact], secret: bytes,
) -> list[LocalArtifact]:
    await asyncio.wait_for(
        provisioning.provision(conn, remote=remote, artifacts=artifacts, secret=secret,
                               start_agent=False),
        TIMEOUT,
    )
    return artifacts


PreflightRunner = Callable[..., Awaitable[PreflightReport]]


@pytest.fixture
def preflight(
    conn: asyncssh.SSHClientConnection, config: Config, provisioned: list[LocalArtifact],
    agent: StandInAgent, secret: bytes,
) -> PreflightRunner:
    """Preflight with everything healthy; keyword arguments replace one input."""

    async def run(**changes: object) -> PreflightReport:
        inputs: dict[str, object] = {
            "conn": conn, "config": config, "service": SERVICE, "artifacts": provisioned,
            "need": AreaNeed(usage=Usage(bytes=1024)), "tunnel": READY_TUNNEL,
            "agent": agent.client(),
            "timeout_s": 5.0,
        }
        inputs.update(changes)
        connection = inputs.pop("conn")
        return await asyncio.wait_for(
            run_preflight(connection, **inputs),  # type: ignore[arg-type]
            TIMEOUT,
        )

    return run


def failed_codes(report: PreflightReport) -> list[ErrorCode]:
    return [result.code for result in report.failures]


def assert_still_running(process: asyncio.subprocess.Process) -> None:
    assert process.returncode is None
    os.kill(process.pid, 0)  # raises if the process is gone


class TestHealthyVps:
    """On a healthy, provisioned VPS every check passes with one exec round trip."""

    async def test_every_check_passes(
        self, preflight: PreflightRunner, vps: VpsServer
    ) -> None:
        commands_before = len(vps.command_log)
        report = await preflight()
        assert report.ok, [r for r in report.results if not r.ok]
        assert [r.check for r in report.results] == [
            "auth", "arch", "bin_dir", "disk_space", "write_test", "agent", "artifacts",
            "tunnel_owner", "forwards", "remote_config", "memory",
        ]
        # the facts script and the pyz's self-check
        assert len(vps.command_log) - commands_before == 2
        assert "self-check passed (cpython 3." in report.result("agent").detail

    async def test_preflights_of_areas_moving_together_ask_the_vps_once(
        self, preflight: PreflightRunner, vps: VpsServer
    ) -> None:
        commands_before = len(vps.command_log)
        shared = SharedFacts()
        reports = await asyncio.gather(*(preflight(shared=shared) for _ in range(10)))
        assert all(report.ok for report in reports), [r.failures for r in reports]
        # one facts script and one self-check for all ten (each alone: two apiece)
        assert len(vps.command_log) - commands_before == 2

    async def test_a_warmed_connection_spares_the_first_preflight_its_self_check(
        self, preflight: PreflightRunner, vps: VpsServer, conn: asyncssh.SSHClientConnection,
        config: Config, provisioned: list[LocalArtifact],
    ) -> None:
        shared = SharedFacts()
        await asyncio.wait_for(
            warm(conn, config=config, artifacts=provisioned, shared=shared), TIMEOUT
        )
        commands_before = len(vps.command_log)
        report = await preflight(shared=shared)
        assert report.ok, report.failures
        assert "self-check passed" in report.result("agent").detail
        assert len(vps.command_log) - commands_before == 1  # the facts script only

    async def test_the_agent_is_asked_over_the_ssh_connection(
        self, preflight: PreflightRunner, agent: StandInAgent
    ) -> None:
        """... and asked nothing whose answer grows with its areas: a move's preflight runs
        once per area, and a whole inventory in each (every area's entry and process, built
        by the agent) made a hundred areas' moves cost both sides a hundred times a hundred
        areas. Our secret is proven by a route whose answer has a fixed size."""
        report = await preflight()
        assert report.result("remote_config").ok, report.result("remote_config").detail
        assert agent.requests == ["/livez", "/v1/host"]


class TestEachCheckFailsAlone:
    """Every check fails in isolation with its own code and a hint; a local daemon keeps running."""

    async def test_auth(
        self, preflight: PreflightRunner, vps: VpsServer, local_daemon: asyncio.subprocess.Process,
    ) -> None:
        stranger = asyncssh.generate_private_key("ssh-ed25519")
        with pytest.raises(asyncssh.PermissionDenied) as denied:
            await asyncio.wait_for(vps.connect(client_keys=[stranger]), TIMEOUT)
        report = await preflight(
            conn=None, tunnel=replace(READY_TUNNEL, auth_error=denied.value.reason))
        assert failed_codes(report) == [ErrorCode.PREFLIGHT_AUTH]
        assert report.result("arch").status is CheckStatus.SKIPPED
        assert_still_running(local_daemon)

    async def test_arch(
        self, tmp_path: Path, config: Config, provisioned: list[LocalArtifact],
        secret: bytes, agent: StandInAgent, local_daemon: asyncio.subprocess.Process,
    ) -> None:
        fake_bin = tmp_path / "arm-bin"
        fake_bin.mkdir()
        (fake_bin / "uname").write_text("#!/bin/sh\necho aarch64\n")
        (fake_bin / "uname").chmod(0o755)
        env = {"PATH": f"{fake_bin}:{os.environ['PATH']}"}
        async with VpsServer(work_dir=tmp_path / "arm-vps", env=env) as arm_vps:
            async with arm_vps.connect() as arm_conn:
                report = await run_preflight(
                    arm_conn, config=config, service=SERVICE, artifacts=provisioned,
                    tunnel=READY_TUNNEL, agent=agent.client(),
                    timeout_s=5.0,
                )
        assert failed_codes(report) == [ErrorCode.PREFLIGHT_ARCH]
        assert "aarch64" in report.result("arch").detail
        assert_still_running(local_daemon)

    async def test_bin_dir(
        self, preflight: PreflightRunner, remote: RemoteSection,
        local_daemon: asyncio.subprocess.Process,
    ) -> None:
        Path(remote.remote_bin_dir).chmod(0o777)
        report = await preflight()
        assert failed_codes(report) == [ErrorCode.PREFLIGHT_BIN_DIR]
        assert "0777" in report.result("bin_dir").detail
        assert_still_running(local_daemon)

    async def test_disk_space(
        self, preflight: PreflightRunner, local_daemon: asyncio.subprocess.Process
    ) -> None:
        report = await preflight(need=AreaNeed(usage=Usage(bytes=1 << 60)))
        assert failed_codes(report) == [ErrorCode.PREFLIGHT_DISK_SPACE]
        assert_still_running(local_daemon)

    async def test_write_test(
        self, preflight: PreflightRunner, remote: RemoteSection,
        local_daemon: asyncio.subprocess.Process,
    ) -> None:
        blocker = Path(remote.remote_bin_dir) / ".preflight-write-test"
        blocker.mkdir()
        (blocker / "keep").write_text("a directory cannot be created as a file nor rm -f'd")
        report = await preflight()
        assert failed_codes(report) == [ErrorCode.PREFLIGHT_WRITE_TEST]
        assert_still_running(local_daemon)

    async def test_agent(
        self, preflight: PreflightRunner, agent: StandInAgent, config: Config,
        remote: RemoteSection, local_daemon: asyncio.subprocess.Process,
    ) -> None:
        await agent.stop()
        broken = remote.model_copy(update={"remote_monitord": ("/nonexistent/python3", "x")})
        report = await preflight(config=config.model_copy(update={"remote": broken}))
        assert failed_codes(report) == [ErrorCode.PREFLIGHT_AGENT]
        assert report.result("remote_config").status is CheckStatus.SKIPPED
        assert_still_running(local_daemon)

    async def test_agent_names_what_the_vps_lacks_and_the_fix(
        self, tmp_path: Path, config: Config, provisioned: list[LocalArtifact],
        agent: StandInAgent, local_daemon: asyncio.subprocess.Process,
    ) -> None:
        """The pushed pyz's self-check runs on the VPS: a broken `ss` (iproute2) is named."""
        fake_bin = tmp_path / "no-ss-bin"
        fake_bin.mkdir()
        (fake_bin / "ss").write_text("#!/bin/sh\necho 'ss: not installed' >&2\nexit 1\n")
        (fake_bin / "ss").chmod(0o755)
        env = {"PATH": f"{fake_bin}:{os.environ['PATH']}"}
        async with VpsServer(work_dir=tmp_path / "bare-vps", env=env) as bare_vps:
            async with bare_vps.connect() as bare_conn:
                report = await run_preflight(
                    bare_conn, config=config, service=SERVICE, artifacts=provisioned,
                    tunnel=READY_TUNNEL, agent=agent.client(), timeout_s=5.0,
                )
        assert failed_codes(report) == [ErrorCode.PREFLIGHT_AGENT]
        detail = report.result("agent").detail
        assert "ss:" in detail and "iproute2" in detail, detail
        assert_still_running(local_daemon)

    async def test_artifacts(
        self, preflight: PreflightRunner, remote: RemoteSection,
        local_daemon: asyncio.subprocess.Process,
    ) -> None:
        (Path(remote.remote_bin_dir) / "monitord.pyz").write_bytes(b"tampered")
        report = await preflight()
        assert failed_codes(report) == [ErrorCode.PREFLIGHT_ARTIFACTS]
        assert "monitord.pyz" in report.result("artifacts").detail
        assert_still_running(local_daemon)

    async def test_tunnel_owner(
        self, preflight: PreflightRunner, local_daemon: asyncio.subprocess.Process
    ) -> None:
        other = TunnelOwnerView(ours=False, owner_id="b7e1", owner_label="pbx-02")
        report = await preflight(tunnel=replace(READY_TUNNEL, owner=other))
        assert failed_codes(report) == [ErrorCode.PREFLIGHT_TUNNEL_OWNER]
        assert "pbx-02" in report.result("tunnel_owner").detail
        assert_still_running(local_daemon)

    async def test_forwards(
        self, preflight: PreflightRunner, local_daemon: asyncio.subprocess.Process
    ) -> None:
        report = await preflight(tunnel=replace(READY_TUNNEL, forwards_ready={"nats": True}))
        assert failed_codes(report) == [ErrorCode.PREFLIGHT_FORWARDS]
        assert "license" in report.result("forwards").detail
        assert_still_running(local_daemon)

    async def test_remote_config(
        self, preflight: PreflightRunner, agent: StandInAgent,
        local_daemon: asyncio.subprocess.Process,
    ) -> None:
        report = await preflight(agent=agent.client(b"not-the-agents-secret"))
        assert failed_codes(report) == [ErrorCode.PREFLIGHT_REMOTE_CONFIG]
        assert_still_running(local_daemon)

    async def test_memory(
        self, preflight: PreflightRunner, agent: StandInAgent,
        local_daemon: asyncio.subprocess.Process,
    ) -> None:
        """600 MiB available: a daemon of 540 MiB, its guard and 64 MiB kept free do not fit;
        the detail names each part."""
        report = await preflight(need=AreaNeed(memory=Need(daemon_bytes=540 * MIB)))
        assert failed_codes(report) == [ErrorCode.PREFLIGHT_MEMORY]
        detail = report.result("memory").detail
        assert detail.startswith("VPS: 600.0 MiB of memory available, 608.0 MiB needed"), detail
        assert report.result("memory").facts["available_bytes"] == 600 * MIB
        assert_still_running(local_daemon)
        assert (await preflight(need=AreaNeed(memory=Need(daemon_bytes=530 * MIB)))).ok

    async def test_memory_claimed_by_the_moves_under_way(
        self, preflight: PreflightRunner, agent: StandInAgent,
    ) -> None:
        report = await preflight(need=AreaNeed(memory=Need(daemon_bytes=100 * MIB,
                                                  claimed_bytes=440 * MIB)))
        assert failed_codes(report) == [ErrorCode.PREFLIGHT_MEMORY]
        assert "moves under way 440.0 MiB" in report.result("memory").detail

    async def test_an_agent_older_than_the_memory_route_proves_the_secret_all_the_same(
        self, preflight: PreflightRunner, agent: StandInAgent,
    ) -> None:
        agent.host = None
        report = await preflight(need=AreaNeed(memory=Need(daemon_bytes=1 << 40)))
        assert report.ok, report.failures
        assert "older than GET /v1/host" in report.result("memory").detail

    async def test_a_memory_answer_out_of_bounds_is_refused(
        self, preflight: PreflightRunner, agent: StandInAgent,
    ) -> None:
        agent.host = {"mem_total_bytes": 1 << 70, "mem_available_bytes": "lots"}
        report = await preflight()
        assert failed_codes(report) == [ErrorCode.PREFLIGHT_REMOTE_CONFIG]
        assert "malformed answer" in report.result("remote_config").detail
        assert report.result("memory").status is CheckStatus.SKIPPED

    async def test_every_failure_carries_a_fix_hint(
        self, preflight: PreflightRunner, remote: RemoteSection, agent: StandInAgent,
    ) -> None:
        Path(remote.remote_bin_dir).chmod(0o777)
        report = await preflight(
            need=AreaNeed(usage=Usage(bytes=1 << 60)),
            tunnel=TunnelView(owner=TunnelOwnerView(ours=False), forwards_ready={}),
            agent=agent.client(b"wrong"),
        )
        assert len(report.failures) == 5
        assert all(result.hint for result in report.failures)


class TestStartableAgent:
    """An agent that does not answer but whose monitord runs on the VPS counts as startable."""

    async def test_a_stopped_agent_with_a_runnable_artifact_passes(
        self, preflight: PreflightRunner, agent: StandInAgent, config: Config,
        remote: RemoteSection,
    ) -> None:
        await agent.stop()
        runnable = remote.model_copy(
            update={"remote_monitord": (sys.executable, "{remote_bin_dir}/monitord.pyz")}
        )
        report = await preflight(config=config.model_copy(update={"remote": runnable}))
        assert report.result("agent").ok, report.result("agent").detail
        assert "startable" in report.result("agent").detail
        assert report.result("remote_config").status is CheckStatus.SKIPPED
        assert report.first_failure() is None

"""End to end on the in-process VPS: provisioning starts the real agent from the pushed
monitord.pyz (system python3, isolated mode) through agent-launch, a second run leaves it
alone, and preflight passes reaching it over the SSH connection."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import asyncssh
import pytest

from monitord.base.config import Config, RemoteSection, ServiceSection
from monitord.remote import agent_channel, provisioning
from monitord.remote.agent_client import AgentClient
from monitord.remote.preflight import TunnelOwnerView, TunnelView, run_preflight
from monitord.remote.provisioning import LocalArtifact
from monitord.testing.stack import SYSTEM_PYTHON

TIMEOUT = 30.0


def agent_pid(bin_dir: Path) -> int:
    return int((bin_dir / "agent.pid").read_text().split()[0])


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
async def real_remote(remote: RemoteSection) -> AsyncIterator[RemoteSection]:
    """The remote section with the default remote_monitord (the pushed pyz); stops the agent."""
    defaults = RemoteSection.model_fields["remote_monitord"].default
    section = remote.model_copy(
        update={"remote_monitord": defaults, "remote_python": SYSTEM_PYTHON}
    )
    bin_dir = Path(section.remote_bin_dir)
    try:
        yield section
    finally:
        with contextlib.suppress(FileNotFoundError, ValueError):
            pid = agent_pid(bin_dir)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            async with asyncio.timeout(TIMEOUT):
                while alive(pid):  # noqa: ASYNC110 - polling an outside process, bounded
                    await asyncio.sleep(0.05)


class TestRealAgent:
    """agent-launch from the pushed pyz starts one agent; preflight then passes against it."""

    async def test_provisioning_starts_the_agent_once_and_preflight_passes(
        self, conn: asyncssh.SSHClientConnection, real_remote: RemoteSection,
        artifacts: list[LocalArtifact],
    ) -> None:
        secret = secrets.token_hex(16).encode()
        bin_dir = Path(real_remote.remote_bin_dir)
        await asyncio.wait_for(
            provisioning.provision(conn, remote=real_remote, artifacts=artifacts, secret=secret),
            TIMEOUT,
        )
        first_pid = agent_pid(bin_dir)
        again = await asyncio.wait_for(
            provisioning.provision(conn, remote=real_remote, artifacts=artifacts, secret=secret),
            TIMEOUT,
        )
        assert not again.changed
        assert agent_pid(bin_dir) == first_pid and alive(first_pid)

        @contextlib.asynccontextmanager
        async def session() -> AsyncIterator[asyncssh.SSHClientConnection]:
            yield conn

        agent = AgentClient(
            channel=agent_channel.over_ssh(session, real_remote.agent_socket()), secret=secret
        )
        service = ServiceSection(command=("/bin/true",), local_data_dir="/l", remote_data_dir="/r")
        report = await asyncio.wait_for(
            run_preflight(
                conn, config=Config(remote=real_remote, services={"tg": service}),
                service="tg", artifacts=artifacts,
                tunnel=TunnelView(owner=TunnelOwnerView(ours=True),
                                  forwards_ready={"nats": True, "license": True}),
                agent=agent,
            ),
            TIMEOUT,
        )
        assert report.ok, [r for r in report.results if not r.ok]

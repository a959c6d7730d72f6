"""Fixtures for the tunnel tests: a real OpenSSH sshd (the VPS), the fault proxy in front of
it, local echo servers as reverse-forward targets, and keepers built from a RemoteSection
whose `remote_monitord` runs the built monitord.pyz under the system python3 in isolated
mode, as a VPS does (the VPS is this machine).

Every test here captures the structlog events it produced and, at teardown, checks that no
log event, status snapshot or error text contains private key material."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import structlog

from monitord.base.config import ForwardSpec, RemoteSection
from monitord.remote.tunnel.keeper import ReconnectHook, TunnelKeeper, TunnelStatus
from tests.support.agent_process import vps_command
from tests.support.sshd import Sshd, can_run_sshd, free_port, running_sshd
from tests.support.tcp_proxy import TcpProxy, running_proxy

pytestmark = pytest.mark.root

KEEPALIVE_S = 0.5
KEEPALIVE_COUNT = 2
LEASE_TTL_S = 2.0


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/integration/tunnel" in str(item.fspath):
            item.add_marker(pytest.mark.root)
            if not can_run_sshd():
                item.add_marker(pytest.mark.skip(reason="needs root and /usr/sbin/sshd"))


@dataclass
class Vps:
    """The VPS side of a test: sshd, a proxy in front of it, and the remote bin dir."""

    sshd: Sshd
    proxy: TcpProxy
    remote_dir: Path
    known_hosts: Path  # for the proxy's address


class EchoServer:
    """A PBX-side TCP target that echoes every line back (stands in for NATS/license)."""

    def __init__(self) -> None:
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while line := await reader.readline():
                writer.write(line)
                await writer.drain()
        writer.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


@dataclass
class Captured:
    """Everything a test exposed to the outside: log events, statuses and error texts."""

    events: list[dict[str, Any]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)

    def add_status(self, status: TunnelStatus) -> None:
        self.texts.append(json.dumps(status.to_dict(), default=str))

    def all_text(self) -> str:
        return "\n".join([json.dumps(e, default=str) for e in self.events] + self.texts)


@pytest.fixture
async def vps(tmp_path: Path) -> AsyncIterator[Vps]:
    async with running_sshd(tmp_path / "sshd") as sshd, running_proxy(
        "127.0.0.1", sshd.port
    ) as proxy:
        remote_dir = tmp_path / "remote"
        remote_dir.mkdir()
        yield Vps(sshd=sshd, proxy=proxy, remote_dir=remote_dir,
                  known_hosts=sshd.known_hosts_for_port(proxy.port))


@pytest.fixture
async def echo() -> AsyncIterator[EchoServer]:
    server = EchoServer()
    await server.start()
    yield server
    await server.close()


@pytest.fixture
def captured(vps: Vps) -> Any:
    """Captures structlog events; at teardown asserts no private key material leaked."""
    result = Captured()
    with structlog.testing.capture_logs() as events:
        result.events = events
        yield result
    text = result.all_text() + "\n" + vps.sshd.log_text()
    for fragment in vps.sshd.client_key.private_key_fragments():
        assert fragment not in text, "private key material leaked into logs/status/errors"


def remote_section(
    vps: Vps,
    *,
    reverse: tuple[ForwardSpec, ...] = (),
    local: tuple[ForwardSpec, ...] = (),
    **overrides: Any,
) -> RemoteSection:
    values: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": vps.proxy.port,
        "user": "root",
        "key_file": vps.sshd.client_key.private_path,
        "known_hosts": vps.known_hosts,
        "remote_bin_dir": str(vps.remote_dir),
        # the tunnel-lease verb as a VPS runs it: the built pyz, system python3, isolated
        "remote_monitord": vps_command(),
        "connect_timeout_s": 5.0,
        "keepalive_interval_s": KEEPALIVE_S,
        "keepalive_count_max": KEEPALIVE_COUNT,
        "reconnect_backoff_base_s": 0.05,
        "reconnect_backoff_cap_s": 0.5,
        "reconnect_max_per_minute": 30,
        "tunnel_lease_ttl_s": LEASE_TTL_S,
        "reverse_forwards": reverse,
        "local_forwards": local,
    }
    values.update(overrides)
    return RemoteSection.model_validate(values)


def reverse_to(echo: EchoServer, name: str = "nats") -> ForwardSpec:
    return ForwardSpec(name=name, listen=f"127.0.0.1:{free_port()}",
                       target=f"127.0.0.1:{echo.port}")


@contextlib.asynccontextmanager
async def running_keeper(
    config: RemoteSection,
    *,
    owner_id: str = "owner-a",
    owner_label: str = "pbx-a",
    captured: Captured | None = None,
    hooks: dict[str, ReconnectHook] | None = None,
    **kwargs: Any,
) -> AsyncIterator[TunnelKeeper]:
    """A keeper running as a named task; closed and awaited on exit."""
    keeper = TunnelKeeper(config, owner_id=owner_id, owner_label=owner_label,
                          probe_timeout_s=5.0, **kwargs)
    for name, hook in (hooks or {}).items():
        keeper.add_reconnect_hook(name, hook)
    if captured is not None:
        keeper.add_listener(captured.add_status)
    task = asyncio.create_task(keeper.run(), name=f"tunnel keeper {owner_id}")
    try:
        yield keeper
    finally:
        await keeper.close()
        await asyncio.wait_for(task, 15)


async def round_trip(listen: str, payload: bytes = b"ping\n", *, timeout_s: float = 5.0) -> bytes:
    """Connect to listen, send one line, return the line that comes back."""
    host, _, port = listen.rpartition(":")
    async with asyncio.timeout(timeout_s):
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(payload)
            await writer.drain()
            return await reader.readline()
        finally:
            writer.close()


async def poll(condition: Callable[[], Any], *, timeout_s: float, what: str) -> Any:
    """Poll condition() until truthy, at most timeout_s (a deadline loop, never a bare sleep)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.02)

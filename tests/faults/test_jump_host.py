"""A VPS whose sshd the PBX reaches only through a jump host (OpenSSH in a second namespace):
with `remote.proxy_jump` (or an ssh_config's ProxyJump) monitord reaches it, the tunnel comes
up and areas move there; every hop is held to the same known_hosts and key as the VPS."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from monitord.base.config import RemoteSection
from monitord.remote.tunnel import ssh_connect
from orchestrator.errors import ErrorCode, MonitordError
from tests.faults.conftest import FaultStackFactory
from tests.faults.nats_server import NatsServer
from tests.faults.netns_vps import JumpHost, NetnsVps, external_vps
from tests.support import stacks

TIMEOUT_S = 20.0


@pytest.fixture
async def jump_stack(
    tmp_path: Path, netns_vps: NetnsVps, jump_host: JumpHost, nats: NatsServer
) -> AsyncIterator[FaultStackFactory]:
    """`fault_stack`, with the VPS's SSH reached through `jump_host`."""
    vps = dataclasses.replace(
        external_vps(netns_vps), known_hosts=jump_host.known_hosts,
        proxy_jump=jump_host.proxy_jump,
    )
    async with stacks.stack_factory(
        tmp_path, external_vps=vps, nats_target=nats.address
    ) as make:
        yield make


def section(vps: NetnsVps, **keys: Any) -> RemoteSection:
    return RemoteSection(
        host=vps.vps_address, user=vps.user, key_file=vps.client_key.private_path,
        remote_bin_dir=str(vps.remote_bin_dir), connect_timeout_s=TIMEOUT_S, **keys,
    )


async def client_address_seen_by(config: RemoteSection) -> str:
    """Connect as monitord does; the client address the VPS's sshd saw (SSH_CONNECTION)."""
    conn = await ssh_connect.open_connection(config)
    async with conn:
        result = await asyncio.wait_for(
            conn.run('echo "$SSH_CONNECTION"', check=True), TIMEOUT_S
        )
    return str(result.stdout).split()[0]


def logins(sshd_log: str) -> list[str]:
    """The client address of every accepted login in an sshd log."""
    return [line.split(" from ")[1].split()[0] for line in sshd_log.splitlines()
            if "Accepted publickey for" in line]


async def refused_directly(vps: NetnsVps) -> bool:
    try:
        _, writer = await asyncio.wait_for(
            asyncio.open_connection(vps.vps_address, vps.port), TIMEOUT_S
        )
    except ConnectionRefusedError:
        return True
    writer.close()
    return False


class TestThroughTheJumpHost:
    """With proxy_jump, monitord runs its tunnel and a move to remote through the jump host."""

    async def test_the_tunnel_comes_up_through_the_jump_host_and_a_move_to_remote_completes(
        self, jump_stack: FaultStackFactory, netns_vps: NetnsVps, jump_host: JumpHost
    ) -> None:
        assert await refused_directly(netns_vps), "the VPS's sshd must be closed to the PBX"
        stack = await jump_stack(services={"tg": 1})

        async def tunnel_connected() -> bool:
            return bool((await stack.status())["tunnel"]["state"] == "connected")

        # The first contact provisions the VPS through the hop; only then is a move asked for
        # (a preflight gives a reconnecting tunnel only preflight_tunnel_wait_s).
        await stack.wait_until(tunnel_connected, timeout_s=90, what="tunnel connected")
        await stack.place("tg", "remote")
        await stack.wait_settled(expect={"tg": "remote"}, timeout_s=90)

        assert await tunnel_connected()
        (area,) = stack.areas["tg"]
        (alive,) = stack.detector.alive(area)
        assert alive.side == "remote" and alive.pid in set(netns_vps.pids())
        vps_logins = logins(netns_vps.log_text())
        assert vps_logins and set(vps_logins) == {jump_host.inner_jump_address}
        assert set(logins(jump_host.ns.log_text())) == {jump_host.ns.pbx_address}


class TestEveryHopIsCheckedLikeTheVps:
    """A jump host is verified against remote.known_hosts and logged into with key_file."""

    async def test_a_chain_of_one_hop_reaches_the_vps_from_the_jump_hosts_side(
        self, netns_vps: NetnsVps, jump_host: JumpHost
    ) -> None:
        config = section(netns_vps, known_hosts=jump_host.known_hosts,
                         proxy_jump=jump_host.proxy_jump)
        assert await client_address_seen_by(config) == jump_host.inner_jump_address

    async def test_a_jump_host_missing_from_known_hosts_is_a_host_key_mismatch(
        self, netns_vps: NetnsVps, jump_host: JumpHost
    ) -> None:
        config = section(netns_vps, known_hosts=netns_vps.known_hosts,  # the VPS's key only
                         proxy_jump=jump_host.proxy_jump)
        with pytest.raises(MonitordError) as caught:
            await ssh_connect.open_connection(config)
        assert caught.value.code == ErrorCode.HOST_KEY_MISMATCH, caught.value
        assert f"jump host {jump_host.proxy_jump}" in caught.value.detail
        assert logins(jump_host.ns.log_text()) == [], "we never logged in to the jump host"
        assert logins(netns_vps.log_text()) == []

    async def test_an_ssh_config_proxy_jump_is_followed_with_our_known_hosts(
        self, tmp_path: Path, netns_vps: NetnsVps, jump_host: JumpHost
    ) -> None:
        ssh_config = tmp_path / "ssh_config"
        ssh_config.write_text(
            f"Host the-vps\n  HostName {netns_vps.vps_address}\n"
            f"  ProxyJump {jump_host.proxy_jump}\n"
            # What asyncssh would obey if it opened the hop itself: no host key check at all.
            "Host *\n  UserKnownHostsFile none\n"
        )
        through = section(netns_vps, known_hosts=jump_host.known_hosts, ssh_config=ssh_config)
        through = through.model_copy(update={"host": "the-vps"})
        assert await client_address_seen_by(through) == jump_host.inner_jump_address

        unknown_jump = through.model_copy(update={"known_hosts": netns_vps.known_hosts})
        with pytest.raises(MonitordError) as caught:
            await ssh_connect.open_connection(unknown_jump)
        assert caught.value.code == ErrorCode.HOST_KEY_MISMATCH, caught.value

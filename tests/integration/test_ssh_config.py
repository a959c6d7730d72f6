"""`remote.ssh_config`: monitord's connection (tunnel/ssh_connect.py) honours an OpenSSH client
config's Host blocks, lets the [remote] keys win over it, and never lets it relax the host key
or key policy. Against the in-process VPS server, no root needed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from monitord.base.config import RemoteSection
from monitord.remote.tunnel import ssh_connect
from monitord.testing.ports import free_port
from monitord.testing.vps_server import VpsServer
from orchestrator.errors import ErrorCode, MonitordError
from tests.support import ssh_keys

TIMEOUT = 10.0
ALIAS = "the-vps"


@pytest.fixture
async def vps(tmp_path: Path) -> AsyncIterator[VpsServer]:
    async with VpsServer(work_dir=tmp_path / "vps") as server:
        yield server


def write_ssh_config(tmp_path: Path, vps: VpsServer, *extra: str) -> Path:
    path = tmp_path / "ssh_config"
    path.write_text("\n".join([
        f"Host {ALIAS}", f"  HostName {vps.host}", f"  Port {vps.port}", *extra, "",
    ]))
    return path


def section(vps: VpsServer, ssh_config: Path, **overrides: Any) -> RemoteSection:
    """A [remote] naming the VPS only by its alias, without a port (as a file would)."""
    values: dict[str, Any] = {
        "host": ALIAS, "user": vps.username, "key_file": vps.key_file,
        "known_hosts": vps.known_hosts, "ssh_config": ssh_config, **overrides,
    }
    return RemoteSection(**values)


async def connect_and_run(config: RemoteSection) -> str:
    conn = await ssh_connect.open_connection(config)
    async with conn:
        result = await asyncio.wait_for(conn.run("echo reached", check=True), TIMEOUT)
    return str(result.stdout).strip()


async def connect_error(config: RemoteSection) -> MonitordError:
    with pytest.raises(MonitordError) as caught:
        await ssh_connect.open_connection(config)
    return caught.value


class TestHostAlias:
    """A Host alias with HostName and Port reaches the VPS; keys set in [remote] win."""

    async def test_the_alias_hostname_and_port_of_the_ssh_config_are_used(
        self, tmp_path: Path, vps: VpsServer
    ) -> None:
        config = section(vps, write_ssh_config(tmp_path, vps))
        assert await connect_and_run(config) == "reached"
        assert vps.accepted_connections == 1

    async def test_an_explicit_port_wins_over_the_ssh_config(
        self, tmp_path: Path, vps: VpsServer
    ) -> None:
        closed = free_port()
        config = section(vps, write_ssh_config(tmp_path, vps), port=closed)
        error = await connect_error(config)
        assert error.code == ErrorCode.SSH_UNREACHABLE
        assert f"{ALIAS}:{closed}" in error.detail
        assert vps.accepted_connections == 0

    async def test_proxy_jump_none_ignores_the_ssh_configs_proxy_jump(
        self, tmp_path: Path, vps: VpsServer
    ) -> None:
        dead_end = f"nobody@127.0.0.1:{free_port()}"
        ssh_config = write_ssh_config(tmp_path, vps, f"  ProxyJump {dead_end}")
        error = await connect_error(section(vps, ssh_config))
        assert error.code == ErrorCode.SSH_UNREACHABLE
        assert f"jump host {dead_end}" in error.detail
        assert await connect_and_run(section(vps, ssh_config, proxy_jump="none")) == "reached"


class TestPolicyStaysOurs:
    """An ssh_config cannot switch the host key check off or bring in other keys."""

    async def test_user_known_hosts_file_none_in_the_ssh_config_still_checks_the_host_key(
        self, tmp_path: Path, vps: VpsServer
    ) -> None:
        impostor = ssh_keys.generate(tmp_path / "impostor_host_key")
        wrong = tmp_path / "known_hosts_wrong"
        wrong.write_text(ssh_keys.known_hosts_line(
            host=vps.host, port=vps.port, host_public_line=impostor.public_line))
        ssh_config = write_ssh_config(
            tmp_path, vps, "  UserKnownHostsFile none", "  StrictHostKeyChecking no",
        )
        error = await connect_error(section(vps, ssh_config, known_hosts=wrong))
        assert error.code == ErrorCode.HOST_KEY_MISMATCH

    async def test_an_identity_file_in_the_ssh_config_is_not_used(
        self, tmp_path: Path, vps: VpsServer
    ) -> None:
        stranger = ssh_keys.generate(tmp_path / "stranger" / "id_ed25519")
        ssh_config = write_ssh_config(tmp_path, vps, f"  IdentityFile {vps.key_file}")
        error = await connect_error(section(vps, ssh_config, key_file=stranger.private_path))
        assert error.code == ErrorCode.AUTH_FAILED


class TestBrokenFile:
    """A line asyncssh cannot parse is CONFIG_INVALID naming the line; nothing connects."""

    async def test_a_bad_line_is_config_invalid_and_no_connection_is_made(
        self, tmp_path: Path, vps: VpsServer
    ) -> None:
        ssh_config = write_ssh_config(tmp_path, vps, "  Port twenty-two")
        error = await connect_error(section(vps, ssh_config))
        assert error.code == ErrorCode.CONFIG_INVALID
        assert "line 4" in error.detail and "twenty-two" in error.detail
        assert vps.accepted_connections == 0

    async def test_a_file_removed_after_loading_is_config_invalid(
        self, tmp_path: Path, vps: VpsServer
    ) -> None:
        ssh_config = write_ssh_config(tmp_path, vps)
        config = section(vps, ssh_config)
        ssh_config.unlink()
        error = await connect_error(config)
        assert error.code == ErrorCode.CONFIG_INVALID
        assert str(ssh_config) in error.detail


class TestCiphers:
    """AES-GCM first (one OpenSSL call a packet, a fraction of chacha20-poly1305's cost in
    asyncssh), unless the operator's ssh_config names its own Ciphers."""

    async def test_aes_gcm_is_chosen_without_an_ssh_config(self, vps: VpsServer) -> None:
        config = RemoteSection(host=vps.host, port=vps.port, user=vps.username,
                               key_file=vps.key_file, known_hosts=vps.known_hosts)
        async with await ssh_connect.open_connection(config) as conn:
            assert conn.get_extra_info("send_cipher") == "aes256-gcm@openssh.com"

    async def test_aes_gcm_is_chosen_with_an_ssh_config_silent_on_ciphers(
        self, tmp_path: Path, vps: VpsServer
    ) -> None:
        config = section(vps, write_ssh_config(tmp_path, vps))
        async with await ssh_connect.open_connection(config) as conn:
            assert conn.get_extra_info("send_cipher") == "aes256-gcm@openssh.com"

    async def test_the_ciphers_of_the_ssh_config_are_kept(
        self, tmp_path: Path, vps: VpsServer
    ) -> None:
        config = section(vps, write_ssh_config(
            tmp_path, vps, "  Ciphers chacha20-poly1305@openssh.com,aes128-gcm@openssh.com"))
        async with await ssh_connect.open_connection(config) as conn:
            assert conn.get_extra_info("send_cipher") == "chacha20-poly1305@openssh.com"

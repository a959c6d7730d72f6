"""Connecting: the keeper comes up with every forward proven, and classifies refusals."""

from __future__ import annotations

from pathlib import Path

from monitord.remote.tunnel.keeper import TunnelState
from tests.integration.tunnel.conftest import (
    Captured,
    EchoServer,
    Vps,
    remote_section,
    reverse_to,
    round_trip,
    running_keeper,
)
from tests.support import ssh_keys


class TestConnected:
    """A fresh keeper holds the lease and proves every forward before it says connected."""

    async def test_connects_holds_the_lease_and_round_trips_through_the_reverse_forward(
        self, vps: Vps, echo: EchoServer, captured: Captured
    ) -> None:
        forward = reverse_to(echo)
        config = remote_section(vps, reverse=(forward,))
        async with running_keeper(config, captured=captured) as keeper:
            status = await keeper.wait_connected(timeout_s=20)
            assert status.lease is not None and status.lease.owner_id == "owner-a"
            assert [f.state for f in status.forwards] == ["proven"]
            assert await round_trip(forward.listen) == b"ping\n"
            async with keeper.session() as conn:
                result = await conn.run("true", check=True)
                assert result.exit_status == 0
                # OpenSSH offers AES-GCM by default: the cipher that costs the daemon least
                assert conn.get_extra_info("send_cipher") == "aes256-gcm@openssh.com"
                assert conn.get_extra_info("recv_cipher") == "aes256-gcm@openssh.com"
        assert keeper.status().state is TunnelState.STOPPED
        assert not (vps.remote_dir / "tunnel_lease.json").exists(), "lease released on close"


class TestRefusals:
    """Wrong key and changed host key are named by their codes, not retried as a storm."""

    async def test_a_wrong_key_is_auth_failed(
        self, vps: Vps, tmp_path: Path, captured: Captured
    ) -> None:
        stranger = ssh_keys.generate(tmp_path / "stranger" / "id_ed25519")
        config = remote_section(vps, key_file=stranger.private_path)
        async with running_keeper(config, captured=captured) as keeper:
            status = await keeper.wait_for(
                lambda s: s.state is TunnelState.AUTH_FAILED, timeout_s=15
            )
            assert status.last_error is not None and status.last_error.code == "AUTH_FAILED"
            assert not status.connected
        for fragment in stranger.private_key_fragments():
            assert fragment not in captured.all_text()

    async def test_a_changed_host_key_is_host_key_mismatch(
        self, vps: Vps, tmp_path: Path, captured: Captured
    ) -> None:
        impostor = ssh_keys.generate(tmp_path / "impostor_host_key")
        wrong = tmp_path / "known_hosts_wrong"
        wrong.write_text(ssh_keys.known_hosts_line(
            host="127.0.0.1", port=vps.proxy.port, host_public_line=impostor.public_line))
        config = remote_section(vps, known_hosts=wrong)
        async with running_keeper(config, captured=captured) as keeper:
            status = await keeper.wait_for(
                lambda s: s.state is TunnelState.HOST_KEY_MISMATCH, timeout_s=15
            )
            assert status.last_error is not None
            assert status.last_error.code == "HOST_KEY_MISMATCH"
        assert "Accepted publickey" not in vps.sshd.log_text(), "we never authenticated"


class TestNoKeyMaterial:
    """Logs, status snapshots and error texts never contain the private key."""

    async def test_nothing_a_keeper_exposes_contains_key_material(
        self, vps: Vps, echo: EchoServer, captured: Captured
    ) -> None:
        config = remote_section(vps, reverse=(reverse_to(echo),))
        async with running_keeper(config, captured=captured) as keeper:
            status = await keeper.wait_connected(timeout_s=20)
            assert status.lease is not None
            vps.sshd.kill_session(status.lease.session.sshd_pid)  # not the standby's
            await keeper.wait_for(lambda s: s.reconnects == 2, timeout_s=20)
        text = captured.all_text()
        assert "tunnel_connected" in text and "owner-a" in text, "the scan saw real output"
        for fragment in vps.sshd.client_key.private_key_fragments():
            assert fragment not in text

    def test_the_scan_recognises_leaked_key_text(self, vps: Vps) -> None:
        leaked = "detail: " + vps.sshd.client_key.private_path.read_text().splitlines()[2]
        assert any(f in leaked for f in vps.sshd.client_key.private_key_fragments())

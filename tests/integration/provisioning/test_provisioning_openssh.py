"""Provisioning against a real OpenSSH sshd (its SFTP server, its exec through the login shell)."""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncssh
import pytest

from monitord.base.config import RemoteSection
from monitord.remote import provisioning, remote_exec
from monitord.remote.provisioning import ArtifactAction, LocalArtifact, ProvisionProgress
from orchestrator.errors import ErrorCode, MonitordError
from tests.support.agent_process import SYSTEM_PYTHON
from tests.support.sshd import Sshd, can_run_sshd, running_sshd

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(not can_run_sshd(), reason="needs root and /usr/sbin/sshd"),
]
TIMEOUT = 30.0


@pytest.fixture
async def sshd(tmp_path: Path) -> AsyncIterator[Sshd]:
    async with running_sshd(tmp_path / "sshd") as server:
        yield server


def connect(sshd: Sshd) -> Any:
    return asyncssh.connect(
        sshd.host, sshd.port, username=sshd.user, known_hosts=str(sshd.known_hosts),
        client_keys=[str(sshd.client_key.private_path)], agent_path=None, config=None,
    )


class TestProvisioningOverOpenSsh:
    """Against OpenSSH, a cut push is redone, a second run is a no-op, and the pyz runs there."""

    async def test_cut_push_then_complete_then_no_op_then_pyz_runs(
        self, sshd: Sshd, remote: RemoteSection, artifacts: list[LocalArtifact],
    ) -> None:
        secret = secrets.token_hex(16).encode()
        binary = artifacts[1]
        bin_dir = Path(remote.remote_bin_dir)

        async with connect(sshd) as conn:
            client_port = conn.get_extra_info("sockname")[1]

            def cut_mid_upload(event: ProvisionProgress) -> None:
                if event.step == "upload" and event.artifact == binary.name and (
                    0 < event.done_bytes < event.total_bytes
                ):
                    pid = sshd.session_pid_for_client_port(client_port)
                    assert pid is not None
                    sshd.kill_session(pid)

            with pytest.raises(MonitordError) as cut:
                await asyncio.wait_for(
                    provisioning.provision(conn, remote=remote, artifacts=artifacts,
                                           secret=secret, progress=cut_mid_upload),
                    TIMEOUT,
                )
        assert cut.value.code in (ErrorCode.SSH_UNREACHABLE, ErrorCode.PROVISION_FAILED)
        assert not (bin_dir / binary.name).exists()

        async with connect(sshd) as conn:
            first = await asyncio.wait_for(
                provisioning.provision(conn, remote=remote, artifacts=artifacts, secret=secret),
                TIMEOUT,
            )
            second = await asyncio.wait_for(
                provisioning.provision(conn, remote=remote, artifacts=artifacts, secret=secret),
                TIMEOUT,
            )
            helped = await remote_exec.run(
                conn, [SYSTEM_PYTHON, "-I", f"{bin_dir}/monitord.pyz", "--help"],
                timeout_s=TIMEOUT,
            )
        assert first.stale_temp_files_removed >= 1
        assert first.artifacts[1].action is ArtifactAction.PUSHED
        assert hashlib.sha256((bin_dir / binary.name).read_bytes()).hexdigest() == binary.sha256
        assert not second.changed
        assert stat.S_IMODE((bin_dir / "agent.secret").stat().st_mode) == 0o600
        assert helped.ok and "agent-launch" in helped.text
        assert sorted(p.name for p in bin_dir.glob(".*.partial")) == []

"""Provisioning against the in-process VPS: verified pushes, repair of broken pushes, the
secret's confidentiality, idempotence and a pyz that runs on the VPS."""

from __future__ import annotations

import asyncio
import hashlib
import os
import secrets
import stat
from pathlib import Path

import asyncssh
import pytest
from structlog.testing import capture_logs

from monitord.base.config import RemoteSection
from monitord.remote import artifact, provisioning, remote_exec
from monitord.remote.provisioning import ArtifactAction, LocalArtifact, ProvisionProgress
from monitord.testing.vps_server import VpsServer
from orchestrator.errors import ErrorCode, MonitordError
from tests.support.agent_process import SYSTEM_PYTHON

TIMEOUT = 30.0


def new_secret() -> bytes:
    return secrets.token_hex(24).encode()


async def provision(
    conn: asyncssh.SSHClientConnection,
    remote: RemoteSection,
    artifacts: list[LocalArtifact],
    secret: bytes,
    events: list[ProvisionProgress] | None = None,
) -> provisioning.ProvisionReport:
    return await asyncio.wait_for(
        provisioning.provision(
            conn,
            remote=remote,
            artifacts=artifacts,
            secret=secret,
            progress=events.append if events is not None else None,
        ),
        TIMEOUT,
    )


def bin_dir(remote: RemoteSection) -> Path:
    return Path(remote.remote_bin_dir)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def snapshot(directory: Path) -> dict[str, tuple[int, int, int]]:
    """Per file: inode, mtime and mode; any rewrite, rename or chmod changes it."""
    return {
        p.name: (p.stat().st_ino, p.stat().st_mtime_ns, p.stat().st_mode)
        for p in directory.iterdir()
    }


def leftovers(remote: RemoteSection) -> list[str]:
    return sorted(p.name for p in bin_dir(remote).glob(".*.partial"))


class TestFirstRun:
    """A first run installs artifacts verified by hash, writes the secret, asks the launcher."""

    async def test_every_artifact_lands_with_its_hash_and_mode(
        self, conn: asyncssh.SSHClientConnection, remote: RemoteSection,
        artifacts: list[LocalArtifact],
    ) -> None:
        report = await provision(conn, remote, artifacts, new_secret())
        assert [a.action for a in report.artifacts] == [ArtifactAction.PUSHED] * 2
        for item in artifacts:
            placed = bin_dir(remote) / item.name
            assert sha256(placed) == item.sha256
            assert stat.S_IMODE(placed.stat().st_mode) == item.mode
        assert stat.S_IMODE(bin_dir(remote).stat().st_mode) == 0o700
        assert leftovers(remote) == []

    async def test_the_agent_launcher_is_asked_with_the_bin_dir(
        self, conn: asyncssh.SSHClientConnection, remote: RemoteSection,
        artifacts: list[LocalArtifact], tmp_path: Path,
    ) -> None:
        await provision(conn, remote, artifacts, new_secret())
        calls = (tmp_path / "launcher-calls").read_text().splitlines()
        assert calls == [f"agent-launch --dir {remote.remote_bin_dir}"]

    async def test_the_configured_artifacts_follow_the_agent_pyz(
        self, remote: RemoteSection, agent_pyz: artifact.ArtifactInfo, service_binary: Path,
    ) -> None:
        names = [a.name for a in artifact.local_artifacts(remote, agent=agent_pyz)]
        assert names == ["monitord.pyz", service_binary.name]


class TestIdempotence:
    """A second run with nothing changed touches nothing on the VPS."""

    async def test_the_second_run_changes_nothing(
        self, conn: asyncssh.SSHClientConnection, remote: RemoteSection,
        artifacts: list[LocalArtifact],
    ) -> None:
        secret = new_secret()
        first = await provision(conn, remote, artifacts, secret)
        before = snapshot(bin_dir(remote))
        second = await provision(conn, remote, artifacts, secret)
        after = snapshot(bin_dir(remote))
        assert first.changed
        assert not second.changed
        assert [a.action for a in second.artifacts] == [ArtifactAction.UNCHANGED] * 2
        assert after == before

    async def test_a_wrong_mode_is_fixed_without_a_new_upload(
        self, conn: asyncssh.SSHClientConnection, remote: RemoteSection,
        artifacts: list[LocalArtifact],
    ) -> None:
        secret = new_secret()
        await provision(conn, remote, artifacts, secret)
        binary = bin_dir(remote) / artifacts[1].name
        binary.chmod(0o600)
        report = await provision(conn, remote, artifacts, secret)
        assert report.modes_fixed == (artifacts[1].name,)
        assert report.artifacts[1].action is ArtifactAction.UNCHANGED
        assert stat.S_IMODE(binary.stat().st_mode) == 0o755


class TestInterruptedPush:
    """A push cut short is detected on the next run and redone; nothing partial is ever in place."""

    async def test_a_truncated_temp_file_left_behind_is_removed_and_the_push_redone(
        self, conn: asyncssh.SSHClientConnection, remote: RemoteSection,
        artifacts: list[LocalArtifact],
    ) -> None:
        bin_dir(remote).mkdir(parents=True)
        binary = artifacts[1]
        stale = bin_dir(remote) / f".{binary.name}.0badc0ffee00.partial"
        stale.write_bytes(binary.path.read_bytes()[: binary.size // 2])
        report = await provision(conn, remote, artifacts, new_secret())
        assert report.stale_temp_files_removed == 1
        assert report.artifacts[1].action is ArtifactAction.PUSHED
        assert sha256(bin_dir(remote) / binary.name) == binary.sha256
        assert leftovers(remote) == []

    async def test_a_connection_cut_mid_upload_is_redone_on_the_next_run(
        self, vps: VpsServer, conn: asyncssh.SSHClientConnection, remote: RemoteSection,
        artifacts: list[LocalArtifact],
    ) -> None:
        binary = artifacts[1]

        def cut_mid_upload(event: ProvisionProgress) -> None:
            if event.step == "upload" and event.artifact == binary.name and (
                0 < event.done_bytes < event.total_bytes
            ):
                vps.drop_all_sessions()

        with pytest.raises(MonitordError) as cut:
            await asyncio.wait_for(
                provisioning.provision(conn, remote=remote, artifacts=artifacts,
                                       secret=new_secret(), progress=cut_mid_upload),
                TIMEOUT,
            )
        assert cut.value.code is ErrorCode.SSH_UNREACHABLE
        assert not (bin_dir(remote) / binary.name).exists()
        assert leftovers(remote), "the cut upload should have left its temp file"

        async with vps.connect() as again:
            report = await provision(again, remote, artifacts, new_secret())
        assert report.artifacts[1].action is ArtifactAction.PUSHED
        assert sha256(bin_dir(remote) / binary.name) == binary.sha256
        assert leftovers(remote) == []

    async def test_a_truncated_file_in_place_is_replaced(
        self, conn: asyncssh.SSHClientConnection, remote: RemoteSection,
        artifacts: list[LocalArtifact],
    ) -> None:
        binary = artifacts[1]
        bin_dir(remote).mkdir(parents=True)
        (bin_dir(remote) / binary.name).write_bytes(binary.path.read_bytes()[:1000])
        report = await provision(conn, remote, artifacts, new_secret())
        assert report.artifacts[1].action is ArtifactAction.REPLACED
        assert sha256(bin_dir(remote) / binary.name) == binary.sha256


class TestTamperedArtifact:
    """A file whose hash differs is replaced, or reported when the VPS cannot verify it."""

    async def test_a_tampered_artifact_is_detected_by_hash_and_replaced(
        self, conn: asyncssh.SSHClientConnection, remote: RemoteSection,
        artifacts: list[LocalArtifact],
    ) -> None:
        secret = new_secret()
        await provision(conn, remote, artifacts, secret)
        pyz = bin_dir(remote) / "monitord.pyz"
        tampered = bytearray(pyz.read_bytes())
        tampered[-1] ^= 0xFF
        pyz.write_bytes(bytes(tampered))
        tampered_hash = sha256(pyz)
        report = await provision(conn, remote, artifacts, secret)
        assert report.artifacts[0].action is ArtifactAction.REPLACED
        assert tampered_hash in report.artifacts[0].detail
        assert sha256(pyz) == artifacts[0].sha256

    async def test_a_push_the_vps_cannot_verify_is_reported_and_never_put_in_place(
        self, tmp_path: Path, remote: RemoteSection, artifacts: list[LocalArtifact],
    ) -> None:
        fake_bin = tmp_path / "corrupting-bin"
        fake_bin.mkdir()
        (fake_bin / "sha256sum").write_text("#!/bin/sh\necho '00000000  -'\n")
        (fake_bin / "sha256sum").chmod(0o755)
        path = f"{fake_bin}:{os.environ['PATH']}"
        async with VpsServer(work_dir=tmp_path / "vps2", env={"PATH": path}) as vps:
            async with vps.connect() as conn:
                with pytest.raises(MonitordError) as failed:
                    await provision(conn, remote, artifacts, new_secret())
        assert failed.value.code is ErrorCode.ARTIFACT_HASH_MISMATCH
        assert not (bin_dir(remote) / "monitord.pyz").exists()
        assert leftovers(remote) == []


class TestAgentSecret:
    """agent.secret is written with mode 0600 and its bytes appear nowhere else."""

    async def test_the_secret_file_has_mode_0600_and_the_exact_bytes(
        self, conn: asyncssh.SSHClientConnection, remote: RemoteSection,
        artifacts: list[LocalArtifact],
    ) -> None:
        secret = new_secret()
        await provision(conn, remote, artifacts, secret)
        path = bin_dir(remote) / "agent.secret"
        assert path.read_bytes() == secret
        assert stat.S_IMODE(path.stat().st_mode) == 0o600

    async def test_a_readable_secret_is_rewritten_with_mode_0600(
        self, conn: asyncssh.SSHClientConnection, remote: RemoteSection,
        artifacts: list[LocalArtifact],
    ) -> None:
        secret = new_secret()
        await provision(conn, remote, artifacts, secret)
        path = bin_dir(remote) / "agent.secret"
        path.chmod(0o644)
        report = await provision(conn, remote, artifacts, secret)
        assert report.secret_written
        assert stat.S_IMODE(path.stat().st_mode) == 0o600

    async def test_a_new_secret_replaces_the_old_one(
        self, conn: asyncssh.SSHClientConnection, remote: RemoteSection,
        artifacts: list[LocalArtifact],
    ) -> None:
        await provision(conn, remote, artifacts, new_secret())
        secret = new_secret()
        report = await provision(conn, remote, artifacts, secret)
        assert report.secret_written
        assert (bin_dir(remote) / "agent.secret").read_bytes() == secret

    async def test_the_secret_never_appears_in_logs_progress_reports_or_command_lines(
        self, vps: VpsServer, conn: asyncssh.SSHClientConnection, remote: RemoteSection,
        artifacts: list[LocalArtifact],
    ) -> None:
        secret = new_secret()
        events: list[ProvisionProgress] = []
        with capture_logs() as logs:
            report = await provision(conn, remote, artifacts, secret, events)
        seen = repr(logs) + repr(events) + repr(report) + "\n".join(vps.command_log)
        assert logs, "provisioning should have logged its steps"
        assert secret.decode() not in seen

    async def test_the_secret_never_appears_in_the_error_when_writing_it_fails(
        self, conn: asyncssh.SSHClientConnection, remote: RemoteSection,
        artifacts: list[LocalArtifact],
    ) -> None:
        secret = new_secret()
        (bin_dir(remote) / "agent.secret").mkdir(parents=True)  # nothing can be renamed over it
        with capture_logs() as logs, pytest.raises(MonitordError) as failed:
            await provision(conn, remote, artifacts, secret)
        assert failed.value.code is ErrorCode.PROVISION_FAILED
        chain = [failed.value, failed.value.__cause__, failed.value.__context__]
        seen = repr(logs) + "".join(f"{e!r} {e}" for e in chain if e is not None)
        assert secret.decode() not in seen
        assert leftovers(remote) == []


class TestPushedArtifactRuns:
    """The pushed monitord.pyz runs on the VPS with the VPS's bare python3 in isolated mode."""

    async def test_the_pushed_pyz_answers_help_and_agent_help_on_the_vps(
        self, conn: asyncssh.SSHClientConnection, remote: RemoteSection,
        artifacts: list[LocalArtifact],
    ) -> None:
        await provision(conn, remote, artifacts, new_secret())
        pyz = f"{remote.remote_bin_dir}/monitord.pyz"
        python = [SYSTEM_PYTHON, "-I"]
        top = await remote_exec.run(conn, [*python, pyz, "--help"], timeout_s=TIMEOUT)
        agent = await remote_exec.run(conn, [*python, pyz, "agent", "--help"], timeout_s=TIMEOUT)
        assert top.raise_for_status(ErrorCode.PROVISION_FAILED).text.startswith("usage: monitord")
        assert "agent-launch" in top.text
        assert agent.raise_for_status(ErrorCode.PROVISION_FAILED).text.startswith(
            "usage: monitord.pyz agent"
        )

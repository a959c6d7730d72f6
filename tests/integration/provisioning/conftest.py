"""Fixtures for provisioning and preflight: a live in-process VPS, a connection to it, the
built agent artifact and a RemoteSection whose remote_bin_dir lives under tmp_path."""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import asyncssh
import pytest

from monitord.base.config import RemoteSection
from monitord.remote import artifact
from monitord.remote.provisioning import LocalArtifact
from monitord.testing.vps_server import VpsServer

SERVICE_BINARY_SIZE = 600 * 1024  # a few SFTP chunks, so an upload can be cut in the middle


@pytest.fixture(scope="session")
def agent_pyz(tmp_path_factory: pytest.TempPathFactory) -> artifact.ArtifactInfo:
    return artifact.build(tmp_path_factory.mktemp("build"))


@pytest.fixture
def service_binary(tmp_path: Path) -> Path:
    path = tmp_path / "local" / "tgd"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(os.urandom(SERVICE_BINARY_SIZE))
    return path


@pytest.fixture
def launcher(tmp_path: Path) -> Path:
    """Stands in for `monitord agent-launch` on the VPS: records each call's argv, one line."""
    path = tmp_path / "local" / "fake-launcher"
    path.parent.mkdir(parents=True, exist_ok=True)
    calls = tmp_path / "launcher-calls"
    path.write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    path.chmod(0o755)
    return path


@pytest.fixture
def remote(tmp_path: Path, launcher: Path, service_binary: Path) -> RemoteSection:
    return RemoteSection(
        host="127.0.0.1",
        user="offload",
        key_file=tmp_path / "unused-key",
        accept_any_host_key=True,
        remote_bin_dir=str(tmp_path / "vps-root" / "opt" / "offload"),
        remote_python=sys.executable,
        remote_monitord=(str(launcher),),
        artifacts=(service_binary,),
    )


@pytest.fixture
def artifacts(
    agent_pyz: artifact.ArtifactInfo, service_binary: Path
) -> list[LocalArtifact]:
    return [LocalArtifact.from_info(agent_pyz), LocalArtifact.from_path(service_binary)]


@pytest.fixture
async def vps(tmp_path: Path) -> AsyncIterator[VpsServer]:
    async with VpsServer(work_dir=tmp_path / "vps") as server:
        yield server


@pytest.fixture
async def conn(vps: VpsServer) -> AsyncIterator[asyncssh.SSHClientConnection]:
    async with vps.connect() as connection:
        yield connection

"""A copy's own dirs (staging, old tree, digest caches) are named where no area id can reach:
areas `A`, `A.staging`, `A.old` and `A.digests` move back and forth, each keeping its data
(real SSH server, real files; the verb's way and the agent's)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from monitord.remote import copy as area_copy
from monitord.testing.vps_server import VpsServer
from tests.integration.migration.test_copy_transfer import _Agent
from tests.support.agent_process import vps_command

AREAS = ("A", "A.staging", "A.old", "A.digests")


def _tree(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _own_data(area: str) -> dict[str, bytes]:
    """What each area holds: its own files, no two areas alike."""
    return {"session.db": f"session of {area}".encode() * 100,
            f"keys/{area}.bin": area.encode() * 7}


def _write(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)


def _expected(area: str) -> dict[str, str]:
    return {rel: hashlib.sha256(data).hexdigest() for rel, data in _own_data(area).items()}


@pytest.fixture
async def vps(tmp_path: Path):  # type: ignore[no-untyped-def]
    async with VpsServer(work_dir=tmp_path / "vps-ssh") as server:
        yield server


class TestAreaIdsWithCopySuffixes:
    """Moving area `A` never touches the data of areas named `A.staging`, `A.old` or
    `A.digests`, on either side, in either direction."""

    @pytest.mark.parametrize("through_agent", [False, True], ids=["verb", "agent"])
    async def test_every_area_keeps_its_own_data_moving_back_and_forth(
        self, vps: VpsServer, tmp_path: Path, through_agent: bool
    ) -> None:
        local_root, remote_root = tmp_path / "pbx" / "tg", tmp_path / "vps" / "data" / "tg"
        for area in AREAS:
            _write(local_root / area, _own_data(area))

        def agent(area: str) -> _Agent | None:
            return _Agent(remote_root / area) if through_agent else None

        def every_area_intact(root: Path) -> None:
            assert {area: _tree(root / area) for area in AREAS} == {
                area: _expected(area) for area in AREAS}

        async with vps.connect() as conn:
            for _round in range(2):
                # to the VPS: `A` last, so its copy meets its suffixed namesakes there
                for area in (*AREAS[1:], AREAS[0]):
                    staged = await area_copy.pre_upload(
                        conn, local_dir=local_root / area, remote_dir=str(remote_root / area),
                        vps_command=vps_command(), agent=agent(area))
                    await area_copy.upload(
                        conn, local_dir=local_root / area, remote_dir=str(remote_root / area),
                        vps_command=vps_command(), staged=staged, agent=agent(area))
                every_area_intact(remote_root)
                every_area_intact(local_root)
                # and home again, `A` first and last
                for area in (*AREAS, AREAS[0]):
                    staged = await area_copy.pre_download(
                        conn, remote_dir=str(remote_root / area), local_dir=local_root / area,
                        vps_command=vps_command(), agent=agent(area))
                    await area_copy.download(
                        conn, remote_dir=str(remote_root / area), local_dir=local_root / area,
                        vps_command=vps_command(), staged=staged, agent=agent(area))
                every_area_intact(local_root)
                every_area_intact(remote_root)
        # nothing but the areas' own dirs and the one reserved copy dir beside them
        assert {p.name for p in remote_root.iterdir()} == {*AREAS, ".monitord-copy"}
        assert {p.name for p in local_root.iterdir()} <= {*AREAS, ".monitord-copy"}

    async def test_a_cut_copy_of_a_is_cleaned_up_without_touching_a_staging(
        self, vps: VpsServer, tmp_path: Path
    ) -> None:
        remote_root = tmp_path / "vps" / "data" / "tg"
        for area in AREAS:
            _write(remote_root / area, _own_data(area))
        async with vps.connect() as conn:
            await area_copy.remove_remote_leftovers(conn, remote_dir=str(remote_root / "A"))
        assert {area: _tree(remote_root / area) for area in AREAS} == {
            area: _expected(area) for area in AREAS}

"""A copy home sends the blocks the PBX's own copy lacks, not the files that changed: after a
pre-copy, a changed store comes back as its changed pages; a pre-copy (or a copy without
one) starts from the area's data dir or archive on the PBX. The block digests only choose
what to fetch: the VPS's SHA-256 listing decides what is promoted, so a wrong basis or a
wrong plan costs bytes, never a wrong file, and a cut delta leaves the PBX's data dir as it
was. Over the in-process SSH VPS, with the agent's copy routes answered in this process."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from monitord.remote import copy as area_copy
from monitord.remote.copy import transfer
from monitord.testing.vps_server import VpsServer
from orchestrator import block_delta
from orchestrator.block_delta import BLOCK_BYTES as PAGE  # an SQLite page
from orchestrator.block_delta import Blocks, ChangedGroups
from orchestrator.errors import ErrorCode, MonitordError
from tests.support.agent_process import vps_command
from tests.support.copy_agent import InProcessAgent


@pytest.fixture
async def vps(tmp_path: Path) -> AsyncIterator[VpsServer]:
    async with VpsServer(work_dir=tmp_path / "vps-ssh") as server:
        yield server


def _tree(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _store(root: Path, *, pages: int = 256) -> None:
    root.mkdir(parents=True)
    (root / "session.db").write_bytes(os.urandom(pages * PAGE))
    (root / "keys").mkdir()
    (root / "keys" / "auth").write_bytes(os.urandom(300))


def _rewrite_pages(path: Path, *indexes: int, append: bytes = b"") -> None:
    """What a live SQLite store does: pages rewritten in place, maybe an append."""
    with path.open("r+b") as f:
        for index in indexes:
            f.seek(index * PAGE)
            f.write(os.urandom(PAGE))
        if append:
            f.seek(0, os.SEEK_END)
            f.write(append)


def _moved_out(tmp_path: Path, name: str) -> tuple[Path, Path, Path]:
    """(archive, the VPS's data dir, the PBX's data dir to come) after a move out: the
    archive and the VPS hold the same store, the PBX's data dir is not there."""
    archive, remote = tmp_path / "archive" / f"{name}-g3", tmp_path / "vps" / "data" / name
    _store(archive)
    shutil.copytree(archive, remote)
    return archive, remote, tmp_path / "back"


async def _home(vps: VpsServer, remote: Path, back: Path, *,
                basis: Path) -> area_copy.CopyReport:
    """A copy home without a pre-copy, from `basis`."""
    async with vps.connect() as conn:
        return await area_copy.download(conn, vps_command=vps_command(),
                                        remote_dir=str(remote), local_dir=back,
                                        agent=InProcessAgent(remote), basis=basis)


def _size(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


class _NoBlocksAgent(InProcessAgent):
    """An agent of a release before the blocks route."""

    async def blocks(self, paths: list[str], known: dict[str, bytes] | None = None,
                     ) -> dict[str, Blocks | ChangedGroups | None]:
        self.calls.append("blocks")
        raise MonitordError(ErrorCode.AGENT_ROUTE_MISSING, "no route /v1/areas/x/copy/blocks")


class TestAfterAPreCopy:
    async def test_a_store_changed_in_a_few_pages_on_the_vps_comes_back_as_those_pages(
        self, vps: VpsServer, tmp_path: Path
    ) -> None:
        remote, back = tmp_path / "vps" / "data" / "h1", tmp_path / "back"
        _store(remote)
        (remote / "cut.db").write_bytes(os.urandom(64 * PAGE))
        agent = InProcessAgent(remote)
        async with vps.connect() as conn:
            staged = await area_copy.pre_download(conn, vps_command=vps_command(),
                                                  remote_dir=str(remote), local_dir=back,
                                                  agent=agent)
            _rewrite_pages(remote / "session.db", 3, 200, 201, append=b"appended")
            os.truncate(remote / "cut.db", 40 * PAGE + 10)
            report = await area_copy.download(conn, vps_command=vps_command(),
                                              remote_dir=str(remote), local_dir=back,
                                              staged=staged, agent=agent)
        assert _tree(back) == _tree(remote)
        assert (report.files, report.reused) == (3, 1)
        # three pages, the append (a block of its own), the cut file's new last block
        assert report.sent_bytes == 3 * PAGE + len(b"appended") + 10
        # the first pass's listing, its second round's look (still), the copy's, the blocks
        assert agent.calls == ["data_listing", "data_listing", "data_listing", "blocks"]

    async def test_a_delta_cut_by_the_link_leaves_the_data_dir_and_a_new_try_completes(
        self, vps: VpsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        remote, back = tmp_path / "vps" / "data" / "h2", tmp_path / "back"
        _store(remote)
        (remote / "other.db").write_bytes(os.urandom(32 * PAGE))
        back.mkdir()
        (back / "previous").write_bytes(b"old")
        agent = InProcessAgent(remote)
        fetch_run = transfer._fetch_run
        runs: list[int] = []

        async def cut_after_the_first_run(*args: Any, **kw: Any) -> int:
            n = await fetch_run(*args, **kw)
            runs.append(n)
            if len(runs) == 1:
                vps.drop_all_sessions()  # mid-delta: the other runs and files are not read
            return n

        monkeypatch.setattr(transfer, "_fetch_run", cut_after_the_first_run)

        async with vps.connect() as conn:
            staged = await area_copy.pre_download(conn, vps_command=vps_command(),
                                                  remote_dir=str(remote), local_dir=back,
                                                  agent=agent)
            _rewrite_pages(remote / "session.db", 7)
            _rewrite_pages(remote / "other.db", 9)
            with pytest.raises(MonitordError):
                await area_copy.download(conn, vps_command=vps_command(),
                                         remote_dir=str(remote), local_dir=back,
                                         staged=staged, agent=agent)
        assert _tree(back) == {"previous": hashlib.sha256(b"old").hexdigest()}
        monkeypatch.setattr(transfer, "_fetch_run", fetch_run)
        async with vps.connect() as conn:  # the engine's next try: a pre-copy again
            staged = await area_copy.pre_download(conn, vps_command=vps_command(),
                                                  remote_dir=str(remote), local_dir=back,
                                                  agent=agent)
            report = await area_copy.download(conn, vps_command=vps_command(),
                                              remote_dir=str(remote), local_dir=back,
                                              staged=staged, agent=agent)
        assert _tree(back) == _tree(remote)
        assert report.sent_bytes == 0

    async def test_an_agent_without_the_blocks_route_fetches_changed_files_whole(
        self, vps: VpsServer, tmp_path: Path
    ) -> None:
        remote, back = tmp_path / "vps" / "data" / "h3", tmp_path / "back"
        _store(remote)
        agent = _NoBlocksAgent(remote)
        async with vps.connect() as conn:
            staged = await area_copy.pre_download(conn, vps_command=vps_command(),
                                                  remote_dir=str(remote), local_dir=back,
                                                  agent=agent)
            _rewrite_pages(remote / "session.db", 5)
            report = await area_copy.download(conn, vps_command=vps_command(),
                                              remote_dir=str(remote), local_dir=back,
                                              staged=staged, agent=agent)
        assert _tree(back) == _tree(remote)
        assert report.sent_bytes == (remote / "session.db").stat().st_size


class TestFromThePbxOwnCopy:
    async def test_a_pre_copy_home_fetches_only_what_the_archive_lacks(
        self, vps: VpsServer, tmp_path: Path
    ) -> None:
        # The move out left the PBX's copy in the archive; on the VPS the account has since
        # changed two pages and written a new file.
        archive, remote, back = _moved_out(tmp_path, "h4")
        _rewrite_pages(remote / "session.db", 10, 90)
        (remote / "keys" / "new").write_bytes(b"a key written on the VPS")
        agent = InProcessAgent(remote)
        async with vps.connect() as conn:
            staged = await area_copy.pre_download(conn, vps_command=vps_command(),
                                                  remote_dir=str(remote), local_dir=back,
                                                  agent=agent, basis=archive)
            report = await area_copy.download(conn, vps_command=vps_command(),
                                              remote_dir=str(remote), local_dir=back,
                                              staged=staged, agent=agent, basis=archive)
        assert _tree(back) == _tree(remote)
        assert staged.sent_bytes == 2 * PAGE + len(b"a key written on the VPS")
        assert (report.reused, report.sent_bytes) == (3, 0)
        assert _tree(archive) != _tree(remote)  # the archive itself is only read

    async def test_a_copy_without_a_pre_copy_starts_from_the_basis_too(
        self, vps: VpsServer, tmp_path: Path
    ) -> None:
        archive, remote, back = _moved_out(tmp_path, "h5")
        _rewrite_pages(remote / "session.db", 0, append=b"tail")
        report = await _home(vps, remote, back, basis=archive)
        assert _tree(back) == _tree(remote)
        assert report.sent_bytes == PAGE + len(b"tail")

    async def test_a_basis_that_is_other_data_costs_bytes_never_a_wrong_file(
        self, vps: VpsServer, tmp_path: Path
    ) -> None:
        archive, remote = tmp_path / "archive" / "h6-g3", tmp_path / "vps" / "data" / "h6"
        back = tmp_path / "back"
        _store(archive)
        _store(remote)  # the same names and sizes, none of the same bytes
        report = await _home(vps, remote, back, basis=archive)
        assert _tree(back) == _tree(remote)
        assert report.sent_bytes == _size(remote)

    async def test_a_wrong_plan_is_caught_by_the_listing_and_copied_over_whole(
        self, vps: VpsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        archive, remote, back = _moved_out(tmp_path, "h7")
        _rewrite_pages(remote / "session.db", 4)

        def blind(have: Blocks, now: Blocks) -> block_delta.Delta:
            return block_delta.Delta(runs=(), size=now.size, resize=True)  # sees no change

        monkeypatch.setattr(transfer.block_delta, "plan", blind)
        report = await _home(vps, remote, back, basis=archive)
        assert _tree(back) == _tree(remote)
        assert report.sent_bytes == _size(remote)

    async def test_a_symlink_in_the_basis_is_not_followed(
        self, vps: VpsServer, tmp_path: Path
    ) -> None:
        archive, remote = tmp_path / "archive" / "h8-g3", tmp_path / "vps" / "data" / "h8"
        back, secret = tmp_path / "back", tmp_path / "secret"
        _store(remote)
        archive.mkdir(parents=True)
        secret.write_bytes((remote / "session.db").read_bytes())  # what the VPS would reuse
        (archive / "session.db").symlink_to(secret)
        report = await _home(vps, remote, back, basis=archive)
        assert _tree(back) == _tree(remote)
        assert report.sent_bytes == _size(remote)

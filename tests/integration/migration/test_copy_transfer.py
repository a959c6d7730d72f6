"""COPY moves an area's data dir whole and verified, or not at all (real SSH server, real files)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import stat
import subprocess
from collections.abc import Awaitable, Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

from monitord.base import round_trips, tree_digest
from monitord.base.round_trips import RoundTrips
from monitord.remote import copy as area_copy
from monitord.remote import remote_exec
from monitord.remote.copy import sftp_session, transfer
from monitord.testing.vps_server import VpsServer
from orchestrator.block_delta import BLOCK_BYTES as PAGE  # an SQLite page
from orchestrator.block_delta import DIGEST_BYTES, Blocks, ChangedGroups
from orchestrator.errors import ErrorCode, MonitordError
from tests.support.agent_process import vps_command, wait_until
from tests.support.copy_agent import InProcessAgent as _Agent
from tests.support.stat_tricks import aged, stealthy_rewrite


def _tree(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _tear_when_sent(remote: Path) -> Callable[[int, int], None]:
    """A progress callback that, once everything is sent and before the VPS has verified,
    appends to session.db in the VPS staging dir."""
    staging = tree_digest.staging_dir(remote)

    def tear(done: int, total: int) -> None:
        if done == total:
            with (staging / "session.db").open("ab") as f:
                f.write(b"torn")

    return tear


class _OlderAgent(_Agent):
    """An agent without the listing, staging and promote routes: it says so when asked, and
    answers each route AGENT_ROUTE_MISSING (`calls` records any such attempt)."""

    async def serves_copies(self) -> bool:
        self.asked += 1
        return False

    async def data_listing(self) -> bytes:
        self.calls.append("data_listing")
        raise MonitordError(ErrorCode.AGENT_ROUTE_MISSING, "no route /v1/areas/x/listing")

    async def reset(self) -> None:
        self.calls.append("reset")
        raise MonitordError(ErrorCode.AGENT_ROUTE_MISSING, "no route /v1/areas/x/staging")

    async def listing(self) -> bytes:
        self.calls.append("listing")
        raise MonitordError(ErrorCode.AGENT_ROUTE_MISSING, "no route /v1/areas/x/staging")

    async def promote(self, expect: str) -> bool:
        self.calls.append("promote")
        raise MonitordError(ErrorCode.AGENT_ROUTE_MISSING, "no route /v1/areas/x/promote")


def _counting_execs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every script run on the VPS from now on."""
    execs: list[str] = []
    original = remote_exec.run_script

    async def counting(conn: Any, script: str, **kwargs: Any) -> Any:
        execs.append(script)
        return await original(conn, script, **kwargs)

    monkeypatch.setattr(remote_exec, "run_script", counting)
    return execs


def _make_area(root: Path) -> None:
    (root / "db").mkdir(parents=True)
    (root / "session.db").write_bytes(b"s" * 70_000)
    (root / "db" / "keys.bin").write_bytes(bytes(range(256)) * 40)
    (root / "empty").write_bytes(b"")


@pytest.fixture
async def vps(tmp_path: Path):  # type: ignore[no-untyped-def]
    async with VpsServer(work_dir=tmp_path / "vps-ssh") as server:
        yield server


class TestRoundTrip:
    """Data uploaded and downloaded back is byte-identical, and the old dir is replaced."""

    async def test_upload_then_download_is_identical(self, vps: VpsServer, tmp_path: Path) -> None:
        src, remote, back = tmp_path / "src", tmp_path / "vps" / "data" / "a1", tmp_path / "back"
        _make_area(src)
        (back / "stale").mkdir(parents=True)
        seen: list[tuple[int, int]] = []
        async with vps.connect() as conn:
            up = await area_copy.upload(
                conn, vps_command=vps_command(),
                local_dir=src,
                remote_dir=str(remote),
                progress=lambda d, t: seen.append((d, t)),
            )
            down = await area_copy.download(
                conn, vps_command=vps_command(), remote_dir=str(remote), local_dir=back
            )
        assert _tree(remote) == _tree(src) == _tree(back)
        assert up.files == down.files == 3 and up.bytes == down.bytes
        assert seen[-1] == (up.bytes, up.bytes)
        assert not tree_digest.staging_dir(remote).exists()

    async def test_missing_source_dir_copies_an_empty_area(
        self, vps: VpsServer, tmp_path: Path
    ) -> None:
        remote = tmp_path / "vps" / "a2"
        async with vps.connect() as conn:
            report = await area_copy.upload(
                conn, vps_command=vps_command(),
                local_dir=tmp_path / "nothing", remote_dir=str(remote)
            )
        assert report.files == 0 and remote.is_dir() and not any(remote.iterdir())


class TestOneSftpSession:
    """The copies over a connection share its one SFTP session (three round trips to start,
    never paid while an area is down once it is open); a copy that fails in it leaves it to
    nobody: the next copy starts its own."""

    async def test_copies_over_one_connection_start_one_session(
        self, vps: VpsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        src = tmp_path / "src"
        _make_area(src)
        async with vps.connect() as conn:
            started = _count_sessions(conn, monkeypatch)
            await asyncio.gather(*(
                area_copy.upload(conn, vps_command=vps_command(), local_dir=src,
                                 remote_dir=str(tmp_path / "vps" / "data" / f"s{i}"))
                for i in range(3)))
            await area_copy.download(conn, vps_command=vps_command(), local_dir=tmp_path / "b",
                                     remote_dir=str(tmp_path / "vps" / "data" / "s0"))
        assert len(started) == 1
        assert _tree(tmp_path / "b") == _tree(src)

    async def test_a_copy_that_failed_in_the_session_leaves_the_next_a_new_one(
        self, vps: VpsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        src, remote = tmp_path / "src", tmp_path / "vps" / "data" / "s9"
        _make_area(src)
        async with vps.connect() as conn:
            started = _count_sessions(conn, monkeypatch)

            def fail(done: int, total: int) -> None:
                raise OSError("the PBX's disk went away")

            with pytest.raises(MonitordError):  # (named as a lost link: it is an OSError)
                await area_copy.upload(conn, vps_command=vps_command(), local_dir=src,
                                       remote_dir=str(remote), progress=fail)
            await area_copy.upload(conn, vps_command=vps_command(), local_dir=src,
                                   remote_dir=str(remote))
        assert len(started) == 2
        assert _tree(remote) == _tree(src)


    async def test_its_requests_count_as_round_trips_of_the_copy(
        self, vps: VpsServer, tmp_path: Path
    ) -> None:
        src, remote = tmp_path / "src", tmp_path / "vps" / "data" / "s7"
        _make_area(src)
        async with vps.connect() as conn:
            started, copied = RoundTrips(), RoundTrips()
            with round_trips.counted_by(started):
                await sftp_session.warm(conn)
            with round_trips.counted_by(copied):
                await area_copy.upload(conn, vps_command=vps_command(), local_dir=src,
                                       remote_dir=str(remote))
        assert started.count == sftp_session.START_TRIPS
        # the files side by side: each one's open, writes and close in the same three waves
        assert copied.count >= 3


class _CountedAgent(_Agent):
    """The in-process agent, each of a download's questions one exchange with the VPS (as
    the agent client marks its requests); `digest_bytes`: the block digests it answered."""

    digest_bytes = 0

    async def data_listing(self) -> bytes:
        with round_trips.exchange():
            return await super().data_listing()

    async def blocks(self, paths: list[str], known: dict[str, bytes] | None = None,
                     ) -> dict[str, Blocks | ChangedGroups | None]:
        with round_trips.exchange():
            answered = await super().blocks(paths, known)
        self.digest_bytes += sum(len(a.digests) for a in answered.values() if a is not None)
        return answered


def _count_sessions(conn: Any, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    started: list[int] = []
    start = conn.start_sftp_client

    def counted() -> Any:
        started.append(1)
        return start()

    monkeypatch.setattr(conn, "start_sftp_client", counted)
    return started


class TestProgress:
    """Every copy tells its bytes done of its total as they cross, chunk by chunk within a
    file, up to the total: what the status shows of a copy in flight."""

    @staticmethod
    def _assert_counts_up(seen: list[tuple[int, int]], total: int, *, within: int) -> None:
        assert seen, "no progress was told"
        assert {t for _, t in seen} == {total}
        done = [d for d, _ in seen]
        assert done == sorted(done) and done[-1] == total
        assert len([d for d in done if 0 < d < total]) >= within, done

    async def test_each_direction_tells_its_bytes_as_they_cross(
        self, vps: VpsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(transfer, "_CHUNK", 4096)
        src, remote = tmp_path / "src", tmp_path / "vps" / "data" / "p1"
        src.mkdir()
        (src / "big.db").write_bytes(os.urandom(40 * 4096))
        (src / "small").write_bytes(b"x" * 100)
        total = 40 * 4096 + 100
        told: dict[str, list[tuple[int, int]]] = {k: [] for k in ("pre", "up", "pre_down",
                                                                   "down")}

        def to(key: str) -> Callable[[int, int], None]:
            return lambda done, of: told[key].append((done, of))

        async with vps.connect() as conn:
            await area_copy.pre_upload(conn, vps_command=vps_command(), local_dir=src,
                                       remote_dir=str(remote), progress=to("pre"))
            await area_copy.upload(conn, vps_command=vps_command(), local_dir=src,
                                   remote_dir=str(remote), progress=to("up"))
            staged = await area_copy.pre_download(
                conn, vps_command=vps_command(), remote_dir=str(remote),
                local_dir=tmp_path / "back", progress=to("pre_down"))
            await area_copy.download(conn, vps_command=vps_command(), remote_dir=str(remote),
                                     local_dir=tmp_path / "cold", progress=to("down"))
        assert staged.files
        for key in ("pre", "up", "pre_down", "down"):
            self._assert_counts_up(told[key], total, within=30)  # (one file's 40 chunks)

    async def test_after_a_pre_copy_what_it_staged_counts_as_done(
        self, vps: VpsServer, tmp_path: Path
    ) -> None:
        src, remote = tmp_path / "src", tmp_path / "vps" / "data" / "p2"
        _make_area(src)
        seen: list[tuple[int, int]] = []
        async with vps.connect() as conn:
            staged = await area_copy.pre_upload(conn, vps_command=vps_command(),
                                                local_dir=src, remote_dir=str(remote))
            (src / "db" / "new.log").write_bytes(b"n" * 5000)
            report = await area_copy.upload(conn, vps_command=vps_command(), local_dir=src,
                                            remote_dir=str(remote), staged=staged,
                                            progress=lambda d, t: seen.append((d, t)))
        assert seen[0] == (report.bytes - 5000, report.bytes)
        assert seen[-1] == (report.bytes, report.bytes)


def _slow_sftp_writes(monkeypatch: pytest.MonkeyPatch, delay_s: float) -> None:
    """Every SFTP write waits `delay_s` first: a slow line that keeps moving."""
    import asyncssh

    write = asyncssh.SFTPClientFile.write

    async def slow(self: Any, data: Any, offset: Any = None) -> Any:
        await asyncio.sleep(delay_s)
        return await write(self, data, offset)

    monkeypatch.setattr(asyncssh.SFTPClientFile, "write", slow)


class TestStallDeadline:
    """A copy's `timeout_s` is how long it may go without a chunk crossing: a large area on
    a slow line is never cut for its length, a stalled copy still ends with COPY_INCOMPLETE."""

    async def test_a_copy_longer_than_its_timeout_that_keeps_moving_completes(
        self, vps: VpsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(transfer, "_CHUNK", 4096)
        monkeypatch.setattr(transfer, "_WRITES_IN_FLIGHT", 1)
        monkeypatch.setattr(transfer, "_BYTES_IN_FLIGHT", 4096)  # one chunk on the wire
        src, remote = tmp_path / "src", tmp_path / "vps" / "data" / "d1"
        src.mkdir()
        (src / "big.db").write_bytes(os.urandom(24 * 4096))
        _slow_sftp_writes(monkeypatch, 0.1)  # 24 chunks: some 2.4 s against a 1 s timeout
        async with vps.connect() as conn:
            started = asyncio.get_running_loop().time()
            staged = await area_copy.pre_upload(conn, vps_command=vps_command(), local_dir=src,
                                                remote_dir=str(remote), timeout_s=1.0)
            report = await area_copy.upload(conn, vps_command=vps_command(), local_dir=src,
                                            remote_dir=str(remote), timeout_s=1.0)
            took = asyncio.get_running_loop().time() - started
        assert took > 2 * 1.0  # (the copies did outlast their timeout)
        assert set(staged.files) == {"big.db"}
        assert report.files == 1 and _tree(remote) == _tree(src)

    async def test_a_stalled_copy_ends_once_nothing_crossed_for_its_timeout(
        self, vps: VpsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        import asyncssh

        monkeypatch.setattr(transfer, "_CHUNK", 4096)
        src, remote = tmp_path / "src", tmp_path / "vps" / "data" / "d2"
        src.mkdir()
        (src / "big.db").write_bytes(os.urandom(64 * 4096))
        write = asyncssh.SFTPClientFile.write
        writes = 0

        async def stalls_after_a_few(self: Any, data: Any, offset: Any = None) -> Any:
            nonlocal writes
            writes += 1
            if writes > 8:  # the line goes silent mid-file (the server itself still answers)
                await asyncio.sleep(3600)
            return await write(self, data, offset)

        monkeypatch.setattr(asyncssh.SFTPClientFile, "write", stalls_after_a_few)
        async with vps.connect() as conn:
            with pytest.raises(MonitordError) as failed:
                async with asyncio.timeout(20):
                    await area_copy.pre_upload(conn, vps_command=vps_command(), local_dir=src,
                                               remote_dir=str(remote), timeout_s=1.0)
        assert failed.value.code == ErrorCode.COPY_INCOMPLETE, failed.value
        assert "nothing crossed the link for 1 s" in failed.value.detail


class _LyingAgent(_Agent):
    """Says the staging dir holds every block of `claimed` (it holds nothing of them)."""

    def __init__(self, remote: Path, claimed: dict[str, Path]) -> None:
        super().__init__(remote)
        self.claimed = claimed

    async def staged_blocks(self) -> dict[str, Any] | None:
        self.calls.append("staged_blocks")
        return {rel: tree_digest.file_blocks(path.parent, path.name)
                for rel, path in self.claimed.items()}


class TestResume:
    """A copy cut by the link resumes from what the VPS holds of it — each file's block
    digests as the VPS reads them in the staging dir, nothing remembered on the PBX (so the
    same after a restart of monitord) — and what it resumed from is verified whole before the
    promote."""

    @staticmethod
    async def _cut_once_staged(vps: VpsServer, staged_file: Path,
                               copy: Callable[[Any], Awaitable[object]]) -> int:
        """`copy(conn)` cut by the link (the writes on the wire stall, then the connection
        goes) once `staged_file` holds 4 MiB; it fails. What that file holds then."""
        async def drop_mid_file() -> None:
            await wait_until(lambda: staged_file.exists() and staged_file.stat().st_size
                             >= 4 << 20, timeout_s=10, what="4 MiB staged", interval_s=0.001)
            vps.stall()
            vps.drop_all_sessions()

        async with vps.connect() as conn:
            dropper = asyncio.create_task(drop_mid_file())
            with pytest.raises(MonitordError):
                await copy(conn)
            await dropper
        vps.resume()
        return staged_file.stat().st_size

    async def _cut_mid_file(self, vps: VpsServer, src: Path, remote: Path) -> int:
        """A pre-copy of src cut by the link after a few MiB of its one big file; what of
        it the staging dir holds then."""
        return await self._cut_once_staged(
            vps, tree_digest.staging_dir(remote) / "big.db",
            lambda conn: area_copy.pre_upload(conn, vps_command=vps_command(), local_dir=src,
                                              remote_dir=str(remote), agent=_Agent(remote)))

    async def test_a_pre_copy_cut_mid_file_resumes_from_what_arrived(
        self, vps: VpsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(transfer, "_CHUNK", 256 * 1024)
        src, remote = tmp_path / "src", tmp_path / "vps" / "data" / "r1"
        src.mkdir()
        (src / "big.db").write_bytes(os.urandom(16 << 20))
        (src / "small").write_bytes(b"s" * 1000)
        arrived = await self._cut_mid_file(vps, src, remote)
        assert 4 << 20 <= arrived < 16 << 20
        async with vps.connect() as conn:  # a new connection: nothing of the first kept
            staged = await area_copy.pre_upload(conn, vps_command=vps_command(), local_dir=src,
                                                remote_dir=str(remote), agent=_Agent(remote))
            report = await area_copy.upload(conn, vps_command=vps_command(), local_dir=src,
                                            remote_dir=str(remote), staged=staged,
                                            agent=_Agent(remote))
        # what arrived before the cut (less the chunks on the wire then) is not sent again
        assert staged.resumed_bytes >= arrived - 4 * 256 * 1024, (staged, arrived)
        assert staged.sent_bytes <= (16 << 20) + 1000 - staged.resumed_bytes + 4096
        assert set(staged.files) == {"big.db", "small"}
        assert report.reused == 2 and _tree(remote) == _tree(src)

    async def test_a_copy_after_the_stop_resumes_what_a_cut_pre_copy_left(
        self, vps: VpsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(transfer, "_CHUNK", 256 * 1024)
        src, remote = tmp_path / "src", tmp_path / "vps" / "data" / "r2"
        src.mkdir()
        (src / "big.db").write_bytes(os.urandom(16 << 20))
        staging = tree_digest.staging_dir(remote)
        arrived = await self._cut_mid_file(vps, src, remote)
        (staging / "gone.log").write_bytes(b"a file the source no longer has")
        (staging / "old").mkdir()
        (staging / "old" / "x").write_bytes(b"x")
        async with vps.connect() as conn:
            report = await area_copy.upload(conn, vps_command=vps_command(), local_dir=src,
                                            remote_dir=str(remote), agent=_Agent(remote))
        assert report.sent_bytes <= (16 << 20) - arrived + 4 * 256 * 1024 + 4096, report
        assert _tree(remote) == _tree(src)  # the stale files and their dir are gone
        assert not (remote / "old").exists()

    async def test_a_pre_copy_home_cut_mid_file_resumes_from_what_arrived(
        self, vps: VpsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        from monitord.remote.copy import local_tree

        monkeypatch.setattr(transfer, "_CHUNK", 256 * 1024)
        remote, back = tmp_path / "vps" / "data" / "r4", tmp_path / "back"
        remote.mkdir(parents=True)
        (remote / "big.db").write_bytes(os.urandom(16 << 20))
        arrived = await self._cut_once_staged(  # kept: the link failed, not the PBX
            vps, local_tree.staging_of(back) / "big.db",
            lambda conn: area_copy.pre_download(conn, vps_command=vps_command(),
                                                local_dir=back, remote_dir=str(remote),
                                                agent=_Agent(remote)))
        assert 4 << 20 <= arrived < 16 << 20
        async with vps.connect() as conn:
            staged = await area_copy.pre_download(
                conn, vps_command=vps_command(), local_dir=back, remote_dir=str(remote),
                agent=_Agent(remote))
            await area_copy.download(conn, vps_command=vps_command(), local_dir=back,
                                     remote_dir=str(remote), staged=staged,
                                     agent=_Agent(remote))
        assert staged.resumed_bytes >= arrived - 4 * 256 * 1024, (staged, arrived)
        assert staged.sent_bytes <= (16 << 20) - staged.resumed_bytes + 4096
        assert _tree(back) == _tree(remote)

    async def test_a_staged_file_that_holds_less_than_the_pbxs_own_copy_is_not_the_start(
        self, vps: VpsServer, tmp_path: Path
    ) -> None:
        """A cut during the copy-in of the PBX's own copy (or of a file fetched whole) leaves
        the staged file holding less than that copy: the fetch starts from whichever of the
        two needs fewer blocks from the VPS."""
        from monitord.remote.copy import local_tree

        remote, back, archive = (tmp_path / "vps" / "data" / "r5", tmp_path / "back",
                                 tmp_path / "archive")
        remote.mkdir(parents=True)
        archive.mkdir()
        store = os.urandom(1024 * PAGE)
        (archive / "big.db").write_bytes(store)
        (remote / "big.db").write_bytes(store)
        _rewrite_pages(remote / "big.db", [700])  # what the VPS changed since
        staging = local_tree.staging_of(back)
        staging.mkdir(parents=True)
        (staging / "big.db").write_bytes(store[:256 * PAGE])  # a quarter copied in, then cut
        async with vps.connect() as conn:
            staged = await area_copy.pre_download(
                conn, vps_command=vps_command(), local_dir=back, remote_dir=str(remote),
                agent=_Agent(remote), basis=archive)
            await area_copy.download(conn, vps_command=vps_command(), local_dir=back,
                                     remote_dir=str(remote), staged=staged,
                                     agent=_Agent(remote), basis=archive)
        assert staged.sent_bytes == PAGE, staged
        assert _tree(back) == _tree(remote)

    async def test_a_staging_dir_the_vps_misreports_is_verified_whole_and_sent_again(
        self, vps: VpsServer, tmp_path: Path
    ) -> None:
        src, remote = tmp_path / "src", tmp_path / "vps" / "data" / "r3"
        _make_area(src)
        liar = _LyingAgent(remote, {"session.db": src / "session.db",
                                    "db/keys.bin": src / "db" / "keys.bin"})
        async with vps.connect() as conn:
            staged = await area_copy.pre_upload(conn, vps_command=vps_command(), local_dir=src,
                                                remote_dir=str(remote), agent=liar)
            assert "session.db" not in staged.files  # not as claimed: the listing says so
            report = await area_copy.upload(conn, vps_command=vps_command(), local_dir=src,
                                            remote_dir=str(remote), staged=staged, agent=liar)
            assert _tree(remote) == _tree(src), report
            # and without a pre-copy: the promote refuses, the copy is redone whole
            (src / "session.db").write_bytes(b"t" * 70_000)
            liar.claimed = {"session.db": src / "session.db"}
            report = await area_copy.upload(conn, vps_command=vps_command(), local_dir=src,
                                            remote_dir=str(remote), agent=liar)
        assert _tree(remote) == _tree(src), report
        assert liar.calls.count("reset") >= 1  # the whole redo started the staging dir over


class TestVerification:
    """A copy that does not match its manifest never replaces the destination dir."""

    async def test_a_corrupted_download_never_replaces_the_local_dir(
        self, vps: VpsServer, tmp_path: Path
    ) -> None:
        src, remote, back = tmp_path / "src", tmp_path / "vps" / "a3", tmp_path / "back"
        _make_area(src)
        back.mkdir()
        (back / "keep").write_bytes(b"old")
        staging = tree_digest.staging_dir(back)

        corrupted: list[Path] = []

        def corrupt_first_arrival(done: int, total: int) -> None:
            # (files arrive several at once: the first with bytes in it, once)
            arrived = next((p for p in staging.rglob("*") if p.is_file() and p.stat().st_size),
                           None)
            if arrived is not None and not corrupted:
                arrived.write_bytes(arrived.read_bytes()[:-1] + b"X")
                corrupted.append(arrived)

        async with vps.connect() as conn:
            await area_copy.upload(
                conn, vps_command=vps_command(), local_dir=src, remote_dir=str(remote)
            )
            with pytest.raises(MonitordError) as err:
                await area_copy.download(
                    conn, vps_command=vps_command(),
                    remote_dir=str(remote), local_dir=back, progress=corrupt_first_arrival
                )
        assert err.value.code == ErrorCode.COPY_INCOMPLETE
        assert _tree(back) == {"keep": hashlib.sha256(b"old").hexdigest()}

    @pytest.mark.parametrize("agent", [False, True], ids=["verb", "agent"])
    async def test_a_corrupted_upload_never_replaces_the_remote_dir(
        self, vps: VpsServer, tmp_path: Path, agent: bool
    ) -> None:
        """Whether the verb or the agent checks the staging dir: refused, differences named."""
        src, remote = tmp_path / "src", tmp_path / "vps" / "a4"
        _make_area(src)
        remote.mkdir(parents=True)
        (remote / "previous").write_bytes(b"generation 3")
        helper = _Agent(remote)
        async with vps.connect() as conn:
            with pytest.raises(MonitordError) as err:
                await area_copy.upload(
                    conn, vps_command=vps_command(), local_dir=src, remote_dir=str(remote),
                    progress=_tear_when_sent(remote), agent=helper if agent else None,
                )
        assert err.value.code == ErrorCode.COPY_INCOMPLETE
        assert "session.db" in err.value.detail
        assert helper.promotes() == int(agent)
        assert _tree(remote) == {"previous": hashlib.sha256(b"generation 3").hexdigest()}

    async def test_a_cut_upload_leaves_the_destination_as_it_was_and_a_retry_completes(
        self, vps: VpsServer, tmp_path: Path
    ) -> None:
        src, remote = tmp_path / "src", tmp_path / "vps" / "a5"
        _make_area(src)
        remote.mkdir(parents=True)
        (remote / "previous").write_bytes(b"old")

        def cut(done: int, total: int) -> None:
            vps.drop_all_sessions()

        async with vps.connect() as conn:
            with pytest.raises(MonitordError):
                await area_copy.upload(
                    conn, vps_command=vps_command(),
                    local_dir=src, remote_dir=str(remote), progress=cut
                )
        assert (remote / "previous").read_bytes() == b"old"
        async with vps.connect() as conn:
            await area_copy.upload(
                conn, vps_command=vps_command(), local_dir=src, remote_dir=str(remote)
            )
        assert _tree(remote) == _tree(src)


class TestAwkwardNames:
    """Names sha256sum writes in its escaped form (a backslash, a newline) survive both ways;
    a name no listing can carry unambiguously (a carriage return) is refused, not mangled."""

    async def test_backslash_and_newline_names_round_trip(
        self, vps: VpsServer, tmp_path: Path
    ) -> None:
        src, remote, back = tmp_path / "src", tmp_path / "vps" / "a6", tmp_path / "back"
        _make_area(src)
        (src / "back\\slash").write_bytes(b"one")
        (src / "db" / "new\nline").write_bytes(b"two")
        (src / "both\\n\nx").write_bytes(b"three")
        async with vps.connect() as conn:
            up = await area_copy.upload(
                conn, vps_command=vps_command(), local_dir=src, remote_dir=str(remote)
            )
            down = await area_copy.download(
                conn, vps_command=vps_command(), remote_dir=str(remote), local_dir=back
            )
        assert _tree(remote) == _tree(src) == _tree(back)
        assert up.files == down.files == 6

    async def test_a_carriage_return_in_a_name_is_refused_on_upload(
        self, vps: VpsServer, tmp_path: Path
    ) -> None:
        src, remote = tmp_path / "src", tmp_path / "vps" / "a7"
        _make_area(src)
        (src / "bad\r").write_bytes(b"x")
        remote.mkdir(parents=True)
        (remote / "previous").write_bytes(b"old")
        async with vps.connect() as conn:
            with pytest.raises(MonitordError) as err:
                await area_copy.upload(
                    conn, vps_command=vps_command(), local_dir=src, remote_dir=str(remote)
                )
        assert err.value.code == ErrorCode.COPY_INCOMPLETE
        assert "carriage return" in err.value.detail
        assert _tree(remote) == {"previous": hashlib.sha256(b"old").hexdigest()}
        assert not tree_digest.staging_dir(remote).exists()

    async def test_a_missing_remote_dir_downloads_an_empty_area(
        self, vps: VpsServer, tmp_path: Path
    ) -> None:
        back = tmp_path / "back"
        async with vps.connect() as conn:
            report = await area_copy.download(
                conn, vps_command=vps_command(),
                remote_dir=str(tmp_path / "vps" / "never"), local_dir=back
            )
        assert report.files == 0 and back.is_dir() and not any(back.iterdir())


def _change_area(root: Path) -> None:
    """What a running daemon does between the pre-copy and its stop."""
    (root / "session.db").write_bytes(b"S" * 70_001)  # rewritten
    (root / "db" / "new.log").write_bytes(b"appended later")  # created
    (root / "empty").unlink()  # deleted


async def _pre_copy_then_upload(
    vps: VpsServer, src: Path, remote: Path, *,
    meddle: Callable[[Path], None] = lambda _staging: None,
    agent: area_copy.CopyAgent | None = None,
) -> area_copy.CopyReport:
    """Pre-copy src to remote, let `meddle` (given the VPS staging dir) change something,
    then copy after the stop; both copies with `agent`."""
    async with vps.connect() as conn:
        staged = await area_copy.pre_upload(
            conn, vps_command=vps_command(), local_dir=src, remote_dir=str(remote),
            agent=agent,
        )
        meddle(tree_digest.staging_dir(remote))
        return await area_copy.upload(
            conn, vps_command=vps_command(), local_dir=src, remote_dir=str(remote),
            staged=staged, agent=agent,
        )


class TestPreCopy:
    """A pre-copy while the source runs stages its files; the copy after the stop sends
    only what changed, removes what is gone and still promotes only a verified whole."""

    async def test_a_file_of_many_chunks_arrives_whole_and_hashed_in_order(
        self, vps: VpsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(transfer, "_CHUNK", 4096)  # 64 chunks, several on the wire
        src, remote = tmp_path / "src", tmp_path / "vps" / "data" / "c1"
        src.mkdir()
        data = os.urandom(64 * 4096 - 100)
        (src / "big.db").write_bytes(data)
        async with vps.connect() as conn:
            staged = await area_copy.pre_upload(conn, vps_command=vps_command(),
                                                local_dir=src, remote_dir=str(remote))
        staging = tree_digest.staging_dir(remote)
        assert (staging / "big.db").read_bytes() == data
        assert staged.files == {"big.db": hashlib.sha256(data).hexdigest()}

    async def test_a_connection_lost_mid_file_fails_the_pre_copy_and_leaves_no_task(
        self, vps: VpsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(transfer, "_CHUNK", 64 * 1024)
        src, remote = tmp_path / "src", tmp_path / "vps" / "data" / "c2"
        src.mkdir()
        (src / "big.db").write_bytes(os.urandom(32 << 20))
        staged_file = tree_digest.staging_dir(remote) / "big.db"

        async def drop_mid_file() -> None:
            await wait_until(lambda: staged_file.exists() and staged_file.stat().st_size
                             >= 1 << 20, timeout_s=10, what="a MiB staged", interval_s=0.001)
            vps.stall()  # the writes on the wire now wait...
            vps.drop_all_sessions()  # ...and the connection goes with them

        tasks_before = asyncio.all_tasks()
        async with vps.connect() as conn:
            dropper = asyncio.create_task(drop_mid_file())
            with pytest.raises(MonitordError):
                async with asyncio.timeout(20):
                    await area_copy.pre_upload(conn, vps_command=vps_command(),
                                               local_dir=src, remote_dir=str(remote))
            await dropper
        vps.resume()
        assert staged_file.stat().st_size < 32 << 20  # it was cut mid-file
        assert asyncio.all_tasks() - tasks_before == set(), "a write outlived the copy"
        assert not remote.exists()

    async def test_upload_after_a_pre_copy_sends_only_what_changed(
        self, vps: VpsServer, tmp_path: Path
    ) -> None:
        src, remote = tmp_path / "src", tmp_path / "vps" / "data" / "a1"
        _make_area(src)
        async with vps.connect() as conn:
            staged = await area_copy.pre_upload(
                conn, vps_command=vps_command(), local_dir=src, remote_dir=str(remote)
            )
            assert not remote.exists()  # staged, never promoted: nothing can start on it
            assert set(staged.files) == {"session.db", "db/keys.bin", "empty"}
            _change_area(src)
            report = await area_copy.upload(
                conn, vps_command=vps_command(),
                local_dir=src, remote_dir=str(remote), staged=staged
            )
        assert _tree(remote) == _tree(src)
        assert (report.files, report.reused) == (3, 1)  # only db/keys.bin was unchanged
        assert not tree_digest.staging_dir(remote).exists()

    async def test_a_store_changed_in_a_few_pages_sends_those_pages_only(
        self, vps: VpsServer, tmp_path: Path
    ) -> None:
        # What a live SQLite store does between the pre-copy and the stop: a few pages
        # rewritten, the file grown by an append; another store cut shorter.
        src, remote = tmp_path / "src", tmp_path / "vps" / "data" / "d1"
        src.mkdir()
        store, shrunk = src / "session.db", src / "cut.db"
        store.write_bytes(os.urandom(512 * PAGE))
        shrunk.write_bytes(os.urandom(64 * PAGE))
        async with vps.connect() as conn:
            staged = await area_copy.pre_upload(
                conn, vps_command=vps_command(), local_dir=src, remote_dir=str(remote))
            with store.open("r+b") as f:
                for index in (3, 200, 201):
                    f.seek(index * PAGE)
                    f.write(os.urandom(PAGE))
                f.seek(0, os.SEEK_END)
                f.write(b"appended")
            os.truncate(shrunk, 40 * PAGE + 10)
            report = await area_copy.upload(
                conn, vps_command=vps_command(), local_dir=src, remote_dir=str(remote),
                staged=staged)
        assert _tree(remote) == _tree(src)
        assert (report.files, report.reused) == (2, 0)
        # three pages, the append (a block of its own), the shrunk file's new last block
        assert report.sent_bytes == 3 * PAGE + len(b"appended") + 10

    async def test_a_delta_cut_by_the_link_leaves_the_destination_and_a_new_try_completes(
        self, vps: VpsServer, tmp_path: Path
    ) -> None:
        src, remote = tmp_path / "src", tmp_path / "vps" / "data" / "d4"
        src.mkdir()
        remote.mkdir(parents=True)
        (remote / "previous").write_bytes(b"old")
        for name in ("a.db", "b.db"):
            (src / name).write_bytes(os.urandom(32 * PAGE))

        def cut(done: int, total: int) -> None:
            vps.drop_all_sessions()  # after the first file's delta, before the second's

        async with vps.connect() as conn:
            staged = await area_copy.pre_upload(
                conn, vps_command=vps_command(), local_dir=src, remote_dir=str(remote))
            for name in ("a.db", "b.db"):
                with (src / name).open("r+b") as f:
                    f.seek(5 * PAGE)
                    f.write(os.urandom(PAGE))
            with pytest.raises(MonitordError):
                await area_copy.upload(
                    conn, vps_command=vps_command(), local_dir=src, remote_dir=str(remote),
                    staged=staged, progress=cut)
        assert _tree(remote) == {"previous": hashlib.sha256(b"old").hexdigest()}
        async with vps.connect() as conn:  # the engine's next try: a pre-copy again
            staged = await area_copy.pre_upload(
                conn, vps_command=vps_command(), local_dir=src, remote_dir=str(remote))
            report = await area_copy.upload(
                conn, vps_command=vps_command(), local_dir=src, remote_dir=str(remote),
                staged=staged)
        assert _tree(remote) == _tree(src)
        assert report.reused == 2

    async def test_scattered_pages_after_the_stop_take_the_waves_of_one(
        self, vps: VpsServer, tmp_path: Path
    ) -> None:
        """The changed pages of a store go on the wire together, not a few at a time: 20
        pages apart from each other take no more round trips than one page."""
        waves: dict[int, int] = {}
        async with vps.connect() as conn:
            await sftp_session.warm(conn)
            for pages in (1, 20):
                src, remote = tmp_path / f"src{pages}", tmp_path / "vps" / "data" / f"w{pages}"
                src.mkdir()
                store = src / "session.db"
                store.write_bytes(os.urandom(64 * PAGE))
                staged = await area_copy.pre_upload(
                    conn, vps_command=vps_command(), local_dir=src, remote_dir=str(remote))
                _rewrite_pages(store, range(1, 3 * pages, 3))
                counted = RoundTrips()
                with round_trips.counted_by(counted):
                    report = await area_copy.upload(
                        conn, vps_command=vps_command(), local_dir=src,
                        remote_dir=str(remote), staged=staged)
                assert _tree(remote) == _tree(src)
                assert report.sent_bytes == pages * PAGE
                waves[pages] = counted.count
        assert waves[20] == waves[1] > 0, waves

    async def test_a_store_replaced_by_a_new_file_is_sent_as_a_delta_of_the_staged_one(
        self, vps: VpsServer, tmp_path: Path
    ) -> None:
        # A daemon that writes its store anew and renames it over the old one (a new inode,
        # mostly the same pages): the delta is against what was staged, not the old inode.
        src, remote = tmp_path / "src", tmp_path / "vps" / "data" / "d5"
        src.mkdir()
        store = src / "session.db"
        store.write_bytes(os.urandom(64 * PAGE))
        async with vps.connect() as conn:
            staged = await area_copy.pre_upload(
                conn, vps_command=vps_command(), local_dir=src, remote_dir=str(remote))
            content = bytearray(store.read_bytes())
            content[9 * PAGE:10 * PAGE] = os.urandom(PAGE)
            (src / "session.db.new").write_bytes(bytes(content))
            os.replace(src / "session.db.new", store)
            report = await area_copy.upload(
                conn, vps_command=vps_command(), local_dir=src, remote_dir=str(remote),
                staged=staged)
        assert _tree(remote) == _tree(src)
        assert report.sent_bytes == PAGE

    async def test_a_delta_into_a_staged_file_changed_on_the_vps_is_copied_over_whole(
        self, vps: VpsServer, tmp_path: Path
    ) -> None:
        # The block digests are the PBX's memory of what it staged: a staged file changed on
        # the VPS since makes the delta wrong, and the VPS's digest of the whole staging dir
        # must refuse it.
        src, remote = tmp_path / "src", tmp_path / "vps" / "data" / "d2"
        src.mkdir()
        (src / "session.db").write_bytes(os.urandom(64 * PAGE))

        def tamper(staging: Path) -> None:
            with (staging / "session.db").open("r+b") as f:
                f.seek(10 * PAGE)
                f.write(b"tampered")
            with (src / "session.db").open("r+b") as f:  # and the source changed elsewhere
                f.seek(50 * PAGE)
                f.write(os.urandom(PAGE))

        report = await _pre_copy_then_upload(vps, src, remote, meddle=tamper)
        assert _tree(remote) == _tree(src)
        assert report.reused == 0 and report.sent_bytes == 64 * PAGE  # redone whole

    async def test_a_source_changed_while_its_delta_is_sent_is_refused(
        self, vps: VpsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        src, remote = tmp_path / "src", tmp_path / "vps" / "data" / "d3"
        src.mkdir()
        store = src / "session.db"
        store.write_bytes(os.urandom(64 * PAGE))
        digest_blocks = transfer._digest_blocks

        def then_written(fd: int, size: int) -> tuple[str, Any]:
            digested = digest_blocks(fd, size)
            with store.open("r+b") as f:  # after the digest, before the send
                f.seek(20 * PAGE)
                f.write(b"late")
            return digested

        async with vps.connect() as conn:
            staged = await area_copy.pre_upload(
                conn, vps_command=vps_command(), local_dir=src, remote_dir=str(remote))
            with store.open("r+b") as f:
                f.seek(20 * PAGE)
                f.write(os.urandom(PAGE))
            monkeypatch.setattr(transfer, "_digest_blocks", then_written)
            with pytest.raises(MonitordError) as caught:
                await area_copy.upload(
                    conn, vps_command=vps_command(), local_dir=src, remote_dir=str(remote),
                    staged=staged)
        assert caught.value.code == ErrorCode.COPY_SOURCE_CHANGED
        assert not remote.exists()

    async def test_a_staging_dir_changed_on_the_vps_is_copied_over_whole(
        self, vps: VpsServer, tmp_path: Path
    ) -> None:
        src, remote = tmp_path / "src", tmp_path / "vps" / "data" / "a2"
        _make_area(src)

        def tamper(staging: Path) -> None:
            (staging / "db" / "keys.bin").write_bytes(b"tampered")
            (staging / "planted").write_bytes(b"extra")

        report = await _pre_copy_then_upload(vps, src, remote, meddle=tamper)
        assert _tree(remote) == _tree(src)
        assert report.reused == 0  # redone whole after the VPS refused the staged set

    async def test_a_staging_dir_removed_on_the_vps_is_copied_over_whole(
        self, vps: VpsServer, tmp_path: Path
    ) -> None:
        # The copy after the stop does not make the staging dir again (a round trip while
        # the area is down): a staging dir that went away meanwhile means a whole copy.
        src, remote = tmp_path / "src", tmp_path / "vps" / "data" / "a6"
        _make_area(src)

        def remove(staging: Path) -> None:
            shutil.rmtree(staging)
            (src / "session.db").write_bytes(b"S" * 70_001)  # to be sent into the gone dir

        report = await _pre_copy_then_upload(vps, src, remote, meddle=remove)
        assert _tree(remote) == _tree(src)
        assert report.reused == 0

    async def test_a_pre_copied_empty_area_whose_staging_dir_went_away_is_promoted_empty(
        self, vps: VpsServer, tmp_path: Path
    ) -> None:
        src, remote = tmp_path / "src", tmp_path / "vps" / "data" / "a7"
        src.mkdir()
        report = await _pre_copy_then_upload(vps, src, remote, meddle=Path.rmdir)
        assert remote.is_dir() and _tree(remote) == {}
        assert report.files == 0

    async def test_download_after_a_pre_copy_fetches_only_what_changed(
        self, vps: VpsServer, tmp_path: Path
    ) -> None:
        remote, back = tmp_path / "vps" / "data" / "a3", tmp_path / "back"
        _make_area(remote)
        staging = tree_digest.staging_dir(back)
        async with vps.connect() as conn:
            staged = await area_copy.pre_download(
                conn, vps_command=vps_command(), remote_dir=str(remote), local_dir=back
            )
            assert not back.exists()
            _change_area(remote)
            (staging / "leftover").write_bytes(b"half-written by a cut pre-copy")
            report = await area_copy.download(
                conn, vps_command=vps_command(),
                remote_dir=str(remote), local_dir=back, staged=staged
            )
        assert _tree(back) == _tree(remote)
        assert (report.files, report.reused) == (3, 1)

    async def test_the_promote_fsyncs_only_what_was_written_after_the_pre_copy(
        self, vps: VpsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # The pre-copy fsynced what it staged; doing it again for every unchanged file while
        # the area is down costs a system call per file (200,000 for a large account).
        monkeypatch.setattr(tree_digest, "epoch_ns", lambda _dir: 2**62)  # no racy ticks
        remote, back = tmp_path / "vps" / "data" / "a8", tmp_path / "back"
        _make_area(remote)
        synced: list[str] = []
        real_fsync = os.fsync

        def fsync(fd: int) -> None:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                synced.append(os.readlink(f"/proc/self/fd/{fd}"))
            real_fsync(fd)

        async with vps.connect() as conn:
            staged = await area_copy.pre_download(
                conn, vps_command=vps_command(), remote_dir=str(remote), local_dir=back
            )
            _change_area(remote)
            monkeypatch.setattr(os, "fsync", fsync)
            await area_copy.download(conn, vps_command=vps_command(),
                                     remote_dir=str(remote), local_dir=back, staged=staged)
        assert _tree(back) == _tree(remote)
        staging = tree_digest.staging_dir(back)
        files = {Path(p).relative_to(staging).as_posix() for p in synced}
        assert files == {"session.db", "db/new.log"}  # not db/keys.bin, unchanged

    async def test_a_pre_copy_of_other_dirs_is_ignored(
        self, vps: VpsServer, tmp_path: Path
    ) -> None:
        src, remote = tmp_path / "src", tmp_path / "vps" / "data" / "a4"
        _make_area(src)
        async with vps.connect() as conn:
            staged = await area_copy.pre_upload(
                conn, vps_command=vps_command(),
                local_dir=src, remote_dir=str(tmp_path / "vps" / "elsewhere")
            )
            report = await area_copy.upload(
                conn, vps_command=vps_command(),
                local_dir=src, remote_dir=str(remote), staged=staged
            )
        assert _tree(remote) == _tree(src) and report.reused == 0


def _rewrite_pages(path: Path, pages: Iterable[int]) -> None:
    with path.open("r+b") as f:
        for index in pages:
            f.seek(index * PAGE)
            f.write(os.urandom(PAGE))


def _while_the_first_pass_ran(monkeypatch: pytest.MonkeyPatch,
                              change: Callable[[], None]) -> None:
    """`change` happens to the running source right after the pre-copy's first pass, as a
    live store changes while its first pass crosses a slow link."""
    first_pass = transfer._Upload.pre_copy

    async def then_changed(self: Any, progress: Any) -> Any:
        staged = await first_pass(self, progress)
        change()
        return staged

    monkeypatch.setattr(transfer._Upload, "pre_copy", then_changed)


class TestPreCopyRounds:
    """A live store changes while the first pass sends it: the pre-copy goes over what
    changed again while the rounds shrink (orchestrator/pre_copy.another_round), so that
    after the stop only the last few pages cross."""

    async def test_pages_changed_during_the_first_pass_go_in_a_second_round(
        self, vps: VpsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        src, remote = tmp_path / "src", tmp_path / "vps" / "data" / "r1"
        src.mkdir()
        store = src / "session.db"
        store.write_bytes(os.urandom(512 * PAGE))
        changed = range(100, 120)  # 80 KiB: more than is left for after the stop
        _while_the_first_pass_ran(monkeypatch, lambda: _rewrite_pages(store, changed))
        async with vps.connect() as conn:
            staged = await area_copy.pre_upload(
                conn, vps_command=vps_command(), local_dir=src, remote_dir=str(remote))
            assert staged.rounds == (512 * PAGE, len(changed) * PAGE, 0)
            assert staged.rounds_error is None
            assert (tree_digest.staging_dir(remote) / "session.db").read_bytes() \
                == store.read_bytes()
            _rewrite_pages(store, [7])
            report = await area_copy.upload(
                conn, vps_command=vps_command(), local_dir=src, remote_dir=str(remote),
                staged=staged)
        assert _tree(remote) == _tree(src)
        assert report.sent_bytes == PAGE  # only the page changed after the rounds

    async def test_a_file_grown_shrunk_created_and_replaced_between_rounds_arrives_exact(
        self, vps: VpsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        src, remote = tmp_path / "src", tmp_path / "vps" / "data" / "r2"
        src.mkdir()
        for name in ("grown.db", "cut.db", "replaced.db"):
            (src / name).write_bytes(os.urandom(64 * PAGE))

        def meanwhile() -> None:
            with (src / "grown.db").open("ab") as f:
                f.write(os.urandom(20 * PAGE + 5))
            os.truncate(src / "cut.db", 10 * PAGE + 3)
            (src / "new.db").write_bytes(os.urandom(3 * PAGE))
            content = bytearray((src / "replaced.db").read_bytes())
            content[PAGE:2 * PAGE] = os.urandom(PAGE)
            (src / "replaced.tmp").write_bytes(bytes(content))
            os.replace(src / "replaced.tmp", src / "replaced.db")  # a new inode

        _while_the_first_pass_ran(monkeypatch, meanwhile)
        async with vps.connect() as conn:
            staged = await area_copy.pre_upload(
                conn, vps_command=vps_command(), local_dir=src, remote_dir=str(remote))
            staging = tree_digest.staging_dir(remote)
            assert _tree(staging) == _tree(src)
            # the append, the cut file's new last block, the new file, the replaced page
            assert staged.rounds[1] == (20 * PAGE + 5) + 3 + 3 * PAGE + PAGE
            report = await area_copy.upload(
                conn, vps_command=vps_command(), local_dir=src, remote_dir=str(remote),
                staged=staged)
        assert _tree(remote) == _tree(src)
        assert report.sent_bytes == 0

    async def test_a_round_cut_by_the_link_keeps_what_was_staged_and_the_copy_completes(
        self, vps: VpsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        src, remote = tmp_path / "src", tmp_path / "vps" / "data" / "r3"
        src.mkdir()
        for name in ("a.db", "b.db"):
            (src / name).write_bytes(os.urandom(64 * PAGE))
        _while_the_first_pass_ran(monkeypatch, lambda: [
            _rewrite_pages(src / name, range(10, 30)) for name in ("a.db", "b.db")])
        refresh = transfer._refresh_file

        async def cut_first(*args: Any, **kwargs: Any) -> Any:
            vps.drop_all_sessions()  # the link goes as the round writes its first file
            return await refresh(*args, **kwargs)

        monkeypatch.setattr(transfer, "_refresh_file", cut_first)
        async with vps.connect() as conn:
            staged = await area_copy.pre_upload(
                conn, vps_command=vps_command(), local_dir=src, remote_dir=str(remote))
        assert staged.rounds_error == "SSH_UNREACHABLE"
        assert staged.rounds == (128 * PAGE,)
        # the file the round was writing is no longer counted as staged
        assert "a.db" not in staged.files and "a.db" not in staged.blocks
        monkeypatch.setattr(transfer, "_refresh_file", refresh)
        async with vps.connect() as conn:
            report = await area_copy.upload(
                conn, vps_command=vps_command(), local_dir=src, remote_dir=str(remote),
                staged=staged)
        assert _tree(remote) == _tree(src)
        # a.db whole; b.db's changed pages as a delta of what the first pass staged
        assert report.sent_bytes == 64 * PAGE + 20 * PAGE

    async def test_a_still_tree_takes_one_look_and_no_session(
        self, vps: VpsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        src, remote = tmp_path / "src", tmp_path / "vps" / "data" / "r4"
        src.mkdir()
        (src / "session.db").write_bytes(os.urandom(64 * PAGE))
        aged(src / "session.db")  # (so that its first pass's hash is cached)
        async with vps.connect() as conn:
            sessions = _count_sessions(conn, monkeypatch)
            staged = await area_copy.pre_upload(
                conn, vps_command=vps_command(), local_dir=src, remote_dir=str(remote))
        assert staged.rounds == (64 * PAGE, 0)
        assert len(sessions) == 1  # the first pass's: the second round found nothing to send


class TestDigestCaches:
    """After a pre-copy both sides re-read only files whose stat identity changed; a change
    that keeps size and mtime (only ctime tells) is still found, on either side."""

    async def test_a_stealthy_change_to_the_source_after_a_pre_copy_is_sent(
        self, vps: VpsServer, tmp_path: Path
    ) -> None:
        src, remote = tmp_path / "src", tmp_path / "vps" / "data" / "c1"
        _make_area(src)
        aged(src / "session.db")
        async with vps.connect() as conn:
            staged = await area_copy.pre_upload(
                conn, vps_command=vps_command(), local_dir=src, remote_dir=str(remote)
            )
            assert "session.db" in staged.cache  # hashed while running, cached
            stealthy_rewrite(src / "session.db", b"t" * 70_000)
            await area_copy.upload(
                conn, vps_command=vps_command(),
                local_dir=src, remote_dir=str(remote), staged=staged
            )
        assert _tree(remote) == _tree(src)

    async def test_a_stealthy_change_to_the_vps_staging_dir_is_found(
        self, vps: VpsServer, tmp_path: Path
    ) -> None:
        src, remote = tmp_path / "src", tmp_path / "vps" / "data" / "c2"
        _make_area(src)
        staging = tree_digest.staging_dir(remote)
        async with vps.connect() as conn:
            staged = await area_copy.pre_upload(
                conn, vps_command=vps_command(), local_dir=src, remote_dir=str(remote)
            )
            # the VPS digested the staging dir; once more after the clock moved on, so that
            # even a file written in that digest's own tick is cached now
            aged(staging / "session.db")
            await asyncio.to_thread(
                subprocess.run, [*vps_command(), "tree-digest", "--dir", str(staging),
                                 "--cache", str(tree_digest.staging_cache(remote))],
                check=True, capture_output=True,
            )
            cached = tree_digest.load_cache(tree_digest.staging_cache(remote))
            assert "session.db" in cached
            stealthy_rewrite(staging / "session.db", b"t" * 70_000)
            report = await area_copy.upload(
                conn, vps_command=vps_command(),
                local_dir=src, remote_dir=str(remote), staged=staged
            )
        assert _tree(remote) == _tree(src)
        assert report.reused == 0  # the VPS's digest differed: redone whole
        digests = tree_digest.load_cache(tree_digest.data_cache(remote))
        assert set(digests) <= {"session.db", "db/keys.bin", "empty"}  # moved with the dir

    async def test_a_stealthy_change_on_the_vps_after_a_pre_copy_is_fetched(
        self, vps: VpsServer, tmp_path: Path
    ) -> None:
        remote, back = tmp_path / "vps" / "data" / "c3", tmp_path / "back"
        _make_area(remote)
        aged(remote / "session.db")
        async with vps.connect() as conn:
            staged = await area_copy.pre_download(
                conn, vps_command=vps_command(), remote_dir=str(remote), local_dir=back
            )
            cached = tree_digest.load_cache(tree_digest.data_cache(remote))
            assert "session.db" in cached
            stealthy_rewrite(remote / "session.db", b"t" * 70_000)
            await area_copy.download(
                conn, vps_command=vps_command(),
                remote_dir=str(remote), local_dir=back, staged=staged
            )
        assert _tree(back) == _tree(remote)

    async def test_a_stealthy_change_to_the_local_staging_dir_is_found(
        self, vps: VpsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # every file written counts as old enough to cache: only its identity can tell
        monkeypatch.setattr(tree_digest, "epoch_ns", lambda _directory: 2**62)
        remote, back = tmp_path / "vps" / "data" / "c4", tmp_path / "back"
        _make_area(remote)
        staging = tree_digest.staging_dir(back)
        async with vps.connect() as conn:
            staged = await area_copy.pre_download(
                conn, vps_command=vps_command(), remote_dir=str(remote), local_dir=back
            )
            assert "session.db" in staged.cache
            stealthy_rewrite(staging / "session.db", b"t" * 70_000)
            report = await area_copy.download(
                conn, vps_command=vps_command(),
                remote_dir=str(remote), local_dir=back, staged=staged
            )
        assert _tree(back) == _tree(remote)
        assert report.reused == 0


class TestAgentStaging:
    """Given the agent, a copy to the VPS starts no process there: the agent makes the
    staging dir, lists what a pre-copy put in it and promotes it. An agent without those
    routes leaves each step to the shell and the verb (a staging dir the agent finds wrong:
    TestVerification)."""

    async def test_a_pre_copied_upload_runs_nothing_on_the_vps(
        self, vps: VpsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        src, remote = tmp_path / "src", tmp_path / "vps" / "data" / "p1"
        _make_area(src)
        helper = _Agent(remote)
        execs = _counting_execs(monkeypatch)
        report = await _pre_copy_then_upload(vps, src, remote, agent=helper)
        assert report.reused == 3, report  # all three were listed back as sent
        assert _tree(remote) == _tree(src)
        assert execs == [], execs
        # (what a cut copy left is asked for in place of a reset: here, nothing)
        assert [c.split()[0] for c in helper.calls] == ["staged_blocks", "listing", "promote"]
        assert helper.asked == 1  # the pre-copy's answer holds for the copy after the stop

    async def test_an_upload_without_a_pre_copy_runs_nothing_on_the_vps(
        self, vps: VpsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        src, remote = tmp_path / "src", tmp_path / "vps" / "data" / "p4"
        _make_area(src)
        remote.mkdir(parents=True)
        (remote / "previous").write_bytes(b"generation 3")
        stale = tree_digest.staging_dir(remote)
        (stale / "leftover").mkdir(parents=True)  # a cut copy's empty dir: removed
        helper = _Agent(remote)
        execs = _counting_execs(monkeypatch)
        async with vps.connect() as conn:
            report = await area_copy.upload(conn, vps_command=vps_command(), local_dir=src,
                                            remote_dir=str(remote), agent=helper)
        assert _tree(remote) == _tree(src) and report.reused == 0
        assert not (remote / "leftover").exists()
        assert execs == [], execs
        assert [c.split()[0] for c in helper.calls] == ["staged_blocks", "promote"]
        assert helper.asked == 1

    async def test_an_agent_without_the_routes_leaves_them_to_the_vps_shell(
        self, vps: VpsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        src, remote = tmp_path / "src", tmp_path / "vps" / "data" / "p2"
        _make_area(src)
        execs = _counting_execs(monkeypatch)
        older = _OlderAgent(remote)
        report = await _pre_copy_then_upload(vps, src, remote, agent=older)
        assert _tree(remote) == _tree(src)
        assert report.reused == 3
        assert len(execs) == 3, execs  # make the staging dir, list it, check and promote it
        assert (older.asked, older.calls) == (1, [])  # asked once, no route tried

    async def test_an_agent_without_the_routes_is_asked_once_per_copy_without_a_pre_copy(
        self, vps: VpsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        src, remote = tmp_path / "src", tmp_path / "vps" / "data" / "p6"
        _make_area(src)
        execs = _counting_execs(monkeypatch)
        older = _OlderAgent(remote)
        async with vps.connect() as conn:
            await area_copy.upload(conn, vps_command=vps_command(), local_dir=src,
                                   remote_dir=str(remote), agent=older)
        assert _tree(remote) == _tree(src)
        assert len(execs) == 2, execs  # make the staging dir, check and promote it
        assert (older.asked, older.calls) == (1, [])

    async def test_an_agent_that_cannot_be_asked_fails_the_copy_with_its_own_code(
        self, vps: VpsServer, tmp_path: Path
    ) -> None:
        src, remote = tmp_path / "src", tmp_path / "vps" / "data" / "p8"
        _make_area(src)

        class Gone(_Agent):
            async def serves_copies(self) -> bool:
                raise MonitordError(ErrorCode.AGENT_UNREACHABLE, "no channel")

        async with vps.connect() as conn:
            with pytest.raises(MonitordError) as err:
                await area_copy.upload(conn, vps_command=vps_command(), local_dir=src,
                                       remote_dir=str(remote), agent=Gone(remote))
        assert err.value.code == ErrorCode.AGENT_UNREACHABLE
        assert not remote.exists()

    async def test_a_route_missing_after_all_fails_the_copy_and_changes_nothing(
        self, vps: VpsServer, tmp_path: Path
    ) -> None:
        """An agent that said it serves the routes but no longer has one (replaced by an
        older build meanwhile): the copy fails with that code, the next try asks again."""
        src, remote = tmp_path / "src", tmp_path / "vps" / "data" / "p7"
        _make_area(src)

        class Replaced(_Agent):
            async def promote(self, expect: str) -> bool:
                raise MonitordError(ErrorCode.AGENT_ROUTE_MISSING, "no route …/promote")

        async with vps.connect() as conn:
            with pytest.raises(MonitordError) as err:
                await area_copy.upload(conn, vps_command=vps_command(), local_dir=src,
                                       remote_dir=str(remote), agent=Replaced(remote))
            assert err.value.code == ErrorCode.AGENT_ROUTE_MISSING
            assert not remote.exists()
            older = _OlderAgent(remote)
            await area_copy.upload(conn, vps_command=vps_command(), local_dir=src,
                                   remote_dir=str(remote), agent=older)
        assert _tree(remote) == _tree(src) and older.asked == 1

    async def test_a_hostile_listing_from_the_agent_fails_the_pre_copy(
        self, vps: VpsServer, tmp_path: Path
    ) -> None:
        src, remote = tmp_path / "src", tmp_path / "vps" / "data" / "p5"
        _make_area(src)

        class Hostile(_Agent):
            async def listing(self) -> bytes:
                return tree_digest.listing({"../../etc/passwd": "0" * 64})

        async with vps.connect() as conn:
            with pytest.raises(MonitordError) as err:
                await area_copy.pre_upload(conn, vps_command=vps_command(), local_dir=src,
                                           remote_dir=str(remote), agent=Hostile(remote))
        assert err.value.code == ErrorCode.COPY_INCOMPLETE
        assert "etc/passwd" in err.value.detail, err.value.detail
        assert not remote.exists()

    async def test_other_agent_errors_fail_the_copy(self, vps: VpsServer, tmp_path: Path) -> None:
        src, remote = tmp_path / "src", tmp_path / "vps" / "data" / "p3"
        _make_area(src)

        class Busy(_Agent):
            async def promote(self, expect: str) -> bool:
                raise MonitordError(ErrorCode.DESTINATION_CONFLICT, "area runs here")

        async with vps.connect() as conn:
            with pytest.raises(MonitordError) as err:
                await area_copy.upload(conn, vps_command=vps_command(), local_dir=src,
                                       remote_dir=str(remote), agent=Busy(remote))
        assert err.value.code == ErrorCode.DESTINATION_CONFLICT
        assert not remote.exists()


class TestAgentListing:
    """Given the agent, a copy from the VPS starts no process there either: the agent lists
    the VPS's data dir, and that listing is held to every rule the verb's output is."""

    async def test_a_pre_copied_download_runs_nothing_on_the_vps(
        self, vps: VpsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        remote, back = tmp_path / "vps" / "data" / "l1", tmp_path / "back"
        _make_area(remote)
        helper = _Agent(remote)
        execs = _counting_execs(monkeypatch)
        async with vps.connect() as conn:
            staged = await area_copy.pre_download(conn, vps_command=vps_command(),
                                                  remote_dir=str(remote), local_dir=back,
                                                  agent=helper)
            _change_area(remote)
            report = await area_copy.download(conn, vps_command=vps_command(),
                                              remote_dir=str(remote), local_dir=back,
                                              staged=staged, agent=helper)
        assert _tree(back) == _tree(remote)
        assert (report.files, report.reused) == (3, 1)
        assert execs == [], execs
        # the first pass's listing, its second round's look (nothing changed yet), the copy
        # after the stop's, and the blocks of the one staged file that changed (the other
        # changed file is new)
        assert helper.calls == ["data_listing", "data_listing", "data_listing", "blocks"]
        assert helper.asked == 1

    async def test_an_agent_without_the_route_leaves_it_to_the_verb(
        self, vps: VpsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        remote, back = tmp_path / "vps" / "data" / "l2", tmp_path / "back"
        _make_area(remote)
        execs = _counting_execs(monkeypatch)
        older = _OlderAgent(remote)
        async with vps.connect() as conn:
            await area_copy.download(conn, vps_command=vps_command(), remote_dir=str(remote),
                                     local_dir=back, agent=older)
        assert _tree(back) == _tree(remote)
        assert len(execs) == 1, execs
        assert (older.asked, older.calls) == (1, [])

    async def test_a_pre_copied_download_from_an_older_agent_asks_it_once(
        self, vps: VpsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        remote, back = tmp_path / "vps" / "data" / "l4", tmp_path / "back"
        _make_area(remote)
        execs = _counting_execs(monkeypatch)
        older = _OlderAgent(remote)
        async with vps.connect() as conn:
            staged = await area_copy.pre_download(conn, vps_command=vps_command(),
                                                  remote_dir=str(remote), local_dir=back,
                                                  agent=older)
            await area_copy.download(conn, vps_command=vps_command(), remote_dir=str(remote),
                                     local_dir=back, staged=staged, agent=older)
        assert _tree(back) == _tree(remote)
        # the verb's listing: the first pass, its second round's look, after the stop
        assert len(execs) == 3, execs
        assert (older.asked, older.calls) == (1, [])

    async def test_a_hostile_listing_from_the_agent_writes_nothing_here(
        self, vps: VpsServer, tmp_path: Path
    ) -> None:
        remote, back = tmp_path / "vps" / "data" / "l3", tmp_path / "back"
        _make_area(remote)
        back.mkdir()
        (back / "keep").write_bytes(b"old")

        class Hostile(_Agent):
            async def data_listing(self) -> bytes:
                return tree_digest.listing({"db/../../escape": "0" * 64})

        async with vps.connect() as conn:
            with pytest.raises(MonitordError) as err:
                await area_copy.download(conn, vps_command=vps_command(),
                                         remote_dir=str(remote), local_dir=back,
                                         agent=Hostile(remote))
        assert err.value.code == ErrorCode.COPY_INCOMPLETE
        assert "escape" in err.value.detail, err.value.detail
        assert _tree(back) == {"keep": hashlib.sha256(b"old").hexdigest()}
        assert not (tmp_path / "escape").exists()
        assert not tree_digest.staging_dir(back).exists()


def _while_the_first_pass_home_ran(monkeypatch: pytest.MonkeyPatch,
                                   change: Callable[[], None]) -> None:
    """`change` happens to the VPS's running tree right after a move home's first pass."""
    first_pass = transfer._Download.pre_copy

    async def then_changed(self: Any, progress: Any) -> Any:
        staged = await first_pass(self, progress)
        change()
        return staged

    monkeypatch.setattr(transfer._Download, "pre_copy", then_changed)


class TestPreCopyRoundsHome:
    """A move home's pre-copy goes over what changed on the VPS while its first pass ran,
    as an upload's does, so that after the stop only the last few pages cross."""

    async def test_pages_changed_during_the_first_pass_come_in_a_second_round(
        self, vps: VpsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        remote, back = tmp_path / "vps" / "data" / "h1", tmp_path / "back"
        remote.mkdir(parents=True)
        store = remote / "session.db"
        store.write_bytes(os.urandom(512 * PAGE))
        (remote / "gone.db").write_bytes(os.urandom(3 * PAGE))

        def meanwhile() -> None:
            _rewrite_pages(store, range(100, 120))
            (remote / "gone.db").unlink()
            (remote / "new.db").write_bytes(os.urandom(2 * PAGE))

        _while_the_first_pass_home_ran(monkeypatch, meanwhile)
        async with vps.connect() as conn:
            staged = await area_copy.pre_download(
                conn, vps_command=vps_command(), local_dir=back, remote_dir=str(remote),
                agent=_Agent(remote))
            assert staged.rounds == (515 * PAGE, 22 * PAGE, 0), staged.rounds
            assert staged.rounds_error is None
            staging = tree_digest.staging_dir(back)
            assert (staging / "session.db").read_bytes() == store.read_bytes()
            assert set(staged.files) == {"session.db", "new.db"}
            _rewrite_pages(store, [7])
            report = await area_copy.download(
                conn, vps_command=vps_command(), local_dir=back, remote_dir=str(remote),
                staged=staged, agent=_Agent(remote))
        assert _tree(back) == _tree(remote)
        assert report.sent_bytes == PAGE  # only the page changed after the rounds

    async def test_a_round_cut_by_the_link_keeps_what_was_staged_and_the_copy_completes(
        self, vps: VpsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        remote, back = tmp_path / "vps" / "data" / "h2", tmp_path / "back"
        remote.mkdir(parents=True)
        for name in ("a.db", "b.db"):
            (remote / name).write_bytes(os.urandom(64 * PAGE))
        _while_the_first_pass_home_ran(monkeypatch, lambda: [
            _rewrite_pages(remote / name, range(10, 30)) for name in ("a.db", "b.db")])
        fetch_delta = transfer._fetch_delta

        async def cut_first(*args: Any, **kwargs: Any) -> Any:
            vps.drop_all_sessions()  # the link goes as the round fetches its first file
            return await fetch_delta(*args, **kwargs)

        async with vps.connect() as conn:
            first = transfer._Download.more_rounds

            async def rounds_cut(self: Any, staged: Any) -> Any:
                monkeypatch.setattr(transfer, "_fetch_delta", cut_first)
                return await first(self, staged)

            monkeypatch.setattr(transfer._Download, "more_rounds", rounds_cut)
            staged = await area_copy.pre_download(
                conn, vps_command=vps_command(), local_dir=back, remote_dir=str(remote),
                agent=_Agent(remote))
        assert staged.rounds_error == "SSH_UNREACHABLE", staged.rounds_error
        assert staged.rounds == (128 * PAGE,)
        assert "a.db" not in staged.files  # the file the round was fetching
        monkeypatch.setattr(transfer, "_fetch_delta", fetch_delta)
        async with vps.connect() as conn:
            await area_copy.download(
                conn, vps_command=vps_command(), local_dir=back, remote_dir=str(remote),
                staged=staged, agent=_Agent(remote))
        assert _tree(back) == _tree(remote)

    async def test_after_the_stop_changed_pages_wait_for_five_waves(
        self, vps: VpsServer, tmp_path: Path
    ) -> None:
        """While the area is down, a download of a store's changed pages asks, in turn: the
        listing; the data dir's real path, each file's real path and size, and the changed
        file's block digests — of its changed 64 KiB groups only — side by side; the file's
        open, its reads (every scattered page at once), its close."""
        remote, back = tmp_path / "vps" / "data" / "h4", tmp_path / "back"
        remote.mkdir(parents=True)
        store = remote / "session.db"
        store.write_bytes(os.urandom(512 * PAGE))  # 32 groups of 16 pages
        (remote / "still.db").write_bytes(os.urandom(2 * PAGE))
        async with vps.connect() as conn:
            await sftp_session.warm(conn)
            staged = await area_copy.pre_download(
                conn, vps_command=vps_command(), local_dir=back, remote_dir=str(remote),
                agent=_CountedAgent(remote))
            _rewrite_pages(store, range(1, 60, 3))  # 20 pages, none beside another
            waves, agent = RoundTrips(), _CountedAgent(remote)
            with round_trips.counted_by(waves):
                report = await area_copy.download(
                    conn, vps_command=vps_command(), local_dir=back, remote_dir=str(remote),
                    staged=staged, agent=agent)
        assert _tree(back) == _tree(remote)
        assert report.sent_bytes == 20 * PAGE
        assert waves.count == 5, waves.count
        assert agent.digest_bytes == 4 * 16 * DIGEST_BYTES  # the 4 groups of the 20 pages

    async def test_a_still_tree_takes_one_look_and_no_session(
        self, vps: VpsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        remote, back = tmp_path / "vps" / "data" / "h3", tmp_path / "back"
        remote.mkdir(parents=True)
        (remote / "session.db").write_bytes(os.urandom(64 * PAGE))
        async with vps.connect() as conn:
            sessions = _count_sessions(conn, monkeypatch)
            staged = await area_copy.pre_download(
                conn, vps_command=vps_command(), local_dir=back, remote_dir=str(remote),
                agent=_Agent(remote))
        assert staged.rounds == (64 * PAGE, 0)
        assert len(sessions) == 1  # the first pass's: the second round found nothing


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs: a PBX disk with little room left."""
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(small)], check=True)
    try:
        yield small
    finally:
        subprocess.run(["umount", str(small)], check=True)


class TestRoomOnThePbx:
    """A download that the PBX has no room for is refused before its first byte: the sizes
    the VPS declares (a hostile one may declare anything) are held against the free space
    where the copy is put together, so the disk that state.db and the logs share is never
    filled by it."""

    async def test_a_download_larger_than_the_free_space_writes_nothing(
        self, vps: VpsServer, tmp_path: Path, small_disk: Path
    ) -> None:
        src, remote = tmp_path / "src", tmp_path / "vps" / "data" / "a9"
        src.mkdir()
        (src / "big.bin").write_bytes(os.urandom(6 << 20))
        done: list[int] = []
        async with vps.connect() as conn:
            await area_copy.upload(conn, vps_command=vps_command(), local_dir=src,
                                   remote_dir=str(remote))
            with pytest.raises(MonitordError) as err:
                await area_copy.download(
                    conn, vps_command=vps_command(), remote_dir=str(remote),
                    local_dir=small_disk / "back", progress=lambda d, t: done.append(d))
        assert err.value.code == ErrorCode.LOCAL_DISK_FULL, err.value
        assert "PBX" in err.value.detail and "free" in err.value.detail, err.value.detail
        assert max(done, default=0) == 0, "bytes were written before the refusal"
        assert not any(p.is_file() for p in small_disk.rglob("*"))

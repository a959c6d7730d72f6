"""A file swapped after the listing — for a FIFO or a symlink to /dev/zero, by the daemon's
user — neither freezes monitord nor streams more bytes than were listed: the copy fails with
COPY_SOURCE_CHANGED, or leaves that file out of a pre-copy, and a download reads no more of a
file than the VPS declared (real SSH server, real files)."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from monitord.base import tree_digest
from monitord.remote import copy as area_copy
from monitord.remote.copy import local_tree
from monitord.testing.vps_server import VpsServer
from orchestrator.errors import ErrorCode, MonitordError
from tests.support.agent_process import vps_command

# How long a guard waits before it unblocks a reader stuck on its FIFO. Not a bound on the
# copy: a copy that never opens the FIFO blocking finishes whatever this is; one that does
# would otherwise hang the test run instead of failing it.
_UNBLOCK_AFTER_S = 15.0


class FifoGuard:
    """Once armed, writes to (and closes) the FIFO at `path` if nothing finished meanwhile,
    so that a reader blocked on it returns; `had_to_unblock` says whether one was."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.finished = threading.Event()
        self.had_to_unblock = False
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        if self.finished.wait(_UNBLOCK_AFTER_S):
            return
        self.had_to_unblock = True
        with contextlib.suppress(OSError):
            fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
            os.write(fd, b"x")
            os.close(fd)

    @contextlib.contextmanager
    def armed(self) -> Iterator[FifoGuard]:
        self._thread.start()
        try:
            yield self
        finally:
            self.finished.set()
            self._thread.join()


def _swap_for_fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _swap_for_dev_zero(path: Path) -> None:
    path.unlink()
    path.symlink_to("/dev/zero")


SWAPS: dict[str, Callable[[Path], None]] = {"fifo": _swap_for_fifo,
                                            "dev-zero": _swap_for_dev_zero}


def _make_area(root: Path) -> None:
    (root / "db").mkdir(parents=True)
    (root / "session.db").write_bytes(b"s" * 70_000)
    (root / "db" / "keys.bin").write_bytes(b"k" * 4096)


def _largest_file(root: Path) -> int:
    return max((p.lstat().st_size for p in root.rglob("*") if p.is_file()), default=0)


@pytest.fixture
async def vps(tmp_path: Path):  # type: ignore[no-untyped-def]
    async with VpsServer(work_dir=tmp_path / "vps-ssh") as server:
        yield server


class TestUploadOfASwappedFile:
    """Upload sends each file from the one fd it opened: the regular file listed, never a
    FIFO or a symlink put in its place."""

    @pytest.mark.parametrize("swap", sorted(SWAPS))
    async def test_a_file_swapped_after_the_manifest_fails_the_copy_at_once(
        self, vps: VpsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, swap: str
    ) -> None:
        src, remote = tmp_path / "src", tmp_path / "vps" / "data" / "a1"
        _make_area(src)
        remote.mkdir(parents=True)
        (remote / "previous").write_bytes(b"generation 3")
        manifest = local_tree.manifest

        def listed_then_swapped(root: Path, cache: Any = None) -> Any:
            listed = manifest(root, cache)
            SWAPS[swap](root / "session.db")
            return listed

        monkeypatch.setattr(local_tree, "manifest", listed_then_swapped)
        guard = FifoGuard(src / "session.db")
        async with vps.connect() as conn:
            with guard.armed(), pytest.raises(MonitordError) as err:
                await area_copy.upload(conn, vps_command=vps_command(), local_dir=src,
                                       remote_dir=str(remote), timeout_s=5.0)
        assert not guard.had_to_unblock, "the upload blocked on the FIFO"
        assert err.value.code == ErrorCode.COPY_SOURCE_CHANGED, err.value.detail
        assert "session.db" in err.value.detail
        assert [p.name for p in remote.iterdir()] == ["previous"]
        # nothing bigger than the listed file went to the VPS
        assert _largest_file(tree_digest.copy_dir(remote)) <= 70_000

    @pytest.mark.parametrize("swap", sorted(SWAPS))
    async def test_a_file_swapped_after_the_pre_listing_is_left_out_of_the_pre_copy(
        self, vps: VpsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, swap: str
    ) -> None:
        src, remote = tmp_path / "src", tmp_path / "vps" / "data" / "a2"
        _make_area(src)
        pre_listing = local_tree.pre_listing

        def listed_then_swapped(root: Path) -> Any:
            listed = pre_listing(root)
            SWAPS[swap](root / "session.db")
            return listed

        monkeypatch.setattr(local_tree, "pre_listing", listed_then_swapped)
        guard = FifoGuard(src / "session.db")
        async with vps.connect() as conn:
            with guard.armed():
                staged = await area_copy.pre_upload(conn, vps_command=vps_command(),
                                                    local_dir=src, remote_dir=str(remote),
                                                    timeout_s=5.0)
        assert not guard.had_to_unblock, "the pre-copy blocked on the FIFO"
        assert set(staged.files) == {"db/keys.bin"}
        assert _largest_file(tree_digest.copy_dir(remote)) <= 70_000


class TestDigestOfASwappedFile:
    """The digest both sides run (the agent's under the area's lock) leaves out a file
    swapped after the walk listed it, and never waits on a FIFO."""

    @pytest.mark.parametrize("swap", sorted(SWAPS))
    def test_a_file_swapped_after_the_walk_is_left_out(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, swap: str
    ) -> None:
        root = tmp_path / "area"
        _make_area(root)
        walk = tree_digest.regular_files

        def walked_then_swapped(top: Path) -> Iterator[tuple[str, Path, os.stat_result]]:
            for rel, full, st in walk(top):
                if rel == "session.db":
                    SWAPS[swap](full)
                yield rel, full, st

        monkeypatch.setattr(tree_digest, "regular_files", walked_then_swapped)
        guard = FifoGuard(root / "session.db")
        answer: list[Any] = []
        with guard.armed():
            worker = threading.Thread(target=lambda: answer.append(
                _digest_or_error(root)), daemon=True)
            worker.start()
            worker.join(_UNBLOCK_AFTER_S * 2)
        assert not guard.had_to_unblock, "the digest blocked on the FIFO"
        assert answer and isinstance(answer[0], bytes), answer
        assert b"session.db" not in answer[0] and b"db/keys.bin" in answer[0]


def _digest_or_error(root: Path) -> bytes | BaseException:
    try:
        return tree_digest.cached_listing(root)
    except OSError as e:
        return e


class TestDownloadCap:
    """A download reads no more of a file than the VPS declared for it, whatever the VPS then
    sends (a file swapped for a link to /dev/zero after it was declared)."""

    async def test_a_remote_file_swapped_for_dev_zero_is_read_no_further_than_declared(
        self, vps: VpsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        remote, back = tmp_path / "vps" / "data" / "a3", tmp_path / "back"
        remote.mkdir(parents=True)
        (remote / "session.db").write_bytes(b"honest data")
        written: list[int] = []
        create_inside = local_tree.create_inside

        class Counting:
            def __init__(self, inner: Any) -> None:
                self.inner = inner

            def write(self, data: bytes) -> int:
                written.append(len(data))
                return int(self.inner.write(data))

            def __getattr__(self, name: str) -> Any:
                return getattr(self.inner, name)

            def __enter__(self) -> Counting:
                self.inner.__enter__()
                return self

            def __exit__(self, *exc: object) -> None:
                self.inner.__exit__(*exc)

        def swapped_on_the_vps(root: Path, rel: str) -> Any:
            _swap_for_dev_zero(remote / rel)
            return Counting(create_inside(root, rel))

        monkeypatch.setattr(local_tree, "create_inside", swapped_on_the_vps)
        async with vps.connect() as conn:
            with pytest.raises(MonitordError) as err:
                await area_copy.download(conn, vps_command=vps_command(),
                                         remote_dir=str(remote), local_dir=back,
                                         timeout_s=3.0)
        assert sum(written) <= len(b"honest data"), f"{sum(written)} bytes written"
        assert err.value.code == ErrorCode.COPY_INCOMPLETE
        assert not back.exists()

"""A digest cache skips re-reading only files whose stat identity is unchanged, never a file
that changed since it was hashed — even keeping its size and mtime — and the VPS verb prints
exactly what coreutils' sha256sum prints (real files, the built pyz under the system Python)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from monitord.base import tree_digest
from tests.support.agent_process import vps_command
from tests.support.stat_tricks import aged, stealthy_rewrite


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class TestCache:
    def test_an_unchanged_file_is_taken_from_the_cache(self, tmp_path: Path) -> None:
        root = tmp_path / "area"
        root.mkdir()
        (root / "db").write_bytes(b"a" * 1000)
        aged(root / "db")
        found, cache = tree_digest.digest_tree(root)
        assert found == {"db": (1000, _sha(b"a" * 1000))} and set(cache) == {"db"}
        # a cache entry with a wrong hash is believed exactly while the identity holds
        cache = {"db": (cache["db"][0], "f" * 64)}
        found, _ = tree_digest.digest_tree(root, cache)
        assert found["db"][1] == "f" * 64

    def test_a_same_size_rewrite_with_its_mtime_put_back_is_hashed_again(
        self, tmp_path: Path
    ) -> None:
        root = tmp_path / "area"
        root.mkdir()
        (root / "db").write_bytes(b"a" * 1000)
        aged(root / "db")
        _, cache = tree_digest.digest_tree(root)
        stealthy_rewrite(root / "db", b"b" * 1000)
        found, _ = tree_digest.digest_tree(root, cache)
        assert found["db"] == (1000, _sha(b"b" * 1000))

    def test_a_file_replaced_by_another_is_hashed_again(self, tmp_path: Path) -> None:
        root = tmp_path / "area"
        root.mkdir()
        (root / "db").write_bytes(b"a" * 10)
        aged(root / "db")
        _, cache = tree_digest.digest_tree(root)
        (root / "other").write_bytes(b"b" * 10)
        os.replace(root / "other", root / "db")
        found, _ = tree_digest.digest_tree(root, cache)
        assert found == {"db": (10, _sha(b"b" * 10))}

    def test_a_file_changed_since_the_epoch_is_never_cached(self, tmp_path: Path) -> None:
        root = tmp_path / "area"
        root.mkdir()
        (root / "db").write_bytes(b"a")
        future = time.time_ns() + 3_600 * 10**9  # as a write in the hash's own tick looks
        os.utime(root / "db", ns=(future, future))
        found, cache = tree_digest.digest_tree(root)
        assert found == {"db": (1, _sha(b"a"))} and cache == {}

    def test_symlinks_are_neither_followed_nor_listed(self, tmp_path: Path) -> None:
        root = tmp_path / "area"
        (root / "d").mkdir(parents=True)
        (tmp_path / "outside").write_bytes(b"secret")
        (root / "link").symlink_to(tmp_path / "outside")
        (root / "dirlink").symlink_to(tmp_path)
        (root / "d" / "f").write_bytes(b"x")
        found, _ = tree_digest.digest_tree(root)
        assert set(found) == {"d/f"}

    def test_a_cache_file_that_is_damaged_counts_as_empty(self, tmp_path: Path) -> None:
        for text in (b"", b"{", b'{"format": 1, "files": {"a": [[1], "x"]}}', b"[]",
                     b'{"format": 99, "files": {}}'):
            (tmp_path / "c").write_bytes(text)
            assert tree_digest.load_cache(tmp_path / "c") == {}
        assert tree_digest.load_cache(tmp_path / "missing") == {}


class TestTheVerb:
    def test_it_prints_what_sha256sum_prints_and_keeps_a_cache(self, tmp_path: Path) -> None:
        root = tmp_path / "area"
        (root / "sub dir").mkdir(parents=True)
        for name, data in [("plain", b"1"), ("back\\slash", b"2"), ("new\nline", b"3"),
                           ("sub dir/ü", b"4"), ("empty", b"")]:
            (root / name).write_bytes(data)
        (root / "link").symlink_to(root / "plain")
        coreutils = subprocess.run(
            "find . -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum",
            shell=True, cwd=root, capture_output=True, check=True,
        ).stdout
        cache = tmp_path / "area.digests"
        ours = subprocess.run(
            [*vps_command(), "tree-digest", "--dir", str(root), "--cache", str(cache), "--sync"],
            capture_output=True, check=True,
        ).stdout
        assert ours == coreutils
        assert cache.stat().st_mode & 0o777 == 0o600
        again = subprocess.run(
            [*vps_command(), "tree-digest", "--dir", str(root), "--cache", str(cache)],
            capture_output=True, check=True,
        ).stdout
        assert again == coreutils
        # what the PBX expects for the same files is the same bytes (the upload's --expect)
        digests, _ = tree_digest.digest_tree(root)
        assert tree_digest.listing({rel: sha for rel, (_, sha) in digests.items()}) == coreutils

    def test_expect_says_whether_the_listing_is_the_expected_one(self, tmp_path: Path) -> None:
        root = tmp_path / "area"
        root.mkdir()
        (root / "a").write_bytes(b"1")
        listing = tree_digest.listing({"a": hashlib.sha256(b"1").hexdigest()})

        def digest(expect: bytes) -> subprocess.CompletedProcess[bytes]:
            return subprocess.run(
                [*vps_command(), "tree-digest", "--dir", str(root),
                 "--expect", hashlib.sha256(expect).hexdigest()], capture_output=True,
            )

        same = digest(listing)
        assert (same.returncode, same.stdout) == (0, listing)
        other = digest(listing + listing)
        assert (other.returncode, other.stdout) == (tree_digest.EXIT_DIFFERS, listing)

    def test_a_missing_dir_prints_nothing(self, tmp_path: Path) -> None:
        done = subprocess.run(
            [*vps_command(), "tree-digest", "--dir", str(tmp_path / "nope"),
             "--cache", str(tmp_path / "nope.digests")],
            capture_output=True, check=True,
        )
        assert done.stdout == b"" and not (tmp_path / "nope.digests").exists()


class TestVerifyAndPromote:
    """The agent's end of an upload: the staging dir replaces the tree only when its listing
    is the expected one, its digest cache moving along; the tree is never half swapped."""

    def test_an_expected_staging_dir_replaces_the_tree_and_leaves_nothing_beside(
        self, tmp_path: Path
    ) -> None:
        final = tmp_path / "area"
        (final / "sub").mkdir(parents=True)
        (final / "sub" / "old.db").write_bytes(b"old")
        tree_digest.old_dir(final).mkdir(parents=True)  # left by a cut swap
        tree_digest.data_cache(final).write_text("{}")
        staging = tree_digest.staging_dir(final)
        staging.mkdir()
        (staging / "new.db").write_bytes(b"new")
        aged(staging / "new.db")  # old enough for its hash to be cached
        want = hashlib.sha256(tree_digest.listing({"new.db": _sha(b"new")})).hexdigest()
        assert tree_digest.verify_and_promote(final, want)
        assert sorted(p.name for p in tmp_path.iterdir()) == [".monitord-copy", "area"]
        assert [p.name for p in tree_digest.copy_dir(final).iterdir()] == ["digests"]
        assert [p.name for p in final.iterdir()] == ["new.db"]
        assert set(tree_digest.load_cache(tree_digest.data_cache(final))) == {"new.db"}

    def test_a_staging_dir_listing_otherwise_is_left_and_the_tree_untouched(
        self, tmp_path: Path
    ) -> None:
        final = tmp_path / "area"
        final.mkdir()
        (final / "old.db").write_bytes(b"old")
        staging = tree_digest.staging_dir(final)
        staging.mkdir(parents=True)
        (staging / "new.db").write_bytes(b"torn")
        want = hashlib.sha256(tree_digest.listing({"new.db": _sha(b"new")})).hexdigest()
        assert not tree_digest.verify_and_promote(final, want)
        assert [p.name for p in final.iterdir()] == ["old.db"]
        assert [p.name for p in staging.iterdir()] == ["new.db"]

    def test_an_empty_area_never_staged_becomes_an_empty_tree(self, tmp_path: Path) -> None:
        final = tmp_path / "area"
        assert tree_digest.verify_and_promote(final, hashlib.sha256(b"").hexdigest())
        assert final.is_dir() and list(final.iterdir()) == []


class TestSwapIn:
    """Both sides' last step of a copy: the staging tree takes the final name by rename."""

    def test_a_final_that_is_a_symlink_is_moved_aside_never_followed(
        self, tmp_path: Path
    ) -> None:
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        (elsewhere / "keep").write_bytes(b"not ours")
        final = tmp_path / "area"
        final.symlink_to(elsewhere)
        staging = tmp_path / "staging"
        staging.mkdir()
        (staging / "new.db").write_bytes(b"new")
        tree_digest.swap_in(staging, final)
        assert not final.is_symlink() and [p.name for p in final.iterdir()] == ["new.db"]
        assert [p.name for p in elsewhere.iterdir()] == ["keep"]
        assert sorted(p.name for p in tmp_path.iterdir()) == [".monitord-copy", "area",
                                                              "elsewhere"]
        assert list((tmp_path / ".monitord-copy").iterdir()) == []


class TestStagedBlocks:
    """What a cut copy left in a staging dir, as the agent answers for it to resume from."""

    def test_each_file_by_its_blocks_empty_dirs_removed_symlinks_never_followed(
        self, tmp_path: Path
    ) -> None:
        final = tmp_path / "data" / "a1"
        staging = tree_digest.staging_dir(final)
        (staging / "db").mkdir(parents=True)
        (staging / "db" / "part.bin").write_bytes(b"p" * 10_000)
        (staging / "gone" / "deeper").mkdir(parents=True)
        (staging / "link").symlink_to(tmp_path / "secret")
        (tmp_path / "secret").write_bytes(b"not area data")
        found = tree_digest.staged_blocks(final)
        assert found == {"db/part.bin": tree_digest.file_blocks(staging, "db/part.bin")}
        assert not (staging / "gone").exists()

    def test_a_missing_staging_dir_is_made_and_holds_nothing(self, tmp_path: Path) -> None:
        final = tmp_path / "data" / "a2"
        assert tree_digest.staged_blocks(final) == {}
        assert tree_digest.staging_dir(final).is_dir()

    def test_too_many_files_answer_for_none(self, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(tree_digest, "MAX_BLOCK_PATHS", 3)
        final = tmp_path / "data" / "a3"
        staging = tree_digest.staging_dir(final)
        staging.mkdir(parents=True)
        for i in range(4):
            (staging / f"f{i}").write_bytes(b"x")
        assert tree_digest.staged_blocks(final) is None

    def test_digests_past_the_answer_bound_leave_that_file_whole(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(tree_digest, "BLOCK_DIGEST_BYTES", 20)  # one file's digests
        final = tmp_path / "data" / "a4"
        staging = tree_digest.staging_dir(final)
        staging.mkdir(parents=True)
        (staging / "a").write_bytes(b"a" * 4096)
        (staging / "b").write_bytes(b"b" * 4096)
        found = tree_digest.staged_blocks(final)
        assert found is not None and found["a"] is not None and found["b"] is None


# What a walk calls on the way (os.walk's islink and scandir among them): a hostile daemon
# user can swap a directory for a symlink between any two of them.
_WALK_CALLS = ("scandir", "listdir", "open", "stat", "lstat")


def _swap_at_call(monkeypatch: pytest.MonkeyPatch, k: int, swap: Callable[[], None]) -> None:
    """Run `swap` just before the k-th call (from 0) of any of _WALK_CALLS."""
    calls = 0

    def counted(real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls == k + 1:
                swap()  # (its own calls count past k)
            return real(*args, **kwargs)
        return call

    for name in _WALK_CALLS:
        monkeypatch.setattr(os, name, counted(getattr(os, name)))


class TestAWalkRacedBySymlinks:
    """Whatever moment of a walk the area's user swaps a directory under it for a symlink
    to the outside (monitord reads as root: an SSH key, the API token, /etc/shadow), nothing
    outside the tree is listed, hashed or opened."""

    @staticmethod
    def _tree(tmp_path: Path) -> tuple[Path, Callable[[], None]]:
        root = tmp_path / "area"
        (root / "sub").mkdir(parents=True)
        (root / "sub" / "keys").write_bytes(b"area data")
        (root / "top").write_bytes(b"t")
        outside = tmp_path / "etc"
        outside.mkdir()
        (outside / "keys").write_bytes(b"secret")
        (outside / "shadow").write_bytes(b"secret")

        def swap() -> None:
            if not (root / "sub").is_symlink():
                (root / "sub").rename(tmp_path / "was-sub")
                (root / "sub").symlink_to(outside)
        return root, swap

    def test_no_moment_of_the_walk_lets_a_symlinked_dir_in(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        for k in range(40):
            case = tmp_path / str(k)
            root, swap = self._tree(case)
            with monkeypatch.context() as m:
                _swap_at_call(m, k, swap)
                found, _ = tree_digest.digest_tree(root)
                listed = {rel for rel, _, _ in tree_digest.regular_files(root)}
            assert _sha(b"secret") not in {sha for _, sha in found.values()}, k
            assert "sub/shadow" not in listed | set(found), k

    def test_a_listed_file_is_opened_below_the_tree_never_through_a_swapped_dir(
        self, tmp_path: Path
    ) -> None:
        root, swap = self._tree(tmp_path)
        (_, _, st), = [e for e in tree_digest.regular_files(root) if e[0] == "sub/keys"]
        (tmp_path / "etc" / "keys").unlink()
        os.mkfifo(tmp_path / "etc" / "keys")  # a device whose open has an effect, as it were
        opened = threading.Event()

        def writer() -> None:  # returns once something opens the FIFO's other end
            os.close(os.open(tmp_path / "etc" / "keys", os.O_WRONLY))
            opened.set()

        thread = threading.Thread(target=writer, daemon=True)
        thread.start()
        swap()
        with pytest.raises(tree_digest.NotTheListedFile):
            os.close(tree_digest.open_listed(root, "sub/keys", (st.st_dev, st.st_ino)))
        was_opened = opened.wait(0.5)
        os.close(os.open(tmp_path / "etc" / "keys", os.O_RDONLY | os.O_NONBLOCK))
        thread.join(5)
        assert not was_opened, "the FIFO outside the tree was opened"


class TestOpenDirInside:
    """A directory under a tree is opened below its parent's fd, never through a symlink."""

    def test_a_directory_below_the_tree_is_opened_and_a_symlinked_one_refused(
        self, tmp_path: Path
    ) -> None:
        root = tmp_path / "area"
        (root / "db" / "deeper").mkdir(parents=True)
        (tmp_path / "etc").mkdir()
        (root / "link").symlink_to(tmp_path / "etc")
        for rel, inode in (("", root), ("db/deeper", root / "db" / "deeper")):
            fd = tree_digest.open_dir_inside(root, rel)
            try:
                assert os.path.samestat(os.fstat(fd), os.stat(inode))
            finally:
                os.close(fd)
        for rel in ("link", "db/../link", "/etc"):
            with pytest.raises(tree_digest.NotTheListedFile):
                os.close(tree_digest.open_dir_inside(root, rel))
        with pytest.raises(FileNotFoundError):
            tree_digest.open_dir_inside(root, "missing")

    def test_the_warm_snapshot_lives_in_the_copy_dir_and_goes_with_it(
        self, tmp_path: Path
    ) -> None:
        final = tmp_path / "data" / "area"
        assert tree_digest.warm_dir(final) == tree_digest.copy_dir(final) / "warm"
        tree_digest.warm_dir(final).mkdir(parents=True)
        tree_digest.forget(final)
        assert not tree_digest.copy_dir(final).exists()

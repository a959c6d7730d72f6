"""A warm snapshot of a live data dir is whole: a SQLite store another process keeps writing
comes out as one commit left it, a self-contained file; a file that never stops changing
fails the snapshot by name; anything else is copied byte for byte; nothing through a
symlink; and a snapshot that fails leaves the previous one as it was (real processes and
files, monitord/vps/warm_snapshot.py)."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from monitord.base import tree_digest
from monitord.vps import warm_snapshot
from monitord.vps.warm_snapshot import Kind, SnapshotFailed

STORE = "db/store.db"
GLOBS = ("db/*.db",)

# Commits a row at a time into a WAL store until its parent closes stdin or 60 s pass: the
# messenger daemon's session store, as the snapshot meets it.
WRITER = """
import sqlite3, sys, threading, time
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("PRAGMA journal_mode=WAL")
db.execute("CREATE TABLE IF NOT EXISTS rows (n INTEGER PRIMARY KEY, payload BLOB)")
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
deadline = time.monotonic() + 60
n = 0
while not done.is_set() and time.monotonic() < deadline:
    n += 1
    db.execute("BEGIN IMMEDIATE")
    db.execute("INSERT INTO rows VALUES (?, randomblob(2000))", (n,))
    db.execute("UPDATE rows SET payload = randomblob(2000) WHERE n = ?", (n // 2 + 1,))
    db.execute("COMMIT")
"""

# Rewrites pages of a file in place, without a pause, for as long as the writer above runs.
REWRITER = """
import os, sys, threading, time
fd = os.open(sys.argv[1], os.O_WRONLY)
size = os.fstat(fd).st_size
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
deadline = time.monotonic() + 60
offset = 0
while not done.is_set() and time.monotonic() < deadline:
    os.pwrite(fd, os.urandom(4096), offset)
    offset = (offset + 4096 * 7) % size
"""


@contextlib.contextmanager
def _running(script: str, path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`script` running on `path` in a Python process of its own, stopped on the way out."""
    process = subprocess.Popen([sys.executable, "-c", script, str(path)], stdin=subprocess.PIPE)
    try:
        yield process
    finally:
        assert process.stdin is not None
        process.stdin.close()  # the writer's sign to stop
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _rows(path: Path) -> int:
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        return int(db.execute("SELECT count(*) FROM rows").fetchone()[0])


def _wait_for_rows(path: Path, *, at_least: int) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with contextlib.suppress(sqlite3.Error):
            if path.exists() and _rows(path) >= at_least:
                return
        time.sleep(0.02)
    raise AssertionError(f"the writer wrote fewer than {at_least} rows in 20 s")


def _tree(root: Path) -> dict[str, bytes]:
    """Every file under root (no symlinks there to follow), by relative path."""
    return {p.relative_to(root).as_posix(): p.read_bytes()
            for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()}


def _data_dir(tmp_path: Path) -> Path:
    data_dir = tmp_path / "data" / "tg" / "area"
    (data_dir / "db").mkdir(parents=True)
    return data_dir


class TestClassify:
    """A file is a database by the area's globs over its relative path; a database's
    journal, WAL or WAL index is its sidecar, even where a glob would match it too."""

    @pytest.mark.parametrize(("rel", "kind"), [
        ("db/store.db", Kind.DATABASE),
        ("db/store.db-wal", Kind.SIDECAR),
        ("db/store.db-shm", Kind.SIDECAR),
        ("db/store.db-journal", Kind.SIDECAR),
        ("store.db", Kind.FILE),  # fnmatch's `*` crosses `/`, the glob's `db/` does not match
        ("db/deeper/x.db", Kind.DATABASE),
        ("db/store.db-wal2", Kind.FILE),
        ("media/a.jpg", Kind.FILE),
        ("DB/STORE.DB", Kind.FILE),  # case matters, on every platform
    ])
    def test_a_path_is_a_database_a_sidecar_or_a_file(self, rel: str, kind: Kind) -> None:
        assert warm_snapshot.classify(rel, GLOBS) is kind

    def test_a_glob_that_takes_everything_still_leaves_the_sidecars_out(self) -> None:
        assert [warm_snapshot.classify(rel, ("*",)) for rel in ("a", "a-wal", "a-shm")] == [
            Kind.DATABASE, Kind.SIDECAR, Kind.SIDECAR]
        assert warm_snapshot.classify("a-wal", ()) is Kind.FILE

    @pytest.mark.parametrize("glob", ["", "/abs/*.db", "a\0b", "x" * 256, 7, None])
    def test_a_glob_that_is_no_relative_pattern_is_refused(self, glob: object) -> None:
        assert warm_snapshot.glob_problem(glob) is not None

    @pytest.mark.parametrize("glob", ["*.db", "db/*.sqlite", "x" * 255, "[ab]?.db"])
    def test_a_relative_pattern_is_taken(self, glob: str) -> None:
        assert warm_snapshot.glob_problem(glob) is None


class TestALiveStore:
    """A WAL store another process commits to while snapshots are taken."""

    def test_every_snapshot_is_a_whole_store_of_one_commit_and_none_goes_back(
        self, tmp_path: Path
    ) -> None:
        data_dir = _data_dir(tmp_path)
        live = data_dir / STORE
        counts = []
        with _running(WRITER, live) as writer:
            _wait_for_rows(live, at_least=50)
            for _ in range(6):
                result = warm_snapshot.take(data_dir, sqlite=GLOBS)
                written = _rows(live)  # the writer's count once the snapshot was taken
                snapshot = tree_digest.warm_dir(data_dir) / STORE
                with contextlib.closing(sqlite3.connect(snapshot)) as db:
                    assert db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
                    assert db.execute("PRAGMA journal_mode").fetchone() == ("delete",)
                    count = db.execute("SELECT count(*), max(n) FROM rows").fetchone()
                assert count[0] == count[1], count  # every commit of a row whole, none torn
                assert count[0] <= written
                counts.append(count[0])
                assert result["databases"] == 1 and result["files"] == 1, result
                assert result["bytes"] == snapshot.stat().st_size
                time.sleep(0.05)
            assert writer.poll() is None, "the writer stopped before the snapshots were taken"
            # the live store's sidecars stay where they are, and none is in the snapshot
            assert {p.name for p in live.parent.iterdir()} >= {
                "store.db", "store.db-wal", "store.db-shm"}
            assert sorted(_tree(tree_digest.warm_dir(data_dir))) == [STORE]
        assert counts == sorted(counts) and counts[0] < counts[-1], counts

    def test_a_store_that_is_no_sqlite_database_fails_the_snapshot_by_name(
        self, tmp_path: Path
    ) -> None:
        data_dir = _data_dir(tmp_path)
        (data_dir / STORE).write_bytes(b"not a database, " * 512)
        with pytest.raises(SnapshotFailed, match="db/store.db"):
            warm_snapshot.take(data_dir, sqlite=GLOBS)
        assert not tree_digest.warm_dir(data_dir).exists()
        assert not warm_snapshot.new_dir(data_dir).exists()


class TestPlainFiles:
    """Every other file is copied whole, or the snapshot fails naming it."""

    def test_a_still_file_is_copied_byte_for_byte(self, tmp_path: Path) -> None:
        data_dir = _data_dir(tmp_path)
        files = {"media/a/b.jpg": os.urandom(3 << 20), "config.json": b"{}", "empty": b""}
        for rel, data in files.items():
            (data_dir / rel).parent.mkdir(parents=True, exist_ok=True)
            (data_dir / rel).write_bytes(data)
        result = warm_snapshot.take(data_dir, sqlite=GLOBS)
        assert _tree(tree_digest.warm_dir(data_dir)) == files
        assert (result["files"], result["bytes"], result["databases"]) == (
            3, sum(map(len, files.values())), 0)
        assert result["took_s"] >= 0 and result["cpu_s"] >= 0
        assert abs(result["taken_at"] - time.time()) < 60

    def test_a_file_written_once_just_before_the_snapshot_is_copied(
        self, tmp_path: Path
    ) -> None:
        """Where timestamps are a clock tick coarse, one written in the tick the copy began
        is copied again once the clock moved on: recent is not the same as changing."""
        data_dir = _data_dir(tmp_path)
        for k in range(20):
            (data_dir / "fresh").write_bytes(b"%d" % k)
            warm_snapshot.take(data_dir, sqlite=GLOBS)
            assert (tree_digest.warm_dir(data_dir) / "fresh").read_bytes() == b"%d" % k

    def test_a_file_rewritten_all_the_time_fails_the_snapshot_by_name(
        self, tmp_path: Path
    ) -> None:
        data_dir = _data_dir(tmp_path)
        churned = data_dir / "media.bin"
        # Two writers, and a file whose copy (and fsync) takes a while: a try is a window in
        # which neither writes, longer than a busy machine leaves both without a core.
        churned.write_bytes(os.urandom(32 << 20))
        with _running(REWRITER, churned) as one, _running(REWRITER, churned) as other:
            time.sleep(0.2)  # (well under way)
            with pytest.raises(SnapshotFailed, match="media.bin.*3 times"):
                warm_snapshot.take(data_dir, sqlite=GLOBS)
            assert one.poll() is None and other.poll() is None
        assert not warm_snapshot.new_dir(data_dir).exists()

    def test_a_symlink_is_neither_followed_nor_copied(self, tmp_path: Path) -> None:
        data_dir = _data_dir(tmp_path)
        outside = tmp_path / "outside"
        outside.mkdir()
        (outside / "secret").write_bytes(b"not the area's")
        (outside / "store.db").write_bytes(b"")
        (data_dir / "session").write_bytes(b"the area's")
        (data_dir / "shadow").symlink_to(outside / "secret")
        (data_dir / "elsewhere").symlink_to(outside)
        (data_dir / "db" / "linked.db").symlink_to(outside / "store.db")
        result = warm_snapshot.take(data_dir, sqlite=GLOBS)
        warm = tree_digest.warm_dir(data_dir)
        assert _tree(warm) == {"session": b"the area's"}
        assert not any(p.is_symlink() for p in warm.rglob("*"))
        assert result["files"] == 1


class TestTheSwap:
    """A snapshot replaces the previous one whole, and only once it is complete."""

    def test_a_failed_snapshot_leaves_the_previous_one_untouched_and_no_new_dir(
        self, tmp_path: Path
    ) -> None:
        data_dir = _data_dir(tmp_path)
        (data_dir / "session").write_bytes(b"first")
        warm_snapshot.take(data_dir, sqlite=GLOBS)
        warm = tree_digest.warm_dir(data_dir)
        before = {p.relative_to(warm): os.lstat(p) for p in warm.rglob("*")}
        (data_dir / "session").write_bytes(b"second")
        (data_dir / STORE).write_bytes(b"torn" * 1024)  # a store SQLite will not read
        with pytest.raises(SnapshotFailed):
            warm_snapshot.take(data_dir, sqlite=GLOBS)
        assert _tree(warm) == {"session": b"first"}
        assert {p.relative_to(warm): tree_digest.identity(os.lstat(p))
                for p in warm.rglob("*")} == {
            rel: tree_digest.identity(st) for rel, st in before.items()}
        assert not warm_snapshot.new_dir(data_dir).exists()

    def test_a_new_dir_a_crash_left_is_not_taken_for_the_snapshot(
        self, tmp_path: Path
    ) -> None:
        data_dir = _data_dir(tmp_path)
        (data_dir / "session").write_bytes(b"now")
        left = warm_snapshot.new_dir(data_dir)
        left.mkdir(parents=True)
        (left / "half-copied").write_bytes(b"x")
        warm_snapshot.take(data_dir, sqlite=GLOBS)
        assert _tree(tree_digest.warm_dir(data_dir)) == {"session": b"now"}
        assert sorted(p.name for p in tree_digest.copy_dir(data_dir).iterdir()) == ["warm"]

    def test_no_data_dir_is_no_snapshot(self, tmp_path: Path) -> None:
        with pytest.raises(SnapshotFailed, match="no data dir"):
            warm_snapshot.take(tmp_path / "missing", sqlite=GLOBS)
        assert not tree_digest.copy_dir(tmp_path / "missing").exists()


def _command(script: str, *, timeout_s: float = 10.0) -> warm_snapshot.Command:
    return warm_snapshot.Command(argv=(sys.executable, "-c", script),
                                 env={"PATH": os.environ.get("PATH", "")}, popen={},
                                 timeout_s=timeout_s)


class TestTheServicesOwnCommand:
    """`warm_copy = {command = [...]}`: what the service's command leaves in the new dir is
    the snapshot, fsynced and swapped in; a command that fails or overruns leaves the
    previous snapshot and says why."""

    def test_what_it_leaves_in_the_snapshot_dir_is_the_snapshot(self, tmp_path: Path) -> None:
        data = tmp_path / "data"
        data.mkdir()
        (data / "live.bin").write_bytes(b"the daemon's")
        taken = warm_snapshot.take(data, command=_command(
            "import os, pathlib, shutil\n"
            "out = pathlib.Path(os.environ['MONITORD_SNAPSHOT_DIR'])\n"
            "assert pathlib.Path.cwd() == pathlib.Path(os.environ['MONITORD_DATA_DIR'])\n"
            "(out / 'db').mkdir()\n"
            "shutil.copy('live.bin', out / 'db' / 'dump.bin')\n"
            "os.symlink('/etc/passwd', out / 'passwd')\n"))
        warm = tree_digest.warm_dir(data)
        assert {p.relative_to(warm).as_posix() for p in warm.rglob("*")
                if p.is_file() and not p.is_symlink()} == {"db/dump.bin"}
        assert (taken["files"], taken["bytes"], taken["databases"]) == (1, 12, 0)
        assert not warm.with_name("warm.new").exists()

    def test_a_failing_command_is_named_with_the_end_of_its_output(
        self, tmp_path: Path
    ) -> None:
        data = tmp_path / "data"
        data.mkdir()
        warm_snapshot.take(data, command=_command(
            "import os; open(os.environ['MONITORD_SNAPSHOT_DIR'] + '/a', 'w').write('1')"))
        before = tree_digest.warm_dir(data).joinpath("a").read_bytes()
        with pytest.raises(SnapshotFailed, match="(?s)exited with status 3: .*store locked$"):
            warm_snapshot.take(data, command=_command(
                "import sys; print('x' * 5000, flush=True); print('store locked', file=sys.stderr);"
                " sys.exit(3)"))
        assert tree_digest.warm_dir(data).joinpath("a").read_bytes() == before
        assert not tree_digest.warm_dir(data).with_name("warm.new").exists()

    def test_a_command_past_its_time_is_killed_with_its_children(
        self, tmp_path: Path
    ) -> None:
        data = tmp_path / "data"
        data.mkdir()
        marker = tmp_path / "child.pid"
        started = time.monotonic()
        with pytest.raises(SnapshotFailed, match="ran past 0.5 s"):
            warm_snapshot.take(data, command=_command(
                "import os, subprocess, sys, time\n"
                f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                f"open({str(marker)!r}, 'w').write(str(child.pid))\n"
                "time.sleep(60)\n", timeout_s=0.5))
        assert time.monotonic() - started < 10
        child = int(marker.read_text())
        for _ in range(100):  # (reaped by nobody here: gone or a zombie of init's)
            try:
                state = Path(f"/proc/{child}/stat").read_text().split()[2]
            except FileNotFoundError:
                break
            if state == "Z":
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"the command's child {child} outlived the timeout")

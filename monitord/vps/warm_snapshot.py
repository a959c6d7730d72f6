"""A consistent snapshot of a live area's data dir, taken on the VPS while its daemon writes it.

A warm copy keeps the PBX's copy of a remote area close to the VPS's without stopping the
area: the PBX asks the agent for a snapshot now and then (`POST /v1/areas/{area}/copy/snapshot`,
monitord.vps.runtime) and downloads it with the copy routes, which read any dir inside the
agent's, as they read a data dir. A copy of the live dir itself could be torn: a store
written during the copy, a file half rewritten.

`take` builds the snapshot in `warm.new` beside `tree_digest.warm_dir(data_dir)`, then swaps
it in for the previous one by rename (every file and directory fsynced first, the parent
after): a reader of `warm/` sees a whole snapshot, and a failure leaves the previous one as it
was. The walk is `tree_digest.regular_files`: no symlink followed or copied, no FIFO opened.
What a file is, by its path against the area's `sqlite` globs (`classify`):

- a database: copied with SQLite's backup API from a read-only connection, in one read
  transaction, so the copy is the store as one commit left it; the copy is set back to the
  rollback journal (`journal_mode=DELETE`), one self-contained file. The connection opens
  the store through its parent dir's fd (`/proc/self/fd/N/name`) so that SQLite finds the
  `-wal` and `-shm` beside it, and the name's inode is the same regular file before and
  after. SQLite resolves that fd's link to the dir's path when it connects, so this pins the
  dir the walk entered, not the open itself.
- a database's sidecar (`{db}-wal`, `-shm`, `-journal`): left out, its content is in the
  backup.
- any other file: copied as it is, and again (up to MAX_TRIES in all) while its stat
  identity changed during the copy or it was written in the same timestamp tick as the copy
  began (`tree_digest.cacheable`, git's "racy clean" rule); then SnapshotFailed names it.

Each file is whole; files are not consistent with each other beyond that (two files the
daemon writes together may be of two moments). A service that knows better names its own
`Command`: run as the area's user in the data dir, it leaves its consistent copy in the new
dir (MONITORD_SNAPSHOT_DIR), which is then fsynced and swapped in the same way. Standard
library only, Python >= 3.9: it runs on the VPS. The agent runs `take` in a thread
(monitord/vps/runtime.py, `snapshot`).
"""

from __future__ import annotations

import contextlib
import enum
import fnmatch
import os
import signal
import sqlite3
import stat
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from monitord.base import tree_digest
from monitord.base.atomic_file import fsync_path

# How often a file that changed while it was copied is copied again before the snapshot fails:
# a file rewritten now and then gets through, one rewritten all the time cannot be copied whole.
MAX_TRIES = 3
# The area's database globs, as a request may name them.
MAX_GLOBS = 64
MAX_GLOB_CHARS = 255
SIDECAR_SUFFIXES = ("-wal", "-shm", "-journal")
# How long the backup's read transaction waits for a writer's lock (a rollback-journal store's
# commit, a WAL's recovery): longer, and this snapshot fails; the next one tries again.
BUSY_TIMEOUT_S = 5.0
# The longest a retry waits for the file system's clock to pass a file's last change: past
# the 2 s of the coarsest timestamps (FAT), never more than that per file.
_TICK_WAIT_S = 2.5
_CHUNK = 1 << 20
_DIR_MODE = 0o700
_FILE_MODE = 0o600  # the agent's own copy: only the agent (and the copy, as its user) reads it


class SnapshotFailed(Exception):
    """No consistent snapshot could be taken (a file kept changing, a store SQLite would
    not read): `detail` says which file and why. The previous snapshot is left as it was."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class Kind(enum.Enum):
    """How a file of the data dir goes into the snapshot."""

    DATABASE = "database"  # SQLite's backup
    SIDECAR = "sidecar"  # a database's journal or WAL index: left out
    FILE = "file"  # copied, checked for change


def glob_problem(glob: object) -> str | None:
    """Why `glob` cannot be one of an area's database globs, or None: a pattern relative to
    the data dir (fnmatch, matched against a file's relative POSIX path)."""
    if not isinstance(glob, str) or not glob:
        return "must be a non-empty string"
    if len(glob) > MAX_GLOB_CHARS:
        return f"must be at most {MAX_GLOB_CHARS} characters"
    if "\0" in glob:
        return "must not hold NUL"
    if glob.startswith("/"):
        return "must be relative to the data dir"
    return None


def classify(rel: str, globs: Sequence[str]) -> Kind:
    """What the file at relative POSIX path `rel` is for a snapshot: a sidecar of a database
    goes first, so that a glob `*` does not make `x.db-wal` a database of its own."""
    for suffix in SIDECAR_SUFFIXES:
        if rel.endswith(suffix) and _matches(rel[: -len(suffix)], globs):
            return Kind.SIDECAR
    return Kind.DATABASE if _matches(rel, globs) else Kind.FILE


def _matches(rel: str, globs: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(rel, glob) for glob in globs)


def new_dir(data_dir: Path) -> Path:
    """Where the next snapshot of `data_dir` is put together."""
    return tree_digest.warm_dir(data_dir).with_name("warm.new")


def _old_dir(data_dir: Path) -> Path:
    """Where the previous snapshot waits while the new one is renamed in."""
    return tree_digest.warm_dir(data_dir).with_name("warm.old")


@dataclass
class _Tally:
    files: int = 0
    bytes: int = 0
    databases: int = 0


@dataclass(frozen=True)
class Command:
    """A service's own way to snapshot its data (`warm_copy = {command = [...]}`): `argv`
    run in the data dir as the area's user (`popen`: run_as.popen_kwargs), with `env` and
    MONITORD_SNAPSHOT_DIR naming the empty dir it must leave a consistent copy in; it has
    `timeout_s` to exit 0. `hand_over` gives it that dir (run_as.hand_over)."""

    argv: Sequence[str]
    env: Mapping[str, str]
    popen: Mapping[str, Any]
    timeout_s: float
    hand_over: Callable[[Path], None] | None = None


# What a failed command's detail quotes of its output (the end: where errors are).
OUTPUT_TAIL_BYTES = 2048


def take(data_dir: Path, *, sqlite: Sequence[str] = (),
         command: Command | None = None) -> dict[str, Any]:
    """Snapshot the live `data_dir` into `tree_digest.warm_dir(data_dir)`, replacing the
    previous snapshot (see the module docstring) — or, with `command`, what the service's
    own command leaves in the new dir (`_run`). `{"taken_at"` (wall clock when the walk
    began), `"files"`, `"bytes"`, `"databases"` (how many of the files are SQLite backups),
    `"took_s"`, `"cpu_s"` (this thread's CPU time; a command's own is not counted)`}`.
    SnapshotFailed, or an OSError of the file system: the previous snapshot is untouched
    either way."""
    globs = tuple(sqlite)
    started, cpu = time.monotonic(), time.thread_time()
    warm, new, old = tree_digest.warm_dir(data_dir), new_dir(data_dir), _old_dir(data_dir)
    tree_digest.remove_path(new)  # what a crash left
    tree_digest.remove_path(old)
    try:
        top = os.lstat(data_dir)
    except FileNotFoundError:
        top = None
    if top is None or not stat.S_ISDIR(top.st_mode):
        raise SnapshotFailed(f"{data_dir}: no data dir to take a snapshot of")
    new.mkdir(parents=True, mode=_DIR_MODE)
    taken_at = time.time()
    try:
        if command is None:
            tally = _fill(data_dir, new, globs)
        else:
            _run(command, data_dir, new)
            tally = _settle(new)
        _swap(new, warm, old)
    except BaseException:
        with contextlib.suppress(OSError):  # (a leftover goes at the next take's start)
            tree_digest.remove_path(new)
        raise
    return {"taken_at": taken_at, "files": tally.files, "bytes": tally.bytes,
            "databases": tally.databases, "took_s": round(time.monotonic() - started, 3),
            "cpu_s": round(time.thread_time() - cpu, 3)}


def discard(data_dir: Path) -> None:
    """Remove every snapshot of `data_dir` (its area is gone: `tree_digest.forget` did it, or
    is about to)."""
    for path in (tree_digest.warm_dir(data_dir), new_dir(data_dir), _old_dir(data_dir)):
        tree_digest.remove_path(path)


def _fill(root: Path, new: Path, globs: Sequence[str]) -> _Tally:
    tally = _Tally()
    made = [new]
    # The racy-clean reference of every first try (see `_copy_file`), read from the clock the
    # data dir's timestamps come from, as tree_digest.digest_tree reads it.
    epoch = tree_digest.epoch_ns(root.parent)
    for rel, _, _ in tree_digest.regular_files(root):
        kind = classify(rel, globs)
        if kind is Kind.SIDECAR:
            continue
        dest = new / rel
        made += _make_parents(new, rel)
        if kind is Kind.DATABASE:
            size = _backup_database(root, rel, dest)
        else:
            size = _copy_file(root, rel, dest, epoch=epoch)
        if size is None:
            continue  # gone since the walk, or no longer a regular file
        tally.files += 1
        tally.bytes += size
        if kind is Kind.DATABASE:
            tally.databases += 1
    for directory in made:
        fsync_path(directory, follow_symlinks=False)
    return tally


def _run(command: Command, data_dir: Path, new: Path) -> None:
    """The service's command, its own process group (so that a timeout kills all of it),
    output to a file beside the snapshot (bounded by the disk, not memory); SnapshotFailed
    unless it exits 0 within its time, quoting the end of what it wrote."""
    if command.hand_over is not None:
        command.hand_over(new)
    output = new.with_name("warm.out")
    env = {**command.env, "MONITORD_SNAPSHOT_DIR": str(new), "MONITORD_DATA_DIR": str(data_dir)}
    with open(output, "w+b") as out:
        try:
            child = subprocess.Popen(list(command.argv), cwd=data_dir, env=env,
                                     stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                     start_new_session=True, **command.popen)
        except OSError as e:
            raise SnapshotFailed(f"the snapshot command did not start: {e.strerror or e}") from e
        try:
            status = child.wait(timeout=command.timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            status = None
        out.seek(max(0, out.seek(0, os.SEEK_END) - OUTPUT_TAIL_BYTES))
        tail = out.read().decode("utf-8", "replace").strip()
    os.unlink(output)
    said = f": {tail}" if tail else ""
    if status is None:
        raise SnapshotFailed(f"the snapshot command ran past {command.timeout_s:g} s{said}")
    if status != 0:
        raise SnapshotFailed(f"the snapshot command exited with status {status}{said}")


def _settle(new: Path) -> _Tally:
    """What a command left in `new`, fsynced: its regular files (a symlink is neither
    followed nor counted: a copy never carries one) and every dir."""
    tally = _Tally()
    for _, path, st in tree_digest.regular_files(new):
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        tally.files += 1
        tally.bytes += st.st_size
    for directory, _, _ in os.walk(new):
        fsync_path(Path(directory), follow_symlinks=False)
    return tally


def _make_parents(new: Path, rel: str) -> list[Path]:
    """Make the dirs of `new / rel` that are missing; the ones made."""
    made = []
    where = new
    for part in rel.split("/")[:-1]:
        where = where / part
        if not where.is_dir():
            where.mkdir(mode=_DIR_MODE)
            made.append(where)
    return made


def _copy_file(root: Path, rel: str, dest: Path, *, epoch: int) -> int | None:
    """Copy root/rel to `dest` whole (fsynced): its size, or None when it is gone or no
    regular file now. The first try opens the file the walk listed; a try that meets a
    change tries again with what is at the name then (an atomic writer renames a new file
    in) and a fresh epoch."""
    after: os.stat_result | None = None  # the last try's, once there was one
    for _ in range(MAX_TRIES):
        if after is not None:
            epoch = _epoch_past(root.parent, after)
        try:
            fd = tree_digest.open_inside(root, rel)
        except (FileNotFoundError, NotADirectoryError, tree_digest.NotTheListedFile):
            return None
        with os.fdopen(fd, "rb") as src:
            before = os.fstat(fd)
            size = _write(src, dest)
            after = os.fstat(fd)
        if tree_digest.cacheable(before, after, epoch) is not None:
            return size
    raise SnapshotFailed(f"{rel}: changed while it was copied, {MAX_TRIES} times in a row")


def _epoch_past(directory: Path, last: os.stat_result) -> int:
    """An epoch (tree_digest.epoch_ns) later than the last change `last` shows, waiting for
    the file system's clock to tick past it (a few ms; at most _TICK_WAIT_S): a file written
    once just before its copy began is copied whole on the next try, not failed for being
    recent three times within one tick."""
    changed = max(last.st_mtime_ns, last.st_ctime_ns)
    deadline = time.monotonic() + _TICK_WAIT_S
    while True:
        epoch = tree_digest.epoch_ns(directory)
        if epoch > changed or time.monotonic() >= deadline:
            return epoch
        time.sleep(0.005)


def _write(src: Any, dest: Path) -> int:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
    size = 0
    with os.fdopen(os.open(dest, flags, _FILE_MODE), "wb") as out:
        while True:
            chunk = src.read(_CHUNK)
            if not chunk:
                break
            out.write(chunk)
            size += len(chunk)
        out.flush()
        os.fsync(out.fileno())
    return size


def _backup_database(root: Path, rel: str, dest: Path) -> int | None:
    """SQLite's backup of the store root/rel into `dest`, a single file (fsynced): its size,
    or None when the store or its dir is gone or no longer what the walk entered. The name
    must be the same regular inode after the backup as before, else it is taken again (up
    to MAX_TRIES)."""
    parent, _, name = rel.rpartition("/")
    for _ in range(MAX_TRIES):
        try:
            dirfd = tree_digest.open_dir_inside(root, parent)
        except (FileNotFoundError, tree_digest.NotTheListedFile):
            return None
        try:
            before = _regular_inode(dirfd, name)
            if before is None:
                return None
            # SQLite finds `{name}-wal` and `-shm` beside this name: the store's own dir.
            uri = f"file:/proc/self/fd/{dirfd}/{quote(os.fsencode(name), safe='')}?mode=ro"
            tree_digest.remove_path(dest)  # (a try before this one's)
            try:
                _backup(uri, dest)
            except sqlite3.Error as e:
                raise SnapshotFailed(f"{rel}: SQLite cannot back it up: {e}") from e
            same = _regular_inode(dirfd, name) == before
        finally:
            os.close(dirfd)
        if same:
            return _settled(rel, dest)
    raise SnapshotFailed(f"{rel}: replaced while it was backed up, {MAX_TRIES} times in a row")


def _regular_inode(dirfd: int, name: str) -> tuple[int, int] | None:
    """(device, inode) of the regular file `name` in `dirfd` (never through a symlink),
    None when there is none."""
    try:
        st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISREG(st.st_mode) else None


def _backup(uri: str, dest: Path) -> None:
    src = sqlite3.connect(uri, uri=True, timeout=BUSY_TIMEOUT_S, isolation_level=None)
    try:
        # The read transaction first: it waits for a writer's lock within the busy timeout
        # (a backup step alone retries a busy store for ever), and the backup reads in it.
        src.execute("BEGIN")
        src.execute("SELECT count(*) FROM sqlite_master").fetchone()
        # (made empty first, as the copy's other files are made: SQLite would make it 0644)
        os.close(os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, _FILE_MODE))
        dst = sqlite3.connect(dest, isolation_level=None)
        try:
            src.backup(dst)  # in one step: the pages of one commit
            # The backup copies the store's header, WAL mode included: a snapshot is one
            # self-contained file, whatever reads it next.
            (mode,) = dst.execute("PRAGMA journal_mode=DELETE").fetchone()
        finally:
            dst.close()
    finally:
        src.close()
    if str(mode).lower() != "delete":
        raise sqlite3.OperationalError(f"its copy stays in journal mode {mode}")


def _settled(rel: str, dest: Path) -> int:
    """The size of the backup `dest`, fsynced, once it is one file: no sidecar beside it."""
    for suffix in SIDECAR_SUFFIXES:
        if os.path.lexists(f"{dest}{suffix}"):
            raise SnapshotFailed(f"{rel}: its copy left a {suffix} file beside it")
    fsync_path(dest, follow_symlinks=False)
    return os.lstat(dest).st_size


def _swap(new: Path, warm: Path, old: Path) -> None:
    """`new` in place of `warm` by rename, the previous snapshot moved aside first and put
    back if the rename fails; removed once the renames are on disk."""
    had = os.path.lexists(warm)
    if had:
        os.rename(warm, old)
    try:
        os.rename(new, warm)
    except BaseException:
        if had:
            os.rename(old, warm)
        raise
    fsync_path(warm.parent)
    tree_digest.remove_path(old)

"""The PBX's side of a copy: one area's local data dir and its staging dir.

What is read here is listed first (`manifest`, `pre_listing`); what is written here comes
from the VPS, so it is written only through directory fds with O_NOFOLLOW and O_EXCL
(`create_inside`): a symlink found, or planted, in the staging dir is refused, never
followed. A staging dir replaces the data dir only fsynced whole (`promote`); what a
pre-copy wrote and fsynced before the stop (`settle`) is not fsynced again while the area
is down. A download that starts from a copy the PBX already has (`delta_target`: the
pre-copy's staged file, or a file of the area's own data dir or archive) writes the fetched
blocks in place and reads the result back whole for its SHA-256 (`finish_delta`). All of it
is blocking file I/O, run in a thread by monitord.remote.copy.transfer.

A file system error here is named by its cause (`local_file_error`): ENOSPC/EDQUOT is
LOCAL_DISK_FULL with the free space found, EACCES/EPERM/EROFS LOCAL_PERMISSION_DENIED,
ENAMETOOLONG NAME_TOO_LONG (orchestrator.errors.file_error_code); anything else refuses the
copy (COPY_INCOMPLETE).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, cast

from monitord.base import tree_digest
from monitord.base.atomic_file import fsync_path
from monitord.remote.copy.listing import incomplete, name_problem
from orchestrator import block_delta, disk_space
from orchestrator.block_delta import Blocks
from orchestrator.errors import ErrorCode, MonitordError, error_for, file_error_code

_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True)
class FileEntry:
    path: str  # relative, POSIX separators
    size: int
    sha256: str
    identity: tree_digest.Identity | None = None  # the file hashed (its device and inode)


@dataclass(frozen=True, slots=True)
class Fetched:
    """One file written into the staging dir from the bytes the VPS sent."""

    size: int
    sha256: str
    written: os.stat_result  # the file's stat right after its last byte was written


def manifest(root: Path, cache: tree_digest.Cache | None = None) -> tuple[FileEntry, ...]:
    """Every regular file under root (sorted), with size and SHA-256; a file unchanged since
    `cache` recorded it is not read again. Missing root: empty."""
    opened: dict[str, tree_digest.Identity] = {}
    found, _ = tree_digest.digest_tree(root, cache, opened=opened)
    return tuple(FileEntry(rel, size, sha, opened.get(rel))
                 for rel, (size, sha) in sorted(found.items()))


def tree_sha256(root: Path) -> str:
    """SHA-256 of root's listing (tree-digest's format, every file read): one value that
    says whether a tree is still exactly the one recorded."""
    return hashlib.sha256(tree_digest.listing(
        {e.path: e.sha256 for e in manifest(root)})).hexdigest()


def pre_listing(root: Path) -> tuple[int, list[tuple[str, os.stat_result]]]:
    """(the epoch of root's filesystem, taken before anything is read; the regular files
    under root with names a copy can carry, each with its lstat). No hashing: a pre-copy
    hashes what it sends."""
    if not root.is_dir():
        return 0, []
    epoch = tree_digest.epoch_ns(root.parent)
    return epoch, sorted(((rel, st) for rel, _, st in tree_digest.regular_files(root)
                          if name_problem(rel) is None), key=lambda listed: listed[0])


def sizes(root: Path, names: list[str]) -> list[int]:
    """The sizes of root/name for `names` (0 for one gone since it was listed)."""
    out = []
    for name in names:
        try:
            out.append((root / name).lstat().st_size)
        except OSError:
            out.append(0)
    return out


def local_file_error(error: OSError, *, during: str) -> MonitordError:
    """The catalogue error for a file system error on the PBX (the module doc); a full disk
    names its free space."""
    code = file_error_code(error.errno, remote=False)
    where = str(error.filename or "")
    place = f"{where}: " if where else ""
    what = f"{during}: {place}{error.strerror or error}"
    if code is None:
        return incomplete(what)
    if code is ErrorCode.LOCAL_DISK_FULL and where:
        with contextlib.suppress(OSError):
            st = os.statvfs(_existing(Path(where)))
            free = st.f_bavail * st.f_frsize
            return error_for(code, f"{what} — PBX: {free} bytes free there",
                             facts={"side": "PBX", "path": str(where), "free_bytes": free})
    return error_for(code, what)


def ensure_room(staging: Path, sizes: Iterable[int]) -> None:
    """LOCAL_DISK_FULL, before a byte is written, when the files a download is to fetch
    (`sizes`, as the VPS declared them) and the margin do not fit where `staging` is put
    together (orchestrator/disk_space.py): a VPS may declare anything, and that disk is the
    one state.db and the logs write to."""
    where = _existing(staging)
    st = os.statvfs(where)
    free = disk_space.Free(bytes=st.f_bavail * st.f_frsize, inodes=st.f_favail,
                           total_inodes=st.f_files)
    short = disk_space.shortage(side="PBX", path=str(where),
                                usage=disk_space.footprint(sizes), free=free)
    if short is not None:
        raise error_for(ErrorCode.LOCAL_DISK_FULL, f"download refused: {short.detail()}",
                        facts=short.facts())


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def staging_of(final: Path) -> Path:
    """The staging dir of a local data dir (monitord.base.tree_digest.staging_dir)."""
    return tree_digest.staging_dir(final)


def create_inside(root: Path, rel: str, *, readable: bool = False) -> BinaryIO:
    """A new file root/rel opened for writing (and reading, if `readable`), never through a
    symlink.

    rel is already validated (name_problem). The resolved path must lie strictly inside
    root; each directory on the way is created or opened relative to its parent's fd with
    O_NOFOLLOW and the file is created with O_EXCL|O_NOFOLLOW, so a symlink found (or
    planted) in the staging dir is refused, never followed."""
    mode = os.O_RDWR if readable else os.O_WRONLY
    return _open_inside(root, rel, mode | os.O_CREAT | os.O_EXCL, "w+b" if readable else "wb")


def open_inside(root: Path, rel: str) -> BinaryIO:
    """The file root/rel a pre-copy wrote, opened to be read and changed in place, as
    `create_inside` would have created it (no symlink followed on the way or at the end)."""
    return _open_inside(root, rel, os.O_RDWR, "r+b")


def _open_inside(root: Path, rel: str, flags: int, mode: str) -> BinaryIO:
    resolved_root = root.resolve()
    resolved = (root / rel).resolve()
    if resolved == resolved_root or not resolved.is_relative_to(resolved_root):
        raise incomplete(f"refusing to write {rel!r}: it resolves outside {root}")
    *dirs, name = rel.split("/")
    dir_flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(root, dir_flags)
    try:
        for part in dirs:
            try:
                os.mkdir(part, dir_fd=fd)
            except FileExistsError:
                pass
            except OSError as e:
                if file_error_code(e.errno, remote=False) is not None:
                    e.filename = str(root / part)
                    raise local_file_error(e, during=f"writing {rel!r}") from e
                raise
            try:
                child = os.open(part, dir_flags, dir_fd=fd)
            except OSError as e:  # ELOOP / ENOTDIR: a symlink or a file is in the way
                raise incomplete(f"refusing to write {rel!r}: {part!r} is not a directory"
                                 f" ({e.strerror})") from e
            os.close(fd)
            fd = child
        try:
            out = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666, dir_fd=fd)
        except OSError as e:
            if file_error_code(e.errno, remote=False) is not None:
                e.filename = str(root / rel)
                raise local_file_error(e, during=f"writing {rel!r}") from e
            raise incomplete(f"refusing to write {rel!r}: {e.strerror}") from e
    finally:
        os.close(fd)
    if not stat.S_ISREG(os.fstat(out).st_mode):
        os.close(out)
        raise incomplete(f"refusing to write {rel!r}: not a regular file")
    return cast(BinaryIO, os.fdopen(out, mode))  # (a binary mode, "wb", "w+b" or "r+b")


def delta_target(staging: Path, rel: str, basis: Path | None, *,
                 have: Blocks | None = None) -> tuple[BinaryIO, Blocks]:
    """Where a download of rel starts from a copy the PBX already has, and that copy's block
    digests (orchestrator/block_delta.py): staging/rel made a copy of basis/rel (the PBX's
    own copy of the area, read as the agent reads the VPS's: tree_digest.open_inside, no
    symlink on the way, no FIFO), or, with no basis, staging/rel as a pre-copy left it
    (`have`: its digests, read already: `staged_blocks`). Opened to be changed in place."""
    if basis is None:
        out = open_inside(staging, rel)
        if have is not None:
            return out, have
        try:
            with _named(staging / rel, during=f"reading {rel!r}"):
                return out, tree_digest.read_blocks(out)
        except BaseException:
            out.close()
            raise
    try:
        fd = tree_digest.open_inside(basis, rel)
    except (FileNotFoundError, NotADirectoryError, tree_digest.NotTheListedFile) as e:
        raise incomplete(f"refusing {basis / rel} as a basis: {e.strerror or e}") from e
    with os.fdopen(fd, "rb") as source:
        out = create_inside(staging, rel, readable=True)
        try:
            # (a full disk shows here first: the basis is copied in before any run is fetched)
            with _named(staging / rel, during=f"copying {basis / rel} in"):
                have = tree_digest.read_blocks(source, copy_to=out)
                out.flush()  # before the fetched runs are written at their offsets, by fd
            return out, have
        except BaseException:
            out.close()
            raise


def finish_delta(out: BinaryIO, size: int, *, path: Path) -> Fetched:
    """The file a delta was written into (`path`) cut or extended to `size`, then read back
    whole: what it now holds (its SHA-256 decides, not the block digests)."""
    with _named(path, during="download"):
        out.flush()
        os.ftruncate(out.fileno(), size)
        out.seek(0)
        digest = hashlib.sha256()
        while chunk := out.read(_CHUNK):
            digest.update(chunk)
        return Fetched(size, digest.hexdigest(), os.fstat(out.fileno()))


@contextlib.contextmanager
def _named(path: Path, *, during: str) -> Iterator[None]:
    """A file system error of the PBX's own file work named by its cause (`local_file_error`),
    before the SFTP session it runs inside could take it for a lost link."""
    try:
        yield
    except OSError as e:
        if e.filename is None:
            e.filename = str(path)
        raise local_file_error(e, during=during) from e


def reset_dir(path: Path) -> None:
    """path made again, empty."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)


def remove(path: Path) -> None:
    """A refused copy's staging dir, gone (nothing of a refused listing is kept), and the
    area's copy dir with it if nothing else is left there."""
    shutil.rmtree(path, ignore_errors=True)
    with contextlib.suppress(OSError):
        path.parent.rmdir()


def prune_to(root: Path, keep: set[str]) -> None:
    """Leave under root only the regular files named in `keep` (what a pre-copy staged and
    is still current); anything else — changed, gone, half-written, a symlink — goes."""
    if not root.is_dir():
        root.mkdir(parents=True)
        return
    for dirpath, dirs, names in os.walk(root):
        for name in [*names, *(d for d in dirs if (Path(dirpath) / d).is_symlink())]:
            full = Path(dirpath) / name
            rel = full.relative_to(root).as_posix()
            if rel not in keep or full.is_symlink():
                full.unlink()


def resumable(root: Path, wanted: set[str]) -> set[str]:
    """What a copy cut by the link left under root that a copy of `wanted` can resume from:
    the regular files among `wanted`; anything else — other files, symlinks, empty
    directories — goes (`prune_to`). The dir is made if missing."""
    prune_to(root, wanted)
    tree_digest.remove_empty_dirs(root)
    return {rel for rel, _, _ in tree_digest.regular_files(root)} & wanted


def staged_blocks(staging: Path, names: Iterable[str]) -> dict[str, Blocks]:
    """The block digests of those of `names` the staging dir holds as regular files (read
    as `delta_target` opens them). Blocking, in a thread."""
    found: dict[str, Blocks] = {}
    for rel in names:
        try:
            with open_inside(staging, rel) as staged:
                found[rel] = tree_digest.read_blocks(staged)
        except (OSError, MonitordError):
            continue  # (not one to start from: the look-up leaves it to be fetched whole)
    return found


def worse_than_basis(basis: Path, staged: dict[str, Blocks],
                     now: dict[str, Blocks]) -> set[str]:
    """Those of the files a cut copy left in the staging dir (`staged`: their block
    digests, `staged_blocks`; `now`: the VPS's) from which basis/name (the PBX's own copy)
    needs fewer blocks fetched (orchestrator/block_delta.cheapest): a cut while that copy
    was copied in, or while a file came whole, leaves the staged file holding less. The
    basis read as a delta's start is (no symlink followed). Blocking, in a thread."""
    worse: set[str] = set()
    for rel, have in staged.items():
        try:
            with os.fdopen(tree_digest.open_inside(basis, rel), "rb") as own:
                theirs = tree_digest.read_blocks(own)
        except OSError:
            continue  # (no such copy here, or not one to start from: the staged file is)
        if block_delta.cheapest(now[rel], [have, theirs]) == 1:
            worse.add(rel)
    return worse


def settle(staging: Path, fetched: dict[str, Fetched]) -> tree_digest.Cache:
    """fsync what a pre-copy wrote (off the downtime) and cache each file's hash under the
    identity it had when written — if it still has it and was not written too recently for
    a stat to tell. The epoch is taken after the last write and before the fsync, so that
    an identity in the cache also proves the file unchanged since it was fsynced (the
    promote fsyncs only the others)."""
    epoch = tree_digest.epoch_ns(staging.parent)
    _fsync_tree(staging)
    cache: tree_digest.Cache = {}
    for rel, f in fetched.items():
        with contextlib.suppress(FileNotFoundError):
            ident = tree_digest.cacheable(f.written, os.lstat(staging / rel), epoch)
            if ident is not None:
                cache[rel] = (ident, f.sha256)
    return cache


def promote(staging: Path, final: Path, *, settled: tree_digest.Cache | None = None) -> None:
    """Swap staging in for final, durably; the files a pre-copy settled (fsynced) and that
    are unchanged since are not fsynced again."""
    _fsync_tree(staging, settled)
    tree_digest.swap_in(staging, final)


def _fsync_tree(root: Path, settled: tree_digest.Cache | None = None) -> None:
    """fsync every directory under root and its files — but a file `settled` records with
    the identity it still has: it was fsynced then and not changed since (its ctime would
    say so; it cannot be set back)."""
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = Path(dirpath) / name
            if settled:
                known = settled.get(path.relative_to(root).as_posix())
                if known is not None and known[0] == tree_digest.identity(os.lstat(path)):
                    continue
            fsync_path(path)
        fsync_path(Path(dirpath))

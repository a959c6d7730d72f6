"""SHA-256 of every regular file under a directory, re-hashing only the files that changed.

A digest cache remembers, per file, the stat identity it had when it was hashed (device,
inode, size, mtime, ctime) and the hash; the next digest of the same tree takes the hash of a
file whose identity is unchanged instead of reading it. Any write, truncation, rename over
it, chmod or touch changes the identity: ctime is set by the kernel on every change and
cannot be set back by a user.

One case escapes a stat comparison: a write in the same timestamp tick as the hash was
taken leaves mtime and ctime as they were. So a hash is cached only for a file whose mtime
and ctime are strictly older than the EPOCH — the mtime of a file created in the same
directory just before hashing began, read from the same filesystem clock at the same
granularity. Every later write stamps at least the epoch, so it differs (this is git's
"racy clean" rule with the reference taken before the hash, not after).

Used on both sides: the PBX keeps caches in memory across one move (pre-copy, then the copy
after the stop); the VPS keeps one per tree in a file (`monitord.pyz tree-digest --dir D
--cache C`, C from `data_cache(D)` or `staging_cache(D)`), rewritten atomically.

Where a copy keeps its own dirs (`copy_dir`): `{parent}/.monitord-copy/{name}/` for a data dir
`{parent}/{name}`, holding `staging/` (where the copy is put together), `staging.digests` (its
cache), `digests` (the data dir's cache), `old/` (the replaced tree during a swap) and `warm/`
(a consistent snapshot of a live data dir, monitord.vps.warm_snapshot). Area ids
may contain `.` but never start with one (orchestrator/names.py), so no area's data dir can be
named `.monitord-copy`, nor lie inside it: a copy of area `A` never touches the data of areas
`A.staging`, `A.old` or `A.digests`, which siblings named by suffix did. One dir per data dir
also means one `rm -rf` forgets everything a copy left. A cache that is missing, unreadable or of
another format is simply empty. Standard library only, Python >= 3.9: it runs on the VPS.

`verify_and_promote` is the receiving side's end of an upload in one call (the agent answers
it, so the area's downtime does not pay for a new process): digest the staging dir of a
tree, every file fsynced, and only if its listing is exactly the expected one swap it in by
rename. `promote` is that swap alone.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import json
import os
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from monitord.base.atomic_file import atomic_write_bytes, fsync_path
from orchestrator import block_delta

_CHUNK = 1 << 20
_FORMAT = 1
# The dir beside a data dir that holds every copy's own dirs (see the module docstring): its
# leading dot is what no area id can have.
COPY_DIR_NAME = ".monitord-copy"
# Names a previous release used beside a data dir: `{dir}.digests` (a file) is still removed
# with the area when it is a regular file (it cannot be a data dir); `{dir}.staging` and
# `{dir}.old` are never touched, as they may be another area's data dir (docs/design.md).
LEGACY_DIGESTS_SUFFIX = ".digests"
# The most of a listing the PBX reads from the VPS, however it arrives (the verb's output or
# the agent's answer): see monitord.remote.copy.listing for why 64 MiB.
MAX_LISTING_BYTES = 64 << 20
# One question for block digests (the agent's `copy/blocks`): at most this many names, and at
# most this many bytes of digests in its answer (a 2 GiB file's worth; base64 makes it 4/3 of
# that on the wire). The PBX asks in batches and fetches whole whatever is answered null.
MAX_BLOCK_PATHS = 1024
BLOCK_DIGEST_BYTES = 8 << 20
# (st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns)
Identity = tuple[int, int, int, int, int]
# relative POSIX path -> (identity when hashed, SHA-256)
Cache = dict[str, tuple[Identity, str]]
# relative POSIX path -> (size, SHA-256)
Digests = dict[str, tuple[int, str]]


def copy_dir(final: Path) -> Path:
    """The dir of a copy's own dirs for the data dir `final`: `{parent}/.monitord-copy/{name}`
    (same file system, so every move in it is a rename)."""
    return final.parent / COPY_DIR_NAME / final.name


def staging_dir(final: Path) -> Path:
    """Where a copy to `final` is put together."""
    return copy_dir(final) / "staging"


def staging_cache(final: Path) -> Path:
    """The digest cache of `final`'s staging dir."""
    return copy_dir(final) / "staging.digests"


def data_cache(final: Path) -> Path:
    """The digest cache of `final` itself."""
    return copy_dir(final) / "digests"


def old_dir(final: Path) -> Path:
    """Where a swap moves the tree `final` held, until the new one is on disk."""
    return copy_dir(final) / "old"


def warm_dir(final: Path) -> Path:
    """Where the agent keeps its last snapshot of the live data dir `final` (a warm copy's
    source: the copy routes read it as they read a data dir)."""
    return copy_dir(final) / "warm"


def forget(final: Path) -> None:
    """Remove everything a copy left for `final` (its staging dir, caches, old tree) and the
    digest cache a previous release left beside it (`{final}.digests`, only a regular file):
    what goes with an area's data."""
    remove_path(copy_dir(final))
    legacy = final.with_name(final.name + LEGACY_DIGESTS_SUFFIX)
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISREG(os.lstat(legacy).st_mode):
            os.unlink(legacy)


def identity(st: os.stat_result) -> Identity:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def epoch_ns(directory: Path) -> int:
    """The filesystem's idea of 'now' in `directory` (see the module docstring)."""
    fd, name = tempfile.mkstemp(prefix=".epoch.", dir=directory)
    try:
        return os.fstat(fd).st_mtime_ns
    finally:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)


def cacheable(before: os.stat_result, after: os.stat_result, epoch: int) -> Identity | None:
    """The identity under which a hash read between `before` and `after` may be reused, or
    None: the file changed while it was read, or recently enough to be racy."""
    if identity(after) != identity(before):
        return None
    if max(before.st_mtime_ns, before.st_ctime_ns) >= epoch:
        return None
    return identity(before)


# How a walk opens each directory, below its parent's fd: never through a symlink (ELOOP),
# never anything but a directory (ENOTDIR, before a device or a FIFO is opened).
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def walk_inside(root: Path) -> Iterator[tuple[str, os.stat_result]]:
    """(relative POSIX path, lstat) of every entry under root, by name in each directory, a
    directory before what it holds; nothing when root is missing or not a directory.

    The daemon's user owns the tree and may swap a directory for a symlink (to /etc, say) at
    any moment, and monitord reads as root: so the walk never takes a path twice. Each
    directory is opened below its parent's fd with _DIR_FLAGS, and entered only if its fstat
    is the directory its lstat listed; each entry is lstat'ed below its directory's fd. What
    a swap leaves is a name that is skipped, never a file from outside listed (os.walk checks
    islink, then lists the path: a swap between the two let it in). One fd a level deep."""
    try:
        top = os.open(root, _DIR_FLAGS)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            return
        raise
    stack: list[tuple[int, str, Iterator[str]]] = []
    try:
        stack.append((top, "", iter(sorted(os.listdir(top)))))
        while stack:
            fd, prefix, names = stack[-1]
            name = next(names, None)
            if name is None:
                os.close(stack.pop()[0])
                continue
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue  # gone since the listing
            yield prefix + name, st
            if stat.S_ISDIR(st.st_mode):
                child = _open_dir(fd, name, st)
                if child is not None:
                    try:
                        names_below = iter(sorted(os.listdir(child)))
                    except BaseException:
                        os.close(child)
                        raise
                    stack.append((child, f"{prefix}{name}/", names_below))
    finally:
        for fd, _, _ in stack:
            os.close(fd)


def _open_dir(parent: int, name: str, listed: os.stat_result) -> int | None:
    """The directory `name` below `parent`, opened if it is still the one `listed`; None when
    something else is in its place now (a symlink, a file, another directory) or it is gone."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            return None
        raise
    if os.path.samestat(os.fstat(fd), listed):
        return fd
    os.close(fd)
    return None


def regular_files(root: Path) -> Iterator[tuple[str, Path, os.stat_result]]:
    """(relative POSIX path, path, lstat) of every regular file under root (`walk_inside`):
    symlinks neither followed nor listed; none when root is missing."""
    for rel, st in walk_inside(root):
        if stat.S_ISREG(st.st_mode):
            yield rel, root / rel, st


class NotTheListedFile(OSError):
    """What a path names now is not the regular file a walk listed there (a FIFO, a device
    or another inode put in its place since): it is not read."""


# How every listed file is opened for reading, on both sides: never through a symlink, never
# blocking on a FIFO (or a device) put in its place — fstat then tells what it is.
OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def open_listed(root: Path, rel: str, listed: tuple[int, int]) -> int:
    """An fd of root/rel, which a walk found to be the regular file `listed` (its device and
    inode): opened below root as `open_inside` opens (no symlink followed at any level, no
    FIFO waited on), and its fstat must show that same file — else NotTheListedFile. A
    parent dir swapped for a symlink is refused before anything beyond it is opened (a
    device's open can have an effect of its own)."""
    fd = open_inside(root, rel)
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != listed:
        os.close(fd)
        raise NotTheListedFile(errno.ESTALE, f"{root / rel}: not the regular file listed")
    return fd


def open_inside(root: Path, rel: str) -> int:
    """An fd for reading the regular file root/rel, every directory on the way opened below
    its parent's fd with O_NOFOLLOW (`open_dir_inside`) and the file with OPEN_FLAGS: a
    symlink anywhere under root (one swapped in for a directory while we walk, too) is
    refused, never followed — NotTheListedFile, as is a name that leaves root (`..`,
    absolute, empty parts) or that is not a regular file. FileNotFoundError when it is not
    there."""
    parts = rel.split("/")
    if not rel or any(part in ("", ".", "..") for part in parts):
        raise NotTheListedFile(errno.EINVAL, f"{rel!r}: not a name inside {root}")
    fd = open_dir_inside(root, "/".join(parts[:-1]))
    try:
        try:
            out = os.open(parts[-1], OPEN_FLAGS, dir_fd=fd)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENXIO):
                raise NotTheListedFile(e.errno, f"{rel!r}: not a regular file") from e
            raise
    finally:
        os.close(fd)
    if not stat.S_ISREG(os.fstat(out).st_mode):
        os.close(out)
        raise NotTheListedFile(errno.EINVAL, f"{rel!r}: not a regular file")
    return out


def open_dir_inside(root: Path, rel: str) -> int:
    """An fd of the directory root/rel (root itself for ""), root and every directory below
    it opened below its parent's fd with O_NOFOLLOW: a symlink on the way is refused, never
    followed — NotTheListedFile, as is a name that leaves root. FileNotFoundError when it is
    not there."""
    parts = rel.split("/") if rel else []
    if any(part in ("", ".", "..") for part in parts):
        raise NotTheListedFile(errno.EINVAL, f"{rel!r}: not a name inside {root}")
    dir_flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(root, dir_flags)
    try:
        for part in parts:
            try:
                child = os.open(part, dir_flags, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise NotTheListedFile(e.errno, f"{rel!r}: {part!r} is not a directory"
                                           ) from e
                raise
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_blocks(f: BinaryIO, copy_to: BinaryIO | None = None) -> block_delta.Blocks:
    """The block digests (orchestrator/block_delta.py) of what `f` holds from where it is to
    its end, read once — and written to `copy_to` as it is read, if given."""
    digests = bytearray()
    size = 0
    while True:
        chunk = f.read(_CHUNK)
        if not chunk:
            break
        digests += block_delta.blocks_of(chunk)  # (chunks start at a block)
        size += len(chunk)
        if copy_to is not None:
            copy_to.write(chunk)
    return block_delta.Blocks(size=size, digests=bytes(digests))


def file_blocks(root: Path, rel: str) -> block_delta.Blocks | None:
    """The block digests of the regular file root/rel (`open_inside`), read once; None when
    there is no such regular file."""
    try:
        fd = open_inside(root, rel)
    except (FileNotFoundError, NotADirectoryError, NotTheListedFile):
        return None
    with os.fdopen(fd, "rb") as f:
        return read_blocks(f)


def hash_file(root: Path, rel: str, *, epoch: int, sync: bool = False,
              listed: os.stat_result | None = None) -> tuple[int, str, Identity | None]:
    """(bytes read, SHA-256, identity to cache it under or None) of root/rel, never through
    a symlink and never from anything but the regular file `listed` (its lstat; the one now
    there if not given) — `open_listed`."""
    if listed is None:
        fd = open_inside(root, rel)
    else:
        fd = open_listed(root, rel, (listed.st_dev, listed.st_ino))
    with os.fdopen(fd, "rb") as f:
        before = os.fstat(fd)
        digest = hashlib.sha256()
        size = 0
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                break
            digest.update(chunk)
            size += len(chunk)
        if sync:
            os.fsync(fd)
        after = os.fstat(fd)
    return size, digest.hexdigest(), cacheable(before, after, epoch)


def digest_tree(root: Path, cache: Cache | None = None, *, sync: bool = False,
                opened: dict[str, Identity] | None = None) -> tuple[Digests, Cache]:
    """(size and SHA-256 of every regular file under root, the cache for the next call).

    A file whose identity matches its cache entry is not read. With `sync`, every file and
    directory is fsynced too (an unchanged one costs a system call, not a write). A file
    replaced since the walk listed it (`NotTheListedFile`) is left out, as one removed
    since. `opened`, if given, gets the identity each listed file had when it was hashed
    (or looked up in the cache): a sender checks that it sends that very file."""
    old = cache or {}
    found: Digests = {}
    fresh: Cache = {}
    if not root.is_dir():
        return found, fresh
    epoch = epoch_ns(root.parent)
    for rel, full, st in regular_files(root):
        hit = old.get(rel)
        if hit is not None and hit[0] == identity(st):
            if sync:
                fsync_path(full, follow_symlinks=False)
            found[rel] = (st.st_size, hit[1])
            fresh[rel] = hit
            if opened is not None:
                opened[rel] = identity(st)
            continue
        try:
            size, sha, ident = hash_file(root, rel, epoch=epoch, sync=sync, listed=st)
        except (FileNotFoundError, NotTheListedFile):
            continue  # gone, or replaced, since the walk
        found[rel] = (size, sha)
        if ident is not None:
            fresh[rel] = (ident, sha)
        if opened is not None:
            opened[rel] = identity(st)
    if sync:
        fsync_path(root, follow_symlinks=False)
        for rel, st in walk_inside(root):
            if stat.S_ISDIR(st.st_mode):
                fsync_path(root / rel, follow_symlinks=False)
    return found, fresh


def load_cache(path: Path) -> Cache:
    try:
        doc = json.loads(path.read_bytes())
        if doc.get("format") != _FORMAT:
            return {}
        return {str(rel): (tuple(int(x) for x in ident), str(sha))  # type: ignore[misc]
                for rel, (ident, sha) in doc["files"].items() if len(ident) == 5}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return {}


def save_cache(path: Path, cache: Cache) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"format": _FORMAT, "files": {rel: [list(ident), sha] for rel, (ident, sha) in
                                         sorted(cache.items())}}
    atomic_write_bytes(path, json.dumps(doc, separators=(",", ":")).encode(), mode=0o600)


def sha256sum_line(rel: str, sha: str) -> bytes:
    """One line as coreutils' `sha256sum` writes it for `./rel` (a name holding a backslash
    or a newline in its escaped form, flagged by a leading backslash)."""
    name = os.fsencode(rel)
    if b"\\" in name or b"\n" in name:
        name = name.replace(b"\\", b"\\\\").replace(b"\n", b"\\n")
        return b"\\" + sha.encode() + b"  ./" + name + b"\n"
    return sha.encode() + b"  ./" + name + b"\n"


def listing(digests: dict[str, str]) -> bytes:
    """The `sha256sum`-format listing of {relative name: SHA-256}, sorted by name: what
    `tree-digest` prints for a tree holding exactly those files."""
    return b"".join(sha256sum_line(rel, digests[rel]) for rel in sorted(digests, key=os.fsencode))


def reset_staging(final: Path) -> None:
    """Make `final`'s staging dir exist and be empty, with no digest cache of its own: where a
    copy to `final` starts (`rm -rf` of both, then `mkdir -p`)."""
    staging = staging_dir(final)
    remove_path(staging)
    remove_path(staging_cache(final))
    staging.mkdir(parents=True)


def staged_blocks(final: Path) -> dict[str, block_delta.Blocks | None] | None:
    """The block digests of every regular file in `final`'s staging dir (`file_blocks`: no
    symlink followed), what a copy cut by the link left there for the next to resume from;
    None for a file whose digests would take the answer past BLOCK_DIGEST_BYTES (sent
    whole), and None for all when there are more than MAX_BLOCK_PATHS files (the next copy
    starts over). The staging dir is made if it is missing (where the copy goes on): {}."""
    staging = staging_dir(final)
    staging.mkdir(parents=True, exist_ok=True)
    remove_empty_dirs(staging)  # (no copy makes one: a cut copy's, or left by its files)
    names = [rel for rel, _, _ in regular_files(staging)]
    if len(names) > MAX_BLOCK_PATHS:
        return None
    found: dict[str, block_delta.Blocks | None] = {}
    left = BLOCK_DIGEST_BYTES
    for rel in sorted(names):
        blocks = file_blocks(staging, rel)
        if blocks is not None and len(blocks.digests) > left:
            blocks = None
        if blocks is not None:
            left -= len(blocks.digests)
        found[rel] = blocks
    return found


def remove_empty_dirs(root: Path) -> None:
    """Remove every empty directory under root (deepest first; symlinks never followed)."""
    for dirpath, _dirs, files in os.walk(root, topdown=False):
        if Path(dirpath) != root and not files:
            with contextlib.suppress(OSError):  # not empty: a subdir holds a file
                os.rmdir(dirpath)


def staging_listing(final: Path) -> bytes:
    """The listing of `final`'s staging dir (what `tree-digest --sync` prints for it): every
    file and directory fsynced, its digest cache kept up to date."""
    return cached_listing(staging_dir(final), sync=True, cache_path=staging_cache(final))


def cached_listing(root: Path, *, sync: bool = False,
                   cache_path: Path | None = None) -> bytes:
    """What `tree-digest --dir root --cache CACHE` prints (CACHE: `data_cache(root)` unless
    given), the cache brought up to date; nothing for a missing root."""
    cache_path = cache_path or data_cache(root)
    found, fresh = digest_tree(root, load_cache(cache_path), sync=sync)
    if root.is_dir():
        save_cache(cache_path, fresh)
    return listing({rel: sha for rel, (_, sha) in found.items()})


def verify_and_promote(final: Path, expect: str) -> bool:
    """Digest `final`'s staging dir (`staging_listing`) and, only if the SHA-256 of its
    listing is `expect`, swap it in for `final` (`promote`). False, with nothing swapped,
    when the listing differs: the caller then asks for the listing itself to name the
    differences."""
    if hashlib.sha256(staging_listing(final)).hexdigest() != expect:
        return False
    promote(final)
    return True


def promote(final: Path) -> None:
    """Replace `final` by its staging dir (made empty if it was never made: an empty area),
    its digest cache moving along (`swap_in`); `final` itself fsynced too."""
    staging = staging_dir(final)
    staging.mkdir(parents=True, exist_ok=True)
    final.parent.mkdir(parents=True, exist_ok=True)
    # The cache first: entries are keyed by inode and ctime, so until the swap below the
    # staging tree's entries simply match none of the old tree's files.
    remove_path(data_cache(final))
    cache = staging_cache(final)
    if cache.exists():
        os.rename(cache, data_cache(final))
    swap_in(staging, final)
    fsync_path(final)


def swap_in(staging: Path, final: Path) -> None:
    """Replace `final` by `staging` by rename, durably: the old tree, moved aside to
    `old_dir(final)`, is removed only once the renames are on disk (the parent fsynced), and only
    as far as it can be — a leftover is removed by the next swap before its renames. Both
    sides' copies end here (monitord.remote.copy on the PBX)."""
    old = old_dir(final)
    remove_path(old)
    old.parent.mkdir(parents=True, exist_ok=True)
    if final.exists() or final.is_symlink():
        os.rename(final, old)
    os.rename(staging, final)
    fsync_path(final.parent)
    with contextlib.suppress(OSError):
        remove_path(old)
        os.rmdir(copy_dir(final))  # (only if nothing else of the area's copy is left there)


def remove_path(path: Path) -> None:
    """`rm -rf -- path`: a directory tree, a file or a symlink (never followed)."""
    if path.is_dir() and not path.is_symlink():
        import shutil  # (here: the tree-digest verb starts inside a downtime, without it)

        shutil.rmtree(path)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


EXIT_DIFFERS = 3  # --expect: the listing is not the one expected (it is printed all the same)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", required=True, type=Path, help="the tree to digest")
    parser.add_argument("--cache", type=Path, help="the digest cache file to use and update")
    parser.add_argument("--sync", action="store_true", help="fsync every file and directory")
    parser.add_argument("--expect", metavar="SHA256",
                        help=f"exit {EXIT_DIFFERS} unless the listing's own SHA-256 is this")


def run(args: argparse.Namespace) -> int:
    """Print `sha256sum`-format lines for every regular file under --dir, sorted by name;
    nothing (exit 0) when --dir does not exist. With --expect, the exit status says whether
    those lines are exactly the expected ones (so a script can act on the answer without
    another round trip)."""
    if args.cache is not None:
        text = cached_listing(args.dir, sync=args.sync, cache_path=args.cache)
    else:
        found, _ = digest_tree(args.dir, sync=args.sync)
        text = listing({rel: sha for rel, (_, sha) in found.items()})
    sys.stdout.buffer.write(text)
    sys.stdout.buffer.flush()
    if args.expect is not None and hashlib.sha256(text).hexdigest() != args.expect:
        return EXIT_DIFFERS
    return 0


VERBS = {"tree-digest": (add_arguments, run)}

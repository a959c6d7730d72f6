"""COPY phase I/O: move one area's data dir between the PBX and the VPS, verified.

Called by the migration engine. Both directions follow the same protocol:
  1. the sender lists its files with size and SHA-256 (the manifest);
  2. the files go over SFTP into a fresh staging dir next to the destination dir;
  3. the RECEIVING side digests the staging dir (every file fsynced) and the two lists must
     be equal: every hash, no file missing, none extra;
  4. only then the staging dir replaces the destination dir by rename (and is fsynced).
The VPS side of steps 1 and 3 is `monitord.pyz tree-digest` (monitord.base.tree_digest).
The agent answers instead (`CopyAgent`, given by the caller): a download's step 1, and on
an upload making the staging dir, digesting what a pre-copy put there, and steps 3 and 4 as
one call — the PBX passes the SHA-256 of the listing it expects, and the VPS renames only
if its own listing hashes the same. No shell and no Python start on the VPS, inside the
downtime or out of it (on a VPS whose login shell sources a slow rc file, one exec cost
80 ms here). An agent without these routes (an older one) answers UNKNOWN_AREA, and the
copy runs the shell and the verb (`--expect`) as before; when the listings differ, the
verb's listing names the differences.
A copy cut at any point leaves at most a staging dir behind (removed by the next try);
the destination dir is either the old one or the complete new one, never a mix. A
mismatch raises COPY_INCOMPLETE; the engine retries or rolls back.

Pre-copy (`pre_upload`, `pre_download`): while the source still runs, its files go into
the staging dir ahead of time, each hashed from the very bytes sent (`Staged`). The copy
after the stop, given that `Staged`, sends only the files whose hash changed since, removes
the ones that are gone, and then checks and promotes exactly as above — so the area is
down for the bytes that changed, not for all of them, and what is promoted is still
verified whole against the stopped source. Nothing is ever started from a staging dir; a
pre-copy that fails or is lost (a restart) only means a full copy.

Hashing is what made a large area's downtime long, so both sides keep digest caches
(monitord.base.tree_digest): a file is re-read after the stop only if its stat identity
(inode, size, mtime, ctime) changed since it was hashed during the pre-copy, or it was
changed too recently for a stat to tell. The PBX keeps its caches in `Staged`; the VPS
keeps one per tree in `<dir>.digests` beside it (moved with a promoted staging dir, removed
with the dir). A cache only ever skips re-reading a file whose identity is unchanged, so
the lists compared in step 3 still describe the bytes on disk.

The VPS is untrusted input. Its listing (step 1 of a download) is read with a size bound
and validated WHOLE before the staging dir is even created: every line must be
`<64 hex>  <name>` (or sha256sum's escaped form, a leading backslash with `\\` and `\n` in
the name), every name relative and normalised (no absolute path, no empty, `.` or `..`
component, no NUL or carriage return, valid UTF-8, listed once, never both a file and a
directory). Each file is then fetched only if its real path on the VPS is the listed one
(no remote symlink on the way) and written through directory fds with O_NOFOLLOW and
O_EXCL, so a symlink in the staging dir is never followed. Upload writes names with a
backslash or newline in the escaped form and refuses names no listing could carry.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import re
import shutil
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO, Protocol, TypeVar

import asyncssh

from monitord.base import tree_digest
from monitord.base.atomic_file import fsync_path
from monitord.remote import remote_exec, ssh_errors
from orchestrator.errors import ErrorCode, MonitordError, error_for

STAGING_SUFFIX = tree_digest.STAGING_SUFFIX
DIGESTS_SUFFIX = tree_digest.DIGESTS_SUFFIX  # the VPS's digest cache of a tree, beside it
_CHUNK = 1 << 20
_WRITES_IN_FLIGHT = 4  # chunks of one file a pre-copy has on the wire at once
_SCRIPT_TIMEOUT_S = 60.0
# Bounds on a VPS listing. An area's data dir (one messenger account's session, keys,
# database and media cache) holds hundreds to a few tens of thousands of files; 200,000
# entries leaves an order of magnitude of room while bounding the PBX's work per copy. The
# byte bound caps memory before parsing: 64 MiB is ~330 bytes per line at the entry bound
# (a line is 64 hex + 2 spaces + "./" + a name, usually well under 200 bytes).
_MAX_LISTING_ENTRIES = 200_000
_MAX_LISTING_BYTES = tree_digest.MAX_LISTING_BYTES
_LINE = re.compile(rb"(\\?)([0-9a-f]{64})  (.+)", re.DOTALL)
_UNESCAPE = {ord("\\"): "\\", ord("n"): "\n"}


class CopyAgent(Protocol):
    """The agent's answers about one area's data dir on the VPS and the staging dir beside
    it (AgentClient's routes, bound to the area and its data dir by the caller: AreaCopy).
    Each raises UNKNOWN_AREA from an agent without the route."""

    async def data_listing(self) -> bytes:
        """The data dir's own listing (tree-digest's output format, its cache kept)."""

    async def reset(self) -> None:
        """The staging dir made empty, its digest cache gone."""

    async def listing(self) -> bytes:
        """The staging dir's listing, every file fsynced (tree-digest's output format)."""

    async def promote(self, expect: str) -> bool:
        """True once the staging dir, its listing's SHA-256 being `expect`, has replaced
        the data dir; False (nothing changed) when the listing differs."""


Progress = Callable[[int, int], None]  # (bytes done, bytes total)


@dataclass(frozen=True, slots=True)
class FileEntry:
    path: str  # relative, POSIX separators
    size: int
    sha256: str


@dataclass(frozen=True, slots=True)
class CopyReport:
    files: int
    bytes: int
    reused: int = 0  # files a pre-copy had already put in place unchanged


@dataclass(frozen=True, slots=True)
class Staged:
    """What a pre-copy left in the destination's staging dir: relative path -> SHA-256 of
    the bytes actually written there (the source was running: not yet the manifest), and
    the PBX's digest cache of the local tree it read (upload) or wrote (download)."""

    local_dir: Path
    remote_dir: str
    upload: bool  # True: PBX -> VPS staging; False: VPS -> PBX staging
    files: dict[str, str]
    cache: tree_digest.Cache

    def matches(self, *, local_dir: Path, remote_dir: str, upload: bool) -> bool:
        return (self.local_dir, self.remote_dir, self.upload) == (local_dir, remote_dir, upload)


def local_manifest(
    root: Path, cache: tree_digest.Cache | None = None
) -> tuple[FileEntry, ...]:
    """Every regular file under root (sorted), with size and SHA-256; a file unchanged since
    `cache` recorded it is not read again. Missing root: empty."""
    found, _ = tree_digest.digest_tree(root, cache)
    return tuple(FileEntry(rel, size, sha) for rel, (size, sha) in sorted(found.items()))


def name_problem(rel: str) -> str | None:
    """Why `rel` cannot be an area file's path (relative to the area dir), or None.

    Accepted: relative, POSIX separators, normalised (no empty, `.` or `..` component), no
    NUL, no carriage return (coreutils 9 and older disagree on how sha256sum writes and
    reads one), representable in UTF-8. The same rule holds for both directions."""
    if not rel:
        return "an empty name"
    if rel.startswith("/"):
        return "an absolute path"
    if "\0" in rel:
        return "a NUL byte in the name"
    if "\r" in rel:
        return "a carriage return in the name"
    for part in rel.split("/"):
        if part in ("", ".", ".."):
            return f"a {part!r} component" if part else "an empty component"
    try:
        rel.encode("utf-8")
    except UnicodeEncodeError:
        return "a name that is not valid UTF-8"
    return None


def _parse_listing(raw: bytes) -> dict[str, str]:
    """A VPS `sha256sum` listing as {relative name: digest}, or COPY_INCOMPLETE naming the
    first bad entry. Nothing is trusted: see the module docstring for what is accepted."""
    if not raw:
        return {}
    lines = raw.split(b"\n")
    if lines[-1] != b"":
        return _bad_listing(f"its last line is cut short: {_shown(lines[-1])}")
    lines.pop()
    if len(lines) > _MAX_LISTING_ENTRIES:
        return _bad_listing(f"it has {len(lines)} entries, more than {_MAX_LISTING_ENTRIES}")
    result: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        match = _LINE.fullmatch(line)
        if match is None:
            return _bad_listing(f"line {number} is not '<64 hex>  <name>': {_shown(line)}")
        escaped, digest, raw_name = match.groups()
        try:
            name = raw_name.decode("utf-8")
        except UnicodeDecodeError:
            return _bad_listing(f"line {number} has a name that is not UTF-8: {_shown(line)}")
        if escaped:
            unescaped = _unescape(name)
            if unescaped is None:
                return _bad_listing(f"line {number} has a bad escape: {_shown(line)}")
            name = unescaped
        rel = name.removeprefix("./")
        problem = name_problem(rel)
        if problem is not None:
            return _bad_listing(f"line {number} names {rel!r}: {problem}")
        if rel in result:
            return _bad_listing(f"line {number} lists {rel!r} a second time")
        result[rel] = digest.decode()
    dirs = {str(parent) for rel in result for parent in PurePosixPath(rel).parents}
    for rel in sorted(result):
        if rel in dirs:
            return _bad_listing(f"{rel!r} is listed both as a file and as a directory")
    return result


def _unescape(name: str) -> str | None:
    out: list[str] = []
    chars = iter(name)
    for char in chars:
        if char == "\\":
            following = _UNESCAPE.get(ord(next(chars, "x")))
            if following is None:
                return None
            out.append(following)
        else:
            out.append(char)
    return "".join(out)


def _shown(line: bytes) -> str:
    return repr(line[:120])[2:-1] + ("…" if len(line) > 120 else "")


def _bad_listing(why: str) -> dict[str, str]:
    raise _incomplete(f"refusing the VPS's file listing: {why}")


def _incomplete(detail: str) -> MonitordError:
    return error_for(ErrorCode.COPY_INCOMPLETE, detail)


def _sftp_translated(during: str, *, timeout_s: float) -> AbstractContextManager[None]:
    """SFTP failures of one transfer: running out of time is COPY_INCOMPLETE (the source keeps
    its data, the engine retries), a lost link or a refused SFTP request SSH_UNREACHABLE
    (the table in ssh_errors.py)."""
    return ssh_errors.translated(
        code=ErrorCode.SSH_UNREACHABLE, during=during,
        timeout_code=ErrorCode.COPY_INCOMPLETE, timeout_s=timeout_s,
    )


# Remote side: fixed scripts, values passed as positional parameters (never spliced); the
# digest scripts take the dir, then the argv that runs monitord.pyz on the VPS.
_PREPARE = 'rm -rf -- "$1" "$1.digests" && mkdir -p -- "$1"'
_VERIFY = 'd=$1; shift; "$@" tree-digest --dir "$d" --cache "$d.digests" --sync'
_PROMOTE_STEPS = (  # (an empty area's staging dir may never have been made: it is empty)
    ' mkdir -p -- "$stg" "$(dirname -- "$dst")";'
    ' if [ -e "$dst" ]; then rm -rf -- "$dst.old"; mv -- "$dst" "$dst.old"; fi;'
    ' mv -- "$stg" "$dst"; rm -rf -- "$dst.old" "$dst.digests";'
    ' if [ -e "$stg.digests" ]; then mv -- "$stg.digests" "$dst.digests"; fi;'
    ' sync -- "$dst" "$(dirname -- "$dst")"'
)
_PROMOTE = 'set -e; dst=$1; stg=$2;' + _PROMOTE_STEPS
# The check and the swap in one exec (one round trip while the area is down): the swap runs
# only if the staging dir's listing is byte for byte the expected one, whose SHA-256 the PBX
# passes; otherwise tree-digest exits EXIT_DIFFERS, having printed what it found.
_VERIFY_PROMOTE = (
    'set -e; dst=$1; stg=$2; want=$3; shift 3;'
    ' "$@" tree-digest --dir "$stg" --cache "$stg.digests" --sync --expect "$want";'
    + _PROMOTE_STEPS
)
_LIST = 'd=$1; shift; "$@" tree-digest --dir "$d" --cache "$d.digests"'


async def upload(
    conn: asyncssh.SSHClientConnection,
    *,
    local_dir: Path,
    remote_dir: str,
    vps_command: Sequence[str],
    progress: Progress | None = None,
    timeout_s: float = 600.0,
    staged: Staged | None = None,
    agent: CopyAgent | None = None,
) -> CopyReport:
    """Copy local_dir to remote_dir on the VPS, verified there, swapped in by rename. With
    `staged` (a pre-copy of the same dirs), only what changed since is sent; if the VPS
    then finds the staging dir wrong, the copy is redone whole, once. `vps_command` runs
    monitord.pyz on the VPS (its tree-digest verb checks the staging dir). `agent` makes
    the staging dir and answers steps 3 and 4 (given the expected listing's SHA-256:
    promoted or not) with no new process on the VPS while the area is down; the shell and
    the verb still answer when the agent has no such routes, and the verb names the
    differences when it found some."""
    if staged is not None and not staged.matches(
        local_dir=local_dir, remote_dir=remote_dir, upload=True
    ):
        staged = None
    manifest = await asyncio.to_thread(
        local_manifest, local_dir, None if staged is None else staged.cache
    )
    for entry in manifest:
        if (problem := name_problem(entry.path)) is not None:
            raise _incomplete(f"cannot copy {local_dir}: {entry.path!r} has {problem}")
    total = sum(e.size for e in manifest)
    staging = remote_dir.rstrip("/") + STAGING_SUFFIX
    kept = {} if staged is None else staged.files
    if staged is None:  # a pre-copy made the staging dir: no round trip to make it again
        await _reset_staging(conn, staging, agent)
    to_send = [e for e in manifest if kept.get(e.path) != e.sha256]
    gone = sorted(set(kept) - {e.path for e in manifest})
    done = total - sum(e.size for e in to_send)
    staged_lost = False
    with _sftp_translated(f"upload to {remote_dir}", timeout_s=timeout_s):
        try:
            async with asyncio.timeout(timeout_s), conn.start_sftp_client() as sftp:
                for rel in gone:
                    with contextlib.suppress(*ssh_errors.SFTP_NO_SUCH_FILE):
                        await sftp.remove(str(PurePosixPath(staging) / rel))
                made: set[str] = {staging}
                for entry in to_send:
                    target = str(PurePosixPath(staging) / entry.path)
                    parent = str(PurePosixPath(target).parent)
                    if parent not in made:
                        await sftp.makedirs(parent, exist_ok=True)
                        made.add(parent)
                    await sftp.put(str(local_dir / entry.path), target)
                    done += entry.size
                    if progress:
                        progress(done, total)
        except ssh_errors.SFTP_NO_SUCH_FILE:
            if staged is None:
                raise
            staged_lost = True  # the pre-copy's staging dir went away on the VPS
    expected = {e.path: e.sha256 for e in manifest}
    if not staged_lost:
        found = await _verify_and_promote(conn, remote_dir=remote_dir, staging=staging,
                                          expected=expected, vps_command=vps_command,
                                          agent=agent)
        if found is None:
            return CopyReport(files=len(manifest), bytes=total,
                              reused=len(manifest) - len(to_send))
        if staged is None:
            raise _incomplete(f"the VPS found {remote_dir} incomplete: it differs in"
                              f" {_differences(found, expected)}")
    # the staging dir changed under us since the pre-copy: start it over, whole
    return await upload(conn, local_dir=local_dir, remote_dir=remote_dir,
                        vps_command=vps_command, progress=progress, timeout_s=timeout_s,
                        agent=agent)


async def _verify_and_promote(
    conn: asyncssh.SSHClientConnection, *, remote_dir: str, staging: str,
    expected: dict[str, str], vps_command: Sequence[str], agent: CopyAgent | None = None,
) -> dict[str, str] | None:
    """Steps 3 and 4 of an upload, on the VPS: None once the staging dir, found to hold
    exactly `expected`, has replaced remote_dir; else what it holds (and nothing changed)."""
    during = f"upload to {remote_dir}"
    want = hashlib.sha256(tree_digest.listing(expected)).hexdigest()
    if agent is not None and await _agent_answer(lambda: agent.promote(want)):
        return None
    # Differs (or no such route): the verb lists what the staging dir holds, and promotes
    # it after all if that is what was expected.
    result = await remote_exec.run_script(
        conn, _VERIFY_PROMOTE, args=(remote_dir, staging, want, *vps_command),
        timeout_s=_SCRIPT_TIMEOUT_S, max_stdout=_MAX_LISTING_BYTES,
    )
    if result.stdout_truncated:
        raise _incomplete(f"refusing {during}: more than {_MAX_LISTING_BYTES} bytes")
    if result.exit_status != tree_digest.EXIT_DIFFERS:
        result.raise_for_status(ErrorCode.COPY_INCOMPLETE)
        return None
    found = _parse_listing(result.stdout)
    if found != expected:
        return found
    # The same files, listed in other bytes (a VPS whose name order differs): swap it apart.
    promoted = await _script(conn, _PROMOTE, remote_dir, staging)
    promoted.raise_for_status(ErrorCode.COPY_INCOMPLETE)
    return None


async def pre_upload(
    conn: asyncssh.SSHClientConnection,
    *,
    local_dir: Path,
    remote_dir: str,
    vps_command: Sequence[str],
    timeout_s: float = 600.0,
    agent: CopyAgent | None = None,
) -> Staged:
    """While the source runs: put local_dir's files into the VPS staging dir, each hashed
    from the bytes sent, then let the VPS digest (and fsync) what arrived, so that the copy
    after the stop re-reads only what changed on either side. A file that changes meanwhile
    is simply sent again by `upload`. `agent`: as for `upload`."""
    sent: dict[str, str] = {}
    cache: tree_digest.Cache = {}
    staging = remote_dir.rstrip("/") + STAGING_SUFFIX
    await _reset_staging(conn, staging, agent)
    epoch, listing = await asyncio.to_thread(_pre_listing, local_dir)
    if listing:
        with _sftp_translated(f"pre-copy to {remote_dir}", timeout_s=timeout_s):
            async with asyncio.timeout(timeout_s), conn.start_sftp_client() as sftp:
                made: set[str] = {staging}
                for rel in listing:
                    target = str(PurePosixPath(staging) / rel)
                    parent = str(PurePosixPath(target).parent)
                    if parent not in made:
                        await sftp.makedirs(parent, exist_ok=True)
                        made.add(parent)
                    staged_file = await _send_hashed(sftp, local_dir / rel, target, epoch)
                    if staged_file is not None:
                        sent[rel], identity = staged_file
                        if identity is not None:
                            cache[rel] = (identity, sent[rel])
    found = await _vps_listing(conn, _VERIFY, staging, vps_command,
                               ask=None if agent is None else agent.listing,
                               during=f"pre-copy to {remote_dir}")
    files = {rel: sha for rel, sha in sent.items() if found.get(rel) == sha}
    return Staged(local_dir=local_dir, remote_dir=remote_dir, upload=True, files=files,
                  cache=cache)


async def _send_hashed(
    sftp: asyncssh.SFTPClient, source_path: Path, target: str, epoch: int
) -> tuple[str, tree_digest.Identity | None] | None:
    """Send one file of a running source: (SHA-256 of the bytes sent, the identity under
    which that hash describes the source file, if any); None if it is gone."""
    try:
        fd = os.open(source_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None  # gone (or replaced by a symlink) since the listing: nothing staged
    digest = hashlib.sha256()
    with os.fdopen(fd, "rb") as source:
        before = os.fstat(fd)
        async with sftp.open(target, "wb") as out:
            # Several chunks on the wire at once (each at its own offset), as `sftp.put`
            # does: one at a time left the link idle for a round trip per chunk.
            writes: set[asyncio.Future[int]] = set()
            offset = 0
            try:
                while chunk := await asyncio.to_thread(source.read, _CHUNK):
                    digest.update(chunk)
                    if len(writes) >= _WRITES_IN_FLIGHT:
                        done, writes = await asyncio.wait(
                            writes, return_when=asyncio.FIRST_COMPLETED)
                        for write in done:
                            write.result()  # (a failed write fails the send)
                    writes.add(asyncio.ensure_future(out.write(chunk, offset)))
                    offset += len(chunk)
                await asyncio.gather(*writes)
            finally:
                for write in writes:
                    write.cancel()
                await asyncio.gather(*writes, return_exceptions=True)
        after = os.fstat(fd)
    return digest.hexdigest(), tree_digest.cacheable(before, after, epoch)


def _pre_listing(root: Path) -> tuple[int, list[str]]:
    """(the epoch of root's filesystem, taken before anything is read; the regular files
    under root with names a copy can carry). No hashing: a pre-copy hashes what it sends."""
    if not root.is_dir():
        return 0, []
    epoch = tree_digest.epoch_ns(root.parent)
    return epoch, sorted(rel for rel, _, _ in tree_digest.regular_files(root)
                         if name_problem(rel) is None)


def _differences(found: dict[str, str], expected: dict[str, str]) -> list[str]:
    """Up to five names that are missing, extra or different between two listings."""
    names = set(found) ^ set(expected) | {p for p in found if found[p] != expected.get(p)}
    return sorted(names)[:5]


async def download(
    conn: asyncssh.SSHClientConnection,
    *,
    remote_dir: str,
    local_dir: Path,
    vps_command: Sequence[str],
    progress: Progress | None = None,
    timeout_s: float = 600.0,
    staged: Staged | None = None,
    agent: CopyAgent | None = None,
) -> CopyReport:
    """Copy remote_dir from the VPS to local_dir, verified here, swapped in by rename. With
    `staged` (a pre-copy of the same dirs), only files whose hash changed are fetched.
    `agent` lists remote_dir (else the tree-digest verb does, a Python start on the VPS).

    The VPS's listing is validated whole before anything is written (a bad one raises
    COPY_INCOMPLETE and leaves local_dir and its staging dir as they were); a file reached
    through a symlink, on either side, fails the copy and removes the staging dir."""
    if staged is not None and not staged.matches(
        local_dir=local_dir, remote_dir=remote_dir, upload=False
    ):
        staged = None
    expected = await _remote_listing(conn, remote_dir, vps_command, agent)
    staging = local_dir.with_name(local_dir.name + STAGING_SUFFIX)
    kept = {} if staged is None else staged.files
    if staged is None:
        await asyncio.to_thread(_reset_dir, staging)
    else:
        kept = {rel: h for rel, h in kept.items() if expected.get(rel) == h}
        await asyncio.to_thread(_prune_to, staging, set(kept))
    to_fetch = sorted(rel for rel in expected if kept.get(rel) != expected[rel])
    done = 0
    try:
        with _sftp_translated(f"download of {remote_dir}", timeout_s=timeout_s):
            async with asyncio.timeout(timeout_s), conn.start_sftp_client() as sftp:
                remote_root = (await sftp.realpath(remote_dir)).rstrip("/") if expected else ""
                for rel in to_fetch:
                    fetched = await _fetch(sftp, remote_root, rel, staging, where=remote_dir)
                    done += fetched.size
                    if progress:
                        progress(done, done)
    except MonitordError as e:
        if e.code == ErrorCode.COPY_INCOMPLETE:  # refused, not cut: leave nothing behind
            await asyncio.to_thread(shutil.rmtree, staging, True)
        raise
    manifest = await asyncio.to_thread(
        local_manifest, staging, None if staged is None else staged.cache
    )
    got = {e.path: e.sha256 for e in manifest}
    if got != expected:
        if staged is not None:  # the staging dir changed under us: start it over, whole
            return await download(conn, remote_dir=remote_dir, local_dir=local_dir,
                                  vps_command=vps_command, progress=progress,
                                  timeout_s=timeout_s, agent=agent)
        raise _incomplete(f"downloaded copy of {remote_dir} differs in"
                          f" {_differences(got, expected)}")
    # What a pre-copy staged was fsynced before the stop: only what was written since costs
    # an fsync while the area is down.
    await asyncio.to_thread(_promote_local, staging, local_dir,
                            settled=None if staged is None else staged.cache)
    return CopyReport(files=len(got), bytes=done, reused=len(expected) - len(to_fetch))


async def pre_download(
    conn: asyncssh.SSHClientConnection,
    *,
    remote_dir: str,
    local_dir: Path,
    vps_command: Sequence[str],
    timeout_s: float = 600.0,
    agent: CopyAgent | None = None,
) -> Staged:
    """While the VPS's daemon runs: fetch remote_dir's files into the local staging dir,
    each hashed from the bytes written, and fsync them. The listing is checked as
    `download` checks it (and leaves the VPS a digest cache of the running tree)."""
    listed = await _remote_listing(conn, remote_dir, vps_command, agent)
    staging = local_dir.with_name(local_dir.name + STAGING_SUFFIX)
    await asyncio.to_thread(_reset_dir, staging)
    fetched: dict[str, _Fetched] = {}
    try:
        with _sftp_translated(f"pre-copy of {remote_dir}", timeout_s=timeout_s):
            async with asyncio.timeout(timeout_s), conn.start_sftp_client() as sftp:
                remote_root = (await sftp.realpath(remote_dir)).rstrip("/") if listed else ""
                for rel in sorted(listed):
                    try:
                        fetched[rel] = await _fetch(
                            sftp, remote_root, rel, staging, where=remote_dir
                        )
                    except ssh_errors.SFTP_NO_SUCH_FILE:
                        continue  # gone since the listing (the daemon runs)
    except MonitordError as e:
        if e.code == ErrorCode.COPY_INCOMPLETE:
            await asyncio.to_thread(shutil.rmtree, staging, True)
        raise
    cache = await asyncio.to_thread(_settle, staging, fetched)
    return Staged(local_dir=local_dir, remote_dir=remote_dir, upload=False,
                  files={rel: f.sha256 for rel, f in fetched.items()}, cache=cache)


def _settle(staging: Path, fetched: dict[str, _Fetched]) -> tree_digest.Cache:
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


async def _remote_listing(
    conn: asyncssh.SSHClientConnection, remote_dir: str, vps_command: Sequence[str],
    agent: CopyAgent | None,
) -> dict[str, str]:
    return await _vps_listing(conn, _LIST, remote_dir, vps_command,
                              ask=None if agent is None else agent.data_listing,
                              during=f"the VPS's file listing of {remote_dir}")


async def _vps_listing(
    conn: asyncssh.SSHClientConnection, script: str, tree: str, vps_command: Sequence[str],
    *, ask: Callable[[], Awaitable[bytes]] | None, during: str,
) -> dict[str, str]:
    """A VPS tree's digest: the agent's answer to `ask`, else (no agent, or one without the
    route) the verb's through `script`; either bounded and validated exactly alike."""
    listed = None if ask is None else await _agent_answer(ask)
    if listed is None:
        return await _digest(conn, script, tree, vps_command, during=during)
    if len(listed) > _MAX_LISTING_BYTES:
        raise _incomplete(f"refusing {during}: more than {_MAX_LISTING_BYTES} bytes")
    return _parse_listing(listed)


async def _digest(
    conn: asyncssh.SSHClientConnection, script: str, remote_dir: str,
    vps_command: Sequence[str], *, during: str,
) -> dict[str, str]:
    """A VPS tree's digest ({relative name: SHA-256}), validated whole (_parse_listing)."""
    listing = await remote_exec.run_script(
        conn, script, args=(remote_dir, *vps_command), timeout_s=_SCRIPT_TIMEOUT_S,
        max_stdout=_MAX_LISTING_BYTES,
    )
    if listing.stdout_truncated:
        raise _incomplete(f"refusing {during}: more than {_MAX_LISTING_BYTES} bytes")
    listing.raise_for_status(ErrorCode.COPY_INCOMPLETE)
    return _parse_listing(listing.stdout)


@dataclass(frozen=True, slots=True)
class _Fetched:
    size: int
    sha256: str
    written: os.stat_result  # the file's stat right after its last byte was written


async def _fetch(
    sftp: asyncssh.SFTPClient, remote_root: str, rel: str, staging: Path, *, where: str
) -> _Fetched:
    """Fetch remote_root/rel into staging/rel (never through a symlink on either side)."""
    source = f"{remote_root}/{rel}"
    if await sftp.realpath(source) != source:
        raise _incomplete(f"refusing {rel!r} from {where}: a symlink on the VPS leads elsewhere")
    digest = hashlib.sha256()
    with _create_inside(staging, rel) as out:
        async with sftp.open(source, "rb") as f:
            while chunk := await f.read(_CHUNK):
                data = _as_bytes(chunk)
                digest.update(data)
                out.write(data)
        out.flush()
        return _Fetched(out.tell(), digest.hexdigest(), os.fstat(out.fileno()))


def _prune_to(root: Path, keep: set[str]) -> None:
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


def _as_bytes(chunk: bytes | str) -> bytes:
    if isinstance(chunk, str):  # a file opened "rb" without an encoding reads bytes
        raise TypeError("SFTP read returned text")
    return chunk


def _create_inside(root: Path, rel: str) -> BinaryIO:
    """A new file root/rel opened for writing, never through a symlink.

    rel is already validated (name_problem). The resolved path must lie strictly inside
    root; each directory on the way is created or opened relative to its parent's fd with
    O_NOFOLLOW and the file is created with O_EXCL|O_NOFOLLOW, so a symlink found (or
    planted) in the staging dir is refused, never followed."""
    resolved_root = root.resolve()
    resolved = (root / rel).resolve()
    if resolved == resolved_root or not resolved.is_relative_to(resolved_root):
        raise _incomplete(f"refusing to write {rel!r}: it resolves outside {root}")
    *dirs, name = rel.split("/")
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(root, flags)
    try:
        for part in dirs:
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, dir_fd=fd)
            try:
                child = os.open(part, flags, dir_fd=fd)
            except OSError as e:  # ELOOP / ENOTDIR: a symlink or a file is in the way
                raise _incomplete(f"refusing to write {rel!r}: {part!r} is not a directory"
                                  f" ({e.strerror})") from e
            os.close(fd)
            fd = child
        try:
            out = os.open(
                name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o666, dir_fd=fd,
            )
        except OSError as e:
            raise _incomplete(f"refusing to write {rel!r}: {e.strerror}") from e
    finally:
        os.close(fd)
    return os.fdopen(out, "wb")


def _reset_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)


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


def _promote_local(staging: Path, final: Path, *,
                   settled: tree_digest.Cache | None = None) -> None:
    """Swap staging in for final, durably; the files a pre-copy settled (fsynced) and that
    are unchanged since are not fsynced again."""
    _fsync_tree(staging, settled)
    tree_digest.swap_in(staging, final)


async def remove_remote_leftovers(conn: asyncssh.SSHClientConnection, *, remote_dir: str) -> None:
    """Remove a staging dir (and its manifest) a cut copy left on the VPS."""
    staging = remote_dir.rstrip("/") + STAGING_SUFFIX
    await _script(conn, 'rm -rf -- "$1" "$1.digests"', staging)


T = TypeVar("T")


async def _agent_answer(ask: Callable[[], Awaitable[T]]) -> T | None:
    """`ask()`'s answer; None from an agent without the route (UNKNOWN_AREA: an older one),
    which the caller then does over a shell instead."""
    try:
        return await ask()
    except MonitordError as e:
        if e.code != ErrorCode.UNKNOWN_AREA:
            raise
        return None


async def _reset_staging(
    conn: asyncssh.SSHClientConnection, staging: str, agent: CopyAgent | None
) -> None:
    async def reset() -> bool:
        assert agent is not None
        await agent.reset()
        return True

    if agent is None or not await _agent_answer(reset):
        await _script(conn, _PREPARE, staging)


async def _script(
    conn: asyncssh.SSHClientConnection, script: str, *args: str
) -> remote_exec.CommandResult:
    return await remote_exec.run_script(conn, script, args=args, timeout_s=_SCRIPT_TIMEOUT_S)

"""COPY phase I/O: move one area's data dir between the PBX and the VPS, verified.

Called through the package (monitord/remote/copy/__init__.py). Both directions follow the
same protocol:
  1. the sender lists its files with size and SHA-256 (the manifest);
  2. the files go over SFTP into a fresh staging dir in the destination dir's copy dir
     (`{parent}/.monitord-copy/{name}/staging`, tree_digest.copy_dir: no area id can name it);
  3. the RECEIVING side digests the staging dir (every file fsynced) and the two lists must
     be equal: every hash, no file missing, none extra;
  4. only then the staging dir replaces the destination dir by rename (and is fsynced).
Each direction is one strategy (`_Upload`, `_Download`) doing both the pre-copy and the
copy after the stop. The VPS side of steps 1, 3 and 4 is a monitord.remote.copy.vps_tree
(the agent, else the shell and the `tree-digest` verb: chosen once per copy, the choice
kept in `Staged`); the PBX side is monitord.remote.copy.local_tree. A copy
cut at any point leaves at most a staging dir behind (removed by the next try); the
destination dir is either the old one or the complete new one, never a mix. A mismatch
raises COPY_INCOMPLETE; the engine retries or rolls back.

A copy that fails while the link still works removes its staging dir on the spot, on
whichever side it was (`_gives_space_back`): a half-written copy on a full disk would
starve every other area there until the next try. A write the destination refuses is named
by its cause, never as an unreachable VPS: an errno on the PBX (LOCAL_DISK_FULL,
LOCAL_PERMISSION_DENIED, NAME_TOO_LONG: local_tree.local_file_error); on the VPS the SFTP
status where it names one (ssh_errors.sftp_cause), else — OpenSSH's sftp-server answers a
full disk with a bare "Failure" — the VPS's free space asked in the same SFTP session
(statvfs@openssh.com) against what was still to be written (orchestrator/disk_space.py):
REMOTE_DISK_FULL with both numbers. A name too long for the VPS (a component over
NAME_MAX_BYTES, a path over PATH_MAX_BYTES) is refused before anything is sent.

Pre-copy (`pre_upload`, `pre_download`): while the source still runs, its files go into
the staging dir ahead of time, each hashed from the very bytes sent (`Staged`; an upload
also keeps each staged file's 4 KiB block digests). The copy after the stop, given that
`Staged`, sends only the files whose hash changed since — of an upload's, only the blocks
that changed (`_send_delta`, orchestrator/block_delta.py) — removes the ones that are gone,
and then checks and promotes exactly as above — so the area is
down for the bytes that changed, not for all of them, and what is promoted is still
verified whole against the stopped source. Nothing is ever started from a staging dir; a
pre-copy that fails or is lost (a restart) only means a full copy.

Hashing is what made a large area's downtime long, so both sides keep digest caches
(monitord.base.tree_digest): a file is re-read after the stop only if its stat identity
(inode, size, mtime, ctime) changed since it was hashed during the pre-copy, or it was
changed too recently for a stat to tell. The PBX keeps its caches in `Staged`; the VPS
keeps one per tree in the data dir's copy dir (tree_digest.copy_dir: moved with a promoted
staging dir, removed with the dir). A cache only ever skips re-reading a file whose identity
is unchanged, so the lists compared in step 3 still describe the bytes on disk.

The VPS is untrusted input: its listing (step 1 of a download) is validated whole before
the staging dir is even created (monitord.remote.copy.listing). Each file is then fetched
only if its real path on the VPS is the listed one (no remote symlink on the way) and it is
a regular file there, reading no more of it than the size the VPS declared (nor more in all
than their sum: `_declared_sizes`), and written through directory fds
(local_tree.create_inside). Upload writes names with a backslash or newline in the escaped
form and refuses names no listing could carry; it sends each file from the one fd it opened
and checked (`_send_file`: no symlink followed, no FIFO waited on, the listed regular file,
no more than its listed size), else COPY_SOURCE_CHANGED.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import hashlib
import os
import stat
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Sequence,
)
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import BinaryIO, TypeVar

import asyncssh

from monitord.base import tree_digest
from monitord.remote import ssh_errors
from monitord.remote.copy import listing, local_tree, sftp_session, vps_tree
from monitord.remote.copy.listing import incomplete
from monitord.remote.copy.vps_tree import CopyAgent, VpsTree
from orchestrator import block_delta, disk_space, pre_copy
from orchestrator.block_delta import Blocks
from orchestrator.errors import ErrorCode, MonitordError, error_for

T = TypeVar("T")
A = TypeVar("A")
B = TypeVar("B")

_CHUNK = 1 << 20
# Linux's limits for one name and one path (NAME_MAX, PATH_MAX less the NUL).
NAME_MAX_BYTES = 255
PATH_MAX_BYTES = 4095
_DIAGNOSE_TIMEOUT_S = 5.0  # asking the VPS why a write failed, or removing a staging dir
# What asking the VPS that (best effort) may raise: the copy's own error is the news then.
_BEST_EFFORT: tuple[type[Exception], ...] = (MonitordError, TimeoutError, *ssh_errors.SSH_ERRORS)
_WRITES_IN_FLIGHT = 4  # chunks of one file on the wire at once (writes up, reads down)
# What one file's delta or upload keeps on the wire at most (`_InFlight`): bytes, requests.
_BYTES_IN_FLIGHT = _WRITES_IN_FLIGHT * _CHUNK
_REQUESTS_IN_FLIGHT = 256
_FILES_AT_ONCE = 4  # files a copy after the stop sends or fetches at once (each its own writes)

Progress = Callable[[int, int], None]  # (bytes done, bytes total)


class _Meter:
    """A copy's bytes done of its total, told to its `progress` (if any) as they move: a
    file sent or fetched whole chunk by chunk as each chunk crosses, one sent or fetched as
    a delta once it is in place (the few blocks that cross are not the file's bytes).

    Bytes moving also push the copy's deadline on (`guards`): a copy's `timeout_s` is the
    time it may go without a chunk crossing, not its whole length, so a large area over a
    slow line is never cut for being large, and a stalled one still ends."""

    def __init__(self, progress: Progress | None, total: int) -> None:
        self._progress = progress
        self.total = total
        self.done = 0
        self._deadline: asyncio.Timeout | None = None
        self._stall_s = 0.0

    def guards(self, deadline: asyncio.Timeout, *, stall_s: float) -> None:
        self._deadline, self._stall_s = deadline, stall_s

    def add(self, n: int = 0) -> None:
        """`n` more bytes done (0: only tell the total, once it is known)."""
        self.done += n
        if n and self._deadline is not None:
            self._deadline.reschedule(asyncio.get_running_loop().time() + self._stall_s)
        if self._progress is not None:
            self._progress(self.done, self.total)


@dataclass(frozen=True, slots=True)
class CopyReport:
    files: int
    bytes: int
    reused: int = 0  # files a pre-copy had already put in place unchanged
    # What crossed the link, and the seconds spent sending it (file by file, from the first
    # open to the last write: no session set-up, listing, digest or promote) — the copy
    # throughput the pre-copy rule is judged on (orchestrator/pre_copy.py).
    sent_bytes: int = 0
    send_s: float = 0.0


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
    through_agent: bool = False  # the way the pre-copy took on the VPS: the copy's too
    sent_bytes: int = 0  # as CopyReport's: what the pre-copy sent, and in how long
    send_s: float = 0.0
    # Upload: the block digests of each file of `files` as staged (orchestrator/
    # block_delta.py), so that the copy after the stop sends a changed file's changed
    # blocks only.
    blocks: dict[str, Blocks] = field(default_factory=dict)
    # The bytes each round of an upload's pre-copy sent (the first: the whole pass), and
    # the code of a failure that ended the rounds early (what they staged still holds).
    rounds: tuple[int, ...] = ()
    rounds_error: str | None = None
    # Of the first pass's bytes, those a cut copy had left in the staging dir already (a
    # resume: not sent again).
    resumed_bytes: int = 0

    def matches(self, *, local_dir: Path, remote_dir: str, upload: bool) -> bool:
        return (self.local_dir, self.remote_dir, self.upload) == (local_dir, remote_dir, upload)


@contextlib.contextmanager
def _sftp_translated(during: str, *, timeout_s: float) -> Iterator[None]:
    """SFTP failures of one transfer: running out of time (`timeout_s` with no chunk
    crossing: _Meter) is COPY_INCOMPLETE (the source keeps its data, the engine retries), a
    lost link SSH_UNREACHABLE (the table in ssh_errors.py), a refused SFTP request its cause
    where the status names one (ssh_errors.sftp_cause: REMOTE_DISK_FULL,
    REMOTE_PERMISSION_DENIED), else SSH_UNREACHABLE."""
    try:
        with ssh_errors.translated(code=ErrorCode.SSH_UNREACHABLE, during=during):
            try:
                yield
            except TimeoutError as e:
                raise error_for(ErrorCode.COPY_INCOMPLETE,
                                f"{during}: nothing crossed the link for {timeout_s:g} s") from e
    except MonitordError as e:
        cause = ssh_errors.sftp_cause(e.__cause__) if e.__cause__ is not None else None
        if cause is None or cause == e.code:
            raise
        raise error_for(cause, e.detail, facts=e.facts) from e.__cause__


# -- PBX -> VPS ---------------------------------------------------------------------------

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
    the verb answer instead when the agent does not serve those routes, and the verb names
    the differences when it found some."""
    if staged is not None and not staged.matches(
        local_dir=local_dir, remote_dir=remote_dir, upload=True
    ):
        staged = None
    if staged is not None:
        async with _gives_space_back(conn, remote_dir=remote_dir):
            tree = await vps_tree.chosen(conn, remote_dir=remote_dir, vps_command=vps_command,
                                         agent=agent, through_agent=staged.through_agent)
            return await _Upload(conn, local_dir, remote_dir, tree, timeout_s).copy(
                staged, progress)
    # No pre-copy (the area is down already): the agent is asked while the files are hashed;
    # both are awaited to the end, then the first failure is raised as it is.
    way, hashed = await asyncio.gather(
        vps_tree.chosen(conn, remote_dir=remote_dir, vps_command=vps_command, agent=agent),
        asyncio.to_thread(local_tree.manifest, local_dir),
        return_exceptions=True,
    )
    if isinstance(way, BaseException):
        raise way
    if isinstance(hashed, BaseException):
        raise hashed
    async with _gives_space_back(conn, remote_dir=remote_dir):
        return await _Upload(conn, local_dir, remote_dir, way, timeout_s).copy(
            None, progress, manifest=hashed)


async def pre_upload(
    conn: asyncssh.SSHClientConnection,
    *,
    local_dir: Path,
    remote_dir: str,
    vps_command: Sequence[str],
    progress: Progress | None = None,
    timeout_s: float = 600.0,
    agent: CopyAgent | None = None,
) -> Staged:
    """While the source runs: put local_dir's files into the VPS staging dir, each hashed
    from the bytes sent, then let the VPS digest (and fsync) what arrived, so that the copy
    after the stop re-reads only what changed on either side. A file that changes meanwhile
    is simply sent again by `upload`. `agent`: as for `upload`; `progress`: told the first
    pass's bytes done of the listing's total as they cross (later rounds are not told)."""
    tree = await vps_tree.chosen(conn, remote_dir=remote_dir, vps_command=vps_command,
                                 agent=agent)
    strategy = _Upload(conn, local_dir, remote_dir, tree, timeout_s)
    async with _gives_space_back(conn, remote_dir=remote_dir):
        staged = await strategy.pre_copy(progress)
    return await strategy.more_rounds(staged)


@contextlib.asynccontextmanager
async def _gives_space_back(
    conn: asyncssh.SSHClientConnection, *, remote_dir: str
) -> AsyncIterator[None]:
    """An upload that fails removes its staging dir on the VPS at once — unless the link
    itself is what failed (nothing can be asked of the VPS then; the next try resets it)."""
    try:
        yield
    except MonitordError as e:
        if _link_usable(e):
            try:
                async with asyncio.timeout(_DIAGNOSE_TIMEOUT_S):
                    await vps_tree.remove_leftovers(conn, remote_dir=remote_dir)
            except _BEST_EFFORT:
                pass  # the next try's reset removes it; the copy's own error is the news
        raise


def _link_usable(error: MonitordError) -> bool:
    """Whether the SSH link presumably still works after `error` (a refusal, not a cut)."""
    cause = error.__cause__
    if isinstance(cause, TimeoutError):
        return False
    if ssh_errors.is_sftp_refusal(cause):
        return True
    return error.code not in (ErrorCode.SSH_UNREACHABLE, ErrorCode.SSH_TIMEOUT,
                              ErrorCode.AGENT_UNREACHABLE)


def name_too_long(path: str) -> str | None:
    """Why `path` cannot be created on a Linux file system (a component over NAME_MAX, the
    whole over PATH_MAX), or None."""
    raw = path.encode("utf-8", "surrogateescape")
    if len(raw) > PATH_MAX_BYTES:
        return f"its path is {len(raw)} bytes long (at most {PATH_MAX_BYTES})"
    longest = max(raw.split(b"/"), key=len)
    if len(longest) > NAME_MAX_BYTES:
        return f"a name in it is {len(longest)} bytes long (at most {NAME_MAX_BYTES})"
    return None


def _check_names(remote_dir: str, rels: Sequence[str]) -> None:
    """NAME_TOO_LONG before anything is sent, naming the first path the VPS cannot hold."""
    staging = vps_tree.staging_of(remote_dir)
    for rel in rels:
        why = name_too_long(f"{staging}/{rel}")
        if why is not None:
            raise error_for(ErrorCode.NAME_TOO_LONG,
                            f"VPS: cannot create {rel!r} under {staging}: {why}")


async def _refused_write(
    sftp: asyncssh.SFTPClient, error: Exception, *, during: str, staging: str,
    remaining: disk_space.Usage,
) -> MonitordError:
    """The cause of an SFTP write the VPS refused (the module doc): the status's own, else
    the VPS's free space against `remaining` (what was still to be written)."""
    translated = ssh_errors.translate(
        error, code=ssh_errors.sftp_cause(error) or ErrorCode.SSH_UNREACHABLE, during=during)
    if not ssh_errors.is_sftp_refusal(error):
        return translated
    try:
        async with asyncio.timeout(_DIAGNOSE_TIMEOUT_S):
            vfs = await sftp.statvfs(staging)
    except _BEST_EFFORT:
        return translated
    free = disk_space.Free(bytes=vfs.bavail * vfs.frsize, inodes=vfs.favail,
                           total_inodes=vfs.files)
    short = disk_space.ran_out(side="VPS", path=staging, remaining=remaining, free=free)
    if short is not None:
        return error_for(ErrorCode.REMOTE_DISK_FULL,
                         f"{during}: {ssh_errors.describe(error)} — {short.detail()}",
                         facts=short.facts())
    if translated.code == ErrorCode.REMOTE_DISK_FULL:
        return error_for(ErrorCode.REMOTE_DISK_FULL,
                         f"{translated.detail} — VPS: {staging} has {free.bytes} bytes free",
                         facts={"side": "VPS", "path": staging, "free_bytes": free.bytes})
    return translated


@dataclass(frozen=True, slots=True)
class _Upload:
    """PBX -> VPS, the pre-copy and the copy after the stop, through one way on the VPS."""

    conn: asyncssh.SSHClientConnection
    local_dir: Path
    remote_dir: str
    tree: VpsTree
    timeout_s: float

    async def _resumable(self, *, whole: bool = False) -> dict[str, Blocks | None]:
        """What a copy cut by the link left in the VPS staging dir, to resume from: each
        file's block digests as the VPS reads them now (None: sent whole). {} once the
        staging dir is started over instead — when `whole`, or when the way cannot say."""
        left = None if whole else await self.tree.staged()
        if left is None:
            await self.tree.reset_staging()
            return {}
        return left

    async def pre_copy(self, progress: Progress | None) -> Staged:
        """`pre_upload`: the running source's files into the VPS staging dir — a file a cut
        copy left there by the blocks that differ (a resume), the others whole."""
        sent: dict[str, str] = {}
        sent_blocks: dict[str, Blocks] = {}
        cache: tree_digest.Cache = {}
        staging = vps_tree.staging_of(self.remote_dir)
        left = await self._resumable()
        epoch, names = await asyncio.to_thread(local_tree.pre_listing, self.local_dir)
        _check_names(self.remote_dir, [rel for rel, _ in names])
        stale = sorted(set(left) - {rel for rel, _ in names})
        during = f"pre-copy to {self.remote_dir}"
        sent_bytes, send_s, resumed = 0, 0.0, 0
        if names:
            sizes = [listed.st_size for _, listed in names]
            meter = _Meter(progress, sum(sizes))
            meter.add()
            with _sftp_translated(during, timeout_s=self.timeout_s):
                async with asyncio.timeout(self.timeout_s) as deadline, \
                        sftp_session.session(self.conn) as sftp:
                    meter.guards(deadline, stall_s=self.timeout_s)
                    await _remove_all(sftp, staging, stale)
                    made: set[str] = {staging}
                    started = time.monotonic()
                    for i, (rel, listed) in enumerate(names):
                        target = str(PurePosixPath(staging) / rel)
                        parent = str(PurePosixPath(target).parent)
                        had = left.get(rel)
                        sha: str | None
                        try:
                            if parent not in made:
                                await sftp.makedirs(parent, exist_ok=True)
                                made.add(parent)
                            if had is None:
                                sha, blocks, before, after = await _send_file(
                                    sftp, self.local_dir, rel, target,
                                    listed=(listed.st_dev, listed.st_ino), size=None,
                                    meter=meter)
                                n = blocks.size
                            else:
                                sha, blocks, before, after, n = await _refresh_file(
                                    sftp, self.local_dir, rel, target,
                                    listed=(listed.st_dev, listed.st_ino), staged=had)
                                meter.add(blocks.size)
                                resumed += blocks.size - n
                        except MonitordError as e:
                            if e.code != ErrorCode.COPY_SOURCE_CHANGED:
                                raise
                            continue  # gone or replaced since the listing: nothing staged
                        except ssh_errors.SFTP_ERRORS as e:
                            raise await _refused_write(
                                sftp, e, during=during, staging=staging,
                                remaining=disk_space.footprint(sizes[i:]),
                            ) from e
                        sent_blocks[rel] = blocks
                        sent_bytes += n
                        if sha is None:
                            continue  # changed while it was read: its blocks are as staged
                        sent[rel] = sha
                        identity = tree_digest.cacheable(before, after, epoch)
                        if identity is not None:
                            cache[rel] = (identity, sha)
                    send_s = time.monotonic() - started
        found = await self.tree.staging_listing(during=f"pre-copy to {self.remote_dir}")
        files = {rel: sha for rel, sha in sent.items() if found.get(rel) == sha}
        # (a file resumed into but changed meanwhile is known by its blocks alone)
        return Staged(local_dir=self.local_dir, remote_dir=self.remote_dir, upload=True,
                      files=files, cache=cache, through_agent=self.tree.through_agent,
                      sent_bytes=sent_bytes, send_s=send_s, resumed_bytes=resumed,
                      blocks={rel: b for rel, b in sent_blocks.items()
                              if rel in files or rel not in sent})

    async def more_rounds(self, staged: Staged) -> Staged:
        """While `pre_copy.another_round` says so, send what changed since the last round
        into the staging dir (`_Round`), over the connection's SFTP session. A failed round
        ends them: what the rounds before staged is kept, and the file it was writing is left
        for the copy after the stop."""
        rounds = [staged.sent_bytes]
        kept = _Round(self, staged)
        error: str | None = None
        during = f"pre-copy to {self.remote_dir}"
        try:
            with _sftp_translated(during, timeout_s=self.timeout_s):
                while pre_copy.another_round(rounds):
                    async with asyncio.timeout(self.timeout_s):
                        rounds.append(await kept.once())
        except MonitordError as e:
            error = e.code.value
        return dataclasses.replace(kept.staged(), rounds=tuple(rounds), rounds_error=error)

    async def copy(
        self, staged: Staged | None, progress: Progress | None, *,
        manifest: tuple[local_tree.FileEntry, ...] | None = None, whole: bool = False,
    ) -> CopyReport:
        """`upload` after the stop (`manifest`: local_dir's, if hashed already). Without a
        pre-copy it resumes from what a cut copy left in the staging dir, unless `whole`."""
        if manifest is None:
            manifest = await asyncio.to_thread(
                local_tree.manifest, self.local_dir, None if staged is None else staged.cache
            )
        for entry in manifest:
            if (problem := listing.name_problem(entry.path)) is not None:
                raise incomplete(f"cannot copy {self.local_dir}: {entry.path!r} has {problem}")
        _check_names(self.remote_dir, [e.path for e in manifest])
        total = sum(e.size for e in manifest)
        staging = vps_tree.staging_of(self.remote_dir)
        kept = {} if staged is None else staged.files
        # A changed file the pre-copy staged whole gets its changed blocks only; without a
        # pre-copy, so does one a cut copy left (a pre-copy made the staging dir and knows
        # what is in it: no round trip to ask).
        if staged is None:
            left = await self._resumable(whole=whole)
            deltas = {rel: b for rel, b in left.items() if b is not None}
            in_staging = set(left)
        else:
            deltas = staged.blocks
            in_staging = set(kept) | set(deltas)
        to_send = [e for e in manifest if kept.get(e.path) != e.sha256]
        # (a file a later round wrote into the staging dir is in `deltas` alone)
        gone = sorted(in_staging - {e.path for e in manifest})
        meter = _Meter(progress, total)
        staged_lost = False
        during = f"upload to {self.remote_dir}"
        send_s, sent_bytes = 0.0, 0
        with _sftp_translated(during, timeout_s=self.timeout_s):
            try:
                async with asyncio.timeout(self.timeout_s) as deadline, \
                        sftp_session.session(self.conn) as sftp:
                    meter.guards(deadline, stall_s=self.timeout_s)
                    await _remove_all(sftp, staging, gone)
                    meter.add(total - sum(e.size for e in to_send))  # what is in place
                    started = time.monotonic()
                    sent_bytes = await self._send_all(
                        sftp, to_send, deltas, staging=staging, during=during, meter=meter)
                    send_s = time.monotonic() - started
            except ssh_errors.SFTP_NO_SUCH_FILE:
                if not deltas:
                    raise
                staged_lost = True  # a file staged before went away on the VPS
        expected = {e.path: e.sha256 for e in manifest}
        if not staged_lost:
            found = await self.tree.promote(expected)
            if found is None:
                return CopyReport(files=len(manifest), bytes=total,
                                  reused=len(manifest) - len(to_send),
                                  sent_bytes=sent_bytes, send_s=send_s)
            if staged is None and not deltas:
                raise incomplete(f"the VPS found {self.remote_dir} incomplete: it differs in"
                                 f" {listing.differences(found, expected)}")
        # the staging dir changed under us since the pre-copy (or since the VPS digested
        # what a cut copy left there): start it over, whole
        return await self.copy(None, progress, whole=True)


    async def _send_all(
        self, sftp: asyncssh.SFTPClient, to_send: list[local_tree.FileEntry],
        deltas: dict[str, Blocks], *, staging: str, during: str, meter: _Meter,
    ) -> int:
        """Send every file of `to_send` into `staging` (the changed blocks of those in
        `deltas`, staged so), telling `meter` as it goes; the bytes that crossed."""
        made: set[str] = {staging}
        sent = 0
        left = {entry.path: entry.size for entry in to_send}

        async def send(entry: local_tree.FileEntry) -> None:
            nonlocal sent
            target = str(PurePosixPath(staging) / entry.path)
            parent = str(PurePosixPath(target).parent)
            try:
                if parent not in made:
                    await sftp.makedirs(parent, exist_ok=True)
                    made.add(parent)
                staged_as = deltas.get(entry.path)
                if staged_as is None:
                    await _send_entry(sftp, self.local_dir, entry, target, meter)
                    n = entry.size
                else:
                    n = await _send_delta(sftp, self.local_dir, entry, target, staged_as)
                    meter.add(entry.size)
            except ssh_errors.SFTP_NO_SUCH_FILE:
                raise
            except ssh_errors.SFTP_ERRORS as e:
                raise await _refused_write(
                    sftp, e, during=during, staging=staging,
                    remaining=disk_space.footprint(left.values()),
                ) from e
            del left[entry.path]
            sent += n  # (added after the await: the files are sent side by side)

        await _at_once([functools.partial(send, entry) for entry in to_send])
        return sent


async def _remove_all(sftp: asyncssh.SFTPClient, staging: str, names: Sequence[str]) -> None:
    """Remove the files `names` from the staging dir, side by side (one gone already is
    fine), then their directories that this left empty (no copy carries an empty one)."""
    async def remove(rel: str) -> None:
        with contextlib.suppress(*ssh_errors.SFTP_NO_SUCH_FILE):
            await sftp.remove(str(PurePosixPath(staging) / rel))

    await _at_once([functools.partial(remove, rel) for rel in names])
    parents = {str(p) for rel in names for p in PurePosixPath(rel).parents if str(p) != "."}
    for rel in sorted(parents, key=lambda p: -p.count("/")):
        with contextlib.suppress(*ssh_errors.SFTP_ERRORS):  # (not empty: a file is kept)
            await sftp.rmdir(str(PurePosixPath(staging) / rel))


async def _side_by_side(first: Awaitable[A], second: Awaitable[B]) -> tuple[A, B]:
    """Both answers, asked at once (one round trip for the two); the first failure cancels
    the other (awaited) and is raised as it is."""
    tasks = (asyncio.ensure_future(first), asyncio.ensure_future(second))
    try:
        one, two = await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return one, two


async def _at_once(jobs: Sequence[Callable[[], Awaitable[None]]]) -> None:
    """Run `jobs`, up to _FILES_AT_ONCE of them at a time: their requests share round trips
    (a small file's open, write and close are three, whatever the number of files). The
    first failure cancels the others (awaited) and is raised as it is."""
    pending = iter(jobs)

    async def worker() -> None:
        for job in pending:
            await job()

    workers = [asyncio.ensure_future(worker()) for _ in range(min(_FILES_AT_ONCE, len(jobs)))]
    try:
        await asyncio.gather(*workers)
    finally:
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)


class _Round:
    """A later round of an upload's pre-copy, over the staged files' state: each file whose
    stat identity is not the one it was staged under is digested (4 KiB blocks) and its
    changed blocks are written into the staged file, a new file is sent whole — all while
    the source runs. What it keeps stays true of the staging dir at every step: a file is
    dropped from it before it is written and put back after, so a round cut half-way leaves
    that one file to be sent whole after the stop. Nothing is trusted to it alone: the
    receiver's digest still decides the promote."""

    def __init__(self, upload: _Upload, staged: Staged) -> None:
        self._upload = upload
        self._first = staged
        self.files = dict(staged.files)
        self.blocks = dict(staged.blocks)
        self.cache = dict(staged.cache)

    def staged(self) -> Staged:
        return dataclasses.replace(self._first, files=self.files, blocks=self.blocks,
                                   cache=self.cache)

    async def once(self) -> int:
        """One round; the bytes it sent (the connection's SFTP session asked for only when
        something changed)."""
        up = self._upload
        epoch, names = await asyncio.to_thread(local_tree.pre_listing, up.local_dir)
        changed = [(rel, listed) for rel, listed in names if not self._unchanged(rel, listed)]
        if not changed:
            return 0
        async with sftp_session.session(up.conn) as sftp:
            return await self._send(sftp, changed, epoch)

    async def _send(self, sftp: asyncssh.SFTPClient,
                    changed: list[tuple[str, os.stat_result]], epoch: int) -> int:
        up = self._upload
        staging = vps_tree.staging_of(up.remote_dir)
        sent = 0
        for rel, listed in changed:
            self.files.pop(rel, None)
            self.cache.pop(rel, None)
            staged_as = self.blocks.pop(rel, None)
            target = str(PurePosixPath(staging) / rel)
            sha: str | None
            try:
                if staged_as is None:
                    await sftp.makedirs(str(PurePosixPath(target).parent), exist_ok=True)
                    sha, blocks, before, after = await _send_file(
                        sftp, up.local_dir, rel, target,
                        listed=(listed.st_dev, listed.st_ino), size=None)
                    sent += blocks.size
                else:
                    sha, blocks, before, after, delta_bytes = await _refresh_file(
                        sftp, up.local_dir, rel, target,
                        listed=(listed.st_dev, listed.st_ino), staged=staged_as)
                    sent += delta_bytes
            except MonitordError as e:
                if e.code != ErrorCode.COPY_SOURCE_CHANGED:
                    raise
                continue  # gone or replaced since the listing: left for after the stop
            self.blocks[rel] = blocks
            if sha is not None:
                self.files[rel] = sha
                identity = tree_digest.cacheable(before, after, epoch)
                if identity is not None:
                    self.cache[rel] = (identity, sha)
        return sent

    def _unchanged(self, rel: str, listed: os.stat_result) -> bool:
        cached = self.cache.get(rel)
        return cached is not None and rel in self.files \
            and cached[0] == tree_digest.identity(listed)


async def _refresh_file(
    sftp: asyncssh.SFTPClient, root: Path, rel: str, target: str, *,
    listed: tuple[int, int], staged: Blocks,
) -> tuple[str | None, Blocks, os.stat_result, os.stat_result, int]:
    """Make the staged `target` (whose blocks are `staged`) the running source's file again
    by writing only the blocks that differ: (its SHA-256 — None when the file changed while
    it was read, so that what was written is not one state of it —, the staged file's block
    digests now, fstat before and after, the bytes sent). The digests kept are those of the
    bytes written, so they describe the staged file whatever the source did meanwhile."""
    source_path = root / rel
    fd = await _open_source(root, rel, listed)
    try:
        before = os.fstat(fd)
        sha, now = await asyncio.to_thread(_digest_blocks, fd, before.st_size)
        delta = block_delta.plan(staged, now)
        digests = bytearray(staged.digests[:block_delta.block_count(now.size)
                                           * block_delta.DIGEST_BYTES])
        digests += now.digests[len(digests):]  # (past the staged end: every block is a run)
        consistent = True

        def record(offset: int, length: int, written: bytes) -> None:
            nonlocal consistent
            consistent = consistent and written == now.run(offset, length)
            start = offset // block_delta.BLOCK_BYTES * block_delta.DIGEST_BYTES
            digests[start:start + len(written)] = written

        await _write_delta(sftp, target, fd, delta, record, path=source_path)
        after = os.fstat(fd)
    finally:
        os.close(fd)
    blocks = Blocks(size=now.size, digests=bytes(digests))
    return (sha if consistent else None), blocks, before, after, delta.sent_bytes


async def _send_entry(sftp: asyncssh.SFTPClient, local_dir: Path,
                      entry: local_tree.FileEntry, target: str, meter: _Meter) -> None:
    """Send a file of the stopped source, exactly as the manifest names it: the same regular
    file (device and inode), of the same size, and the bytes sent hash to its SHA-256 —
    else COPY_SOURCE_CHANGED (the next try lists the source again)."""
    if entry.identity is None:
        raise _source_changed(entry.path, "it was not hashed from a file of its own")
    sha, _, _, _ = await _send_file(sftp, local_dir, entry.path, target,
                                    listed=entry.identity[:2], size=entry.size, meter=meter)
    if sha != entry.sha256:
        raise _source_changed(entry.path, "its bytes changed since it was hashed")


async def _send_delta(sftp: asyncssh.SFTPClient, local_dir: Path, entry: local_tree.FileEntry,
                      target: str, staged: Blocks) -> int:
    """Make the staged `target` (whose blocks are `staged`) the stopped source's file by
    writing only the blocks that differ (orchestrator/block_delta.py); the bytes sent.

    The file is read twice from the one fd opened as `_send_entry` opens it: once whole, to
    digest its blocks and check its SHA-256 against the manifest, then each run again as it
    is sent, every block checked against its first digest — else COPY_SOURCE_CHANGED. The
    receiver's digest of the whole staging dir still decides the promote."""
    if entry.identity is None:
        raise _source_changed(entry.path, "it was not hashed from a file of its own")
    fd = await _open_source(local_dir, entry.path, entry.identity[:2])
    try:
        sha, now = await asyncio.to_thread(_digest_blocks, fd, entry.size)
        if sha != entry.sha256:
            raise _source_changed(entry.path, "its bytes changed since it was hashed")
        delta = block_delta.plan(staged, now)

        def check(offset: int, length: int, written: bytes) -> None:
            if written != now.run(offset, length):
                raise _source_changed(entry.path, "its bytes changed while it was sent")

        await _write_delta(sftp, target, fd, delta, check, path=local_dir / entry.path)
    finally:
        os.close(fd)
    return delta.sent_bytes


async def _write_delta(
    sftp: asyncssh.SFTPClient, target: str, fd: int, delta: block_delta.Delta,
    seen: Callable[[int, int, bytes], None], *, path: Path,
) -> None:
    """Write `delta`'s runs of `fd` into the staged `target` in place (a few on the wire at
    once), then cut or extend it; `seen(offset, length, block digests)` is told each run's digests
    as read, before it is written (it may refuse it by raising). A run that reads short is
    COPY_SOURCE_CHANGED: the file shrank."""
    if delta.nothing:
        return
    async with sftp.open(target, "r+b") as out:
        writes = _InFlight()
        try:
            # (runs read a window's worth at a time, in one thread call: a thread hop
            # between two writes could let the first's answer come first, a wave more)
            for batch in _windows(delta.runs):
                read = await asyncio.to_thread(_pread_runs, fd, batch)
                for (offset, length), data in zip(batch, read, strict=True):
                    if len(data) != length:
                        raise _source_changed(str(path), "it shrank while it was read")
                    seen(offset, length, block_delta.blocks_of(data))
                    await writes.add(functools.partial(out.write, data, offset), length)
            await writes.finish()
        finally:
            await writes.cancel()
        if delta.resize:
            await out.truncate(delta.size)


def _windows(runs: Sequence[tuple[int, int]]) -> Iterator[Sequence[tuple[int, int]]]:
    """`runs` in consecutive groups of at most _BYTES_IN_FLIGHT bytes (a longer run alone)."""
    start, held = 0, 0
    for i, (_, length) in enumerate(runs):
        if i > start and held + length > _BYTES_IN_FLIGHT:
            yield runs[start:i]
            start, held = i, 0
        held += length
    if start < len(runs):
        yield runs[start:]


def _pread_runs(fd: int, runs: Sequence[tuple[int, int]]) -> list[bytes]:
    return [os.pread(fd, length, offset) for offset, length in runs]


def _digest_blocks(fd: int, size: int) -> tuple[str, Blocks]:
    """(SHA-256, block digests) of the first `size` bytes of `fd` (in a thread: a large
    file takes a while); COPY_SOURCE_CHANGED if it holds fewer."""
    sha = hashlib.sha256()
    digests = bytearray()
    offset = 0
    while offset < size:
        chunk = os.pread(fd, min(_CHUNK, size - offset), offset)
        if not chunk:
            raise _source_changed(f"fd {fd}", f"it ended after {offset} of {size} bytes")
        sha.update(chunk)
        digests += block_delta.blocks_of(chunk)  # (chunks start at a block)
        offset += len(chunk)
    return sha.hexdigest(), Blocks(size=size, digests=bytes(digests))


class _InFlight:
    """The SFTP requests of one file on the wire at once (an upload's writes, a delta's
    reads), each at its own offset, as `sftp.put` does: one at a time left the link idle for
    a round trip per chunk. Bounded by the bytes they carry (_BYTES_IN_FLIGHT: four whole
    chunks) and by their number (_REQUESTS_IN_FLIGHT), not by a count alone: a delta's
    scattered 4 KiB pages, four at a time, took a round trip per four pages while the area
    was down (23 changed pages: six waves, 1.8 s on a 300 ms link)."""

    def __init__(self) -> None:
        self._pending: dict[asyncio.Future[int], int] = {}

    async def add(self, write: Callable[[], Awaitable[int]], nbytes: int) -> None:
        """Start `write()`, of `nbytes`, once it fits beside those on the wire (one alone
        always does)."""
        while self._pending and (
                len(self._pending) >= _REQUESTS_IN_FLIGHT
                or sum(self._pending.values()) + nbytes > _BYTES_IN_FLIGHT):
            done, _ = await asyncio.wait(self._pending, return_when=asyncio.FIRST_COMPLETED)
            for finished in done:
                del self._pending[finished]
                finished.result()  # (a failed write fails the send)
        self._pending[asyncio.ensure_future(write())] = nbytes

    async def finish(self) -> None:
        pending, self._pending = self._pending, {}
        await asyncio.gather(*pending)

    async def cancel(self) -> None:
        pending, self._pending = self._pending, {}
        for write in pending:
            write.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


async def _opened_in_thread(open_: Callable[[], T], *, close: Callable[[T], object]) -> T:
    """`open_()` in a thread. A thread cannot be stopped: if the copy is cancelled meanwhile
    (a file beside it failed), what it opens is closed once it returns, not leaked."""
    opening = asyncio.ensure_future(asyncio.to_thread(open_))
    try:
        return await asyncio.shield(opening)
    except asyncio.CancelledError:
        def close_it(done: asyncio.Future[T]) -> None:
            if not done.cancelled() and done.exception() is None:
                close(done.result())

        opening.add_done_callback(close_it)
        raise


async def _open_source(root: Path, rel: str, listed: tuple[int, int]) -> int:
    """The listed regular file root/rel opened for reading (tree_digest.open_listed: below
    root, no symlink followed at any level), else COPY_SOURCE_CHANGED."""
    try:
        return await _opened_in_thread(functools.partial(
            tree_digest.open_listed, root, rel, listed), close=os.close)
    except (FileNotFoundError, NotADirectoryError, tree_digest.NotTheListedFile) as e:
        raise _source_changed(str(root / rel), e.strerror or str(e)) from e


async def _send_file(
    sftp: asyncssh.SFTPClient, root: Path, rel: str, target: str, *,
    listed: tuple[int, int], size: int | None, meter: _Meter | None = None,
) -> tuple[str, Blocks, os.stat_result, os.stat_result]:
    """Send one local file to `target`: (SHA-256 and block digests of the bytes sent, its
    fstat before and after).

    The file is opened once (tree_digest.open_listed: no symlink followed, no FIFO or device
    waited on) and must be the regular file the listing named (`listed`: device and inode);
    every byte sent is read from that fd, in a thread, never from the path again. `size`: the
    manifest's (a stopped source) — the file must still have it, and exactly that many bytes
    are sent; None (a pre-copy of a running source): at most the size fstat shows at open.
    Anything else is COPY_SOURCE_CHANGED: a FIFO, a symlink to /dev/zero or a growing file
    put in its place neither blocks monitord nor streams more than was listed."""
    source_path = root / rel
    fd = await _open_source(root, rel, listed)
    try:
        before = os.fstat(fd)
        if size is not None and before.st_size != size:
            raise _source_changed(str(source_path),
                                  f"{before.st_size} bytes now, {size} when it was listed")
        cap = before.st_size if size is None else size
        metered = meter if meter is not None else _Meter(None, cap)
        digest = hashlib.sha256()
        digests = bytearray()
        async with sftp.open(target, "wb") as out:
            writes = _InFlight()
            offset = 0
            try:
                while offset < cap:
                    chunk = await asyncio.to_thread(os.pread, fd, min(_CHUNK, cap - offset),
                                                    offset)
                    if not chunk:
                        break
                    digest.update(chunk)
                    digests += block_delta.blocks_of(chunk)  # (chunks start at a block)
                    await writes.add(functools.partial(_write_metered, out, chunk, offset,
                                                       metered), len(chunk))
                    offset += len(chunk)
                await writes.finish()
            finally:
                await writes.cancel()
        if size is not None and offset != size:
            raise _source_changed(str(source_path),
                                  f"it ended after {offset} of the {size} bytes listed")
        after = os.fstat(fd)
    finally:
        os.close(fd)
    return digest.hexdigest(), Blocks(size=offset, digests=bytes(digests)), before, after


async def _write_metered(out: asyncssh.SFTPClientFile, chunk: bytes, offset: int,
                         meter: _Meter) -> int:
    written = await out.write(chunk, offset)
    meter.add(len(chunk))
    return written


def _source_changed(what: str, why: str) -> MonitordError:
    return error_for(ErrorCode.COPY_SOURCE_CHANGED,
                     f"{what} is not the file listed for the copy: {why}")


# -- VPS -> PBX ---------------------------------------------------------------------------

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
    basis: Path | None = None,
) -> CopyReport:
    """Copy remote_dir from the VPS to local_dir, verified here, swapped in by rename. With
    `staged` (a pre-copy of the same dirs), only files whose hash changed are fetched, and of
    those only the blocks the staged file lacks; a file the pre-copy did not stage starts
    from `basis/` (the PBX's own copy of the area) where it has one. `agent` lists
    remote_dir and digests its blocks (else the tree-digest verb lists it, a Python start on
    the VPS, and files are fetched whole).

    The VPS's listing is validated whole before anything is written (a bad one raises
    COPY_INCOMPLETE and leaves local_dir and its staging dir as they were); a file reached
    through a symlink, on either side, fails the copy and removes the staging dir."""
    if staged is not None and not staged.matches(
        local_dir=local_dir, remote_dir=remote_dir, upload=False
    ):
        staged = None
    tree = await vps_tree.chosen(conn, remote_dir=remote_dir, vps_command=vps_command,
                                 agent=agent,
                                 through_agent=None if staged is None else staged.through_agent)
    return await _Download(conn, local_dir, remote_dir, tree, timeout_s, basis).copy(
        staged, progress)


async def pre_download(
    conn: asyncssh.SSHClientConnection,
    *,
    remote_dir: str,
    local_dir: Path,
    vps_command: Sequence[str],
    progress: Progress | None = None,
    timeout_s: float = 600.0,
    agent: CopyAgent | None = None,
    basis: Path | None = None,
) -> Staged:
    """While the VPS's daemon runs: fetch remote_dir's files into the local staging dir,
    each hashed from the bytes written, and fsync them; a file `basis/` (the PBX's own copy
    of the area: what it moved out from) has is copied from there and only the blocks that
    differ are fetched. The listing is checked as `download` checks it (and leaves the VPS
    a digest cache of the running tree). `progress`: as for `pre_upload`."""
    tree = await vps_tree.chosen(conn, remote_dir=remote_dir, vps_command=vps_command,
                                 agent=agent)
    strategy = _Download(conn, local_dir, remote_dir, tree, timeout_s, basis)
    return await strategy.more_rounds(await strategy.pre_copy(progress))


@dataclass(frozen=True, slots=True)
class _LookedUp:
    """What a download's look-up wave found (`_Download._looked_up`)."""

    root: str  # the data dir's real path on the VPS
    sizes: dict[str, int]  # {name: its size there}, the files to fetch, in order
    seeds: dict[str, Path | None]  # {name: the PBX's copy it starts from; None: the staged file}
    blocks: dict[str, Blocks]  # the VPS's digests of the files with a start
    have: dict[str, Blocks]  # the staged files' own digests (a start in place)


@dataclass(frozen=True, slots=True)
class _Download:
    """VPS -> PBX, the pre-copy and the copy after the stop, through one way on the VPS;
    `basis`: the PBX's own copy of the area, where a file not staged starts from."""

    conn: asyncssh.SSHClientConnection
    local_dir: Path
    remote_dir: str
    tree: VpsTree
    timeout_s: float
    basis: Path | None = None

    @property
    def staging(self) -> Path:
        return local_tree.staging_of(self.local_dir)

    async def pre_copy(self, progress: Progress | None) -> Staged:
        """`pre_download`: the running VPS tree's files into a fresh local staging dir."""
        async with self._gives_space_back():
            return await self._pre_copy(_Meter(progress, 0))

    async def copy(self, staged: Staged | None, progress: Progress | None) -> CopyReport:
        """`download` after the stop."""
        async with self._gives_space_back():
            return await self._copy(staged, progress)

    async def more_rounds(self, staged: Staged) -> Staged:
        """While `pre_copy.another_round` says so, fetch what changed on the VPS since the
        last round into the staging dir — a staged file by its changed blocks, in place —
        as an upload's rounds send (`_Upload.more_rounds`), so that the copy after the stop
        fetches the last moments' pages only. A failed round ends them: what the rounds
        before staged is kept, and the file it was writing is left for the copy after the
        stop (out of `files`: it is fetched again there)."""
        rounds = [staged.sent_bytes]
        files, cache = dict(staged.files), dict(staged.cache)
        error: str | None = None
        during = f"pre-copy of {self.remote_dir}"
        try:
            with _sftp_translated(during, timeout_s=self.timeout_s):
                while pre_copy.another_round(rounds):
                    async with asyncio.timeout(self.timeout_s):
                        rounds.append(await self._round(files, cache))
        except (MonitordError, OSError) as e:
            error = e.code.value if isinstance(e, MonitordError) else \
                local_tree.local_file_error(e, during=during).code.value
        return dataclasses.replace(staged, files=files, cache=cache, rounds=tuple(rounds),
                                   rounds_error=error)

    async def _round(self, files: dict[str, str], cache: tree_digest.Cache) -> int:
        """One round (`more_rounds`): `files` and `cache` brought up to what it staged;
        the bytes it fetched."""
        listed = await self.tree.data_listing()
        for rel in [rel for rel in files if rel not in listed]:
            del files[rel]  # (gone on the VPS: the copy after the stop prunes it)
        changed = sorted(rel for rel, sha in listed.items() if files.get(rel) != sha)
        if not changed:
            return 0
        staged_here = {rel for rel in changed if rel in files}
        fetched: dict[str, local_tree.Fetched] = {}
        sent = 0
        async with sftp_session.session(self.conn) as sftp:
            found = await self._looked_up(sftp, changed, staged_here, skip_gone=True)
            sizes, remote_blocks = found.sizes, found.blocks
            in_place = {rel for rel in staged_here if rel in remote_blocks}
            if staged_here - in_place:  # (a staged file is never fetched whole over itself)
                for rel in staged_here - in_place:
                    files.pop(rel, None)
                await asyncio.to_thread(local_tree.prune_to, self.staging, set(files))
            await asyncio.to_thread(local_tree.ensure_room, self.staging, [
                size for rel, size in sizes.items() if rel not in in_place])
            budget = _Budget(sum(sizes.values()))
            meter = _Meter(None, budget.left)
            for rel, size in sizes.items():
                files.pop(rel, None)  # (until it is whole again: a cut leaves it mixed)
                cache.pop(rel, None)
                try:
                    fetched[rel], n = await self._fetch(sftp, found, rel, size=size,
                                                        budget=budget, meter=meter)
                except ssh_errors.SFTP_NO_SUCH_FILE:
                    continue  # gone since the listing (the daemon runs)
                files[rel] = fetched[rel].sha256
                sent += n
        cache.update(await asyncio.to_thread(local_tree.settle, self.staging, fetched))
        return sent

    @contextlib.asynccontextmanager
    async def _gives_space_back(self) -> AsyncIterator[None]:
        """A download that fails removes its local staging dir at once (nothing of a failed
        copy keeps the PBX's space) — unless the link is what failed: what arrived is where
        the next pre-copy resumes (as an upload's staging dir on the VPS). A file system
        error here is named by its cause."""
        try:
            try:
                yield
            except OSError as e:  # local file work in a thread (asyncssh's are translated)
                raise local_tree.local_file_error(e, during=f"download of {self.remote_dir}"
                                                  ) from e
        except MonitordError as e:
            if _link_usable(e):
                await asyncio.to_thread(local_tree.remove, self.staging)
            raise

    async def _pre_copy(self, meter: _Meter) -> Staged:
        listed = await self.tree.data_listing()
        staging = self.staging
        # What a copy cut by the link left in the staging dir: each such file is where its
        # fetch resumes, by the blocks that differ (the rest of the dir goes).
        left = await asyncio.to_thread(local_tree.resumable, staging, set(listed))
        fetched: dict[str, local_tree.Fetched] = {}
        async with self._refused_leaves_nothing(f"pre-copy of {self.remote_dir}",
                                                meter) as sftp:
            # (a file gone since the listing is left out: the daemon runs)
            found = await self._looked_up(sftp, sorted(listed), left, skip_gone=True)
            sizes, remote_blocks = found.sizes, found.blocks
            resumed_from = {rel for rel in left if rel in remote_blocks and rel in sizes}
            if self.basis is not None and resumed_from:
                # (a staged file holding less than the PBX's own copy is not the start)
                worse = await asyncio.to_thread(
                    local_tree.worse_than_basis, self.basis,
                    {rel: found.have[rel] for rel in sorted(resumed_from) if rel in found.have},
                    remote_blocks)
                resumed_from -= worse
                found.seeds.update(dict.fromkeys(worse, self.basis))
            if resumed_from != left:  # (a staged file is never fetched whole over itself)
                await asyncio.to_thread(local_tree.prune_to, staging, resumed_from)
            await asyncio.to_thread(local_tree.ensure_room, staging, [
                size for rel, size in sizes.items() if rel not in resumed_from])
            budget = _Budget(sum(sizes.values()))
            meter.total = budget.left
            meter.add()
            sent = resumed = 0
            started = time.monotonic()
            for rel, size in sizes.items():
                try:
                    fetched[rel], n = await self._fetch(sftp, found, rel, size=size,
                                                        budget=budget, meter=meter)
                except ssh_errors.SFTP_NO_SUCH_FILE:
                    continue  # gone since the listing (the daemon runs)
                sent += n
                if rel in resumed_from:
                    resumed += fetched[rel].size - n
            send_s = time.monotonic() - started
        cache = await asyncio.to_thread(local_tree.settle, staging, fetched)
        return Staged(local_dir=self.local_dir, remote_dir=self.remote_dir, upload=False,
                      files={rel: f.sha256 for rel, f in fetched.items()}, cache=cache,
                      through_agent=self.tree.through_agent, sent_bytes=sent, send_s=send_s,
                      resumed_bytes=resumed)

    async def _looked_up(
        self, sftp: asyncssh.SFTPClient, names: Sequence[str], staged_here: set[str], *,
        skip_gone: bool, whole: bool = False,
    ) -> _LookedUp:
        """What a fetch of `names` needs before its first byte (`_LookedUp`), asked in one
        wave: the data dir's real path and each file's declared size (`_declared_sizes`),
        and the VPS's block digests of every file with a start here — a file `staged_here`
        (it holds its basis and what came since), else the PBX's own copy (`_seeds`). Of a
        staged file the VPS sends those of the 64 KiB groups that differ only (the question
        summarises it: block_delta.group_digests): after the stop a live store's answer is
        its last pages' groups, where a digest per page of the whole store (96 KiB for
        24 MiB) took the link's slow start after idle, a few round trips, while the area was
        down. (`whole`: no start at all, every file fetched whole.)"""
        seeds: dict[str, Path | None] = {}
        have: dict[str, Blocks] = {}
        if not whole:
            seeds = await asyncio.to_thread(
                _seeds, self.basis, [rel for rel in names if rel not in staged_here])
            here = sorted(staged_here & set(names))
            seeds.update(dict.fromkeys(here))
            have = await asyncio.to_thread(local_tree.staged_blocks, self.staging, here)
        sized = _declared_sizes(sftp, self.remote_dir, names, where=self.remote_dir,
                                skip_gone=skip_gone)
        if not seeds:
            root, sizes = await sized
            return _LookedUp(root, sizes, seeds, {}, have)
        (root, sizes), remote_blocks = await _side_by_side(
            sized, self.tree.blocks(sorted(seeds), have))
        # (a file gone by its look-up has no start: it is not fetched)
        return _LookedUp(root, sizes, seeds,
                         {rel: b for rel, b in remote_blocks.items() if rel in sizes}, have)

    async def _fetch(
        self, sftp: asyncssh.SFTPClient, found: _LookedUp, rel: str, *, size: int,
        budget: _Budget, meter: _Meter,
    ) -> tuple[local_tree.Fetched, int]:
        """One file into the staging dir: (what it holds, the bytes fetched). With the VPS
        file's block digests, from the copy here (its seed/rel, or the staged file itself
        when None) by its changed blocks; without them, or from a seed when they were
        digested at another size than the one declared for the fetch (a running source),
        whole. (The staged file is never fetched whole: the copy after the stop pruned it
        if the VPS did not digest it.)"""
        source = f"{found.root}/{rel}"
        blocks, seed = found.blocks.get(rel), found.seeds.get(rel)
        if blocks is None or (seed is not None and blocks.size != size):
            fetched = await _fetch(sftp, source, rel, self.staging, size=size, budget=budget,
                                   meter=meter)
            return fetched, fetched.size
        fetched, n = await _fetch_delta(sftp, source, rel, self.staging, seed=seed,
                                        have=None if seed is not None else found.have.get(rel),
                                        now=blocks, budget=budget)
        meter.add(fetched.size)
        return fetched, n

    async def _copy(self, staged: Staged | None, progress: Progress | None, *,
                    whole: bool = False) -> CopyReport:
        expected = await self.tree.data_listing()
        staging = self.staging
        kept = {} if staged is None else staged.files
        # A staged file that changed is where its delta starts; others start from the basis.
        changed = {rel for rel, h in kept.items() if rel in expected and expected[rel] != h}
        kept = {rel: h for rel, h in kept.items() if expected.get(rel) == h}
        to_fetch = sorted(rel for rel in expected if kept.get(rel) != expected[rel])
        sent = 0
        meter = _Meter(progress, 0)
        async with self._refused_leaves_nothing(f"download of {self.remote_dir}",
                                                meter) as sftp:
            found = await self._looked_up(sftp, to_fetch, changed, skip_gone=False,
                                          whole=whole)
            sizes, remote_blocks = found.sizes, found.blocks
            in_place: set[str] = set()  # (staged files changed in place: their room is taken)
            if staged is None:
                await asyncio.to_thread(local_tree.reset_dir, staging)
            else:
                in_place = {rel for rel in changed if rel in remote_blocks}
                await asyncio.to_thread(local_tree.prune_to, staging, set(kept) | in_place)
            await asyncio.to_thread(local_tree.ensure_room, staging, [
                size for rel, size in sizes.items() if rel not in in_place])
            budget = _Budget(sum(sizes.values()))
            meter.total = budget.left
            meter.add()
            started = time.monotonic()

            async def fetch(rel: str, size: int) -> None:
                nonlocal sent
                _, n = await self._fetch(sftp, found, rel, size=size, budget=budget,
                                         meter=meter)
                sent += n

            await _at_once([functools.partial(fetch, rel, size) for rel, size in sizes.items()])
            send_s = time.monotonic() - started
        manifest = await asyncio.to_thread(
            local_tree.manifest, staging, None if staged is None else staged.cache
        )
        got = {e.path: e.sha256 for e in manifest}
        if got != expected:
            if staged is not None or remote_blocks:
                # The staging dir changed under us, or a delta went wrong: over, whole.
                return await self._copy(None, progress, whole=True)
            raise incomplete(f"downloaded copy of {self.remote_dir} differs in"
                             f" {listing.differences(got, expected)}")
        # What a pre-copy staged was fsynced before the stop: only what was written since
        # costs an fsync while the area is down.
        await asyncio.to_thread(local_tree.promote, staging, self.local_dir,
                                settled=None if staged is None else staged.cache)
        # (bytes: the area's size, as an upload reports it; sent_bytes what crossed)
        return CopyReport(files=len(got), bytes=sum(e.size for e in manifest),
                          reused=len(expected) - len(to_fetch), sent_bytes=sent, send_s=send_s)

    @contextlib.asynccontextmanager
    async def _refused_leaves_nothing(
        self, during: str, meter: _Meter,
    ) -> AsyncIterator[asyncssh.SFTPClient]:
        """An SFTP session for fetching into the staging dir (`meter`'s chunks keep its
        deadline off), its failures translated; a refusal (COPY_INCOMPLETE, not a cut)
        removes the staging dir: nothing of a refused copy stays behind."""
        try:
            with _sftp_translated(during, timeout_s=self.timeout_s):
                async with asyncio.timeout(self.timeout_s) as deadline, \
                        sftp_session.session(self.conn) as sftp:
                    meter.guards(deadline, stall_s=self.timeout_s)
                    yield sftp
        except MonitordError as e:
            if e.code == ErrorCode.COPY_INCOMPLETE:
                await asyncio.to_thread(local_tree.remove, self.staging)
            raise


# How many files' realpath and lstat a download asks for at once (one round trip for many).
_STATS_IN_FLIGHT = 64


async def _declared_sizes(
    sftp: asyncssh.SFTPClient, remote_dir: str, names: Sequence[str], *, where: str,
    skip_gone: bool,
) -> tuple[str, dict[str, int]]:
    """(`remote_dir`'s real path on the VPS, {name: its size there}) for the files about to
    be fetched, in the given order, before any byte is: each must be a regular file whose real
    path is the listed one below that dir (no remote symlink on the way) — else
    COPY_INCOMPLETE. These sizes cap what is read of each file, and their sum the whole
    download: a VPS that sends more than it declared (a file swapped for a link to /dev/zero)
    fills no disk here. `skip_gone`: a file that is gone since the listing is left out (a
    running source) instead of failing the copy. The dir's real path and every file's real
    path and lstat are asked side by side, 64 files a wave (over a WAN each wave is a round
    trip, and a move home waits for this one while the area is down)."""
    if not names:
        return "", {}
    base = remote_dir.rstrip("/")

    async def looked_up(rel: str) -> tuple[str, asyncssh.SFTPAttrs] | None:
        try:
            real, attrs = await asyncio.gather(sftp.realpath(f"{base}/{rel}"),
                                               sftp.lstat(f"{base}/{rel}"))
        except ssh_errors.SFTP_NO_SUCH_FILE:
            if skip_gone:
                return None
            raise
        return real, attrs

    async def batch(start: int) -> list[tuple[str, asyncssh.SFTPAttrs] | None]:
        return await asyncio.gather(*(looked_up(rel)
                                      for rel in names[start:start + _STATS_IN_FLIGHT]))

    real_root, found = await asyncio.gather(sftp.realpath(base), batch(0))
    root = real_root.rstrip("/")
    for start in range(_STATS_IN_FLIGHT, len(names), _STATS_IN_FLIGHT):
        found += await batch(start)
    sizes: dict[str, int] = {}
    for rel, seen in zip(names, found, strict=True):
        if seen is None:
            continue
        real, attrs = seen
        if real != f"{root}/{rel}":
            raise incomplete(f"refusing {rel!r} from {where}: a symlink on the VPS leads"
                             " elsewhere")
        regular = (stat.S_ISREG(attrs.permissions) if attrs.permissions is not None
                   else attrs.type == asyncssh.FILEXFER_TYPE_REGULAR)
        if not regular or attrs.size is None:
            raise incomplete(f"refusing {rel!r} from {where}: not a regular file on the VPS")
        sizes[rel] = attrs.size
    return root, sizes


@dataclass(slots=True)
class _Budget:
    """What a download may still write here: the sum of the sizes the VPS declared."""

    left: int

    def take(self, n: int, rel: str) -> None:
        if n > self.left:
            raise incomplete(f"refusing {rel!r}: the VPS sent more bytes than it declared")
        self.left -= n


async def _fetch(
    sftp: asyncssh.SFTPClient, source: str, rel: str, staging: Path, *, size: int,
    budget: _Budget, meter: _Meter,
) -> local_tree.Fetched:
    """Fetch `source` into staging/rel (never through a symlink here), reading at most the
    `size` the VPS declared for it (`_declared_sizes`), within the download's `budget`."""
    digest = hashlib.sha256()
    with local_tree.create_inside(staging, rel) as out:
        async with sftp.open(source, "rb") as f, contextlib.aclosing(
                _read_ahead(f, size)) as chunks:
            async for data in chunks:
                budget.take(len(data), rel)
                digest.update(data)
                _write_local(out, data, path=staging / rel)
                meter.add(len(data))
        _write_local(out, b"", path=staging / rel)  # flush
        return local_tree.Fetched(out.tell(), digest.hexdigest(), os.fstat(out.fileno()))


async def _read_ahead(f: asyncssh.SFTPClientFile, size: int) -> AsyncGenerator[bytes, None]:
    """The first `size` bytes of `f` in order, in chunks, with _WRITES_IN_FLIGHT chunks'
    reads on the wire at once: one read at a time left the link idle for a round trip per
    chunk (a quarter of a 20 Mbit/s line at 80 ms). Ends early where the file does (a short
    chunk): what it held then is the digest's to judge."""
    ahead: collections.deque[asyncio.Future[bytes | str]] = collections.deque()
    asked = 0
    try:
        while ahead or asked < size:
            while len(ahead) < _WRITES_IN_FLIGHT and asked < size:
                length = min(_CHUNK, size - asked)
                ahead.append(asyncio.ensure_future(f.read(length, asked)))
                asked += length
            data = _as_bytes(await ahead.popleft())
            if data:
                yield data
            if len(data) < _CHUNK and (ahead or asked < size):
                return  # the file ended before its declared size
    finally:
        for read in ahead:
            read.cancel()
        await asyncio.gather(*ahead, return_exceptions=True)


def _seeds(basis: Path | None, names: Iterable[str]) -> dict[str, Path | None]:
    """{name: basis} for those of `names` the PBX's own copy at `basis` holds as a regular
    file (lstat, no symlink followed: a first look; the file is opened as
    local_tree.delta_target opens it). Blocking, in a thread."""
    if basis is None:
        return {}
    found: dict[str, Path | None] = {}
    for rel in names:
        with contextlib.suppress(OSError):
            if stat.S_ISREG(os.lstat(basis / rel).st_mode):
                found[rel] = basis
    return found


async def _fetch_delta(
    sftp: asyncssh.SFTPClient, source: str, rel: str, staging: Path, *, seed: Path | None,
    now: Blocks, budget: _Budget, have: Blocks | None = None,
) -> tuple[local_tree.Fetched, int]:
    """staging/rel made the VPS's `source`, whose block digests are `now`, from a copy the
    PBX already has — `seed`/rel copied in, or (None) the file a pre-copy staged there: only the
    runs of blocks orchestrator/block_delta.plan finds different are read from the VPS (a
    few at once), written in place, and the file cut or extended to the size. (What it
    holds then, hashed whole here, and the bytes fetched.) The digests only choose what to
    fetch: the SHA-256 against the VPS's listing still decides the promote."""
    out, start = await _opened_in_thread(
        functools.partial(local_tree.delta_target, staging, rel, seed, have=have),
        close=lambda opened: opened[0].close())
    try:
        delta = block_delta.plan(start, now)
        if delta.runs:
            async with sftp.open(source, "rb") as f:
                reads = _InFlight()
                try:
                    for offset, length in delta.runs:
                        await reads.add(functools.partial(
                            _fetch_run, f, out, offset, length, budget=budget,
                            path=staging / rel), length)
                    await reads.finish()
                finally:
                    await reads.cancel()
        fetched = await asyncio.to_thread(local_tree.finish_delta, out, now.size,
                                          path=staging / rel)
    finally:
        out.close()
    return fetched, delta.sent_bytes


async def _fetch_run(f: asyncssh.SFTPClientFile, out: BinaryIO, offset: int, length: int, *,
                     budget: _Budget, path: Path) -> int:
    """One run of a delta, read from the VPS and written at its offset here."""
    data = _as_bytes(await f.read(length, offset))
    budget.take(len(data), str(path))
    try:
        await asyncio.to_thread(os.pwrite, out.fileno(), data, offset)
    except OSError as e:
        e.filename = str(path)
        raise local_tree.local_file_error(e, during="download") from e
    return len(data)


def _write_local(out: BinaryIO, data: bytes, *, path: Path) -> None:
    """Write (and, for no data, flush) one fetched chunk; a local file system error named
    by its cause here, before the SFTP layer could take it for a lost link."""
    try:
        if data:
            out.write(data)
        else:
            out.flush()
    except OSError as e:
        e.filename = str(path)
        raise local_tree.local_file_error(e, during="download") from e


def _as_bytes(chunk: bytes | str) -> bytes:
    if isinstance(chunk, str):  # a file opened "rb" without an encoding reads bytes
        raise TypeError("SFTP read returned text")
    return chunk


async def remove_remote_leftovers(conn: asyncssh.SSHClientConnection, *, remote_dir: str) -> None:
    """Remove a staging dir (and its manifest) a cut copy left on the VPS."""
    await vps_tree.remove_leftovers(conn, remote_dir=remote_dir)

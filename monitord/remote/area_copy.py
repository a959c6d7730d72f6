"""COPY phase I/O: move one area's data dir between the PBX and the VPS, verified.

Called by the migration engine. Both directions follow the same protocol:
  1. the sender lists its files with size and SHA-256 (the manifest);
  2. the files go over SFTP into a fresh staging dir next to the destination dir;
  3. the RECEIVING side checks every hash and that no file is missing or extra;
  4. only then the staging dir replaces the destination dir by rename (and is fsynced).
A copy cut at any point leaves at most a staging dir behind (removed by the next try);
the destination dir is either the old one or the complete new one, never a mix. A
mismatch raises COPY_INCOMPLETE; the engine retries or rolls back.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import asyncssh

from monitord.remote import remote_exec, ssh_errors
from orchestrator.errors import ErrorCode, TransientError

STAGING_SUFFIX = ".staging"
_CHUNK = 1 << 20
_SCRIPT_TIMEOUT_S = 60.0

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


def _hash_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def local_manifest(root: Path) -> tuple[FileEntry, ...]:
    """Every regular file under root (sorted), with size and SHA-256. Missing root: empty."""
    if not root.is_dir():
        return ()
    entries = []
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            full = Path(dirpath) / name
            if full.is_symlink() or not full.is_file():
                continue
            rel = full.relative_to(root).as_posix()
            entries.append(FileEntry(rel, full.stat().st_size, _hash_file(full)))
    return tuple(sorted(entries, key=lambda e: e.path))


def _sha256sum_text(manifest: tuple[FileEntry, ...]) -> bytes:
    return "".join(f"{e.sha256}  ./{e.path}\n" for e in manifest).encode()


def _parse_sha256sum(text: str) -> dict[str, str]:
    result = {}
    for line in text.splitlines():
        digest, _, path = line.partition("  ")
        if digest and path:
            result[path.removeprefix("./")] = digest
    return result


def _incomplete(detail: str) -> TransientError:
    return TransientError(ErrorCode.COPY_INCOMPLETE, detail)


def _sftp_translated(during: str, *, timeout_s: float) -> AbstractContextManager[None]:
    """SFTP failures of one transfer: running out of time is COPY_INCOMPLETE (the source keeps
    its data, the engine retries), a lost link or a refused SFTP request SSH_UNREACHABLE
    (the table in ssh_errors.py)."""
    return ssh_errors.translated(
        code=ErrorCode.SSH_UNREACHABLE, during=during,
        timeout_code=ErrorCode.COPY_INCOMPLETE, timeout_s=timeout_s,
    )


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# Remote side: fixed scripts, values passed as positional parameters (never spliced).
_PREPARE = 'rm -rf -- "$1" && mkdir -p -- "$1"'
_VERIFY = (
    'cd -- "$1" && { [ "$3" -eq 0 ] || sha256sum --quiet --strict -c -- "$2" >&2; }'
    ' && test "$(find . -type f | wc -l)" -eq "$3"'
)
_PROMOTE = (
    'set -e; dst=$1; stg=$2; mkdir -p -- "$(dirname -- "$dst")";'
    ' if [ -e "$dst" ]; then rm -rf -- "$dst.old"; mv -- "$dst" "$dst.old"; fi;'
    ' mv -- "$stg" "$dst"; rm -rf -- "$dst.old" "$stg.manifest";'
    ' sync -- "$dst" "$(dirname -- "$dst")"'
)
_LIST = (
    'if [ -d "$1" ]; then cd -- "$1" && find . -type f -print0 | sort -z'
    " | xargs -0 -r sha256sum; fi"
)


async def upload(
    conn: asyncssh.SSHClientConnection,
    *,
    local_dir: Path,
    remote_dir: str,
    progress: Progress | None = None,
    timeout_s: float = 600.0,
) -> CopyReport:
    """Copy local_dir to remote_dir on the VPS, verified there, swapped in by rename."""
    manifest = await asyncio.to_thread(local_manifest, local_dir)
    total = sum(e.size for e in manifest)
    staging = remote_dir.rstrip("/") + STAGING_SUFFIX
    await _script(conn, _PREPARE, staging)
    done = 0
    with _sftp_translated(f"upload to {remote_dir}", timeout_s=timeout_s):
        async with asyncio.timeout(timeout_s), conn.start_sftp_client() as sftp:
            made: set[str] = {staging}
            for entry in manifest:
                target = str(PurePosixPath(staging) / entry.path)
                parent = str(PurePosixPath(target).parent)
                if parent not in made:
                    await sftp.makedirs(parent, exist_ok=True)
                    made.add(parent)
                await sftp.put(str(local_dir / entry.path), target)
                done += entry.size
                if progress:
                    progress(done, total)
            async with sftp.open(staging + ".manifest", "wb") as f:
                await f.write(_sha256sum_text(manifest))
    verify = await _script(conn, _VERIFY, staging, staging + ".manifest", str(len(manifest)))
    if not verify.ok:
        raise _incomplete(f"the VPS found {remote_dir} incomplete: {verify.stderr_tail()}")
    promoted = await _script(conn, _PROMOTE, remote_dir, staging)
    promoted.raise_for_status(ErrorCode.COPY_INCOMPLETE)
    return CopyReport(files=len(manifest), bytes=total)


async def download(
    conn: asyncssh.SSHClientConnection,
    *,
    remote_dir: str,
    local_dir: Path,
    progress: Progress | None = None,
    timeout_s: float = 600.0,
) -> CopyReport:
    """Copy remote_dir from the VPS to local_dir, verified here, swapped in by rename."""
    listing = await _script(conn, _LIST, remote_dir)
    listing.raise_for_status(ErrorCode.COPY_INCOMPLETE)
    expected = _parse_sha256sum(listing.text)
    staging = local_dir.with_name(local_dir.name + STAGING_SUFFIX)
    await asyncio.to_thread(_reset_dir, staging)
    done = 0
    with _sftp_translated(f"download of {remote_dir}", timeout_s=timeout_s):
        async with asyncio.timeout(timeout_s), conn.start_sftp_client() as sftp:
            for rel in sorted(expected):
                target = staging / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                await sftp.get(f"{remote_dir.rstrip('/')}/{rel}", str(target))
                done += target.stat().st_size
                if progress:
                    progress(done, done)
    got = {e.path: e.sha256 for e in await asyncio.to_thread(local_manifest, staging)}
    if got != expected:
        bad = sorted(set(got) ^ set(expected) | {p for p in got if got[p] != expected.get(p)})
        raise _incomplete(f"downloaded copy of {remote_dir} differs in {bad[:5]}")
    await asyncio.to_thread(_promote_local, staging, local_dir)
    return CopyReport(files=len(got), bytes=done)


def _reset_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)


def _fsync_tree(root: Path) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            fd = os.open(Path(dirpath) / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _promote_local(staging: Path, final: Path) -> None:
    _fsync_tree(staging)
    old = final.with_name(final.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    staging.rename(final)
    _fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


async def remove_remote_leftovers(conn: asyncssh.SSHClientConnection, *, remote_dir: str) -> None:
    """Remove a staging dir (and its manifest) a cut copy left on the VPS."""
    staging = remote_dir.rstrip("/") + STAGING_SUFFIX
    await _script(conn, 'rm -rf -- "$1" "$1.manifest"', staging)


async def _script(
    conn: asyncssh.SSHClientConnection, script: str, *args: str
) -> remote_exec.CommandResult:
    return await remote_exec.run_script(conn, script, args=args, timeout_s=_SCRIPT_TIMEOUT_S)

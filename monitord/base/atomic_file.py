"""Crash-safe replacement of a file, the one way monitord (on either side) writes state.

`atomic_write_bytes` writes a temp file in the same directory, fsyncs it, renames it over the
target and fsyncs the directory. A reader sees the old bytes or the new ones, never a mix, and
a failure leaves the target untouched. Standard library only: the VPS side uses it too.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def fsync_path(path: Path, *, follow_symlinks: bool = True) -> None:
    """fsync a file, or a directory (its entries), by path. With `follow_symlinks=False` a
    symlink there is refused (ELOOP), never followed."""
    flags = os.O_RDONLY | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(
    path: Path, data: bytes, *, mode: int = 0o644, owner: tuple[int, int] | None = None,
    durable: bool = True,
) -> None:
    """Replace `path` with `data` atomically and durably; on any failure the old file stays.
    `durable=False` leaves out both fsyncs: still atomic for every reader while the machine
    runs, but a crash of the machine may leave the old bytes (or none) — only for a file
    whose readers cannot outlive the machine.

    The temp file is created 0600 (mkstemp) and, before any byte is written, given `owner`
    (uid, gid; None: the caller's) and then `mode`, both through its descriptor: the target
    never exists, not even briefly, with a wider mode or another owner than asked for. A
    chown this process may not do (not root) is an error unless the temp already has that
    owner.
    """
    # Imported here, not above: the VPS verbs that start once per operation (the lease
    # guard, tunnel-lease) import this module, several for fsync_path alone, and tempfile
    # (with random and shutil) is a tenth of such a start.
    import tempfile

    directory = path.parent
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    tmp_path = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as tmp:
            if owner is not None:
                _fchown(tmp.fileno(), owner)
            os.fchmod(tmp.fileno(), mode)  # after chown, which may clear set-id bits
            tmp.write(data)
            tmp.flush()
            if durable:
                os.fsync(tmp.fileno())
        os.replace(tmp_path, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()
        raise
    if durable:
        fsync_path(directory)


def _fchown(fd: int, owner: tuple[int, int]) -> None:
    uid, gid = owner
    try:
        os.fchown(fd, uid, gid)
    except PermissionError:
        st = os.fstat(fd)
        if (st.st_uid, st.st_gid) != (uid, gid):
            raise

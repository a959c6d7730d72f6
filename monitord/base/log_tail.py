"""Reading an area's log file (or monitord's own) back, bounded: its last lines, or what was
appended since a reader's last position, across the rotations of the log hub and sinks.

Used by the agent's `GET /v1/areas/{area}/log` (the VPS side), by the daemon's
`GET /v1/areas/{uuid}/logs` for a local area, by `monitord logs` and `monitord bundle
--offline`. Every read is at most `MAX_BYTES` (1 MiB), so no log, however large, is read or
sent whole.

A position is `(file, offset)`: `file` is the log file's inode, `offset` a byte offset in it.
The hub and the sinks (monitord.base.log_sink.RotatingLog) rotate by renaming P to P.1 and
opening a fresh P, so when P's inode is no longer the reader's `file`, the rest of that file is
read from P.1 first, then the new P from its start: a follower loses nothing unless more than
a whole file was written between two reads. A P shorter than the offset (kept = 0: started
afresh) is read from 0.

Answers are dicts of JSON-able values: `data` (text, UTF-8 with undecodable bytes replaced),
`file`, `offset` (where the next read starts), `missing` (there is no such log). Standard
library only, Python >= 3.9: it runs on the VPS too.
"""

from __future__ import annotations

import os
from typing import Any

MAX_BYTES = 1024 * 1024
MAX_LINES = 10000
DEFAULT_LINES = 100


def _answer(data: bytes, *, file: int | None, offset: int, missing: bool = False) -> dict[str, Any]:
    return {"data": data.decode("utf-8", "replace"), "file": file, "offset": offset,
            "missing": missing}


def _lines(data: bytes, *, whole: bool) -> list[bytes]:
    """`data` as lines (each with its newline; the last may lack it). Unless `whole` (data
    starts at the file's start), its first line is a partial one and left out."""
    parts = data.split(b"\n")
    lines = [part + b"\n" for part in parts[:-1]]
    if parts[-1]:
        lines.append(parts[-1])
    return lines if whole else lines[1:]


def _read_end(fd: int, size: int, budget: int) -> tuple[bytes, bool]:
    """The last `budget` bytes of an open file of `size` bytes; whether that is all of it."""
    start = max(0, size - budget)
    return os.pread(fd, size - start, start), start == 0


_FIRST_READ_BYTES = 64 * 1024


def _last_lines(fd: int, size: int, *, lines: int, max_bytes: int) -> tuple[list[bytes], bool]:
    """The last `lines` lines within the last `max_bytes` of an open file, read from its end
    in growing pieces (64 KiB, then doubled): a hundred lines of a large log cost one small
    read. Whether the whole file was read."""
    budget = min(max_bytes, _FIRST_READ_BYTES)
    while True:
        data, whole = _read_end(fd, size, budget)
        found = _lines(data, whole=whole)
        if whole or len(found) >= lines or budget >= max_bytes:
            return (found[-lines:] if lines else []), whole
        budget = min(max_bytes, budget * 2)


def tail(path: str, *, lines: int = DEFAULT_LINES, max_bytes: int = MAX_BYTES) -> dict[str, Any]:
    """The last `lines` lines of the log at `path` within `max_bytes` — taken from the
    rotated `path.1` too when `path` was started afresh lately — and the position after them
    (for `read_from`)."""
    lines = max(0, min(lines, MAX_LINES))
    max_bytes = max(0, min(max_bytes, MAX_BYTES))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return _answer(b"", file=None, offset=0, missing=True)
    try:
        st = os.fstat(fd)
        found, whole = _last_lines(fd, st.st_size, lines=lines, max_bytes=max_bytes)
    finally:
        os.close(fd)
    taken = b"".join(found)
    budget = max_bytes - len(taken)
    if whole and len(found) < lines and budget > 0:
        try:
            older_fd = os.open(f"{path}.1", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            older_fd = -1
        if older_fd >= 0:
            try:
                older, older_whole = _read_end(older_fd, os.fstat(older_fd).st_size, budget)
            finally:
                os.close(older_fd)
            before = _lines(older, whole=older_whole)[-(lines - len(found)):]
            taken = b"".join(before) + taken
    return _answer(taken, file=st.st_ino, offset=st.st_size)


def read_from(
    path: str, *, file: int | None, offset: int, max_bytes: int = MAX_BYTES
) -> dict[str, Any]:
    """What was appended to the log since position (`file`, `offset`), at most `max_bytes`
    (cut after the last whole line when there is more to read); see the module doc."""
    max_bytes = max(1, min(max_bytes, MAX_BYTES))
    offset = max(0, offset)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return _answer(b"", file=None, offset=0, missing=True)
    try:
        st = os.fstat(fd)
        if file is not None and st.st_ino != file:
            rest = _rest_of_rotated(f"{path}.1", file=file, offset=offset, max_bytes=max_bytes)
            if rest is not None:
                return rest
            offset = 0  # the reader's file is gone (or read to its end): the new one from 0
        if offset > st.st_size:
            offset = 0  # started afresh in place
        chunk = os.pread(fd, max_bytes, offset)
    finally:
        os.close(fd)
    chunk = _whole_lines(chunk, more=offset + len(chunk) < st.st_size)
    return _answer(chunk, file=st.st_ino, offset=offset + len(chunk))


def _rest_of_rotated(
    path: str, *, file: int, offset: int, max_bytes: int
) -> dict[str, Any] | None:
    """The unread end of the reader's file, now rotated to `path` (None: it is not there, or
    nothing of it is left unread)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if st.st_ino != file or offset >= st.st_size:
            return None
        chunk = os.pread(fd, max_bytes, offset)
    finally:
        os.close(fd)
    chunk = _whole_lines(chunk, more=offset + len(chunk) < st.st_size)
    return _answer(chunk, file=file, offset=offset + len(chunk))


def _whole_lines(chunk: bytes, *, more: bool) -> bytes:
    """A chunk with more after it ends at its last newline (the rest comes next time), so
    that a line — and a UTF-8 character — is not split between two reads."""
    if not more:
        return chunk
    newline = chunk.rfind(b"\n")
    return chunk[: newline + 1] if newline >= 0 else chunk

"""The API token: the local authority for changes through the HTTP API.

Reads of the API (status, metrics, the page, health) are open on loopback; every change and
the diagnostic bundle need `Authorization: Bearer <token>` (docs/design.md, "Local
authorization"). The token is 32 random bytes (URL-safe base64, 43 characters) in
`<work_dir>/api-token`, owned by monitord's user, group `http.token_group` (default: monitord's
own group), mode 0640: root and that group's members may read it, nobody else, in particular
not the messenger daemons' own service users.

`ensure(work_dir, group)` runs once at daemon start, before the API listens: it keeps a token
file that is in order and writes a new one otherwise (missing, not a regular file, another
owner or group, a mode wider than 0640, garbled content), atomically and durably
(monitord.base.atomic_file) with its owner and mode set before the first byte. `read(work_dir)`
is the CLI's side. `permits(token, header)` compares in constant time. The token is never
logged, printed, returned by the API or put into a bundle.

Callers: monitord.surface.daemon (ensure), monitord.surface.http_api (permits),
monitord.surface.client_commands (read).
"""

from __future__ import annotations

import grp
import hmac
import os
import re
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.errors import ErrorCode, PermanentError

FILE_NAME = "api-token"
MODE = 0o640
_TOKEN_BYTES = 32
_SHAPE = re.compile(r"[A-Za-z0-9_-]{43}")
_READ_LIMIT = 256  # more than a token line; a larger file is garbled, not read whole


class ApiTokenError(PermanentError):
    """The token file cannot be set up (DAEMON_START_FAILED): the daemon does not start."""

    def __init__(self, detail: str) -> None:
        super().__init__(ErrorCode.DAEMON_START_FAILED, detail)


@dataclass(frozen=True)
class ApiToken:
    """The token the API compares against, and where an operator finds it (for details)."""

    value: bytes = field(repr=False)
    path: Path
    group: str

    def __str__(self) -> str:  # never the value
        return f"API token in {self.path} (group {self.group})"


@dataclass(frozen=True)
class Ensured:
    """What `ensure` did: the token, and why it wrote a new file (None: kept the old one)."""

    token: ApiToken
    written: str | None


def token_path(work_dir: Path) -> Path:
    return work_dir / FILE_NAME


def _group(name: str | None) -> tuple[int, str]:
    """(gid, name) of `http.token_group`, or of this process's own group when None."""
    try:
        if name is None:
            gid = os.getegid()
            return gid, grp.getgrgid(gid).gr_name
        return grp.getgrnam(name).gr_gid, name
    except KeyError:
        if name is None:
            return os.getegid(), str(os.getegid())
        raise ApiTokenError(f"http.token_group {name!r} is not a group on this machine") from None


def _read_fd(path: Path) -> tuple[os.stat_result, bytes]:
    """The file's stat and first bytes, opened without following a symlink or blocking on a
    FIFO; OSError (ELOOP for a symlink) when it cannot be opened so."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return st, b""
        return st, os.read(fd, _READ_LIMIT)
    finally:
        os.close(fd)


def _shape(raw: bytes) -> bytes | None:
    text = raw.strip()
    return text if _SHAPE.fullmatch(text.decode("ascii", "replace")) else None


def _why_not_kept(path: Path, gid: int) -> tuple[str | None, bytes]:
    """(None, token) for a file in order; (reason, b"") when a new one must be written."""
    try:
        st, raw = _read_fd(path)
    except FileNotFoundError:
        return "missing", b""
    except OSError as e:
        return f"cannot be opened as a plain file ({e.strerror or e})", b""
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file", b""
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not monitord's", b""
    if st.st_gid != gid:
        return f"group {st.st_gid}, not http.token_group's {gid}", b""
    if stat.S_IMODE(st.st_mode) & ~MODE:
        return f"mode {stat.S_IMODE(st.st_mode):04o} is wider than {MODE:04o}", b""
    token = _shape(raw)
    if token is None:
        return "content is not a token", b""
    return None, token


def ensure(work_dir: Path, group: str | None) -> Ensured:
    """The API token of this work_dir: the file's if it is in order, else a new one written
    (0640, monitord's user, `group`). Blocking file I/O: call it in a thread."""
    from monitord.base import atomic_file

    gid, group_name = _group(group)
    path = token_path(work_dir)
    reason, token = _why_not_kept(path, gid)
    if reason is None:
        return Ensured(ApiToken(token, path, group_name), None)
    # A rename replaces a symlink or a FIFO there (never follows it); a directory stays and
    # is an error below.
    token = secrets.token_urlsafe(_TOKEN_BYTES).encode("ascii")
    try:
        atomic_file.atomic_write_bytes(path, token + b"\n", mode=MODE, owner=(os.geteuid(), gid))
    except OSError as e:
        raise ApiTokenError(
            f"cannot write {path} with group {group_name}: {e.strerror or e}"
            " (monitord's user must own work_dir and be a member of http.token_group)"
        ) from e
    return Ensured(ApiToken(token, path, group_name), reason)


def read(work_dir: Path) -> tuple[str | None, str]:
    """The CLI's side: (token, "") or (None, why it could not be read) — never raises."""
    path = token_path(work_dir)
    try:
        st, raw = _read_fd(path)
    except OSError as e:
        return None, f"cannot read {path}: {e.strerror or e}"
    token = _shape(raw) if stat.S_ISREG(st.st_mode) else None
    if token is None:
        return None, f"{path} does not hold an API token"
    return token.decode("ascii"), ""


def presented(header: str | None) -> bytes | None:
    """The token of an `Authorization: Bearer <token>` header; None for any other header."""
    if header is None:
        return None
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    try:
        return value.strip().encode("ascii")
    except UnicodeEncodeError:
        return None


def permits(token: ApiToken, header: str | None) -> bool:
    """Whether `header` carries this token; compared in constant time (hmac.compare_digest)."""
    offered = presented(header)
    return offered is not None and hmac.compare_digest(offered, token.value)

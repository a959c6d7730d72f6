"""The local side of the tunnel lease: runs `monitord tunnel-lease` on the VPS over SSH exec
and turns its JSON answer into frozen values or typed errors.

Called by monitord/remote/tunnel/keeper.py (acquire after every connect, renew every TTL/3,
release on close), monitord/remote/tunnel/forwards.py (fence a stale session, probe a reverse
forward), monitord/remote/tunnel/standby.py and monitord/surface/check_command.py. The VPS
command prefix comes from `config.remote.remote_monitord` with {remote_python} and
{remote_bin_dir} expanded.

The VPS may be compromised, so every answer is typed and bounded before use: a reply line of
at most MAX_REPLY_BYTES (the helper's stdout is read in chunks, never with an unbounded
`readline`), JSON within monitord.base.bounded_json's bounds, and every field checked for its
type and range (`parse_answer`, `parse_record`): a time is a number within ±2^53, a PID or
port an integer in range (monitord.base.bounded_json's `number` and `integer`: no bool, NaN
or integer float() cannot hold), a string a string, made safe as outside text
(monitord.base.outside_text, in `_text`). Anything else is TransientError
VPS_REPLY_INVALID, never a ValueError, KeyError, OverflowError or RecursionError out of the
keeper's attempt. A command that
printed no JSON line at all is PROVISION_FAILED, as before (a missing or broken install, which
the keeper answers by provisioning).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from monitord.base import bounded_json, outside_text
from orchestrator.errors import (
    ErrorCode,
    MonitordError,
    PermanentError,
    TransientError,
    UnknownErrorCode,
    error_for,
    lookup,
)
from orchestrator.tunnel_lease import LeaseRecord, SessionIdentity

if TYPE_CHECKING:  # the SSH side loads after readiness (monitord/remote/ssh_side.py)
    import asyncssh

EXIT_NOT_FOUND = 127
EXIT_NOT_EXECUTABLE = 126
# One answer is a few hundred bytes; a line longer than this is not an answer.
MAX_REPLY_BYTES = 64 * 1024
_READ_CHUNK = 16 * 1024
_DETAIL_CHARS = 300
_MAX_PID = 2**22  # Linux's pid_max ceiling
_MAX_TICKS = 2**63 - 1


@dataclass(frozen=True)
class LeaseAnswer:
    """The VPS's answer to a lease operation."""

    ok: bool
    action: str
    reason: str
    now: float  # VPS clock
    lease: LeaseRecord | None  # the record now in force for us (granted) or None
    holder: LeaseRecord | None  # the record that blocked us or was replaced
    session: SessionIdentity | None  # our own session as the VPS sees it
    code: str | None = None
    fenced_pid: int | None = None


class LeaseClient:
    """Lease operations for one owner against one VPS directory."""

    def __init__(
        self,
        *,
        prefix: Sequence[str],
        remote_dir: str,
        owner_id: str,
        owner_label: str,
        ttl_s: float,
        timeout_s: float = 15.0,
    ) -> None:
        self._prefix = tuple(prefix)
        self._dir = remote_dir
        self.owner_id = owner_id
        self.owner_label = owner_label
        self.ttl_s = ttl_s
        self._timeout_s = timeout_s

    def _argv(self, op: str, *extra: str) -> list[str]:
        return [*self._prefix, "tunnel-lease", "--dir", self._dir, op, *extra]

    def _owner_args(self) -> list[str]:
        return ["--owner-id", self.owner_id, "--owner-label", self.owner_label,
                "--ttl", repr(self.ttl_s)]

    async def acquire(self, conn: asyncssh.SSHClientConnection) -> LeaseAnswer:
        return parse_answer(await self._run(conn, self._argv("acquire", *self._owner_args())))

    async def renew(self, conn: asyncssh.SSHClientConnection) -> LeaseAnswer:
        return parse_answer(await self._run(conn, self._argv("renew", *self._owner_args())))

    async def release(self, conn: asyncssh.SSHClientConnection) -> LeaseAnswer:
        return parse_answer(await self._run(conn, self._argv("release", *self._owner_args())))

    async def show(self, conn: asyncssh.SSHClientConnection) -> tuple[LeaseRecord | None, float]:
        """The record on the VPS (whoever holds it) and the VPS clock."""
        doc = await self._run(conn, self._argv("show"))
        return parse_record(doc.get("lease"), where="lease"), _number(doc, "now", default=0.0)

    async def fence(self, conn: asyncssh.SSHClientConnection, *, pid: int,
                    start_ticks: int) -> bool:
        """End the sshd session `pid` (verified by its start time) on the VPS; True if gone."""
        doc = await self._run(
            conn, self._argv("fence", "--pid", str(pid), "--start-ticks", str(start_ticks))
        )
        return _flag(doc, "ok")

    async def open_session(self, conn: asyncssh.SSHClientConnection) -> LeaseSession:
        """Start the per-connection helper (`tunnel-lease serve`) and wait until it is ready."""
        from monitord.remote import remote_exec, ssh_errors

        argv = self._argv("serve", *self._owner_args())
        with ssh_errors.translated(code=ErrorCode.SSH_UNREACHABLE,
                                   during="starting tunnel-lease serve"):
            async with asyncio.timeout(self._timeout_s):
                process = await conn.create_process(remote_exec.command_line(argv),
                                                    encoding=None)
        session = LeaseSession(process, owner_id=self.owner_id, timeout_s=self._timeout_s)
        try:
            await session.read_reply("ready")
        except MonitordError:
            process.close()
            raise
        return session

    async def _run(self, conn: asyncssh.SSHClientConnection, argv: list[str]) -> dict[str, Any]:
        from monitord.remote import remote_exec

        result = await remote_exec.run(conn, argv, timeout_s=self._timeout_s,
                                       max_stdout=MAX_REPLY_BYTES)
        if result.stdout_truncated:
            raise invalid(f"tunnel-lease {argv[len(self._prefix) + 3]}: more than"
                          f" {MAX_REPLY_BYTES} bytes of output")
        if result.exit_status in (EXIT_NOT_FOUND, EXIT_NOT_EXECUTABLE) or (
            result.exit_status != 0 and b"No such file" in result.stderr
        ):
            raise TransientError(
                ErrorCode.PROVISION_FAILED,
                f"monitord is not installed on the VPS ({argv[0]} ...): {result.stderr_tail()}",
            )
        return parse_answer_document(result.text, stderr=result.stderr_tail())


def invalid(detail: str) -> TransientError:
    """A VPS answer that is not what the verb answers: VPS_REPLY_INVALID."""
    return TransientError(ErrorCode.VPS_REPLY_INVALID, detail[:2 * _DETAIL_CHARS])


def parse_answer_document(text: str, *, stderr: str = "") -> dict[str, Any]:
    """The last JSON line of the command's stdout; a usage answer becomes a typed error.

    No JSON object at all is PROVISION_FAILED (not installed, or a broken install); a line
    that is JSON but outside bounded_json's bounds (deep, huge numbers) VPS_REPLY_INVALID."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines or not lines[-1].lstrip().startswith("{"):
        raise TransientError(
            ErrorCode.PROVISION_FAILED,
            f"tunnel-lease gave no JSON answer: {text[-200:]!r} {stderr}",
        )
    try:
        doc = bounded_json.loads(lines[-1])
    except bounded_json.JsonRefused as e:
        raise invalid(f"tunnel-lease answer is not JSON within bounds: {e}") from e
    if not isinstance(doc, dict):
        raise invalid(f"tunnel-lease answer is {type(doc).__name__}, not an object")
    if doc.get("ok") is False and "code" in doc and "action" not in doc:
        code = _text(doc, "code", default="") or "BAD_REQUEST"
        raise _usage_error(code, _text(doc, "detail", default=""))
    return doc


def _usage_error(code: str, detail: str) -> MonitordError:
    try:
        return error_for(code, f"tunnel-lease: {detail}")
    except KeyError:
        return PermanentError(ErrorCode.BAD_REQUEST, f"tunnel-lease: {code:.60}: {detail}")


# -- typed fields -------------------------------------------------------------------------------

_MISSING = object()


def _get(doc: dict[str, Any], key: str, default: Any) -> Any:
    value = doc.get(key, _MISSING)
    if value is _MISSING or value is None:
        if default is _MISSING:
            raise invalid(f"tunnel-lease answer: {key} is missing")
        return default
    return value


def _number(doc: dict[str, Any], key: str, *, default: Any = _MISSING,
            minimum: float = -bounded_json.MAX_NUMBER) -> float:
    value = _get(doc, key, default)
    found = bounded_json.number(value, minimum=minimum)
    if found is None:
        raise invalid(f"tunnel-lease answer: {key} is {value!r:.40}, not a number in"
                      f" [{minimum:g}, {bounded_json.MAX_NUMBER:g}]")
    return found


def _integer(doc: dict[str, Any], key: str, *, maximum: int, minimum: int = 0,
             default: Any = _MISSING) -> int:
    value = _get(doc, key, default)
    found = bounded_json.integer(value, minimum=minimum, maximum=maximum)
    if found is None:
        raise invalid(f"tunnel-lease answer: {key} is {value!r:.40}, not an integer in"
                      f" [{minimum}, {maximum}]")
    return found


def _text(doc: dict[str, Any], key: str, *, default: Any = _MISSING) -> str:
    """A string field, as outside text (monitord.base.outside_text): every text of an
    answer is read here, so none reaches a detail, a log line or the status as sent."""
    value = _get(doc, key, default)
    if not isinstance(value, str):
        raise invalid(f"tunnel-lease answer: {key} is {type(value).__name__}, not a string")
    return outside_text.clean(value, limit=_DETAIL_CHARS)


def _flag(doc: dict[str, Any], key: str) -> bool:
    value = doc.get(key, False)
    if not isinstance(value, bool):
        raise invalid(f"tunnel-lease answer: {key} is {value!r:.40}, not true or false")
    return value


def _object(raw: Any, *, where: str) -> dict[str, Any] | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise invalid(f"tunnel-lease answer: {where} is {type(raw).__name__}, not an object")
    return raw


def parse_session(raw: Any, *, where: str = "session") -> SessionIdentity | None:
    doc = _object(raw, where=where)
    if not doc:
        return None
    return SessionIdentity(
        sshd_pid=_integer(doc, "sshd_pid", maximum=_MAX_PID),
        sshd_start_ticks=_integer(doc, "sshd_start_ticks", maximum=_MAX_TICKS),
        ssh_connection=_text(doc, "ssh_connection"),
    )


def parse_record(raw: Any, *, where: str) -> LeaseRecord | None:
    """A lease record of an answer (None for null or {}); VPS_REPLY_INVALID if malformed."""
    doc = _object(raw, where=where)
    if not doc:
        return None
    session = parse_session(doc.get("session"), where=f"{where}.session")
    if session is None:
        raise invalid(f"tunnel-lease answer: {where}.session is missing")
    return LeaseRecord(
        owner_id=_text(doc, "owner_id"),
        owner_label=_text(doc, "owner_label"),
        acquired_at=_number(doc, "acquired_at"),
        renewed_at=_number(doc, "renewed_at"),
        ttl=_number(doc, "ttl", minimum=0.0),
        session=session,
    )


def parse_answer(doc: dict[str, Any]) -> LeaseAnswer:
    """The typed answer to acquire, renew or release; VPS_REPLY_INVALID if malformed."""
    code = doc.get("code")
    if code is not None and not isinstance(code, str):
        raise invalid(f"tunnel-lease answer: code is {type(code).__name__}, not a string")
    if code is not None:
        try:
            lookup(code)  # the keeper raises it as ours: an uncatalogued one is no answer
        except UnknownErrorCode as e:
            raise invalid(f"tunnel-lease answer: code {code!r:.60} is not in the catalogue") from e
    fenced = doc.get("fenced_pid")
    return LeaseAnswer(
        ok=_flag(doc, "ok"),
        action=_text(doc, "action", default=""),
        reason=_text(doc, "reason", default=""),
        now=_number(doc, "now", default=0.0),
        lease=parse_record(doc.get("lease"), where="lease"),
        holder=parse_record(doc.get("holder"), where="holder"),
        session=parse_session(doc.get("session")),
        code=None if code is None else code[:60],
        fenced_pid=None if fenced is None else _integer(doc, "fenced_pid", maximum=_MAX_PID),
    )



@dataclass(frozen=True)
class ProbeAnswer:
    """The VPS's account of one forward probe (probe-connect)."""

    ok: bool
    rtt_ms: float
    detail: str


def parse_probe_answer(doc: dict[str, Any]) -> ProbeAnswer:
    return ProbeAnswer(
        ok=_flag(doc, "ok"),
        rtt_ms=_number(doc, "rtt_ms", default=0.0, minimum=0.0),
        detail=_text(doc, "detail", default=""),
    )


class LeaseSession:
    """One `tunnel-lease serve` helper on the VPS for the life of a connection: lease
    operations, fencing and forward probes become one JSON line each way instead of a
    process start (login shell + interpreter + imports) every time."""

    def __init__(self, process: asyncssh.SSHClientProcess[bytes], *, owner_id: str,
                 timeout_s: float) -> None:
        self._process = process
        self.owner_id = owner_id
        self._timeout_s = timeout_s
        self._lock = asyncio.Lock()
        self._pending = b""  # read past the last reply line

    async def read_reply(self, op: str, *, timeout_s: float | None = None) -> dict[str, Any]:
        """The next reply line; EOF means the helper is gone (maybe not installed)."""
        from monitord.remote import ssh_errors

        with ssh_errors.translated(code=ErrorCode.SSH_UNREACHABLE, during=f"tunnel-lease {op}"):
            async with asyncio.timeout(timeout_s or self._timeout_s):
                line = await self._read_line(op)
        if not line:
            raise await self._gone(op)
        return parse_answer_document(line.decode("utf-8", "replace"))

    async def _read_line(self, op: str) -> bytes:
        """One line of at most MAX_REPLY_BYTES (the partial one at EOF, b"" at EOF alone);
        asyncssh's readline would buffer a line of any length."""
        while b"\n" not in self._pending:
            if len(self._pending) > MAX_REPLY_BYTES:
                self._pending = b""
                raise invalid(f"tunnel-lease {op}: a reply line over {MAX_REPLY_BYTES} bytes")
            chunk = await self._process.stdout.read(_READ_CHUNK)
            if not chunk:
                line, self._pending = self._pending, b""
                return line
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        if len(line) > MAX_REPLY_BYTES:
            raise invalid(f"tunnel-lease {op}: a reply line over {MAX_REPLY_BYTES} bytes")
        return line + b"\n"

    async def _gone(self, op: str) -> MonitordError:
        from monitord.remote import ssh_errors

        stderr = b""
        status: int | None = None
        with contextlib.suppress(*ssh_errors.SSH_ERRORS):  # best effort: we are failing anyway
            async with asyncio.timeout(2.0):
                stderr = await self._process.stderr.read(MAX_REPLY_BYTES)
                status = (await self._process.wait(check=False)).exit_status
        tail = outside_text.clean(stderr.decode("utf-8", "replace").strip(), limit=_DETAIL_CHARS,
                                  tail=True)
        if status in (EXIT_NOT_FOUND, EXIT_NOT_EXECUTABLE) or "No such file" in tail:
            return TransientError(
                ErrorCode.PROVISION_FAILED, f"monitord is not installed on the VPS: {tail}"
            )
        return TransientError(
            ErrorCode.SSH_UNREACHABLE, f"tunnel-lease serve ended during {op}: {tail}"
        )

    async def request(self, op: str, *, timeout_s: float | None = None,
                      **fields: Any) -> dict[str, Any]:
        from monitord.remote import ssh_errors

        async with self._lock:
            with ssh_errors.translated(code=ErrorCode.SSH_UNREACHABLE,
                                       during=f"tunnel-lease {op}"):
                self._process.stdin.write(json.dumps({"op": op, **fields}).encode() + b"\n")
            return await self.read_reply(op, timeout_s=timeout_s)

    async def acquire(self, *, timeout_s: float | None = None) -> LeaseAnswer:
        return parse_answer(await self.request("acquire", timeout_s=timeout_s))

    async def renew(self) -> LeaseAnswer:
        return parse_answer(await self.request("renew"))

    async def release(self) -> LeaseAnswer:
        return parse_answer(await self.request("release"))

    async def fence(self, *, pid: int, start_ticks: int) -> bool:
        doc = await self.request("fence", pid=pid, start_ticks=start_ticks)
        return _flag(doc, "ok")

    async def probe_bind(self, *, host: str) -> int:
        doc = await self.request("probe-bind", host=host)
        return _integer(doc, "source_port", minimum=1, maximum=65535)

    async def probe_connect(self, *, source_port: int, host: str, port: int, nonce: str,
                            timeout_s: float) -> ProbeAnswer:
        doc = await self.request("probe-connect", timeout_s=timeout_s + self._timeout_s,
                                 source_port=source_port, host=host, port=port,
                                 nonce=nonce, timeout=timeout_s)
        return parse_probe_answer(doc)

    def close(self) -> None:
        self._process.close()

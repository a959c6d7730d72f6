"""The local side of the tunnel lease: runs `monitord tunnel-lease` on the VPS over SSH exec
and turns its JSON answer into frozen values or typed errors.

Called by the keeper (acquire after every connect, renew every TTL/3, release on close)
and by forwards.py (fence a stale session, probe a reverse forward). The VPS command prefix
comes from `config.remote.remote_monitord` with {remote_python} and {remote_bin_dir} expanded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import asyncssh

from monitord.remote import remote_exec, ssh_errors
from orchestrator.errors import (
    ErrorCode,
    MonitordError,
    PermanentError,
    TransientError,
    error_for,
)
from orchestrator.tunnel_lease import LeaseRecord, SessionIdentity

EXIT_NOT_FOUND = 127
EXIT_NOT_EXECUTABLE = 126


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
        return _answer(await self._run(conn, self._argv("acquire", *self._owner_args())))

    async def renew(self, conn: asyncssh.SSHClientConnection) -> LeaseAnswer:
        return _answer(await self._run(conn, self._argv("renew", *self._owner_args())))

    async def release(self, conn: asyncssh.SSHClientConnection) -> LeaseAnswer:
        return _answer(await self._run(conn, self._argv("release", *self._owner_args())))

    async def show(self, conn: asyncssh.SSHClientConnection) -> tuple[LeaseRecord | None, float]:
        """The record on the VPS (whoever holds it) and the VPS clock."""
        doc = await self._run(conn, self._argv("show"))
        return _record(doc.get("lease")), float(doc.get("now", 0.0))

    async def fence(self, conn: asyncssh.SSHClientConnection, *, pid: int,
                    start_ticks: int) -> bool:
        """End the sshd session `pid` (verified by its start time) on the VPS; True if gone."""
        doc = await self._run(
            conn, self._argv("fence", "--pid", str(pid), "--start-ticks", str(start_ticks))
        )
        return bool(doc.get("ok"))

    async def open_session(self, conn: asyncssh.SSHClientConnection) -> LeaseSession:
        """Start the per-connection helper (`tunnel-lease serve`) and wait until it is ready."""
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
        result = await remote_exec.run(conn, argv, timeout_s=self._timeout_s)
        if result.exit_status in (EXIT_NOT_FOUND, EXIT_NOT_EXECUTABLE) or (
            result.exit_status != 0 and b"No such file" in result.stderr
        ):
            raise TransientError(
                ErrorCode.PROVISION_FAILED,
                f"monitord is not installed on the VPS ({argv[0]} ...): {result.stderr_tail()}",
            )
        return parse_answer_document(result.text, stderr=result.stderr_tail())


def parse_answer_document(text: str, *, stderr: str = "") -> dict[str, Any]:
    """The last JSON line of the command's stdout; a usage answer becomes a typed error."""
    lines = [line for line in text.splitlines() if line.strip()]
    try:
        doc = json.loads(lines[-1])
        if not isinstance(doc, dict):
            raise ValueError("not an object")
    except (IndexError, ValueError) as e:
        raise TransientError(
            ErrorCode.PROVISION_FAILED,
            f"tunnel-lease gave no JSON answer: {text[-200:]!r} {stderr}",
        ) from e
    if doc.get("ok") is False and "code" in doc and "action" not in doc:
        code = str(doc.get("code") or "BAD_REQUEST")
        raise _usage_error(code, str(doc.get("detail", "")))
    return doc


def _usage_error(code: str, detail: str) -> MonitordError:
    try:
        return error_for(code, f"tunnel-lease: {detail}")
    except KeyError:
        return PermanentError(ErrorCode.BAD_REQUEST, f"tunnel-lease: {code}: {detail}")


def _record(raw: Any) -> LeaseRecord | None:
    if not raw:
        return None
    return LeaseRecord.from_dict(raw)


def _session(raw: Any) -> SessionIdentity | None:
    if not raw:
        return None
    return SessionIdentity(sshd_pid=int(raw["sshd_pid"]),
                           sshd_start_ticks=int(raw["sshd_start_ticks"]),
                           ssh_connection=str(raw["ssh_connection"]))


def _answer(doc: dict[str, Any]) -> LeaseAnswer:
    return LeaseAnswer(
        ok=bool(doc.get("ok")),
        action=str(doc.get("action", "")),
        reason=str(doc.get("reason", "")),
        now=float(doc.get("now", 0.0)),
        lease=_record(doc.get("lease")),
        holder=_record(doc.get("holder")),
        session=_session(doc.get("session")),
        code=doc.get("code"),
        fenced_pid=doc.get("fenced_pid"),
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

    async def read_reply(self, op: str, *, timeout_s: float | None = None) -> dict[str, Any]:
        """The next reply line; EOF means the helper is gone (maybe not installed)."""
        with ssh_errors.translated(code=ErrorCode.SSH_UNREACHABLE, during=f"tunnel-lease {op}"):
            async with asyncio.timeout(timeout_s or self._timeout_s):
                line = await self._process.stdout.readline()
        if not line:
            raise await self._gone(op)
        return parse_answer_document(line.decode("utf-8", "replace"))

    async def _gone(self, op: str) -> MonitordError:
        stderr = b""
        status: int | None = None
        with contextlib.suppress(*ssh_errors.SSH_ERRORS):  # best effort: we are failing anyway
            async with asyncio.timeout(2.0):
                stderr = await self._process.stderr.read()
                status = (await self._process.wait(check=False)).exit_status
        tail = stderr.decode("utf-8", "replace").strip()[-300:]
        if status in (EXIT_NOT_FOUND, EXIT_NOT_EXECUTABLE) or "No such file" in tail:
            return TransientError(
                ErrorCode.PROVISION_FAILED, f"monitord is not installed on the VPS: {tail}"
            )
        return TransientError(
            ErrorCode.SSH_UNREACHABLE, f"tunnel-lease serve ended during {op}: {tail}"
        )

    async def request(self, op: str, *, timeout_s: float | None = None,
                      **fields: Any) -> dict[str, Any]:
        async with self._lock:
            with ssh_errors.translated(code=ErrorCode.SSH_UNREACHABLE,
                                       during=f"tunnel-lease {op}"):
                self._process.stdin.write(json.dumps({"op": op, **fields}).encode() + b"\n")
            return await self.read_reply(op, timeout_s=timeout_s)

    async def acquire(self, *, timeout_s: float | None = None) -> LeaseAnswer:
        return _answer(await self.request("acquire", timeout_s=timeout_s))

    async def renew(self) -> LeaseAnswer:
        return _answer(await self.request("renew"))

    async def release(self) -> LeaseAnswer:
        return _answer(await self.request("release"))

    async def fence(self, *, pid: int, start_ticks: int) -> bool:
        doc = await self.request("fence", pid=pid, start_ticks=start_ticks)
        return bool(doc.get("ok"))

    async def probe_bind(self, *, host: str) -> int:
        doc = await self.request("probe-bind", host=host)
        return int(doc["source_port"])

    async def probe_connect(self, *, source_port: int, host: str, port: int, nonce: str,
                            timeout_s: float) -> dict[str, Any]:
        return await self.request("probe-connect", timeout_s=timeout_s + self._timeout_s,
                                  source_port=source_port, host=host, port=port,
                                  nonce=nonce, timeout=timeout_s)

    def close(self) -> None:
        self._process.close()

"""Run one command on the VPS over an existing asyncssh connection, with a timeout and typed errors.

The adapter between monitord and `SSHClientConnection.create_process`: callers pass an argv
(an absolute program path where possible), this module quotes it with `shlex.join` so no
argument is ever re-split or expanded by the remote shell, bounds the whole exchange by a
timeout, and has ssh_errors.py translate asyncssh/OS failures into `TransientError`s with a
stable code:

- the command did not finish in time            -> SSH_TIMEOUT (the channel is closed)
- the connection/channel failed or was refused  -> SSH_UNREACHABLE

A non-zero exit status is not an error here: `CommandResult.raise_for_status(code)` turns
it into the caller's own code. sshd always hands an exec request to the user's shell with
`-c` (never a login shell); `run_script` therefore passes multi-step probes as one
`/bin/sh -c SCRIPT name ARG…` so values travel as positional parameters, never spliced
into script text. Secrets never go on a command line: send them on stdin (`input=`) or
over SFTP. The VPS is untrusted: every command's stdout is bounded (`max_stdout`, 1 MiB
unless the caller passes less: a caller that parses the output passes what its answer can
need) and so is stderr (its last 64 KiB kept); the rest is read and dropped until the
command ends (or `timeout_s` runs out) and `CommandResult.stdout_truncated` is set, instead
of buffering whatever the VPS sends. A caller that parses a truncated stdout treats it as
VPS_REPLY_INVALID.

Called by monitord.remote.provisioning, monitord.remote.preflight, monitord.remote.remote_usage,
monitord.remote.copy.vps_tree and the tunnel's helpers on the VPS
(monitord.remote.tunnel.lease_client, monitord.remote.tunnel.port_holder).
"""

from __future__ import annotations

import asyncio
import contextlib
import shlex
import signal
from collections.abc import Sequence
from dataclasses import dataclass

import asyncssh

from monitord.base import outside_text
from monitord.base.task_owner import TaskOwner
from monitord.remote import ssh_errors
from orchestrator.errors import ErrorCode, error_for

_STDERR_TAIL = 400
_READ_CHUNK = 64 * 1024
_STDERR_KEEP = 64 * 1024  # the most of stderr kept (its end)
DEFAULT_MAX_STDOUT = 1024 * 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class CommandResult:
    """What one remote command did: its argv, exit status and raw output."""

    argv: tuple[str, ...]
    exit_status: int
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool = False  # stdout went past max_stdout; the rest was dropped

    @property
    def ok(self) -> bool:
        return self.exit_status == 0

    @property
    def text(self) -> str:
        """stdout decoded as UTF-8 (undecodable bytes replaced)."""
        return self.stdout.decode("utf-8", "replace")

    def stderr_tail(self) -> str:
        """The last few hundred characters of stderr, for error details: outside text, so
        made safe here (monitord.base.outside_text)."""
        return outside_text.clean(self.stderr.decode("utf-8", "replace").strip(),
                                  limit=_STDERR_TAIL, tail=True)

    def raise_for_status(self, code: str) -> CommandResult:
        """Return self when the command succeeded, else raise `code` with the exit status."""
        if not self.ok:
            raise error_for(
                code,
                f"{self.argv[0]} exited with status {self.exit_status}: {self.stderr_tail()}",
            )
        return self


def command_line(argv: Sequence[str]) -> str:
    """The exec request text for argv: every argument quoted for a POSIX shell."""
    if not argv:
        raise ValueError("empty argv")
    return shlex.join(argv)


async def run(
    conn: asyncssh.SSHClientConnection,
    argv: Sequence[str],
    *,
    timeout_s: float,
    input: bytes | None = None,
    max_stdout: int = DEFAULT_MAX_STDOUT,
) -> CommandResult:
    """Run argv on the VPS and wait for it, at most `timeout_s` seconds in total.

    At most `max_stdout` bytes of stdout are kept: the rest is read and dropped until the
    command ends, and the result has `stdout_truncated` set."""
    line = command_line(argv)
    process: asyncssh.SSHClientProcess[bytes] | None = None
    truncated = False
    try:
        with ssh_errors.translated(
            code=ErrorCode.SSH_UNREACHABLE, during=f"running {argv[0]} on the VPS",
            timeout_s=timeout_s,
        ):
            async with asyncio.timeout(timeout_s):
                process = await conn.create_process(line, encoding=None)
                stdout, stderr, truncated = await _communicate_bounded(
                    process, input, max_stdout
                )
                completed = await process.wait(check=False)
    finally:
        if process is not None and process.exit_status is None:
            process.close()
    status = completed.exit_status
    if status is None:  # ended by a signal
        status = 128 + _signal_number(completed.exit_signal)
    return CommandResult(
        argv=tuple(argv),
        exit_status=status,
        stdout=bytes(stdout or b""),
        stderr=bytes(stderr or b""),
        stdout_truncated=truncated,
    )


async def _communicate_bounded(
    process: asyncssh.SSHClientProcess[bytes], input: bytes | None, max_stdout: int
) -> tuple[bytes, bytes, bool]:
    """`communicate` that keeps at most max_stdout bytes of stdout (dropping the rest as it
    arrives) and the tail of stderr: (stdout, stderr, truncated)."""
    if input is not None:
        process.stdin.write(input)
    process.stdin.write_eof()
    # The stderr reader is awaited below (its errors are ours); cancelled on the way out.
    async with TaskOwner("remote command", report_crashes=False) as tasks:
        stderr_task = tasks.spawn("remote command: stderr",
                                  _read_tail(process.stderr, _STDERR_KEEP))
        stdout = bytearray()
        truncated = False
        while chunk := await process.stdout.read(_READ_CHUNK):
            if truncated:
                continue
            if len(stdout) + len(chunk) > max_stdout:
                stdout += chunk[: max_stdout - len(stdout)]
                truncated = True
            else:
                stdout += chunk
        return bytes(stdout), await stderr_task, truncated
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await stderr_task


async def _read_tail(stream: asyncssh.SSHReader[bytes], keep: int) -> bytes:
    tail = bytearray()
    while chunk := await stream.read(_READ_CHUNK):
        tail += chunk
        del tail[:-keep]
    return bytes(tail)


async def run_script(
    conn: asyncssh.SSHClientConnection,
    script: str,
    *,
    args: Sequence[str] = (),
    timeout_s: float,
    input: bytes | None = None,
    max_stdout: int = DEFAULT_MAX_STDOUT,
) -> CommandResult:
    """Run a fixed POSIX sh script on the VPS; `args` arrive as "$1"…, never as script text."""
    return await run(
        conn, ["/bin/sh", "-c", script, "monitord", *args],
        timeout_s=timeout_s, input=input, max_stdout=max_stdout,
    )


def _signal_number(exit_signal: tuple[str, bool, str, str] | None) -> int:
    if exit_signal is None:
        return 0
    try:
        return int(signal.Signals["SIG" + exit_signal[0]])
    except KeyError:
        return 0

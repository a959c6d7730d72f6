"""Provisioning: put the agent artifact, the service binaries and agent.secret on the VPS,
verified by SHA-256 there, then start the agent through its idempotent launcher.

Called by monitord.surface.wiring (the tunnel keeper's hook, before forwards),
monitord.remote.remote_link (an agent to start again), monitord.remote.preflight and
monitord.surface.check_command; takes a plain `asyncssh.SSHClientConnection`, so it works
on any connection (the tunnel's or a fresh one). The steps, each idempotent:

1. one exec: create `remote_bin_dir` (mode 0700), remove temp files a broken earlier push
   left behind (`.NAME.XXXX.partial`), and report mode + SHA-256 of every artifact in place;
2. for each artifact whose remote hash differs (missing, truncated, tampered): SFTP it to a
   temp name in the same directory, fsync, then one exec verifies the SHA-256 ON THE VPS,
   chmods and renames it into place (rename(2): readers see the old or the new file, never
   a part). A mismatch after upload is retried once, then ARTIFACT_HASH_MISMATCH;
3. agent.secret: written over SFTP (never a command line) to a 0600 temp file, renamed into
   place; left alone when it already holds the same bytes with mode 0600;
4. `<remote_monitord> agent-launch --dir <remote_bin_dir>` (the agent then listens on
   `<remote_bin_dir>/api/agent.sock`).

Running it twice changes nothing the second time (`ProvisionReport.changed` is False).
Errors: TransientError SSH_UNREACHABLE / SSH_TIMEOUT (from remote_exec and, for SFTP steps,
ssh_errors.py, which makes a refused SFTP request PROVISION_FAILED), PROVISION_FAILED,
ARTIFACT_HASH_MISMATCH. The secret never appears in logs, progress events, reports or errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import re
import secrets
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from enum import StrEnum

import asyncssh

from monitord.base import logs, outside_text
from monitord.base.config import RemoteSection
from monitord.remote import artifact, remote_exec, ssh_errors
from monitord.remote.artifact import LocalArtifact as LocalArtifact  # its old home
from orchestrator.errors import ErrorCode, TransientError, error_for

log = logs.get_logger(__name__)

SECRET_NAME = "agent.secret"
BIN_DIR_MODE = 0o700
SECRET_MODE = 0o600
_CHUNK = 256 * 1024
# What the VPS reports back is read within bounds (it may be compromised): ASCII digits only
# (str.isdigit and int() also take "²" or "١"), a report of a few lines, a secret of ours.
_COUNT_RE = re.compile(r"[0-9]{1,9}")
_MODE_RE = re.compile(r"[0-7]{1,4}")
MAX_REPORT_BYTES = 64 * 1024
MAX_SECRET_READ = 4096

# "$1" = bin dir, "$@" after shift = artifact names. Prints "stale N", then one line per
# artifact: "have MODE SHA NAME" or "missing - - NAME".
_PREPARE_SCRIPT = r"""
d=$1; shift
mkdir -p -m 0700 -- "$d" || exit 10
[ "$(stat -c %a -- "$d")" = 700 ] || chmod 0700 -- "$d" || exit 11
n=0
for f in "$d"/.*.partial; do
  [ -e "$f" ] || continue
  rm -f -- "$f" || exit 12
  n=$((n + 1))
done
echo "stale $n"
for name in "$@"; do
  p="$d/$name"
  if [ -f "$p" ]; then
    h=$(sha256sum < "$p") || exit 13
    echo "have $(stat -c %a -- "$p") ${h%% *} $name"
  else
    echo "missing - - $name"
  fi
done
"""

# "$1" temp file, "$2" final path, "$3" expected SHA-256, "$4" octal mode.
# Exit 3 (and the temp file removed) when the uploaded bytes do not hash as expected.
_INSTALL_SCRIPT = r"""
h=$(sha256sum < "$1") || exit 10
h=${h%% *}
if [ "$h" != "$3" ]; then
  rm -f -- "$1"
  echo "$h"
  exit 3
fi
chmod "$4" -- "$1" || exit 11
mv -f -- "$1" "$2" || exit 12
"""


class ArtifactAction(StrEnum):
    """What provisioning did with one artifact."""

    UNCHANGED = "unchanged"  # already in place with the expected hash
    PUSHED = "pushed"  # was missing
    REPLACED = "replaced"  # was there with another hash (old version, truncated, tampered)


@dataclass(frozen=True, slots=True, kw_only=True)
class ArtifactOutcome:
    name: str
    sha256: str
    action: ArtifactAction
    detail: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class ProvisionReport:
    """What one provisioning run found and did."""

    bin_dir: str
    artifacts: tuple[ArtifactOutcome, ...]
    secret_written: bool
    stale_temp_files_removed: int
    modes_fixed: tuple[str, ...]
    agent_launched: bool

    @property
    def changed(self) -> bool:
        """True when this run changed anything on the VPS besides asking the launcher."""
        return (
            self.secret_written
            or self.stale_temp_files_removed > 0
            or bool(self.modes_fixed)
            or any(a.action is not ArtifactAction.UNCHANGED for a in self.artifacts)
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ProvisionProgress:
    """One progress event: a step name, the artifact it concerns and bytes done/total."""

    step: str  # prepare, upload, verify, installed, unchanged, secret, launch, done
    artifact: str = ""
    done_bytes: int = 0
    total_bytes: int = 0


ProgressCallback = Callable[[ProvisionProgress], None]


async def provision(
    conn: asyncssh.SSHClientConnection,
    *,
    remote: RemoteSection,
    artifacts: Sequence[LocalArtifact],
    secret: bytes,
    progress: ProgressCallback | None = None,
    start_agent: bool = True,
    step_timeout_s: float = 60.0,
) -> ProvisionReport:
    """Bring the VPS's remote_bin_dir to the wanted state and start the agent (see module doc)."""
    if not secret:
        raise ValueError("the agent secret must not be empty")
    notify = progress or (lambda _event: None)
    bin_dir = remote.remote_bin_dir
    notify(ProvisionProgress(step="prepare"))
    found, stale, modes = await _prepare(conn, bin_dir, artifacts, timeout_s=step_timeout_s)
    outcomes: list[ArtifactOutcome] = []
    modes_fixed: list[str] = []
    async with _sftp(conn, timeout_s=step_timeout_s) as sftp:
        for item in artifacts:
            remote_hash = found.get(item.name)
            if remote_hash == item.sha256:
                if modes.get(item.name) != item.mode:
                    await _sftp_step(sftp.chmod(f"{bin_dir}/{item.name}", item.mode),
                                     what=f"chmod {item.name}", timeout_s=step_timeout_s)
                    modes_fixed.append(item.name)
                outcomes.append(ArtifactOutcome(name=item.name, sha256=item.sha256,
                                                action=ArtifactAction.UNCHANGED))
                notify(ProvisionProgress(step="unchanged", artifact=item.name,
                                         done_bytes=item.size, total_bytes=item.size))
                continue
            await _push(conn, sftp, bin_dir=bin_dir, item=item, notify=notify,
                        timeout_s=step_timeout_s)
            action = ArtifactAction.PUSHED if remote_hash is None else ArtifactAction.REPLACED
            detail = "" if remote_hash is None else f"remote SHA-256 was {remote_hash}"
            outcomes.append(ArtifactOutcome(name=item.name, sha256=item.sha256, action=action,
                                            detail=detail))
            log.info("artifact_installed", artifact=item.name, action=str(action),
                     sha256=item.sha256, previous=remote_hash)
        notify(ProvisionProgress(step="secret", artifact=SECRET_NAME))
        secret_written = await _ensure_secret(sftp, bin_dir=bin_dir, secret=secret,
                                              timeout_s=step_timeout_s)
    if start_agent:
        notify(ProvisionProgress(step="launch"))
        await launch_agent(conn, remote=remote, timeout_s=step_timeout_s)
    report = ProvisionReport(
        bin_dir=bin_dir,
        artifacts=tuple(outcomes),
        secret_written=secret_written,
        stale_temp_files_removed=stale,
        modes_fixed=tuple(modes_fixed),
        agent_launched=start_agent,
    )
    notify(ProvisionProgress(step="done"))
    log.info(
        "provisioned",
        bin_dir=bin_dir,
        changed=report.changed,
        artifacts={a.name: str(a.action) for a in outcomes},
        secret_written=secret_written,
        stale_temp_files_removed=stale,
    )
    return report


async def _prepare(
    conn: asyncssh.SSHClientConnection,
    bin_dir: str,
    artifacts: Sequence[LocalArtifact],
    *,
    timeout_s: float,
) -> tuple[dict[str, str], int, dict[str, int]]:
    names = [item.name for item in artifacts]
    for name in names:
        if not artifact.NAME_RE.fullmatch(name):
            raise ValueError(f"artifact name {name!r} must be a plain file name")
    result = await remote_exec.run_script(
        conn, _PREPARE_SCRIPT, args=[bin_dir, *names], timeout_s=timeout_s,
        max_stdout=MAX_REPORT_BYTES,
    )
    result.raise_for_status(ErrorCode.PROVISION_FAILED)
    return parse_prepare_report(result.text, truncated=result.stdout_truncated)


def parse_prepare_report(
    text: str, *, truncated: bool = False
) -> tuple[dict[str, str], int, dict[str, int]]:
    """The prepare script's `stale N` and `have MODE SHA256 NAME` lines: (hashes, stale,
    modes). The VPS wrote them: a count or mode that is not ASCII digits of bounded length
    (octal for a mode) is VPS_REPLY_INVALID, as is a report over MAX_REPORT_BYTES."""
    if truncated:
        raise error_for(ErrorCode.VPS_REPLY_INVALID,
                        f"prepare: more than {MAX_REPORT_BYTES} bytes of report")
    hashes: dict[str, str] = {}
    modes: dict[str, int] = {}
    stale = 0
    for line in text.splitlines():
        parts = line.split()
        if parts[:1] == ["stale"] and len(parts) == 2:
            if _COUNT_RE.fullmatch(parts[1]) is None:
                raise error_for(ErrorCode.VPS_REPLY_INVALID,
                                f"prepare: stale count {parts[1]!r:.40}")
            stale = int(parts[1])
        elif parts[:1] == ["have"] and len(parts) == 4:
            if _MODE_RE.fullmatch(parts[1]) is None:
                raise error_for(ErrorCode.VPS_REPLY_INVALID,
                                f"prepare: mode {parts[1]!r:.40} of {parts[3]!r:.80}")
            modes[parts[3]] = int(parts[1], 8)
            hashes[parts[3]] = parts[2]
    return hashes, stale, modes


async def _push(
    conn: asyncssh.SSHClientConnection,
    sftp: asyncssh.SFTPClient,
    *,
    bin_dir: str,
    item: LocalArtifact,
    notify: ProgressCallback,
    timeout_s: float,
) -> None:
    final = f"{bin_dir}/{item.name}"
    last_seen = ""
    for _attempt in range(2):
        temp = f"{bin_dir}/.{item.name}.{secrets.token_hex(6)}.partial"
        await _upload(sftp, item=item, temp=temp, notify=notify, timeout_s=timeout_s)
        notify(ProvisionProgress(step="verify", artifact=item.name, done_bytes=item.size,
                                 total_bytes=item.size))
        result = await remote_exec.run_script(
            conn, _INSTALL_SCRIPT, args=[temp, final, item.sha256, f"{item.mode:o}"],
            timeout_s=timeout_s,
        )
        if result.ok:
            notify(ProvisionProgress(step="installed", artifact=item.name,
                                     done_bytes=item.size, total_bytes=item.size))
            return
        if result.exit_status != 3:
            result.raise_for_status(ErrorCode.PROVISION_FAILED)
        last_seen = outside_text.clean(result.text.strip(), limit=200)  # the VPS's hash, or not
        log.warning("artifact_hash_mismatch_after_upload", artifact=item.name,
                    expected=item.sha256, found=last_seen, error_code="ARTIFACT_HASH_MISMATCH")
    raise TransientError(
        ErrorCode.ARTIFACT_HASH_MISMATCH,
        f"{item.name}: uploaded twice, the VPS hashes it as {last_seen}, expected {item.sha256}",
    )


async def _upload(
    sftp: asyncssh.SFTPClient,
    *,
    item: LocalArtifact,
    temp: str,
    notify: ProgressCallback,
    timeout_s: float,
) -> None:
    done = 0
    notify(ProvisionProgress(step="upload", artifact=item.name, total_bytes=item.size))
    with _sftp_errors(f"upload {item.name}"):
        async with asyncio.timeout(timeout_s):
            remote_file = await sftp.open(
                temp, "wb", attrs=asyncssh.SFTPAttrs(permissions=0o600)
            )
            async with remote_file:
                with item.path.open("rb") as local_file:
                    while chunk := local_file.read(_CHUNK):
                        await remote_file.write(chunk, done)
                        done += len(chunk)
                        notify(ProvisionProgress(step="upload", artifact=item.name,
                                                 done_bytes=done, total_bytes=item.size))
                await _fsync(remote_file)


async def _ensure_secret(
    sftp: asyncssh.SFTPClient, *, bin_dir: str, secret: bytes, timeout_s: float
) -> bool:
    """Write agent.secret (0600) unless it already holds these bytes with that mode."""
    final = f"{bin_dir}/{SECRET_NAME}"
    with _sftp_errors(f"write {SECRET_NAME}"):
        async with asyncio.timeout(timeout_s):
            current = await _read_if_exists(sftp, final)
            if current is not None:
                attrs = await sftp.stat(final)
                mode_ok = attrs.permissions is not None and attrs.permissions & 0o777 == 0o600
                if mode_ok and hmac.compare_digest(current, secret):
                    return False
            temp = f"{bin_dir}/.{SECRET_NAME}.{secrets.token_hex(6)}.partial"
            try:
                remote_file = await sftp.open(
                    temp, "wb", attrs=asyncssh.SFTPAttrs(permissions=SECRET_MODE)
                )
                async with remote_file:
                    await remote_file.write(secret)
                    await _fsync(remote_file)
                await sftp.chmod(temp, SECRET_MODE)
                await sftp.posix_rename(temp, final)
            except ssh_errors.SFTP_ERRORS:
                # Do not leave a copy of the secret behind; the next run's prepare step
                # removes it too should this removal fail.
                with contextlib.suppress(*ssh_errors.SFTP_ERRORS):
                    await sftp.remove(temp)
                raise
    log.info("agent_secret_written", path=final)
    return True


async def _read_if_exists(sftp: asyncssh.SFTPClient, path: str) -> bytes | None:
    """At most MAX_SECRET_READ bytes of `path` (a longer file is not our secret anyway:
    it differs and is replaced), None if it does not exist."""
    try:
        remote_file = await sftp.open(path, "rb")
    except ssh_errors.SFTP_NO_SUCH_FILE:
        return None
    async with remote_file:
        data = await remote_file.read(MAX_SECRET_READ)
    return (data if isinstance(data, bytes) else data.encode())[:MAX_SECRET_READ]


async def _fsync(remote_file: asyncssh.SFTPClientFile) -> None:
    try:
        await remote_file.fsync()
    except ssh_errors.SFTP_OP_UNSUPPORTED:
        log.warning("sftp_fsync_unsupported")  # the rename still keeps readers safe


async def launch_agent(
    conn: asyncssh.SSHClientConnection, *, remote: RemoteSection, timeout_s: float
) -> None:
    argv = [
        *artifact.remote_command(remote),
        "agent-launch",
        "--dir",
        remote.remote_bin_dir,
    ]
    result = await remote_exec.run(conn, argv, timeout_s=timeout_s)
    result.raise_for_status(ErrorCode.PROVISION_FAILED)
    log.info("agent_launch_requested", bin_dir=remote.remote_bin_dir, socket=remote.agent_socket())


class _SftpSession:
    """`async with _sftp(conn)`: an SFTP client whose start-up is bounded and translated."""

    def __init__(self, conn: asyncssh.SSHClientConnection, timeout_s: float) -> None:
        self._conn = conn
        self._timeout_s = timeout_s
        self._client: asyncssh.SFTPClient | None = None

    async def __aenter__(self) -> asyncssh.SFTPClient:
        with _sftp_errors("start SFTP"):
            async with asyncio.timeout(self._timeout_s):
                self._client = await self._conn.start_sftp_client()
        return self._client

    async def __aexit__(self, *exc_info: object) -> None:
        if self._client is not None:
            self._client.exit()


def _sftp(conn: asyncssh.SSHClientConnection, *, timeout_s: float) -> _SftpSession:
    return _SftpSession(conn, timeout_s)


async def _sftp_step(step: Awaitable[object], *, what: str, timeout_s: float) -> None:
    with _sftp_errors(what):
        async with asyncio.timeout(timeout_s):
            await step


def _sftp_errors(what: str) -> AbstractContextManager[None]:
    """SFTP failures of one step as typed errors (the table in ssh_errors.py): a refused
    request is PROVISION_FAILED, a lost link SSH_UNREACHABLE, no answer SSH_TIMEOUT."""
    return ssh_errors.translated(code=ErrorCode.PROVISION_FAILED, during=what)

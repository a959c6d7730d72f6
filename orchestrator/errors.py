"""The error catalogue and the typed errors of monitord.

Every failure an operator can meet has a stable code (a string that never changes and
appears in the API, the status page, logs and metrics). `CATALOGUE` maps each code to
its severity, whether retrying on its own can help, the operator text and a safe
recommended action; docs/error-codes.md is generated from it by scripts/gen_docs.py. No other
code reaches a client: tests/unit/test_error_convention.py scans monitord/ for every code a
client can see (HTTP answers, the CLI, the VPS agent, log lines) and fails on one that is not
here.

The typed errors form a small tree, raised by adapters in `monitord/` after they
translate a foreign exception once (`raise TransientError(...) from e`):

    MonitordError(code, detail)
    ├── TransientError(code, detail, delay=None)   retrying later may succeed
    └── PermanentError(code, detail)               nothing changes until someone acts

`error_for(code, detail)` picks the subclass the catalogue says the code deserves.
Every part of monitord that reports or raises an error uses it.
"""

from __future__ import annotations

import errno
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from orchestrator.text_enum import TextEnum


class Severity(TextEnum):
    """How loudly the status page shows an error."""

    INFO = "info"
    WARNING = "warning"
    ERROR = "error"
    CRITICAL = "critical"


class ErrorCode(TextEnum):
    """Every stable error code; members compare equal to their plain string."""

    AUTH_FAILED = "AUTH_FAILED"
    HOST_KEY_MISMATCH = "HOST_KEY_MISMATCH"
    SSH_UNREACHABLE = "SSH_UNREACHABLE"
    SSH_TIMEOUT = "SSH_TIMEOUT"
    TUNNEL_LEASE_CONFLICT = "TUNNEL_LEASE_CONFLICT"
    PORT_OCCUPIED = "PORT_OCCUPIED"
    FORWARD_DENIED = "FORWARD_DENIED"
    FORWARD_UNPROVEN = "FORWARD_UNPROVEN"
    AGENT_UNREACHABLE = "AGENT_UNREACHABLE"
    AGENT_UNAUTHORIZED = "AGENT_UNAUTHORIZED"
    AGENT_ROUTE_MISSING = "AGENT_ROUTE_MISSING"
    VPS_REPLY_INVALID = "VPS_REPLY_INVALID"
    PROVISION_FAILED = "PROVISION_FAILED"
    ARTIFACT_HASH_MISMATCH = "ARTIFACT_HASH_MISMATCH"
    PREFLIGHT_AUTH = "PREFLIGHT_AUTH"
    PREFLIGHT_ARCH = "PREFLIGHT_ARCH"
    PREFLIGHT_BIN_DIR = "PREFLIGHT_BIN_DIR"
    PREFLIGHT_DISK_SPACE = "PREFLIGHT_DISK_SPACE"
    PREFLIGHT_MEMORY = "PREFLIGHT_MEMORY"
    PREFLIGHT_WRITE_TEST = "PREFLIGHT_WRITE_TEST"
    PREFLIGHT_AGENT = "PREFLIGHT_AGENT"
    PREFLIGHT_ARTIFACTS = "PREFLIGHT_ARTIFACTS"
    PREFLIGHT_TUNNEL_OWNER = "PREFLIGHT_TUNNEL_OWNER"
    PREFLIGHT_FORWARDS = "PREFLIGHT_FORWARDS"
    PREFLIGHT_REMOTE_CONFIG = "PREFLIGHT_REMOTE_CONFIG"
    COPY_INCOMPLETE = "COPY_INCOMPLETE"
    COPY_SOURCE_CHANGED = "COPY_SOURCE_CHANGED"
    REMOTE_DISK_FULL = "REMOTE_DISK_FULL"
    LOCAL_DISK_FULL = "LOCAL_DISK_FULL"
    REMOTE_PERMISSION_DENIED = "REMOTE_PERMISSION_DENIED"
    LOCAL_PERMISSION_DENIED = "LOCAL_PERMISSION_DENIED"
    NAME_TOO_LONG = "NAME_TOO_LONG"
    HEALTHCHECK_TIMEOUT = "HEALTHCHECK_TIMEOUT"
    DESTINATION_CONFLICT = "DESTINATION_CONFLICT"
    WARM_COPY_REFUSED = "WARM_COPY_REFUSED"
    LEASE_EXPIRED = "LEASE_EXPIRED"
    CONFIG_CORRUPT = "CONFIG_CORRUPT"
    CONFIG_INVALID = "CONFIG_INVALID"
    DATA_NOT_NEWEST = "DATA_NOT_NEWEST"
    AREA_ID_INVALID = "AREA_ID_INVALID"
    AREA_ENTRY_INVALID = "AREA_ENTRY_INVALID"
    ROLLBACK_DATA_UNREACHABLE = "ROLLBACK_DATA_UNREACHABLE"
    WARM_COPY_FAILED = "WARM_COPY_FAILED"
    CLEANUP_STUCK = "CLEANUP_STUCK"
    DUPLICATE_INSTANCE = "DUPLICATE_INSTANCE"
    STORE_WRITE_FAILED = "STORE_WRITE_FAILED"
    BAD_REQUEST = "BAD_REQUEST"
    NOT_FOUND = "NOT_FOUND"
    API_UNAUTHORIZED = "API_UNAUTHORIZED"
    UNKNOWN_SERVICE = "UNKNOWN_SERVICE"
    UNKNOWN_AREA = "UNKNOWN_AREA"
    DRAINING = "DRAINING"
    TRANSACTION_CONFLICT = "TRANSACTION_CONFLICT"
    VPS_NOT_FENCED = "VPS_NOT_FENCED"
    DAEMON_START_FAILED = "DAEMON_START_FAILED"
    DAEMON_STOP_FAILED = "DAEMON_STOP_FAILED"
    SERVICE_USER_UNKNOWN = "SERVICE_USER_UNKNOWN"
    DAEMON_UNREACHABLE = "DAEMON_UNREACHABLE"
    INTERNAL = "INTERNAL"


@dataclass(frozen=True)
class CatalogueEntry:
    """What the operator is told about one code."""

    code: ErrorCode
    severity: Severity
    retryable: bool
    text: str
    action: str


_E = ErrorCode
_S = Severity

# The table: (code, severity, retryable, operator text, recommended action). Keep texts short
# and the actions safe: an action never asks the operator to start a daemon by hand or to
# edit custom_config.json while monitord runs.
_ROWS: tuple[tuple[ErrorCode, Severity, bool, str, str], ...] = (
    (_E.AUTH_FAILED, _S.ERROR, False,
           "The VPS rejected the SSH key.",
           "Check that remote.key_file is the key authorised for remote.user on the VPS."),
    (_E.HOST_KEY_MISMATCH, _S.CRITICAL, False,
           "The VPS presented a host key that does not match known_hosts.",
           "Verify the VPS identity out of band, then update remote.known_hosts."),
    (_E.SSH_UNREACHABLE, _S.WARNING, True,
           "The VPS cannot be reached over SSH.",
           "Check the VPS is up and its SSH port is reachable; monitord keeps retrying. A VPS"
           " gone for good: `monitord give-up SERVICE` starts its areas on the PBX's copy."),
    (_E.SSH_TIMEOUT, _S.WARNING, True,
           "The SSH connection timed out or stopped answering keepalives.",
           "Check the network path to the VPS; monitord reconnects with backoff."),
    (_E.TUNNEL_LEASE_CONFLICT, _S.ERROR, True,
           "Another node owns the tunnel lease on the VPS.",
           "Stop the other owner named in the detail, or wait for its lease to expire."),
    (_E.PORT_OCCUPIED, _S.ERROR, True,
           "A non-SSH process holds a forwarded port on the VPS.",
           "Stop the process named in the detail (PID and command) on the VPS."),
    (_E.FORWARD_DENIED, _S.WARNING, True,
           "The VPS refused a port forward.",
           "monitord diagnoses the port holder; check the tunnel status for the verdict."),
    (_E.FORWARD_UNPROVEN, _S.WARNING, True,
           "A forward is open but a round trip through it failed.",
           "Check sshd's AllowTcpForwarding on the VPS; monitord retries."),
    (_E.AGENT_UNREACHABLE, _S.WARNING, True,
           "The remote agent does not answer over the SSH connection.",
           "Check the tunnel; monitord restarts the agent through its launcher."),
    (_E.AGENT_UNAUTHORIZED, _S.ERROR, False,
           "The remote agent rejected monitord's credentials.",
           "Re-provision the VPS so agent.secret matches (retry the service)."),
    (_E.AGENT_ROUTE_MISSING, _S.WARNING, True,
           "The remote agent has no such route (it is older than this monitord).",
           "monitord asks the agent what it serves and uses the shell for the rest;"
           " re-provisioning the VPS upgrades the agent."),
    (_E.VPS_REPLY_INVALID, _S.ERROR, True,
           "A command on the VPS answered with something monitord does not accept (a field of"
           " the wrong type or out of range, JSON nested too deep, output over its size"
           " bound); the answer was dropped and nothing acted on it.",
           "monitord retries; if it repeats, re-provision the VPS (`monitord retry SERVICE`)"
           " so its monitord.pyz matches, and check the VPS for tampering."),
    (_E.PROVISION_FAILED, _S.ERROR, True,
           "Pushing the agent or service binaries to the VPS failed.",
           "Check free space and permissions of remote_bin_dir; monitord retries."),
    (_E.ARTIFACT_HASH_MISMATCH, _S.ERROR, True,
           "A binary on the VPS does not match its expected SHA-256.",
           "monitord pushes it again; if this repeats, check the VPS disk."),
    (_E.PREFLIGHT_AUTH, _S.ERROR, False,
           "Preflight: SSH authentication with the tunnel's key failed.",
           "Authorise remote.key_file for remote.user on the VPS, then retry."),
    (_E.PREFLIGHT_ARCH, _S.ERROR, False,
           "Preflight: the VPS is not x86_64.",
           "Use an x86_64 VPS."),
    (_E.PREFLIGHT_BIN_DIR, _S.ERROR, False,
           "Preflight: remote_bin_dir is missing or has wrong permissions.",
           "Create remote_bin_dir owned by remote.user with mode 0700, then retry."),
    (_E.PREFLIGHT_DISK_SPACE, _S.ERROR, False,
           "Preflight: the file system that would hold the area's data (or the binaries)"
           " lacks the free space or inodes the move needs; nothing was stopped.",
           "Free the space the detail names (side, path, needed and free) or grow that file"
           " system, then `monitord retry SERVICE`."),
    (_E.PREFLIGHT_MEMORY, _S.ERROR, False,
           "Preflight: the VPS has less memory available than the area's daemon (as resident"
           " on the PBX), its lease guard, the moves under way there and the reserve kept"
           " free need; nothing was stopped.",
           "Free memory on the VPS (or grow it), move fewer areas there, or lower"
           " remote.memory_reserve_mib if the VPS needs less kept free; then"
           " `monitord retry SERVICE`."),
    (_E.PREFLIGHT_WRITE_TEST, _S.ERROR, False,
           "Preflight: a test file could not be created and removed.",
           "Check the file system of remote_bin_dir (read-only, quota), then retry."),
    (_E.PREFLIGHT_AGENT, _S.WARNING, True,
           "Preflight: the remote agent is neither reachable nor startable.",
           "Check the tunnel and the agent log on the VPS; monitord retries."),
    (_E.PREFLIGHT_ARTIFACTS, _S.WARNING, True,
           "Preflight: artifact versions or hashes on the VPS do not match.",
           "monitord re-provisions; if this repeats, check remote.artifacts."),
    (_E.PREFLIGHT_TUNNEL_OWNER, _S.ERROR, True,
           "Preflight: another node owns the tunnel.",
           "Stop the other owner named in the detail, then retry."),
    (_E.PREFLIGHT_FORWARDS, _S.WARNING, True,
           "Preflight: the tunnel's forwards are not ready.",
           "Check the tunnel status; monitord retries once the forwards are proven."),
    (_E.PREFLIGHT_REMOTE_CONFIG, _S.WARNING, True,
           "Nothing is configured to run this on the VPS: no [remote] section (a move there"
           " is refused before anything is recorded), or the service has no remote_command"
           " / remote_data_dir.",
           "Add the [remote] section (docs/vps-setup.md) or the service's remote_command and"
           " remote_data_dir, restart monitord, then place or retry."),
    (_E.COPY_INCOMPLETE, _S.WARNING, True,
           "Area data was not copied completely: the copy differs from its manifest, or"
           " nothing crossed the link for the copy's 600 s.",
           "Nothing to do: the source kept its data; the migration retries."),
    (_E.COPY_SOURCE_CHANGED, _S.WARNING, True,
           "A file of the area was not the one listed when it was sent (replaced by a FIFO,"
           " a symlink, a device or another file, or of another size).",
           "Nothing to do: the source kept its data and the migration retries with a fresh"
           " listing; if it repeats, look for what replaces files in the area's data dir."),
    (_E.REMOTE_DISK_FULL, _S.ERROR, False,
           "The VPS ran out of space (or inodes, or quota) while the area's data was copied"
           " there; the half-written copy was removed and the source runs again.",
           "Free space under the VPS path named in the detail (needed and free are"
           " given), then `monitord retry SERVICE`."),
    (_E.LOCAL_DISK_FULL, _S.ERROR, False,
           "The PBX ran out of space (or inodes, or quota) while the area's data was copied"
           " here, or had too little for what the VPS declared before the first byte; the"
           " half-written copy was removed.",
           "Free space under the PBX path named in the detail, then `monitord retry"
           " SERVICE`."),
    (_E.REMOTE_PERMISSION_DENIED, _S.ERROR, False,
           "The VPS refused to let the copy write or read a path (permission denied).",
           "Make the path named in the detail writable by remote.user on the VPS, then"
           " `monitord retry SERVICE`."),
    (_E.LOCAL_PERMISSION_DENIED, _S.ERROR, False,
           "The PBX refused to let the copy write or read a path (permission denied).",
           "Make the path named in the detail writable by monitord's user, then"
           " `monitord retry SERVICE`."),
    (_E.NAME_TOO_LONG, _S.ERROR, False,
           "A file's name or path is too long for the destination's file system.",
           "Shorten the data dir template or the file named in the detail, then"
           " `monitord retry SERVICE`."),
    (_E.HEALTHCHECK_TIMEOUT, _S.WARNING, True,
           "The destination daemon did not stay healthy for the minimum uptime.",
           "Check the daemon's log on the destination; the source keeps running."),
    (_E.DESTINATION_CONFLICT, _S.ERROR, False,
           "The destination holds the area for another owner or a newer generation.",
           "Inspect the remote inventory; remove the foreign entry, then retry."),
    (_E.WARM_COPY_REFUSED, _S.INFO, True,
           "The VPS agent took no snapshot of a remote area for a warm copy: it holds the"
           " area at another generation, or with another data dir, than the one asked for.",
           "Nothing to do: the next warm copy asks for what the VPS holds then. If it"
           " persists, compare the area's generation in `monitord status` with the VPS's."),
    (_E.LEASE_EXPIRED, _S.WARNING, True,
           "An area lease on the VPS expired; the remote daemon was stopped.",
           "Check the tunnel; monitord renews and restarts the area when it can."),
    (_E.CONFIG_CORRUPT, _S.CRITICAL, False,
           "custom_config.json cannot be parsed; monitord will not act on it.",
           "Restore a valid custom_config.json (see the parse position in the detail)."),
    (_E.CONFIG_INVALID, _S.CRITICAL, False,
           "monitord.toml is not a valid configuration; monitord does not start.",
           "Fix the key named in the message; `monitord run` prints the file and key."),
    (_E.AREA_ID_INVALID, _S.ERROR, False,
           "A custom_config.json entry's uuid or service is not a valid name (or the uuid is"
           " there twice); that entry is left as it is and never started or sent to the VPS.",
           "Correct the entry named in the detail; the other areas are not affected."),
    (_E.AREA_ENTRY_INVALID, _S.ERROR, False,
           "A custom_config.json entry has a bad field (not an object, a location or"
           " generation that does not parse, a generation outside [0, 2^63)); that entry is"
           " left as it is and never started. An area at the last generation (2^63 - 1)"
           " stays where it is: no move can follow it.",
           "Correct the entry named in the detail; the other areas are not affected."),
    (_E.DATA_NOT_NEWEST, _S.ERROR, False,
           "An area was not started on a side that does not hold its newest data.",
           "Nothing to do: monitord copies the newest data there first; see the events."),
    (_E.ROLLBACK_DATA_UNREACHABLE, _S.CRITICAL, True,
           "A rolled-back area stays stopped: the data it wrote on the destination cannot be"
           " reached to bring it back.",
           "Restore the VPS link: monitord copies the data back and restarts the area (once"
           " parked: `monitord retry SERVICE`); or accept losing that data:"
           " `monitord rollback --discard-remote-data SERVICE` (a VPS gone for good:"
           " `monitord give-up SERVICE`)."),
    (_E.WARM_COPY_FAILED, _S.WARNING, True,
           "A warm copy of a remote area could not be taken or received (a snapshot that"
           " failed on the VPS, a file that kept changing, the link); the last warm copy is"
           " kept and no move is affected.",
           "Nothing to do if it passes: the next interval tries again. If the area's warm"
           " copy grows old (status `warm_copy.overdue`), read the detail: a file outside"
           " warm_copy_databases that the daemon rewrites all the time needs a glob."),
    (_E.CLEANUP_STUCK, _S.ERROR, False,
           "A cleanup item keeps failing and needs a manual check.",
           "Check the side and generation named in the detail; monitord keeps retrying."),
    (_E.DUPLICATE_INSTANCE, _S.WARNING, False,
           "Another monitord already runs for this work_dir.",
           "Nothing to do; use `monitord launch`, which is idempotent."),
    (_E.STORE_WRITE_FAILED, _S.CRITICAL, True,
           "monitord could not durably write its state.",
           "Check free space and health of work_dir's file system."),
    (_E.BAD_REQUEST, _S.INFO, False,
           "The request was malformed.",
           "Fix the request body as described in the detail."),
    (_E.NOT_FOUND, _S.INFO, False,
           "No such endpoint in monitord's HTTP API (method and path as sent).",
           "Use a method and path listed in docs/operator.md, \"HTTP API\"."),
    (_E.API_UNAUTHORIZED, _S.WARNING, False,
           "A change through monitord's HTTP API came without the local API token, or with"
           " another one; nothing was changed.",
           "Send `Authorization: Bearer` with the content of work_dir/api-token (readable by root"
           " and the group of http.token_group); the CLI does this for root and that group."),
    (_E.UNKNOWN_SERVICE, _S.INFO, False,
           "No such service is configured.",
           "Use a service name from monitord.toml."),
    (_E.UNKNOWN_AREA, _S.INFO, False,
           "No such area is in custom_config.json.",
           "Use an area UUID listed in custom_config.json."),
    (_E.DRAINING, _S.INFO, True,
           "monitord is shutting down and takes no new work.",
           "Send the request again once monitord is back."),
    (_E.TRANSACTION_CONFLICT, _S.WARNING, True,
           "The request conflicts with an active migration.",
           "Wait for the migration to finish, or reverse it explicitly."),
    (_E.VPS_NOT_FENCED, _S.WARNING, True,
           "Giving the VPS up is not allowed yet: a copy of the area there may still run until"
           " its area lease has provably lapsed.",
           "Wait the time named in the detail, then give the VPS up again"
           " (`monitord give-up SERVICE`); nothing was changed."),
    (_E.DAEMON_START_FAILED, _S.ERROR, True,
           "A daemon could not be started.",
           "Check the service command and data dir; monitord retries with backoff."),
    (_E.DAEMON_STOP_FAILED, _S.CRITICAL, True,
           "A daemon could not be proven stopped.",
           "Check the PID named in the detail; monitord keeps the other side stopped."),
    (_E.SERVICE_USER_UNKNOWN, _S.ERROR, False,
           "A service's user or group does not exist on the machine that starts its daemon.",
           "Create it (on the PBX and on the VPS), or fix services.NAME.user / group;"
           " monitord keeps retrying the start."),
    (_E.INTERNAL, _S.ERROR, True,
           "An unexpected error inside monitord (logged once with its traceback); the step"
           " counts as failed, so a service that keeps meeting it parks; in a root loop it"
           " is counted and shown (status `loops`) and the loop goes on.",
           "Send the diagnostic bundle and the log line to the maintainers; `monitord retry`"
           " after the cause is fixed."),
    (_E.DAEMON_UNREACHABLE, _S.ERROR, True,
           "The monitord daemon's API did not answer this command.",
           "Check `systemctl status monitord`; start it with `monitord launch -c FILE`."),
)

CATALOGUE: Mapping[ErrorCode, CatalogueEntry] = MappingProxyType(
    {
        code: CatalogueEntry(
            code=code, severity=severity, retryable=retryable, text=text, action=action
        )
        for code, severity, retryable, text, action in _ROWS
    }
)


class UnknownErrorCode(KeyError):
    """A code that is not in the catalogue (a programming error)."""


def lookup(code: str) -> CatalogueEntry:
    """The catalogue entry for a code; raises UnknownErrorCode for anything else."""
    try:
        return CATALOGUE[ErrorCode(code)]
    except ValueError as e:
        raise UnknownErrorCode(code) from e


class MonitordError(Exception):
    """Base of every error monitord raises on purpose; carries a catalogued code, and
    `facts`: numbers the status shows beside the detail (e.g. a disk's needed and free
    bytes)."""

    facts: Mapping[str, object] = MappingProxyType({})

    def __init__(self, code: str, detail: str = "") -> None:
        self.entry = lookup(code)
        self.code: ErrorCode = self.entry.code
        self.detail = detail
        super().__init__(f"{self.code}: {detail}" if detail else str(self.code))

    @property
    def retryable(self) -> bool:
        return isinstance(self, TransientError)


class TransientError(MonitordError):
    """Retrying later may succeed; `delay` (seconds) suggests when, None lets backoff decide."""

    def __init__(self, code: str, detail: str = "", *, delay: float | None = None) -> None:
        super().__init__(code, detail)
        self.delay = delay


class PermanentError(MonitordError):
    """Nothing changes until an operator acts; retrying on its own is pointless."""


def error_for(
    code: str, detail: str = "", *, delay: float | None = None,
    facts: Mapping[str, object] | None = None,
) -> MonitordError:
    """A TransientError or PermanentError for `code`, as the catalogue classifies it."""
    error: MonitordError
    if lookup(code).retryable:
        error = TransientError(code, detail, delay=delay)
    else:
        error = PermanentError(code, detail)
    if facts:
        error.facts = MappingProxyType(dict(facts))
    return error


# A file system error's cause, by errno, on the side that raised it (`file_error_code`):
# what an operator must fix there, never an unreachable VPS.
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
_NO_PERMISSION = (errno.EACCES, errno.EPERM, errno.EROFS)
_CAUSES: Mapping[tuple[int, bool], ErrorCode] = MappingProxyType({
    **{(e, True): ErrorCode.REMOTE_DISK_FULL for e in _DISK_FULL},
    **{(e, False): ErrorCode.LOCAL_DISK_FULL for e in _DISK_FULL},
    **{(e, True): ErrorCode.REMOTE_PERMISSION_DENIED for e in _NO_PERMISSION},
    **{(e, False): ErrorCode.LOCAL_PERMISSION_DENIED for e in _NO_PERMISSION},
    (errno.ENAMETOOLONG, True): ErrorCode.NAME_TOO_LONG,
    (errno.ENAMETOOLONG, False): ErrorCode.NAME_TOO_LONG,
})


def file_error_code(errno_value: int | None, *, remote: bool) -> ErrorCode | None:
    """The code a file system error (`OSError.errno`) on the VPS (`remote`) or the PBX
    stands for, or None when its errno names no cause an operator fixes (ENOSPC/EDQUOT:
    *_DISK_FULL, EACCES/EPERM/EROFS: *_PERMISSION_DENIED, ENAMETOOLONG: NAME_TOO_LONG)."""
    if errno_value is None:
        return None
    return _CAUSES.get((errno_value, remote))

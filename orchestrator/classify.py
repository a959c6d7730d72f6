"""Turns structured observations of failures into stable error codes.

Adapters in `monitord/` catch a foreign exception or read a reply, describe what they
saw as one of the small observation values below (an exception *kind* string, an HTTP
status, a copy manifest comparison, ...) and ask `classify(observation)` for the code.
The foreign exception object itself never reaches this module. Port-holder diagnosis of a
denied forward is decided in orchestrator/forward_diagnosis.py; its verdict maps to a code
here through `ForwardVerdict`.

Called by the tunnel keeper, the agent client, the copier, the supervisor, the store
adapter and the HTTP layer, each right where it translates a foreign failure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from orchestrator.errors import ErrorCode


class UnclassifiedObservation(ValueError):
    """An observation this module has no code for (a programming error in the caller)."""


# SSH-level failure kinds an adapter names after catching asyncssh/OSError exceptions.
SSH_FAILURE_KINDS: Mapping[str, ErrorCode] = MappingProxyType({
    "auth": ErrorCode.AUTH_FAILED,  # PermissionDenied
    "host_key": ErrorCode.HOST_KEY_MISMATCH,  # HostKeyNotVerifiable
    "connect_refused": ErrorCode.SSH_UNREACHABLE,  # ConnectionRefusedError
    "no_route": ErrorCode.SSH_UNREACHABLE,  # EHOSTUNREACH / ENETUNREACH
    "dns": ErrorCode.SSH_UNREACHABLE,  # socket.gaierror
    "connection_lost": ErrorCode.SSH_UNREACHABLE,  # ConnectionLost / reset
    "timeout": ErrorCode.SSH_TIMEOUT,  # connect or exec timed out
    "keepalive_timeout": ErrorCode.SSH_TIMEOUT,  # peer stopped answering keepalives
    "channel_listen": ErrorCode.FORWARD_DENIED,  # ChannelListenError on tcpip-forward
    "channel_open": ErrorCode.FORWARD_UNPROVEN,  # ChannelOpenError on a forward probe
    "forward_round_trip": ErrorCode.FORWARD_UNPROVEN,  # probe did not come back
})

# Verdicts of forward_diagnosis for a denied reverse forward.
FORWARD_VERDICTS: Mapping[str, ErrorCode] = MappingProxyType({
    "own_stale_session": ErrorCode.FORWARD_DENIED,  # fenced and retried at once
    "other_owner": ErrorCode.TUNNEL_LEASE_CONFLICT,
    "foreign_process": ErrorCode.PORT_OCCUPIED,
    "unknown": ErrorCode.FORWARD_DENIED,
})

# Results of `monitord tunnel-lease acquire|renew` on the VPS.
TUNNEL_LEASE_RESULTS: Mapping[str, ErrorCode] = MappingProxyType({
    "held_by_other": ErrorCode.TUNNEL_LEASE_CONFLICT,
    "lost": ErrorCode.TUNNEL_LEASE_CONFLICT,
})

# Preflight check names (monitord/remote/preflight.py) -> their codes.
PREFLIGHT_CHECKS: Mapping[str, ErrorCode] = MappingProxyType({
    "auth": ErrorCode.PREFLIGHT_AUTH,
    "arch": ErrorCode.PREFLIGHT_ARCH,
    "bin_dir": ErrorCode.PREFLIGHT_BIN_DIR,
    "disk_space": ErrorCode.PREFLIGHT_DISK_SPACE,
    "write_test": ErrorCode.PREFLIGHT_WRITE_TEST,
    "agent": ErrorCode.PREFLIGHT_AGENT,
    "artifacts": ErrorCode.PREFLIGHT_ARTIFACTS,
    "tunnel_owner": ErrorCode.PREFLIGHT_TUNNEL_OWNER,
    "forwards": ErrorCode.PREFLIGHT_FORWARDS,
    "remote_config": ErrorCode.PREFLIGHT_REMOTE_CONFIG,
})

# Why a request to monitord's own API was not admitted.
REQUEST_REFUSALS: Mapping[str, ErrorCode] = MappingProxyType({
    "bad_json": ErrorCode.BAD_REQUEST,
    "bad_field": ErrorCode.BAD_REQUEST,
    "unknown_service": ErrorCode.UNKNOWN_SERVICE,
    "unknown_area": ErrorCode.UNKNOWN_AREA,
    "draining": ErrorCode.DRAINING,
    "transaction_conflict": ErrorCode.TRANSACTION_CONFLICT,
    "vps_not_fenced": ErrorCode.VPS_NOT_FENCED,
})

# What went wrong with monitord's own files and process.
LOCAL_FAULTS: Mapping[str, ErrorCode] = MappingProxyType({
    "custom_config_unparsable": ErrorCode.CONFIG_CORRUPT,
    "monitord_toml_invalid": ErrorCode.CONFIG_INVALID,
    "start_on_stale_data": ErrorCode.DATA_NOT_NEWEST,
    "rollback_data_unreachable": ErrorCode.ROLLBACK_DATA_UNREACHABLE,
    "daemon_api_silent": ErrorCode.DAEMON_UNREACHABLE,
    "area_entry_bad_name": ErrorCode.AREA_ID_INVALID,
    "unexpected_exception": ErrorCode.INTERNAL,
    "area_entry_bad_field": ErrorCode.AREA_ENTRY_INVALID,
    "store_write": ErrorCode.STORE_WRITE_FAILED,
    "instance_lock_held": ErrorCode.DUPLICATE_INSTANCE,
    "provision_push": ErrorCode.PROVISION_FAILED,
    "provision_launch": ErrorCode.PROVISION_FAILED,
    "service_user_missing": ErrorCode.SERVICE_USER_UNKNOWN,
})


@dataclass(frozen=True, slots=True)
class SshFailure:
    """An SSH/transport failure, named by kind (see SSH_FAILURE_KINDS)."""

    kind: str


@dataclass(frozen=True, slots=True)
class ForwardVerdict:
    """forward_diagnosis' verdict for a denied reverse forward (see FORWARD_VERDICTS)."""

    verdict: str


@dataclass(frozen=True, slots=True)
class TunnelLeaseResult:
    """The VPS answer to a tunnel lease acquire/renew that did not grant it."""

    result: str


@dataclass(frozen=True, slots=True)
class AgentReply:
    """An HTTP reply of the remote agent (status None: no reply arrived at all).

    `error_code` is the code from the agent's JSON error body, if it sent one.
    """

    status: int | None
    error_code: str | None = None


@dataclass(frozen=True, slots=True)
class CopyVerification:
    """The remote SHA-256 manifest check of a copied area data dir."""

    expected_files: int
    verified_files: int
    mismatched_files: int = 0


@dataclass(frozen=True, slots=True)
class ArtifactCheck:
    """An artifact's SHA-256 as expected and as measured on the VPS (None: missing)."""

    expected_sha256: str
    actual_sha256: str | None


@dataclass(frozen=True, slots=True)
class HealthObservation:
    """The destination daemon during HEALTHCHECK_DESTINATION."""

    uptime_s: float
    min_uptime_s: float
    running: bool
    probe_ok: bool | None = None  # None: no probe configured
    waited_s: float = 0.0
    deadline_s: float = 0.0


@dataclass(frozen=True, slots=True)
class DaemonControl:
    """A start or stop of a daemon by the supervisor or the agent and whether it held."""

    operation: str  # "start" | "stop"
    succeeded: bool


@dataclass(frozen=True, slots=True)
class PreflightFailure:
    """One failed preflight check, named as in PREFLIGHT_CHECKS."""

    check: str


@dataclass(frozen=True, slots=True)
class RequestRefusal:
    """Why monitord's API refused a request (see REQUEST_REFUSALS)."""

    reason: str


@dataclass(frozen=True, slots=True)
class LocalFault:
    """A failure of monitord's own files or process (see LOCAL_FAULTS)."""

    fault: str


@dataclass(frozen=True, slots=True)
class CleanupOverdue:
    """A cleanup item that has failed for long (see cleanup_policy.is_stuck)."""

    attempts: int


Observation = (
    SshFailure
    | ForwardVerdict
    | TunnelLeaseResult
    | AgentReply
    | CopyVerification
    | ArtifactCheck
    | HealthObservation
    | DaemonControl
    | PreflightFailure
    | RequestRefusal
    | LocalFault
    | CleanupOverdue
)


def _from_table(table: Mapping[str, ErrorCode], key: str, what: str) -> ErrorCode:
    try:
        return table[key]
    except KeyError as e:
        raise UnclassifiedObservation(f"unknown {what} {key!r}") from e


def _agent_reply(reply: AgentReply) -> ErrorCode | None:
    if reply.error_code is not None:
        try:
            return ErrorCode(reply.error_code)
        except ValueError:
            pass  # an agent of another version: fall back to the status code
    if reply.status is None or reply.status >= 500:
        return ErrorCode.AGENT_UNREACHABLE
    if reply.status in (401, 403):
        return ErrorCode.AGENT_UNAUTHORIZED
    if reply.status == 409:
        return ErrorCode.DESTINATION_CONFLICT
    if reply.status == 410:
        return ErrorCode.LEASE_EXPIRED
    if reply.status >= 400:
        return ErrorCode.BAD_REQUEST
    return None


def _health(seen: HealthObservation) -> ErrorCode | None:
    healthy = seen.running and seen.uptime_s >= seen.min_uptime_s and seen.probe_ok is not False
    if healthy:
        return None
    if not seen.running:
        return ErrorCode.DAEMON_START_FAILED
    return ErrorCode.HEALTHCHECK_TIMEOUT if seen.waited_s >= seen.deadline_s else None


def classify(observation: Observation) -> ErrorCode | None:
    """The code for a failure observation, or None when the observation shows no failure."""
    match observation:
        case SshFailure(kind=kind):
            return _from_table(SSH_FAILURE_KINDS, kind, "SSH failure kind")
        case ForwardVerdict(verdict=verdict):
            return _from_table(FORWARD_VERDICTS, verdict, "forward verdict")
        case TunnelLeaseResult(result=result):
            return _from_table(TUNNEL_LEASE_RESULTS, result, "tunnel lease result")
        case AgentReply():
            return _agent_reply(observation)
        case CopyVerification(expected_files=want, verified_files=got, mismatched_files=bad):
            return ErrorCode.COPY_INCOMPLETE if bad or got != want else None
        case ArtifactCheck(expected_sha256=want, actual_sha256=got):
            return None if got == want else ErrorCode.ARTIFACT_HASH_MISMATCH
        case HealthObservation():
            return _health(observation)
        case DaemonControl(operation=operation, succeeded=succeeded):
            if succeeded:
                return None
            codes = {"start": ErrorCode.DAEMON_START_FAILED, "stop": ErrorCode.DAEMON_STOP_FAILED}
            return _from_table(codes, operation, "daemon operation")
        case PreflightFailure(check=check):
            return _from_table(PREFLIGHT_CHECKS, check, "preflight check")
        case RequestRefusal(reason=reason):
            return _from_table(REQUEST_REFUSALS, reason, "request refusal")
        case LocalFault(fault=fault):
            return _from_table(LOCAL_FAULTS, fault, "local fault")
        case CleanupOverdue():
            return ErrorCode.CLEANUP_STUCK
    raise UnclassifiedObservation(f"not an observation: {observation!r}")

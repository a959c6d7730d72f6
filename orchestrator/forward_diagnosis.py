"""What a denied reverse forward means, pure: given what holds the port on the
VPS, decide between fencing our own stale session, waiting for a session that is going
silent, a lease conflict with a live owner, or a port held by some other program.

Called by monitord/remote/tunnel/forwards.py after `ss` on the VPS has been parsed into a
`PortHolder`. No I/O; the caller fences, waits or reports.

| holder                                              | verdict        | error code            |
|-----------------------------------------------------|----------------|-----------------------|
| nobody any more                                     | RETRY_NOW      | -                     |
| not an SSH session (orchestrator/sshd_session.py)  | PORT_OCCUPIED  | PORT_OCCUPIED         |
| our own live sshd session                           | DENIED         | FORWARD_DENIED        |
| sshd session of another owner's unexpired lease     | LEASE_CONFLICT | TUNNEL_LEASE_CONFLICT |
| sshd, no client socket or silent >= stale_after     | FENCE          | -                     |
| sshd, silent > one keepalive, < stale_after         | WAIT_STALE     | -                     |
| sshd, talking (silent <= one keepalive interval)    | LEASE_CONFLICT | TUNNEL_LEASE_CONFLICT |

Why fencing a silent sshd session is safe: forwards are only requested while we hold the
tunnel lease, so the port belongs to us; a session whose client sent nothing for longer
than keepalive interval × count has a dead or partitioned client (a live client sends
keepalives), so killing it loses no live traffic.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from orchestrator.tunnel_lease import LeaseRecord


class HolderKind(StrEnum):
    NONE = "none"
    SSHD = "sshd"
    OTHER = "other"


@dataclass(frozen=True)
class PortHolder:
    """One observation of the listener on a VPS port. `lastrcv_s` is how long the holder's
    client connection has been silent (None: no established client socket found)."""

    port: int
    kind: HolderKind
    pid: int | None = None
    command: str = ""
    lastrcv_s: float | None = None
    client: str = ""


class Verdict(StrEnum):
    RETRY_NOW = "retry_now"
    FENCE = "fence"
    WAIT_STALE = "wait_stale"
    LEASE_CONFLICT = "lease_conflict"
    PORT_OCCUPIED = "port_occupied"
    DENIED = "denied"


@dataclass(frozen=True)
class Diagnosis:
    verdict: Verdict
    detail: str
    code: str | None = None
    fence_pid: int | None = None
    retry_after_s: float = 0.0
    owner_id: str | None = None
    owner_label: str | None = None
    holder_pid: int | None = None
    holder_command: str = ""


def diagnose(
    holder: PortHolder,
    *,
    our_owner_id: str,
    our_sshd_pid: int | None,
    lease: LeaseRecord | None,
    now: float,
    keepalive_interval_s: float,
    stale_after_s: float,
    conflict_retry_s: float,
) -> Diagnosis:
    """Apply the module table. `lease` is the record on the VPS, `now` the VPS clock."""
    port = holder.port
    if holder.kind is HolderKind.NONE:
        return Diagnosis(Verdict.RETRY_NOW, f"port {port} is free now")
    if holder.kind is HolderKind.OTHER:
        return Diagnosis(
            Verdict.PORT_OCCUPIED,
            f"port {port} is held by pid {holder.pid} ({holder.command}), not by an SSH session",
            code="PORT_OCCUPIED",
            retry_after_s=conflict_retry_s,
            holder_pid=holder.pid,
            holder_command=holder.command,
        )
    if holder.pid is not None and holder.pid == our_sshd_pid:
        return Diagnosis(
            Verdict.DENIED,
            f"port {port} is already held by our own live session (pid {holder.pid})",
            code="FORWARD_DENIED",
            retry_after_s=conflict_retry_s,
            holder_pid=holder.pid,
        )
    lease_session = lease is not None and lease.session.sshd_pid == holder.pid
    silent = holder.lastrcv_s
    if (
        lease is not None
        and lease_session
        and lease.owner_id != our_owner_id
        and not lease.is_expired(now)
    ):
        return _conflict(holder, owner_id=lease.owner_id, owner_label=lease.owner_label,
                         retry_s=conflict_retry_s)
    whose = "our own" if lease is not None and lease.owner_id == our_owner_id else "an unknown"
    if silent is None or silent >= stale_after_s:
        why = "has no client connection" if silent is None else f"silent for {silent:.1f}s"
        return Diagnosis(
            Verdict.FENCE,
            f"port {port} is held by {whose} stale sshd session pid {holder.pid} that {why}",
            fence_pid=holder.pid,
            holder_pid=holder.pid,
            holder_command=holder.command,
        )
    if silent > keepalive_interval_s:
        return Diagnosis(
            Verdict.WAIT_STALE,
            f"port {port} is held by sshd session pid {holder.pid}, silent for {silent:.1f}s;"
            f" stale after {stale_after_s:.1f}s",
            retry_after_s=stale_after_s - silent + min(0.2, keepalive_interval_s),
            holder_pid=holder.pid,
        )
    if lease is not None and lease_session:
        return _conflict(holder, owner_id=lease.owner_id, owner_label=lease.owner_label,
                         retry_s=conflict_retry_s)
    return _conflict(holder, owner_id="unknown",
                     owner_label=f"live ssh session from {holder.client or '?'}",
                     retry_s=conflict_retry_s)


def _conflict(
    holder: PortHolder, *, owner_id: str, owner_label: str, retry_s: float
) -> Diagnosis:
    return Diagnosis(
        Verdict.LEASE_CONFLICT,
        f"port {holder.port} is held by the live ssh session pid {holder.pid} of"
        f" {owner_label} ({owner_id})",
        code="TUNNEL_LEASE_CONFLICT",
        retry_after_s=retry_s,
        owner_id=owner_id,
        owner_label=owner_label,
        holder_pid=holder.pid,
        holder_command=holder.command,
    )

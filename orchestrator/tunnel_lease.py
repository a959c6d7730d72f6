"""The tunnel lease decisions, pure: may this node take, renew or release the
lease that names the one owner of the SSH tunnel on the VPS?

Called by monitord.vps.tunnel_lease (`monitord tunnel-lease` on the VPS), under the lease
file's flock, with the record it read, the caller's identity, the VPS wall clock and whether
the recorded sshd session still exists. It returns what to write (or whom to fence first);
it performs no I/O. All times are seconds on the VPS clock, so two PBX clocks never have to agree.

Decision table for acquire (first matching row wins):

| current record                         | decision          |
|----------------------------------------|-------------------|
| none                                   | TAKE              |
| same owner_id (our earlier session)    | TAKE              |
| other owner, not expired               | REFUSE_CONFLICT   |
| other owner, expired, session gone     | TAKE              |
| other owner, expired, session alive    | FENCE_THEN_TAKE   |
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from orchestrator.text_enum import TextEnum

# The end-to-end proof of a forward: the VPS side sends PROBE_PREFIX + nonce through the
# forward, and only our own listener answers PROBE_REPLY + nonce.
PROBE_PREFIX = b"monitord-forward-probe "
PROBE_REPLY = b"monitord-forward-proven "


@dataclass(frozen=True)
class SessionIdentity:
    """The sshd session a lease belongs to: per-connection sshd PID (+ its start time in
    clock ticks, so a reused PID is never mistaken for it) and SSH_CONNECTION."""

    sshd_pid: int
    sshd_start_ticks: int
    ssh_connection: str


@dataclass(frozen=True)
class LeaseRecord:
    """The lease file's content."""

    owner_id: str
    owner_label: str
    acquired_at: float
    renewed_at: float
    ttl: float
    session: SessionIdentity

    @property
    def expires_at(self) -> float:
        return self.renewed_at + self.ttl

    def is_expired(self, now: float) -> bool:
        return now >= self.expires_at

    def to_dict(self) -> dict[str, Any]:
        return {
            "owner_id": self.owner_id,
            "owner_label": self.owner_label,
            "acquired_at": self.acquired_at,
            "renewed_at": self.renewed_at,
            "ttl": self.ttl,
            "expires_at": self.expires_at,
            "session": {
                "sshd_pid": self.session.sshd_pid,
                "sshd_start_ticks": self.session.sshd_start_ticks,
                "ssh_connection": self.session.ssh_connection,
            },
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LeaseRecord:
        """Raises KeyError/TypeError/ValueError on a malformed record."""
        session = data["session"]
        return cls(
            owner_id=str(data["owner_id"]),
            owner_label=str(data["owner_label"]),
            acquired_at=float(data["acquired_at"]),
            renewed_at=float(data["renewed_at"]),
            ttl=float(data["ttl"]),
            session=SessionIdentity(
                sshd_pid=int(session["sshd_pid"]),
                sshd_start_ticks=int(session["sshd_start_ticks"]),
                ssh_connection=str(session["ssh_connection"]),
            ),
        )


class LeaseAction(TextEnum):
    TAKE = "take"
    FENCE_THEN_TAKE = "fence_then_take"
    REFUSE_CONFLICT = "refuse_conflict"
    RENEW = "renew"
    LOST = "lost"
    RELEASE = "release"
    NOTHING = "nothing"


@dataclass(frozen=True)
class LeaseDecision:
    """What the VPS side must do. `record` is the record to write for TAKE/FENCE_THEN_TAKE/
    RENEW; `holder` is the record that blocks us (conflict) or that we replace or lost to."""

    action: LeaseAction
    reason: str
    record: LeaseRecord | None = None
    holder: LeaseRecord | None = None
    fence_pid: int | None = None


def decide_acquire(
    current: LeaseRecord | None,
    *,
    owner_id: str,
    owner_label: str,
    ttl: float,
    session: SessionIdentity,
    now: float,
    holder_session_alive: bool,
) -> LeaseDecision:
    """Decide an acquire request (see the module table). Never takes a live foreign lease."""
    fresh = LeaseRecord(
        owner_id=owner_id,
        owner_label=owner_label,
        acquired_at=now,
        renewed_at=now,
        ttl=ttl,
        session=session,
    )
    if current is None:
        return LeaseDecision(LeaseAction.TAKE, "no lease on record", record=fresh)
    if current.owner_id == owner_id:
        keep = current.session == session
        record = replace(fresh, acquired_at=current.acquired_at) if keep else fresh
        why = "already ours" if keep else "our own earlier session; this one replaces it"
        return LeaseDecision(LeaseAction.TAKE, why, record=record, holder=current)
    if not current.is_expired(now):
        left = current.expires_at - now
        return LeaseDecision(
            LeaseAction.REFUSE_CONFLICT,
            f"held by {current.owner_label} ({current.owner_id}) for {left:.1f}s more",
            holder=current,
        )
    if not holder_session_alive:
        return LeaseDecision(
            LeaseAction.TAKE, "expired lease whose session is gone", record=fresh, holder=current
        )
    return LeaseDecision(
        LeaseAction.FENCE_THEN_TAKE,
        f"expired lease whose sshd session {current.session.sshd_pid} is still there",
        record=fresh,
        holder=current,
        fence_pid=current.session.sshd_pid,
    )


def decide_renew(
    current: LeaseRecord | None, *, owner_id: str, session: SessionIdentity, now: float
) -> LeaseDecision:
    """Renew only our own record from the session that took it; anything else is LOST.

    An expired record that nobody replaced is still ours: takeover would have rewritten it
    under the same lock, so renewing it cannot overlap another owner."""
    if current is None:
        return LeaseDecision(LeaseAction.LOST, "no lease on record")
    if current.owner_id != owner_id:
        return LeaseDecision(
            LeaseAction.LOST,
            f"taken by {current.owner_label} ({current.owner_id})",
            holder=current,
        )
    if current.session != session:
        return LeaseDecision(
            LeaseAction.LOST, "held by another session of the same owner", holder=current
        )
    return LeaseDecision(
        LeaseAction.RENEW, "renewed", record=replace(current, renewed_at=now), holder=current
    )


def decide_release(current: LeaseRecord | None, *, owner_id: str) -> LeaseDecision:
    """Release removes only our own record."""
    if current is None:
        return LeaseDecision(LeaseAction.NOTHING, "no lease on record")
    if current.owner_id != owner_id:
        return LeaseDecision(LeaseAction.NOTHING, "not ours; left alone", holder=current)
    return LeaseDecision(LeaseAction.RELEASE, "released", holder=current)

"""Area-lease arithmetic on the local monotonic clock.

The VPS runs an area only while the local owner keeps renewing its lease. The local side
may treat a remote daemon as gone without being able to reach the VPS only once

    lease_expired_at = last acknowledged grant + ttl * (1 + clock_margin) + safety_margin

has passed on the LOCAL monotonic clock: the agent's own timer (and the per-daemon guard)
stop the daemon at grant + ttl on the VPS clock, the clock margin covers a VPS clock that
runs slower than ours, and the safety margin covers stopping latency.

Called by orchestrator/phases.py (the rollback guard) and by monitord/engine/lease_ledger.py
(the grants known); which leases to renew is rules.desired_runs(side=REMOTE).
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.models import AreaLease


@dataclass(frozen=True, slots=True, kw_only=True)
class LeasePolicy:
    """The lease settings of monitord.toml [remote] that the rules need."""

    ttl_s: float = 30.0
    clock_margin: float = 0.1
    safety_margin_s: float = 2.0


def expired_at(lease: AreaLease, *, policy: LeasePolicy) -> float:
    """The local monotonic time after which the remote daemon is provably stopped."""
    return lease.acknowledged_at + lease.ttl * (1.0 + policy.clock_margin) + policy.safety_margin_s


def provably_expired(lease: AreaLease, *, now: float, policy: LeasePolicy) -> bool:
    """True once `now` (local monotonic) is at or past expired_at()."""
    return now >= expired_at(lease, policy=policy)


def after_restart(
    *, area: str, generation: int, owner_id: str, now: float, policy: LeasePolicy
) -> AreaLease:
    """The lease to assume after monitord restarted and lost its monotonic acknowledgements.

    Monotonic time does not survive a restart, so the last acknowledgement is unknown; it
    happened before `now` (the restart), so assuming it happened at `now` is conservative.
    """
    return AreaLease(
        area=area, generation=generation, owner_id=owner_id, acknowledged_at=now, ttl=policy.ttl_s
    )

"""The area-lease ledger: what the local owner knows of its grants that let the VPS run areas.

Synchronous book-keeping, no I/O: the lease renewer (monitord/engine/lease_renewer.py, the
loop that sends the renewals) and CREATE_DESTINATION (monitord/engine/phase_actions.py)
record acknowledgements and failed grants here; the migration engine asks it for the lease
a rollback's expiry bound counts from (`lease_for`).

Per (area, generation) it records the local monotonic time at which the agent's
acknowledgement arrived. That time is what `orchestrator.area_leases.expired_at()` counts
from, so the rollback rule ("restart the source only after the destination's lease provably
expired") rests on acknowledgements actually received, never on requests merely sent.

After a restart nothing is known about earlier acknowledgements; `lease_for()` then answers
with `area_leases.after_restart()` (as if acknowledged at start-up), which is conservative.

A grant whose answer never came (a timeout, a connection reset after sending) may still
reach the agent later — but only over the SSH connection that carried it. Such a grant is
*uncertain* and tagged with that connection's epoch (the keeper's reconnect count): while
that connection lives, the lease counts as renewed "now"; once the epoch changes or the
tunnel is down, no late delivery is possible and the bound counts from the moment that was
observed. A grant that provably never left (no channel to the agent could be opened)
changes nothing. `oldest_uncertain()` tells the renewer how long the oldest uncertainty has
lasted, so that one outliving a lease TTL on a live connection is ended on purpose.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from monitord.remote.agent_client import maybe_delivered
from orchestrator import area_leases
from orchestrator.area_leases import LeasePolicy
from orchestrator.errors import MonitordError
from orchestrator.models import AreaLease

Key = tuple[str, int]


class LeaseLedger:
    """The grants' acknowledgements and uncertainties; see the module docstring."""

    def __init__(
        self,
        *,
        owner_id: str,
        policy: LeasePolicy,
        tunnel_connected: Callable[[], bool],
        connection_epoch: Callable[[], int],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.owner_id = owner_id
        self.policy = policy
        self._tunnel_connected = tunnel_connected
        self._epoch = connection_epoch
        self._clock = clock
        self.started_at = clock()
        self._acks: dict[Key, float] = {}
        self._acked_over: dict[Key, int] = {}  # the connection epoch of each acknowledgement
        self._uncertain: dict[Key, int] = {}  # grant -> epoch of the connection carrying it
        self._uncertain_since: dict[Key, float] = {}

    def now(self) -> float:
        """The ledger's clock (local monotonic): what acknowledgements are dated with."""
        return self._clock()

    def lease_for(self, area: str, generation: int) -> AreaLease:
        """The best-known lease of (area, generation) for the expiry bound."""
        self._resolve()
        key = (area, generation)
        acked = self._clock() if key in self._uncertain else self._acks.get(key)
        if acked is None:
            return area_leases.after_restart(
                area=area,
                generation=generation,
                owner_id=self.owner_id,
                now=self.started_at,
                policy=self.policy,
            )
        return AreaLease(
            area=area,
            generation=generation,
            owner_id=self.owner_id,
            acknowledged_at=acked,
            ttl=self.policy.ttl_s,
        )

    def epoch(self) -> int:
        """The current connection epoch; pass it back to `grant_failed`."""
        return self._epoch()

    def acknowledge(self, area: str, generation: int, *, at: float | None = None) -> None:
        """Record a grant the agent confirmed (also used by CREATE_DESTINATION)."""
        key = (area, generation)
        self._acks[key] = self._clock() if at is None else at
        self._acked_over[key] = self._epoch()
        self._uncertain.pop(key, None)
        self._uncertain_since.pop(key, None)

    def grant_failed(self, area: str, generation: int, *, epoch: int, error: MonitordError) -> None:
        """A grant sent over connection `epoch` got no answer (see the module doc)."""
        if not maybe_delivered(error):
            return
        key = (area, generation)
        if epoch != self._epoch() or not self._tunnel_connected():
            self._acks[key] = self._clock()  # its connection is gone: nothing arrives later
        else:
            self._uncertain[key] = epoch
            self._uncertain_since.setdefault(key, self._clock())

    def tunnel_down(self) -> None:
        """The SSH connection is gone: uncertain grants can no longer arrive."""
        self._resolve()

    def _resolve(self) -> None:
        if not self._uncertain:
            return
        current, connected = self._epoch(), self._tunnel_connected()
        now = self._clock()
        for key, epoch in list(self._uncertain.items()):
            if epoch != current or not connected:
                self._acks[key] = now
                del self._uncertain[key]
                self._uncertain_since.pop(key, None)

    def split_due(self, grants: dict[str, int]) -> tuple[dict[str, int], float]:
        """(the grants a renewal names now; seconds until the first one left out is due,
        at TTL/3 of age). Left out: acknowledged less than TTL/6 ago over this very
        connection, and not uncertain. After a reconnect every grant is named: the VPS may
        have restarted, and its agent starts nothing until it is granted again."""
        now, fresh_s, due_age_s = self._clock(), self.policy.ttl_s / 6, self.policy.ttl_s / 3
        epoch = self._epoch()
        named: dict[str, int] = {}
        next_due_s = due_age_s
        for area, generation in grants.items():
            key = (area, generation)
            acked = self._acks.get(key)
            if (acked is None or key in self._uncertain or now - acked >= fresh_s
                    or self._acked_over.get(key) != epoch):
                named[area] = generation
            else:
                next_due_s = min(next_due_s, acked + due_age_s - now)
        return named, next_due_s

    def oldest_uncertain(self) -> tuple[int, float | None]:
        """(how many grants are uncertain, since when the oldest is), after resolving the
        ones whose connection is gone."""
        self._resolve()
        return len(self._uncertain), min(self._uncertain_since.values(), default=None)

"""Area-lease renewal: the local owner's grants that let the VPS run areas.

A root task ("lease renewer"). Every TTL/3, and at once when the placement changes, it sends
the agent ONE batch renewal naming the areas that may run remote right now
(`PlacementState.runs(REMOTE)`) and need it — all of them, except those acknowledged less
than TTL/6 ago over the same SSH connection: a move changes the placement many times a
second, and naming every area each time rewrote every lease file on the VPS that often. An
area left out is named again by the time its grant is TTL/3 old, as with the regular
renewal. It records, per (area, generation), the local monotonic time at which the agent's
acknowledgement arrived. That time is what `orchestrator.area_leases.expired_at()` counts
from, so the rollback rule ("restart the source only after the destination's lease
provably expired") rests on acknowledgements actually received, never on requests merely
sent.

After a restart nothing is known about earlier acknowledgements; `lease_for()` then answers
with `area_leases.after_restart()` (as if acknowledged at start-up), which is conservative.

A grant whose answer never came (a timeout, a connection reset after sending) may still
reach the agent later — but only over the SSH connection that carried it. Such a grant is
*uncertain* and tagged with that connection's epoch (the keeper's reconnect count): while
that connection lives, the lease counts as renewed "now"; once the epoch changes or the
tunnel is down, no late delivery is possible and the bound counts from the moment that was
observed. A grant that provably never left (no channel to the agent could be opened)
changes nothing. An uncertainty that outlives one lease TTL on a live connection (an agent
that hangs without dropping the link) is ended on purpose: `recycle` closes that connection,
the keeper reconnects, and the bound starts counting.

The renewing loop runs under the root loops' error policy (monitord/base/periodic.py): an
iteration that raises (a reply that names an area not asked for, say) is counted and shown,
and the next one runs within TTL/3 — the back-off never outlasts the renewal interval.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from monitord.base import logs
from monitord.base.periodic import LoopBook, Periodic
from monitord.engine.placement_state import PlacementState
from monitord.remote.agent_client import AgentClient, maybe_delivered
from orchestrator import area_leases
from orchestrator.area_leases import LeasePolicy
from orchestrator.errors import MonitordError
from orchestrator.models import AreaLease, Side

log = logs.get_logger(__name__)

TASK_NAME = "lease renewer"
Key = tuple[str, int]


class LeaseRenewer:
    def __init__(
        self,
        *,
        state: PlacementState,
        agent: Callable[[], AgentClient | None],
        owner_id: str,
        policy: LeasePolicy,
        tunnel_connected: Callable[[], bool],
        connection_epoch: Callable[[], int],
        recycle: Callable[[], Awaitable[None]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        loops: LoopBook | None = None,
    ) -> None:
        self._recycle = recycle
        self._state = state
        self._agent = agent
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
        self.loop = Periodic(TASK_NAME, iteration=self._iterate, interval_s=policy.ttl_s / 3,
                             book=loops)
        self.rejected: dict[str, str] = {}  # area -> the agent's reason, for the status
        self.last_error: MonitordError | None = None
        state.add_listener(self.loop.wake)

    # -- the bound ---------------------------------------------------------------------------

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

    # -- the loop ----------------------------------------------------------------------------

    def wake(self) -> None:
        self.loop.wake()

    async def run(self) -> None:
        """The root task body: renew every TTL/3, and at once on a placement change."""
        await self.loop.run()

    async def _iterate(self) -> float:
        next_due_s = await self.renew_once()
        await self._end_long_uncertainty()
        return next_due_s

    def _split_due(self, grants: dict[str, int]) -> tuple[dict[str, int], float]:
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

    async def _end_long_uncertainty(self) -> None:
        self._resolve()
        oldest = min(self._uncertain_since.values(), default=None)
        if self._recycle is None or oldest is None:
            return
        if self._clock() - oldest >= self.policy.ttl_s:
            log.warning("grant_uncertain_recycling_tunnel", grants=len(self._uncertain),
                        waited_s=round(self._clock() - oldest, 1))
            await self._recycle()

    async def renew_once(self) -> float:
        """One batch renewal of the areas that need it; returns the seconds until one left
        out will need it."""
        agent = self._agent()
        grants, next_due_s = self._split_due(dict(self._state.runs(Side.REMOTE)))
        if agent is None or not grants:
            return next_due_s
        epoch = self._epoch()
        try:
            answers = await agent.renew(
                owner_id=self.owner_id, ttl_s=self.policy.ttl_s, areas=grants
            )
        except MonitordError as e:
            for area, generation in grants.items():
                self.grant_failed(area, generation, epoch=epoch, error=e)
            if self.last_error is None or self.last_error.code != e.code:
                log.warning("lease_renewal_failed", error_code=e.code, detail=e.detail)
            self.last_error = e
            return next_due_s
        arrived = self._clock()
        self.last_error = None
        for area, answer in answers.items():
            if answer.renewed:
                self.acknowledge(area, grants[area], at=arrived)
                self.rejected.pop(area, None)
            else:
                self.rejected[area] = answer.result
        return next_due_s

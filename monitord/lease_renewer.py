"""Area-lease renewal: the local owner's grants that let the VPS run areas (SPEC §6.4).

A root task ("lease renewer"). Every TTL/3, and at once when the placement changes, it sends
the agent ONE batch renewal naming every area that may run remote right now
(`PlacementState.runs(REMOTE)`), and records, per (area, generation), the local monotonic
time at which the agent's acknowledgement arrived. That time is what
`orchestrator.area_leases.expired_at()` counts from, so the rollback rule ("restart the
source only after the destination's lease provably expired") rests on acknowledgements
actually received, never on requests merely sent.

After a restart nothing is known about earlier acknowledgements; `lease_for()` then answers
with `area_leases.after_restart()` (as if acknowledged at start-up), which is conservative.

A grant whose answer never came (timeout, broken forward) may still reach the agent later,
as long as the SSH connection that carries it lives. Such a grant is *uncertain*: its lease
counts as renewed "now" until the tunnel is seen down (`tunnel_down()`), after which no late
delivery is possible and the bound counts from that moment.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import structlog

from monitord.agent_client import AgentClient
from monitord.placement_state import PlacementState
from orchestrator import area_leases
from orchestrator.area_leases import LeasePolicy
from orchestrator.errors import MonitordError
from orchestrator.models import AreaLease, Side

log = structlog.get_logger("monitord.lease_renewer")

TASK_NAME = "lease renewer"


class LeaseRenewer:
    def __init__(
        self,
        *,
        state: PlacementState,
        agent: Callable[[], AgentClient | None],
        owner_id: str,
        policy: LeasePolicy,
        tunnel_connected: Callable[[], bool],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._tunnel_connected = tunnel_connected
        self._state = state
        self._agent = agent
        self.owner_id = owner_id
        self.policy = policy
        self._clock = clock
        self.started_at = clock()
        self._acks: dict[tuple[str, int], float] = {}
        self._uncertain: set[tuple[str, int]] = set()
        self._wake = asyncio.Event()
        self.rejected: dict[str, str] = {}  # area -> the agent's reason, for the status
        self.last_error: MonitordError | None = None
        state.add_listener(self._wake.set)

    def lease_for(self, area: str, generation: int) -> AreaLease:
        """The best-known lease of (area, generation) for the expiry bound."""
        if (area, generation) in self._uncertain:
            acked: float | None = self._clock()
        else:
            acked = self._acks.get((area, generation))
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

    def acknowledge(self, area: str, generation: int, *, at: float | None = None) -> None:
        """Record a grant the agent confirmed (also used by CREATE_DESTINATION)."""
        self._acks[(area, generation)] = self._clock() if at is None else at
        self._uncertain.discard((area, generation))

    def grant_failed(self, area: str, generation: int) -> None:
        """A grant was sent and its answer lost: it may still arrive (see module doc)."""
        if self._tunnel_connected():
            self._uncertain.add((area, generation))
        else:  # the carrying connection is already gone: nothing can arrive after now
            self._acks[(area, generation)] = self._clock()

    def tunnel_down(self) -> None:
        """The SSH connection is gone: uncertain grants can no longer arrive."""
        now = self._clock()
        for key in self._uncertain:
            self._acks[key] = now
        self._uncertain.clear()

    def wake(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        interval = self.policy.ttl_s / 3
        while True:
            self._wake.clear()
            await self.renew_once()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self._wake.wait()

    async def renew_once(self) -> None:
        agent = self._agent()
        grants = dict(self._state.runs(Side.REMOTE))
        if agent is None or not grants:
            return
        try:
            answers = await agent.renew(
                owner_id=self.owner_id, ttl_s=self.policy.ttl_s, areas=grants
            )
        except MonitordError as e:
            for area, generation in grants.items():
                self.grant_failed(area, generation)
            if self.last_error is None or self.last_error.code != e.code:
                log.warning("lease_renewal_failed", error_code=e.code, detail=e.detail)
            self.last_error = e
            return
        arrived = self._clock()
        self.last_error = None
        for area, answer in answers.items():
            if answer.renewed:
                self.acknowledge(area, grants[area], at=arrived)
                self.rejected.pop(area, None)
            else:
                self.rejected[area] = answer.result

"""Area-lease renewal: the loop that sends the local owner's grants to the agent.

A root task ("lease renewer"). Every TTL/3, and at once when the placement changes, it sends
the agent ONE batch renewal naming the areas that may run remote right now
(`PlacementState.runs(REMOTE)`) and need it — all of them, except those acknowledged less
than TTL/6 ago over the same SSH connection: a move changes the placement many times a
second, and naming every area each time rewrote every lease file on the VPS that often. An
area left out is named again by the time its grant is TTL/3 old, as with the regular
renewal. What each answer means for the expiry bound (acknowledged, uncertain, never left)
is recorded in the lease ledger (monitord/engine/lease_ledger.py), which the migration
engine asks.

An uncertain grant that outlives one lease TTL on a live connection (an agent that hangs
without dropping the link) is ended on purpose: `recycle` closes that connection, the keeper
reconnects, and the bound starts counting.

An answer is held to the request (`_book`): an area the renewal did not name is ignored, one
it named but the answer leaves out (or answers `renewed` for another generation) is
uncertain, as if the answer had been lost — never acknowledged, so the rollback bound never
counts from a renewal the agent did not confirm — and each is logged
(`lease_renewal_unexpected_answer`, VPS_REPLY_INVALID).

The renewing loop runs under the root loops' error policy (monitord/base/periodic.py): an
iteration that raises is counted and shown, and the next one runs within TTL/3 — the
back-off never outlasts the renewal interval.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

from monitord.base import logs
from monitord.base.periodic import LoopBook, Periodic
from monitord.engine.lease_ledger import LeaseLedger
from monitord.engine.placement_state import PlacementState
from monitord.remote.agent_client import AgentClient, AgentUnreachable, RenewResult
from orchestrator.errors import ErrorCode, MonitordError
from orchestrator.models import Side

log = logs.get_logger(__name__)

TASK_NAME = "lease renewer"


class LeaseRenewer:
    def __init__(
        self,
        *,
        state: PlacementState,
        agent: Callable[[], AgentClient | None],
        ledger: LeaseLedger,
        recycle: Callable[[], Awaitable[None]] | None = None,
        loops: LoopBook | None = None,
    ) -> None:
        self._recycle = recycle
        self._state = state
        self._agent = agent
        self.ledger = ledger
        self.loop = Periodic(TASK_NAME, iteration=self._iterate,
                             interval_s=ledger.policy.ttl_s / 3, book=loops)
        self.rejected: dict[str, str] = {}  # area -> the agent's reason, for the status
        self.last_error: MonitordError | None = None
        state.add_listener(self.loop.wake)

    # -- what CREATE_DESTINATION records (monitord/engine/phase_actions.py, which holds the
    #    renewer): the ledger's own methods -----------------------------------------------

    def epoch(self) -> int:
        return self.ledger.epoch()

    def acknowledge(self, area: str, generation: int, *, at: float | None = None) -> None:
        self.ledger.acknowledge(area, generation, at=at)

    def grant_failed(self, area: str, generation: int, *, epoch: int, error: MonitordError) -> None:
        self.ledger.grant_failed(area, generation, epoch=epoch, error=error)

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

    async def _end_long_uncertainty(self) -> None:
        count, oldest = self.ledger.oldest_uncertain()
        if self._recycle is None or oldest is None:
            return
        waited_s = self.ledger.now() - oldest
        if waited_s >= self.ledger.policy.ttl_s:
            log.warning("grant_uncertain_recycling_tunnel", grants=count,
                        waited_s=round(waited_s, 1))
            await self._recycle()

    async def renew_once(self) -> float:
        """One batch renewal of the areas that need it; returns the seconds until one left
        out will need it."""
        agent = self._agent()
        grants, next_due_s = self.ledger.split_due(dict(self._state.runs(Side.REMOTE)))
        if agent is None or not grants:
            return next_due_s
        epoch = self.ledger.epoch()
        try:
            answers = await agent.renew(
                owner_id=self.ledger.owner_id, ttl_s=self.ledger.policy.ttl_s, areas=grants
            )
        except MonitordError as e:
            for area, generation in grants.items():
                self.ledger.grant_failed(area, generation, epoch=epoch, error=e)
            if self.last_error is None or self.last_error.code != e.code:
                log.warning("lease_renewal_failed", error_code=e.code, detail=e.detail)
            self.last_error = e
            return next_due_s
        arrived = self.ledger.now()
        self.last_error = None
        self._book(answers, grants=grants, epoch=epoch, arrived=arrived)
        return next_due_s

    def _book(self, answers: Mapping[str, RenewResult], *, grants: Mapping[str, int],
              epoch: int, arrived: float) -> None:
        """Record what the agent said about each grant asked for. The answer is the agent's,
        so it is held to the request: an area not asked is ignored; one asked but missing,
        or answered `renewed` for another generation, may have been renewed or not — it is
        uncertain (the bound counts it renewed while this connection lives), never
        acknowledged. Each kind is logged once per renewal."""
        odd: dict[str, list[str]] = {}
        for area, answer in answers.items():
            generation = grants.get(area)
            if generation is None:
                odd.setdefault("not_asked", []).append(area[:80])
            elif answer.renewed and answer.generation not in (None, generation):
                odd.setdefault("other_generation", []).append(area)
                self._uncertain(area, generation, epoch=epoch)
            elif answer.renewed:
                self.ledger.acknowledge(area, generation, at=arrived)
                self.rejected.pop(area, None)
            else:
                self.rejected[area] = answer.result[:80]
        for area, generation in grants.items():
            if area not in answers:
                odd.setdefault("missing", []).append(area)
                self._uncertain(area, generation, epoch=epoch)
        if odd:
            log.warning("lease_renewal_unexpected_answer", error_code=ErrorCode.VPS_REPLY_INVALID,
                        **{kind: areas[:10] for kind, areas in odd.items()},
                        counts={kind: len(areas) for kind, areas in odd.items()})

    def _uncertain(self, area: str, generation: int, *, epoch: int) -> None:
        self.ledger.grant_failed(area, generation, epoch=epoch, error=AgentUnreachable(
            f"area {area}: the renewal's answer does not say", maybe_delivered=True))

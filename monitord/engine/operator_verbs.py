"""The operator's verbs on moves, on top of the migration engine.

    retry(service)                   parked moves start again with fresh generations
    discard_remote_data(service)     a rollback waiting for the other side's newer data gives
                                     it up and restarts its source on its own data
    give_up_remote(service)          the VPS is given up: areas home on the PBX's own copy
    give_up_lost_vps()               the same by policy (on_vps_lost = "home"), every tick

Each takes the engine's intake lock, feeds its outcome through the engine's `apply` (the
core decides the record: orchestrator/migration_step.py) and lets the engine's runners go on.
A give-up decides on records no step may change meanwhile: `engine.halted()` stops the
areas' runners for the decision and starts them again whatever it ended in. What a give-up
may do is orchestrator/give_up.py's to say.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from monitord.base import logs
from monitord.engine.migration_engine import MigrationEngine
from monitord.engine.phase_actions import PhaseActions
from orchestrator import area_leases, give_up, phases, warm_copy
from orchestrator.errors import ErrorCode, MonitordError, PermanentError
from orchestrator.models import Area, AreaLease, Phase, Side
from orchestrator.phases import Outcome

log = logs.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class GivenUp:
    """A give-up's answer: the transactions that take the areas home, and per area what it
    starts on and what that loses (`kept_copy` "warm" or "pbx", `kept_copy_age_s`,
    `warm_copy_taken_at`: PhaseActions.abandon_remote_data)."""

    transaction_ids: list[str]
    kept: dict[str, dict[str, Any]]


class OperatorVerbs:
    def __init__(
        self,
        *,
        engine: MigrationEngine,
        actions: PhaseActions,
        vps_lost_after_s: float | None = None,
        vps_lost_services: frozenset[str] = frozenset(),
    ) -> None:
        self.engine = engine
        self.actions = actions
        self.state = engine.state
        # Services that give a lost VPS up by themselves (on_vps_lost = "home"), after that long
        self.vps_lost_after_s = vps_lost_after_s
        self.vps_lost_services = vps_lost_services
        self._vps_lost_logged: set[str] = set()

    async def retry(self, service: str) -> list[str]:
        """The operator's retry: leave PARKED with fresh generations; clear back-offs."""
        engine = self.engine
        async with engine.intake_lock:
            engine.forgive(service, areas=[a.uuid for a in self.state.areas_of(service)])
            resumed = []
            for txn in list(self.state.transactions.values()):
                if txn.service != service or txn.phase is not Phase.PARKED:
                    continue
                if phases.parked_rollback(txn) and phases.awaits_data(
                    txn, self.state.lineage(txn.area)
                ):
                    # It parked waiting for the destination's data: try to bring it back.
                    await engine.apply(txn, Outcome.ROLLBACK_RESUMED)
                    resumed.append(txn.transaction_id)
                    continue
                committed = self.state.committed[txn.area]
                generation = await engine.store.issue_generation(
                    txn.area, floor=max(committed.generation, txn.generation)
                )
                await engine.apply(txn, Outcome.RETRY_REQUESTED, new_generation=generation)
                resumed.append(txn.transaction_id)
        engine.wake()
        return resumed

    async def discard_remote_data(self, service: str, *, area: str | None = None) -> list[str]:
        """The operator's override: rollbacks of `service` (or of one area) that wait for
        the destination's newer data give it up and restart their source on its own data.

        Recorded as a `remote_data_discarded` event per area. Raises TRANSACTION_CONFLICT
        when no rollback of that service (area) waits for data."""
        engine = self.engine
        async with engine.intake_lock:
            waiting = [
                txn for txn in self.state.transactions.values()
                if txn.service == service and (area is None or txn.area == area)
                and txn.phase in (Phase.ROLLBACK, Phase.PARKED) and txn.destination_fenced
                and phases.awaits_data(txn, self.state.lineage(txn.area))
            ]
            if not waiting:
                where = f"area {area}" if area else f"service {service}"
                raise PermanentError(
                    ErrorCode.TRANSACTION_CONFLICT,
                    f"no rollback of {where} waits for data on the other side",
                )
            for txn in waiting:
                await self.actions.discard_data(txn, keep=txn.source, reason="operator")
                engine.clear_back_offs([txn.area])
                if txn.phase is Phase.PARKED:  # the rollback goes on: restart the source
                    await engine.apply(txn, Outcome.ROLLBACK_RESUMED)
        engine.wake()
        engine.start_runners()
        return [txn.transaction_id for txn in waiting]

    async def give_up_remote(
        self, service: str, *, area: str | None = None, reason: str = "operator"
    ) -> GivenUp:
        """The operator gives the VPS up for `service` (or one area): its areas start on the
        PBX's own copy and the data they wrote on the VPS is lost (orchestrator/give_up.py).

        Refused, changing nothing, while any remote copy could still run (VPS_NOT_FENCED,
        saying when it will be allowed), while an area commits a move (TRANSACTION_CONFLICT)
        or when nothing of it is on the VPS. Otherwise the loss is recorded per area
        (lineage first, `remote_data_abandoned` event), the wish becomes "local", and each
        area's transaction goes home; returns their ids and what each area starts on."""
        engine = self.engine
        async with engine.intake_lock:
            targets = [self.state.committed[area]] if area else self.state.areas_of(service)
            # No step may finish on a record decided on below.
            async with engine.halted(t.uuid for t in targets):
                abandoned = self._decide_give_up(targets, area=area, service=service)
                engine.forgive(service, areas=abandoned)
                await self.state.record_desired(service=service, area=area, location=Side.LOCAL)
                kept = {uuid: await self._abandon(uuid, decision, reason=reason)
                        for uuid, decision in abandoned.items()}
                await engine.open_for([self.state.committed[uuid] for uuid in abandoned])
        engine.wake()
        return GivenUp(transaction_ids=[
            t.transaction_id for t in self.state.transactions.values() if t.area in abandoned
        ], kept=kept)

    def _decide_give_up(self, targets: list[Area], *, area: str | None, service: str
                        ) -> dict[str, give_up.Abandon]:
        """The areas of `targets` to give up; raises (changing nothing) when any is busy or
        not provably fenced yet, or when none is on the VPS."""
        now = self.engine.clock()
        decisions = {
            target.uuid: give_up.decide(
                area=target, txn=self.state.transactions.get(target.uuid),
                lineage=self.state.lineage(target.uuid),
                leases=self._remote_leases(target), now=now, policy=self.engine.bounds.policy,
            )
            for target in targets
        }
        where = f"area {area}" if area else f"service {service}"
        for decision in decisions.values():
            if isinstance(decision, give_up.Busy):
                raise PermanentError(ErrorCode.TRANSACTION_CONFLICT,
                                     f"{decision.detail}; ask again in a moment")
        until = max((d.until for d in decisions.values()
                     if isinstance(d, give_up.NotFenced)), default=None)
        if until is not None:
            raise give_up.VpsNotFenced(where=where, wait_s=until - now, wall=self.engine.wall())
        abandoned = {uuid: d for uuid, d in decisions.items() if isinstance(d, give_up.Abandon)}
        if not abandoned:
            raise PermanentError(ErrorCode.TRANSACTION_CONFLICT,
                                 f"nothing of {where} is on the VPS: nothing to give up")
        return abandoned

    async def _abandon(self, uuid: str, decision: give_up.Abandon, *, reason: str
                       ) -> dict[str, Any]:
        committed = self.state.committed[uuid]
        txn = self.state.transactions.get(uuid)
        kept = await self.actions.abandon_remote_data(
            committed, reason=reason,
            generations=give_up.remote_generations(committed, txn),
        )
        if txn is None or decision.outcome is None:
            return kept
        generation = None
        if decision.outcome is Outcome.SOURCE_ABANDONED:
            generation = await self.engine.store.issue_generation(
                uuid, floor=max(committed.generation, txn.generation)
            )
        await self.engine.apply(txn, decision.outcome, new_generation=generation)
        return kept

    async def give_up_lost_vps(self, unreachable_since: float | None) -> None:
        """`[monitord] vps_lost_after_s`: the services with `on_vps_lost = "home"` give the
        VPS up by themselves once it has been unreachable that long (monotonic
        `unreachable_since`) — with the same proof of fencing as an operator's give-up
        (refused, and asked again next tick, until then)."""
        if self.vps_lost_after_s is None or unreachable_since is None:
            self._vps_lost_logged.clear()
            return
        lost_s = self.engine.clock() - unreachable_since
        if lost_s < self.vps_lost_after_s:
            return
        for service in sorted(self.vps_lost_services):
            view = self.give_up_view(service)
            if view is None:
                continue
            if view["allowed_at"] > self.engine.wall():
                # Not provably fenced yet: asking now would only halt its runners to refuse.
                if service not in self._vps_lost_logged:  # once per outage, not every tick
                    self._vps_lost_logged.add(service)
                    log.critical("vps_lost_give_up_waiting", service=service,
                                 allowed_at=view["allowed_at"], unreachable_s=round(lost_s, 1))
                continue
            try:
                ids = (await self.give_up_remote(service, reason="policy")).transaction_ids
            except MonitordError as e:  # a commit being written: asked again next tick
                log.warning("vps_lost_give_up_refused", service=service, error_code=e.code,
                            detail=e.detail)
                continue
            log.critical("vps_lost_given_up", service=service, transaction_ids=ids,
                         unreachable_s=round(lost_s, 1))

    def give_up_view(self, service: str) -> dict[str, Any] | None:
        """What giving the VPS up would do for `service` now, for the status: how many areas
        would go home, from when (wall time) it is allowed, and how many of them would start
        on a warm copy (the oldest's `taken_at`: what the page's dialog names as the loss);
        None when nothing is there."""
        now, wall = self.engine.clock(), self.engine.wall()
        areas, until = 0, now
        warm: list[float] = []
        for area in self.state.areas_of(service):
            txn = self.state.transactions.get(area.uuid)
            lineage = self.state.lineage(area.uuid)
            decision = give_up.decide(
                area=area, txn=txn, lineage=lineage, leases=self._remote_leases(area),
                now=now, policy=self.engine.bounds.policy,
            )
            if isinstance(decision, give_up.NotFenced):
                until = max(until, decision.until)
            if isinstance(decision, give_up.Abandon | give_up.NotFenced):
                areas += 1
                copy = self.state.warm.get(area.uuid)
                if copy is not None and warm_copy.usable_at_give_up(
                        copy, lineage, generations=give_up.remote_generations(area, txn)):
                    warm.append(copy.taken_at)
        if not areas:
            return None
        return {"areas": areas, "allowed_at": round(wall + (until - now), 3),
                "warm_copies": len(warm), "oldest_warm_copy_taken_at": min(warm, default=None)}

    def _remote_leases(self, area: Area) -> dict[int, AreaLease]:
        """The best-known lease of every generation of `area` that could run on the VPS."""
        txn = self.state.transactions.get(area.uuid)
        generations = give_up.remote_generations(area, txn)
        ledger, policy = self.engine.leases, self.engine.bounds.policy
        if ledger is None:  # no [remote] now: a renewal may still have reached the VPS
            # before this start, by a run that had one (never dated at minus infinity)
            return {g: area_leases.after_restart(area=area.uuid, generation=g,
                                                 owner_id="unknown", now=self.engine.started_at,
                                                 policy=policy)
                    for g in generations}
        return {g: ledger.lease_for(area.uuid, g) for g in generations}

"""The I/O behind each action of the phase table (orchestrator/phases.py).

`PhaseActions.perform(txn, action)` does what one action says, verifies it, and returns the
`Outcome` to feed back into `phases.step()`; a failure is raised as a `MonitordError` with
a stable code and turned into FAILED or UNREACHABLE by the engine. Every action here is
idempotent and generation-checked, because after a crash the engine simply performs the
stored record's next action again.

Who does what:
- the local side is the supervisor (`LocalSupervisor`); what may run locally is always
  `PlacementState.runs(LOCAL)`, fed to it by the runtime whenever the state changes, so
  "suppressing" the source is just the persisted phase plus a verified stop;
- the remote side is the agent, through `RemoteLink` (tunnel + manager API + SFTP);
- the commit is the atomic custom_config.json write in `PlacementState.commit()`.
Called by monitord.engine.migration_engine.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from monitord.base import logs
from monitord.base.config import Config, ServiceSection
from monitord.engine import crash_points, txn_log
from monitord.engine.area_side import AreaSide, health_timeout
from monitord.engine.copies_in_flight import CopiesInFlight
from monitord.engine.copy_timings import CopyTimings
from monitord.engine.lease_renewer import LeaseRenewer
from monitord.engine.local_side import LocalRuns, LocalSide
from monitord.engine.placement_state import PlacementState
from monitord.engine.remote_side import RemoteSide
from monitord.local.supervisor import AreaRun, LocalSupervisor
from monitord.store.state_db import Store
from orchestrator import disk_space, lineage, memory_room, phases, warm_copy
from orchestrator.errors import ErrorCode, MonitordError, error_for
from orchestrator.lineage import CopyPlan
from orchestrator.models import Area, Side, Transaction
from orchestrator.phases import Outcome
from orchestrator.pre_copy import Decision as PreCopyDecision
from orchestrator.pre_copy import ends_the_preflight

if TYPE_CHECKING:  # the SSH side loads after readiness (monitord/remote/ssh_side.py)
    from monitord.remote import copy as area_copy
    from monitord.remote.remote_link import RemoteLink

log = logs.get_logger(__name__)

POLL_S = 0.1
# Past the end of a health window, so that one look finds it over (clocks tick unevenly).
HEALTH_SLACK_S = 0.02
# Why a tunnel is not up, as the preflight reports it (anything else: SSH_UNREACHABLE).
TUNNEL_STATE_CODES = {
    "auth_failed": ErrorCode.PREFLIGHT_AUTH,
    "host_key_mismatch": ErrorCode.HOST_KEY_MISMATCH,
    "lease_conflict": ErrorCode.PREFLIGHT_TUNNEL_OWNER,
    "port_occupied": ErrorCode.PREFLIGHT_FORWARDS,
}


def _next_health_look(uptime: float | None, min_uptime_s: float, left_s: float) -> float:
    """How long to wait before looking at a starting destination again: once it runs, until
    the moment its health window is over (each look is an agent call; an area is down
    until the window closes, so a fixed poll would add up to one period to its downtime);
    before it runs, the poll period. Never past the deadline."""
    if uptime is not None and uptime < min_uptime_s:
        wait = min_uptime_s - uptime + HEALTH_SLACK_S
    else:
        wait = POLL_S
    return max(0.0, min(wait, left_s))


class PhaseActions:
    def __init__(
        self,
        *,
        config: Config,
        state: PlacementState,
        supervisor: LocalSupervisor,
        link: RemoteLink | None,
        renewer: LeaseRenewer | None,
        store: Store,
        owner_id: str,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.state = state
        self.link = link
        self.store = store
        self._clock = clock
        self._wall = wall
        # What each area's pre-copy staged while its source still ran (by transaction id):
        # in memory only — lost on a restart, which just means a full copy.
        self._staged: dict[str, area_copy.Staged] = {}
        # What each move to the VPS claims of its memory, from its preflight until it ends.
        self._memory_claims = memory_room.Claims()
        # What the copies cost, per direction, for the pre-copy rule (in memory, bounded).
        self.copy_timings = CopyTimings()
        # Each copy's bytes done, rate and ETA while it runs, for the status.
        self.copies = CopiesInFlight()
        self._local_runs = LocalRuns(config)
        self.local_side = LocalSide(config=config, supervisor=supervisor, runs=self.local_runs,
                                    link=link)
        self.remote_side = RemoteSide(config=config, link=link, renewer=renewer,
                                      owner_id=owner_id, state=state, clock=clock)
        self.sides: dict[Side, AreaSide] = {Side.LOCAL: self.local_side,
                                            Side.REMOTE: self.remote_side}

    def forget(self, txn: Transaction) -> None:
        """A transaction ended: what its pre-copy staged is of no use any more (a rollback
        after the pre-copy, or a preflight that failed when checked again), and its claim
        on the VPS's memory is over (the daemon runs there and shows in its figure, or
        never started)."""
        self._staged.pop(txn.transaction_id, None)
        self._memory_claims.release(txn.transaction_id)

    def _link(self) -> RemoteLink:
        if self.link is None:
            raise error_for(ErrorCode.PREFLIGHT_REMOTE_CONFIG, "no [remote] section configured")
        return self.link

    def _section(self, txn: Transaction) -> ServiceSection:
        return self.config.services[txn.service]

    # -- dispatch ----------------------------------------------------------------------

    async def perform(self, txn: Transaction, action: phases.Action) -> Outcome:
        match action:
            case phases.RunPreflight(again=again, source_given_up=given_up):
                return await self.preflight(txn, pre_copy=not again, source_given_up=given_up)
            case phases.SuppressSource(side=side):
                await self.sides[side].stop(area=txn.area, generation=action.generation)
                return Outcome.OK
            case phases.CopyData(source=source, destination=destination, own_copy=own_copy):
                await self.copy_forward(txn, source=source, destination=destination,
                                        own_copy=own_copy)
                return Outcome.OK
            case phases.CreateDestination(side=side, generation=generation):
                await self.create(txn, side=side, generation=generation)
                return Outcome.OK
            case phases.CheckHealth(side=side, generation=generation):
                await self.check_health(txn, side=side, generation=generation)
                return Outcome.OK
            case phases.CommitLocation(location=location, generation=generation):
                await self.state.commit(area=txn.area, location=location, generation=generation)
                await crash_points.reached("COMMIT_WRITTEN", direction=txn.direction.value,
                                           area=txn.area)
                return Outcome.OK
            case phases.CleanupSource(side=side, generation=generation):
                await self.sides[side].retire(service=txn.service, area=txn.area,
                                              generation=generation)
                return Outcome.OK
            case phases.FenceDestination(side=side, generation=generation, keep_data=keep):
                # A destination that ran keeps its data (and remote entry) until the data is
                # back at the source; the cleanup queue removes them after.
                if keep:
                    await self.sides[side].stop(area=txn.area, generation=generation)
                else:
                    await self.sides[side].remove(service=txn.service, area=txn.area,
                                                  generation=generation)
                return Outcome.FENCED
            case phases.ReturnData():
                return await self.return_data(txn, action)
            case phases.EnqueueCleanup(item=item):
                await self.store.enqueue_cleanup(
                    service=item.service, area=item.area, side=item.side.value,
                    generation=item.generation, action=item.action.value,
                    now=item.created_at, item_id=item.id,
                )
                return Outcome.OK
            case phases.WaitLeaseExpiry(until=until, ask=ask):
                if not ask:  # a given-up VPS's source: its lease alone fences it
                    await asyncio.sleep(max(0.0, until - self._clock()))
                    return Outcome.LEASE_EXPIRED
                return await self.wait_lease_or_absence(txn, until=until)
            case phases.RestartSource(side=side, generation=generation):
                await self.state.claim_data(txn.area, side)
                await self.sides[side].resume(service=txn.service, area=txn.area,
                                              generation=generation)
                return Outcome.OK
        raise AssertionError(f"no performer for {type(action).__name__}")

    # -- PREFLIGHT -----------------------------------------------------------------------

    async def preflight(
        self, txn: Transaction, *, pre_copy: bool = True, source_given_up: bool = False
    ) -> Outcome:
        """Every preflight check of the destination (monitord.engine.area_side.check_ready),
        with the source's size and footprint where the source can tell them (the VPS's
        through one `find` there); then (`pre_copy`) the pre-copy — skipped for an area
        known to be small enough that sending it whole after the stop costs less than the
        pre-copy's own round trips (orchestrator/pre_copy.py: by the copy timings measured,
        or `remote.pre_copy_min_bytes`).

        First of all the authoritative file: nothing stops while custom_config.json is
        corrupt (the commit could not be written, and the move would only roll back)."""
        if not await self.state.recheck():
            assert self.state.corrupt is not None
            raise error_for(ErrorCode.CONFIG_CORRUPT, self.state.corrupt.detail)
        link = self._link()
        if source_given_up:
            # A given-up VPS is not waited for and nothing is asked of it; nothing is copied
            # either (the area starts on the PBX's own copy): no space is needed for it.
            return Outcome.OK
        await self._wait_for_tunnel(link)
        usage = await self.sides[txn.source].usage(
            service=txn.service, area=txn.area, generation=txn.source_generation
        )
        size = None if usage is None else usage.size
        if not pre_copy and txn.transaction_id in self._staged:
            # The pre-copy's staging dir holds the area on the destination already: what
            # must still be free there is the margin (orchestrator/disk_space.py).
            usage = disk_space.Usage(bytes=0)
        memory = None
        if txn.destination is Side.REMOTE:
            memory = self._memory_claims.claim(
                txn.transaction_id,
                daemon_bytes=self.sides[txn.source].resident_bytes(area=txn.area))
        try:
            await self.sides[txn.destination].check_ready(txn, incoming=usage, memory=memory)
        except BaseException:
            self._memory_claims.release(txn.transaction_id)
            raise
        if not pre_copy:
            return Outcome.OK
        decision = self.copy_timings.decide(txn.source, size=size, remote=link.section)
        if decision.pre_copy:
            await self._pre_copy(txn, decision)
        else:
            txn_log.bound(txn).info("area_pre_copy_skipped", bytes=size, **decision.facts())
        return Outcome.OK

    async def warm_preflight(self, conn: object) -> None:
        """A connection just came up: what every preflight over it asks first, fetched now."""
        await self.remote_side.warm(conn)  # type: ignore[arg-type]

    async def _wait_for_tunnel(self, link: RemoteLink) -> None:
        """A (re)connecting tunnel gets a moment; a VPS that stays away fails the preflight."""
        if link.connected():
            return
        try:
            await link.keeper.wait_connected(timeout_s=link.section.preflight_tunnel_wait_s)
        except TimeoutError as e:
            status = link.keeper.status()
            last = status.last_error
            why = f"{last.code}: {last.detail}" if last else "not connected yet"
            code = TUNNEL_STATE_CODES.get(status.state.value, ErrorCode.SSH_UNREACHABLE)
            raise error_for(code, f"the tunnel to the VPS is {status.state.value} ({why})") from e

    async def wait_lease_or_absence(self, txn: Transaction, *, until: float) -> Outcome:
        """Wait out the destination's lease — unless the VPS comes back first and shows the
        destination gone at its generation (no process, no entry): that is FENCED.

        Verified absence is the same proof the cleanup worker completes items on; it ends a
        rollback early when the link returns, instead of after the (possibly long) bound.
        """
        destination = self.sides[txn.destination]
        while (remaining := until - self._clock()) > 0:
            if destination.reachable():
                try:
                    await destination.verify_gone(area=txn.area, generation=txn.generation)
                except MonitordError:
                    pass  # still there, or not observable now: keep waiting
                else:
                    return Outcome.FENCED
            await asyncio.sleep(min(remaining, 1.0))
        return Outcome.LEASE_EXPIRED

    # -- COPY -----------------------------------------------------------------------------

    async def copy_forward(
        self, txn: Transaction, *, source: Side, destination: Side, own_copy: bool = False
    ) -> None:
        """COPY: bring the newest data to the destination, as the lineage says it must."""
        if own_copy:
            # The VPS was given up: the PBX's own copy is the newest (the lineage says so) —
            # or the warm copy the give-up chose, taken from the copy given up.
            warm = self.state.warm.get(txn.area)
            if not warm_copy.restores(warm, self.state.lineage(txn.area)):
                warm = None
            restored = await self.local_side.restore_own_copy(
                service=txn.service, area=txn.area, generation=txn.generation, warm=warm,
            )
            txn_log.bound(txn).warning(
                "area_restored_from_own_copy", restored_from=restored,
                warm_copy_taken_at=None if warm is None else warm.taken_at)
            # (moved into place, or found unusable: either way no longer a warm copy)
            await self.state.forget_warm_copy(txn.area)
            return
        current = self.state.lineage(txn.area)
        plan = lineage.copy_plan(current, source=source, destination=destination)
        if plan is CopyPlan.SKIP:
            # An earlier attempt left the destination holding the newest data: copying the
            # source's (older) data over it would send the area back in time.
            txn_log.bound(txn).info("area_copy_skipped", reason="destination holds the newest")
            return
        if plan is CopyPlan.REFUSE:
            raise error_for(
                ErrorCode.DATA_NOT_NEWEST,
                f"{txn.area}: neither {source.value} nor {destination.value} holds the newest"
                " data; nothing is copied",
            )
        await self.copy(
            txn, source=source, source_generation=txn.source_generation,
            destination_generation=txn.generation,
        )
        await self.state.record_lineage(
            lineage.copied(current, source=source, destination=destination)
        )

    async def copy(
        self,
        txn: Transaction,
        *,
        source: Side,
        source_generation: int,
        destination_generation: int,
    ) -> None:
        """Copy the area's data dir from `source` to the other side (staging, manifest,
        SHA-256 check, atomic rename: monitord.remote.copy); after a pre-copy of the
        same dirs only what changed since moves."""
        local, remote_dir = self._copy_dirs(
            txn, source=source, source_generation=source_generation,
            destination_generation=destination_generation,
        )
        staged = self._staged.pop(txn.transaction_id, None)
        with self.copies.tracked(txn.transaction_id, stage="copy",
                                 from_side=source.value) as progress:
            report = await self.sides[source.other].receive(
                local_dir=local, remote_dir=remote_dir, service=txn.service, area=txn.area,
                staged=staged, progress=progress,
            )
        self.copy_timings.copied(source, report)
        txn_log.bound(txn).info(
            "area_copied", from_side=source.value, files=report.files, bytes=report.bytes,
            reused=report.reused, sent_bytes=report.sent_bytes,
        )

    def _copy_dirs(
        self, txn: Transaction, *, source: Side, source_generation: int,
        destination_generation: int,
    ) -> tuple[Path, str]:
        """(local data dir, remote data dir) of a copy from `source`."""
        generations = {source: source_generation, source.other: destination_generation}
        local = self.sides[Side.LOCAL].data_dir(
            service=txn.service, area=txn.area, generation=generations[Side.LOCAL]
        )
        remote_dir = self.sides[Side.REMOTE].data_dir(
            service=txn.service, area=txn.area, generation=generations[Side.REMOTE]
        )
        return Path(local), remote_dir

    async def _pre_copy(self, txn: Transaction, decision: PreCopyDecision) -> None:
        """Best effort, while the source still runs: stage its data on the destination so
        that the copy after the stop moves only what changed (monitord.remote.copy).
        Only where the lineage says the copy will happen; a failure just means a full copy
        later, so it is logged and does not fail the move — except a cause retrying cannot
        fix (a full disk, a refused path: rules.PARK_AT_ONCE_CODES), found here before the
        source stops (the copy removed its staging dir), and a lost link: both fail the
        preflight (orchestrator/pre_copy.ends_the_preflight), and after a lost link the next
        try resumes from what reached the staging dir."""
        plan = lineage.copy_plan(
            self.state.lineage(txn.area), source=txn.source, destination=txn.destination
        )
        if plan is not CopyPlan.COPY or self.link is None or not self.link.connected():
            return
        local, remote_dir = self._copy_dirs(
            txn, source=txn.source, source_generation=txn.source_generation,
            destination_generation=txn.generation,
        )
        log = txn_log.bound(txn)
        started = self._clock()
        try:
            with self.copies.tracked(txn.transaction_id, stage="pre_copy",
                                     from_side=txn.source.value) as progress:
                staged = await self.sides[txn.destination].pre_receive(
                    local_dir=local, remote_dir=remote_dir, service=txn.service,
                    area=txn.area, progress=progress,
                )
        except MonitordError as e:
            log.warning("area_pre_copy_failed", error_code=e.code, detail=e.detail)
            if ends_the_preflight(e.code):
                raise
            return
        wall_s = self._clock() - started
        self._staged[txn.transaction_id] = staged
        self.copy_timings.pre_copied(txn.source, staged, wall_s=wall_s)
        rounds: dict[str, object] = {"rounds": list(staged.rounds)} if staged.rounds else {}
        if staged.rounds_error is not None:
            rounds["rounds_error"] = staged.rounds_error
        log.info("area_pre_copied", files=len(staged.files), bytes=staged.sent_bytes,
                 seconds=round(wall_s, 3), send_seconds=round(staged.send_s, 3),
                 resumed_bytes=staged.resumed_bytes, **rounds, **decision.facts())

    # -- ROLLBACK: the destination's newer data back to the source --------------------------

    async def return_data(self, txn: Transaction, action: phases.ReturnData) -> Outcome:
        """Stop the destination again (copy only from a stopped process), copy its data back
        to the source, record the lineage. When that data cannot be reached, the configured
        `rollback_data` decides: wait for it (raise ROLLBACK_DATA_UNREACHABLE) or give it
        up (DATA_DISCARDED, recorded as an event)."""
        log = txn_log.bound(txn)
        try:
            await self.sides[action.source].stop(
                area=txn.area, generation=action.source_generation
            )
            await self.copy(
                txn, source=action.source, source_generation=action.source_generation,
                destination_generation=action.destination_generation,
            )
        except MonitordError as e:
            if self.config.monitord.rollback_data == "discard":
                await self.discard_data(txn, keep=action.destination, reason="policy")
                return Outcome.DATA_DISCARDED
            log.warning("rollback_data_unreachable", error_code=e.code, detail=e.detail)
            raise error_for(
                ErrorCode.ROLLBACK_DATA_UNREACHABLE,
                f"{txn.area} stays stopped: the data it wrote on {action.source.value} cannot"
                f" be copied back ({e.code}: {e.detail})",
            ) from e
        await self.state.record_lineage(
            lineage.copied(
                self.state.lineage(txn.area), source=action.source,
                destination=action.destination,
            )
        )
        log.info("rollback_data_returned", from_side=action.source.value)
        return Outcome.DATA_RETURNED

    async def abandon_remote_data(
        self, area: Area, *, generations: frozenset[int], reason: str
    ) -> dict[str, object]:
        """Give the VPS's copy of `area` up (orchestrator/give_up.py): the PBX holds the
        newest data from now on — recorded first, so that no grant names the area again —
        and a `remote_data_abandoned` event says what is lost and what the PBX has."""
        # (a warm copy is chosen only if its files still hash to what was received: the
        # event then says truly what the area starts on)
        copy = self.state.warm.get(area.uuid)
        whole = copy is not None and await self.local_side.warm_copy_whole(copy)
        current = await self.state.abandon_remote(area.uuid, generations=generations,
                                                  warm_whole=whole)
        own = await self.local_side.own_copy(service=area.service, area=area.uuid,
                                             generation=area.generation)
        fields = {"service": area.service, "area": area.uuid, "kept": Side.LOCAL.value,
                  "reason": reason, "epoch": current.epoch + 1,
                  "remote_generations": sorted(generations),
                  "committed": area.location.value, "generation": area.generation,
                  "local_copy": own["path"], "local_copy_modified_at": own["modified_at"],
                  **self._kept_copy(area.uuid, own["modified_at"])}
        log.warning("remote_data_abandoned", **fields)
        await self.store.record_event("remote_data_abandoned", fields)
        return {key: fields[key] for key in ("kept_copy", "kept_copy_age_s",
                                             "warm_copy_taken_at")}

    def _kept_copy(self, area: str, own_modified_at: object) -> dict[str, object]:
        """What a give-up starts the area on, and how much of its life that loses: the warm
        copy it chose (`kept_copy` "warm", its age since the VPS's snapshot), else the
        PBX's own copy ("pbx", its age since it was last written; None: no copy at all)."""
        warm = self.state.warm.get(area)
        now = self._wall()
        if warm_copy.restores(warm, self.state.lineage(area)):
            assert warm is not None
            return {"kept_copy": "warm", "warm_copy_taken_at": warm.taken_at,
                    "kept_copy_age_s": round(warm_copy.age_s(warm, now=now), 3)}
        age = (round(max(0.0, now - own_modified_at), 3)
               if isinstance(own_modified_at, (int, float)) else None)
        return {"kept_copy": "pbx", "warm_copy_taken_at": None, "kept_copy_age_s": age}

    async def discard_data(self, txn: Transaction, *, keep: Side, reason: str) -> None:
        """Give up the other side's newer data: `keep` holds the newest from now on."""
        current = self.state.lineage(txn.area)
        await self.state.record_lineage(lineage.discarded(current, keep=keep))
        fields = {**txn_log.identity(txn), "kept": keep.value, "reason": reason,
                  "epoch": current.epoch + 1}
        txn_log.bound(txn).warning("remote_data_discarded", kept=keep.value, reason=reason)
        await self.store.record_event("remote_data_discarded", fields)

    # -- CREATE_DESTINATION ---------------------------------------------------------------

    async def create(self, txn: Transaction, *, side: Side, generation: int) -> None:
        # The destination takes the data over BEFORE anything starts there: from now on a
        # rollback must bring its data back before the source may run again.
        await self.state.claim_data(txn.area, side)
        await self.sides[side].start(service=txn.service, area=txn.area, generation=generation)

    # -- HEALTHCHECK_DESTINATION ----------------------------------------------------------

    async def check_health(self, txn: Transaction, *, side: Side, generation: int) -> None:
        """The destination runs at `generation` for min_uptime_s (and its probe passes)."""
        section = self._section(txn)
        target = self.sides[side]
        deadline = self._clock() + section.min_uptime_s + section.healthcheck_timeout_s
        if await target.healthy_by(txn, generation=generation,
                                   min_uptime_s=section.min_uptime_s, deadline=deadline):
            return
        while True:
            uptime = await target.uptime(area=txn.area, generation=generation)
            if uptime is not None and uptime >= section.min_uptime_s:
                if await target.probe(txn):
                    return
            now = self._clock()
            if now >= deadline:
                raise health_timeout(txn, section, side)
            await asyncio.sleep(_next_health_look(uptime, section.min_uptime_s, deadline - now))

    # -- helpers --------------------------------------------------------------------------

    def local_runs(self) -> dict[str, AreaRun]:
        """What may run locally now (the supervisor's wanted set)."""
        return self._local_runs(self.state)

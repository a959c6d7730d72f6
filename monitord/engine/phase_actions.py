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
import errno
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from monitord.base import logs
from monitord.base.config import Config, ServiceSection
from monitord.engine import crash_points, txn_log
from monitord.engine.lease_renewer import LeaseRenewer
from monitord.engine.placement_state import PlacementState
from monitord.local.supervisor import AreaRun, LocalSupervisor, area_run, expand
from monitord.remote import artifact
from monitord.remote import copy as area_copy
from monitord.remote import preflight as preflight_checks
from monitord.remote.copy import AreaCopy
from monitord.remote.remote_link import RemoteLink
from monitord.remote.shared_facts import SharedFacts
from monitord.store.state_db import Store
from orchestrator import lineage, phases
from orchestrator.errors import ErrorCode, MonitordError, error_for
from orchestrator.lineage import CopyPlan
from orchestrator.models import Side, Transaction
from orchestrator.phases import Outcome

log = logs.get_logger(__name__)

POLL_S = 0.1
# The longest one health question to the agent is held open (it answers when the window
# closes); several are asked in turn up to the health check's deadline.
HEALTH_WAIT_S = 5.0
# Past the end of a health window, so that one look finds it over (clocks tick unevenly).
HEALTH_SLACK_S = 0.02
# Why a tunnel is not up, as the preflight reports it (anything else: SSH_UNREACHABLE).
TUNNEL_STATE_CODES = {
    "auth_failed": ErrorCode.PREFLIGHT_AUTH,
    "host_key_mismatch": ErrorCode.HOST_KEY_MISMATCH,
    "lease_conflict": ErrorCode.PREFLIGHT_TUNNEL_OWNER,
    "port_occupied": ErrorCode.PREFLIGHT_FORWARDS,
}
STOP_GRACE_S = 10.0


def remote_paths(
    config: Config, *, service: str, area: str, generation: int
) -> tuple[str, tuple[str, ...]]:
    """(data dir, argv) of an area on the VPS, templates expanded."""
    assert config.remote is not None
    section = config.services[service]
    bin_dir = config.remote.remote_bin_dir
    data_dir = expand(
        section.remote_data_dir, area=area, data_dir="", generation=generation, side="remote",
        remote_bin_dir=bin_dir,
    )
    template = section.remote_command or section.command
    command = tuple(
        expand(part, area=area, data_dir=data_dir, generation=generation, side="remote",
               remote_bin_dir=bin_dir)
        for part in template
    )
    return data_dir, command


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


def _health_timeout(txn: Transaction, section: ServiceSection, side: Side) -> MonitordError:
    return error_for(
        ErrorCode.HEALTHCHECK_TIMEOUT,
        f"{txn.area} did not stay up {section.min_uptime_s:g} s on {side.value}"
        f" within {section.min_uptime_s + section.healthcheck_timeout_s:g} s",
    )


def local_data_dir(section: ServiceSection, *, area: str, generation: int) -> Path:
    return Path(expand(section.local_data_dir, area=area, data_dir="", generation=generation,
                       side="local"))


class PhaseActions:
    def __init__(
        self,
        *,
        config: Config,
        state: PlacementState,
        supervisor: LocalSupervisor,
        remote: RemoteLink | None,
        renewer: LeaseRenewer | None,
        store: Store,
        owner_id: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.state = state
        self.supervisor = supervisor
        self.remote = remote
        self.renewer = renewer
        self.store = store
        self.owner_id = owner_id
        self._clock = clock
        self.archive_dir = config.monitord.work_dir / "archive"
        # What each area's pre-copy staged while its source still ran (by transaction id):
        # in memory only — lost on a restart, which just means a full copy.
        self._staged: dict[str, area_copy.Staged] = {}
        # One probe and one self-check of the VPS for the areas whose preflights run together.
        self._preflight_facts = SharedFacts()
        self._local_runs = LocalRuns(config)

    def forget(self, txn: Transaction) -> None:
        """A transaction ended: what its pre-copy staged is of no use any more (a rollback
        after the pre-copy, or a preflight that failed when checked again)."""
        self._staged.pop(txn.transaction_id, None)

    def _link(self) -> RemoteLink:
        if self.remote is None:
            raise error_for(ErrorCode.PREFLIGHT_REMOTE_CONFIG, "no [remote] section configured")
        return self.remote

    def _section(self, txn: Transaction) -> ServiceSection:
        return self.config.services[txn.service]

    # -- dispatch ----------------------------------------------------------------------

    async def perform(self, txn: Transaction, action: phases.Action) -> Outcome:
        match action:
            case phases.RunPreflight(again=again):
                return await self.preflight(txn, pre_copy=not again)
            case phases.SuppressSource(side=side, generation=generation):
                await self.stop_side(txn, side=side, generation=generation, keep_entry=True)
                return Outcome.OK
            case phases.CopyData(source=source, destination=destination):
                await self.copy_forward(txn, source=source, destination=destination)
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
                await self.cleanup_source(txn, side=side, generation=generation)
                return Outcome.OK
            case phases.FenceDestination(side=side, generation=generation, keep_data=keep):
                # A destination that ran keeps its data (and remote entry) until the data is
                # back at the source; the cleanup queue removes them after.
                await self.stop_side(txn, side=side, generation=generation, keep_entry=keep)
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
            case phases.WaitLeaseExpiry(until=until):
                return await self.wait_lease_or_absence(txn, until=until)
            case phases.RestartSource(side=side, generation=generation):
                await self.restart_source(txn, side=side, generation=generation)
                return Outcome.OK
        raise AssertionError(f"no performer for {type(action).__name__}")

    # -- PREFLIGHT -----------------------------------------------------------------------

    async def preflight(self, txn: Transaction, *, pre_copy: bool = True) -> Outcome:
        """Every preflight check for a move to the VPS; reachability + local space back;
        then (`pre_copy`) the pre-copy — to the VPS only for an area of at least
        `remote.pre_copy_min_bytes` (smaller ones cost less sent whole after the stop).

        First of all the authoritative file: nothing stops while custom_config.json is
        corrupt (the commit could not be written, and the move would only roll back)."""
        if not await self.state.recheck():
            assert self.state.corrupt is not None
            raise error_for(ErrorCode.CONFIG_CORRUPT, self.state.corrupt.detail)
        link = self._link()
        await self._wait_for_tunnel(link)
        if txn.destination is Side.LOCAL:
            target = local_data_dir(self._section(txn), area=txn.area, generation=txn.generation)
            target.parent.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(target.parent).free
            if free < 64 * 1024 * 1024:
                raise error_for(ErrorCode.PREFLIGHT_DISK_SPACE, f"only {free} bytes free locally")
            if pre_copy:
                await self._pre_copy(txn)
            return Outcome.OK
        data = local_data_dir(self._section(txn), area=txn.area, generation=txn.source_generation)
        size = await asyncio.to_thread(_tree_size, data)
        ours, owner_id, owner_label = link.tunnel_owner()
        async with link.session() as conn:
            report = await self._run_preflight(link, conn, txn, size, ours, owner_id, owner_label)
        failure = report.first_failure()
        if failure is None and not report.ok and link.connected():
            # Only "startable" failed: the agent is not running but can be; start it.
            await link.ensure_agent()
        if failure is None:
            if pre_copy and size >= link.remote.pre_copy_min_bytes:
                await self._pre_copy(txn)
            elif pre_copy:
                txn_log.bound(txn).info("area_pre_copy_skipped", bytes=size,
                                        pre_copy_min_bytes=link.remote.pre_copy_min_bytes)
            return Outcome.OK
        raise error_for(failure.code, f"{failure.detail} — {failure.hint}".rstrip(" —"))

    async def warm_preflight(self, conn: object) -> None:
        """A connection just came up: fetch what every preflight over it will ask first
        (monitord.remote.preflight.warm), so that the first move need not wait for it."""
        link = self._link()
        await preflight_checks.warm(
            conn,  # type: ignore[arg-type]
            config=self.config, artifacts=link.artifacts, shared=self._preflight_facts,
        )

    async def _wait_for_tunnel(self, link: RemoteLink) -> None:
        """A (re)connecting tunnel gets a moment; a VPS that stays away fails the preflight."""
        if link.connected():
            return
        try:
            await link.keeper.wait_connected(timeout_s=link.remote.preflight_tunnel_wait_s)
        except TimeoutError as e:
            status = link.keeper.status()
            last = status.last_error
            why = f"{last.code}: {last.detail}" if last else "not connected yet"
            code = TUNNEL_STATE_CODES.get(status.state.value, ErrorCode.SSH_UNREACHABLE)
            raise error_for(code, f"the tunnel to the VPS is {status.state.value} ({why})") from e

    async def _run_preflight(
        self,
        link: RemoteLink,
        conn: object,
        txn: Transaction,
        size: int,
        ours: bool,
        owner_id: str,
        owner_label: str,
    ) -> preflight_checks.PreflightReport:
        last = link.keeper.status().last_error
        return await preflight_checks.run_preflight(
            conn,  # type: ignore[arg-type]
            config=self.config,
            service=txn.service,
            artifacts=link.artifacts,
            area_data_bytes=size,
            tunnel_owner=preflight_checks.TunnelOwnerView(
                ours=ours, owner_id=owner_id, owner_label=owner_label
            ),
            forwards_ready=link.forwards_ready(),
            auth_error=f"{last.code}: {last.detail}" if last else "",
            agent=link.agent,
            shared=self._preflight_facts,
        )

    # -- stopping (SUPPRESS_SOURCE, FenceDestination) -----------------------------------

    async def stop_side(
        self, txn: Transaction, *, side: Side, generation: int, keep_entry: bool
    ) -> None:
        """Stop the area on `side` at `generation` and verify it gone.

        Locally the persisted phase already removed the area from what may run; this stops
        the process and waits for proof. Remotely the agent stops (keep_entry) or deletes
        the entry, at that generation only.
        """
        if side is Side.LOCAL:
            self.supervisor.set_desired(self.local_runs())
            if not await self.supervisor.stop_area(txn.area, grace_s=STOP_GRACE_S):
                raise error_for(ErrorCode.DAEMON_STOP_FAILED, f"{txn.area} would not stop")
            if not keep_entry:
                section = self._section(txn)
                target = local_data_dir(section, area=txn.area, generation=generation)
                await asyncio.to_thread(_remove_staging, target)
            return
        agent = self._link().agent
        if keep_entry:
            await agent.stop(area=txn.area, generation=generation)
        else:
            await agent.delete(area=txn.area, generation=generation)
        await self._verify_remote_gone(txn.area, generation=generation, entry_gone=not keep_entry)

    async def _verify_remote_gone(self, area: str, *, generation: int, entry_gone: bool) -> None:
        inventory = await self._link().agent.inventory()
        running = [p for p in inventory.processes if p.area == area and p.generation <= generation]
        entries = [e for e in inventory.entries if e.area == area and e.generation == generation]
        if running or (entry_gone and entries):
            raise error_for(
                ErrorCode.DAEMON_STOP_FAILED,
                f"{area} still present on the VPS at generation {generation}",
            )

    async def wait_lease_or_absence(self, txn: Transaction, *, until: float) -> Outcome:
        """Wait out the destination's lease — unless the VPS comes back first and shows the
        destination gone at its generation (no process, no entry): that is FENCED.

        Verified absence is the same proof the cleanup worker completes items on; it ends a
        rollback early when the link returns, instead of after the (possibly long) bound.
        """
        while (remaining := until - self._clock()) > 0:
            if self.remote is not None and self.remote.connected():
                try:
                    await self._verify_remote_gone(
                        txn.area, generation=txn.generation, entry_gone=True
                    )
                except MonitordError:
                    pass  # still there, or not observable now: keep waiting
                else:
                    return Outcome.FENCED
            await asyncio.sleep(min(remaining, 1.0))
        return Outcome.LEASE_EXPIRED

    # -- COPY -----------------------------------------------------------------------------

    async def copy_forward(self, txn: Transaction, *, source: Side, destination: Side) -> None:
        """COPY: bring the newest data to the destination, as the lineage says it must."""
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
        SHA-256 check, atomic rename: monitord.remote.area_copy); after a pre-copy of the
        same dirs only what changed since moves."""
        link = self._link()
        local, remote_dir = self._copy_dirs(
            txn, source=source, source_generation=source_generation,
            destination_generation=destination_generation,
        )
        staged = self._staged.pop(txn.transaction_id, None)
        agent = AreaCopy(link.agent, txn.area, remote_dir)
        async with link.session() as conn:
            if source is Side.LOCAL:
                report = await area_copy.upload(
                    conn, local_dir=local, remote_dir=remote_dir, staged=staged,
                    vps_command=self._vps_command(), agent=agent,
                )
            else:
                report = await area_copy.download(
                    conn, remote_dir=remote_dir, local_dir=local, staged=staged,
                    vps_command=self._vps_command(), agent=agent,
                )
        txn_log.bound(txn).info(
            "area_copied", from_side=source.value, files=report.files, bytes=report.bytes,
            reused=report.reused,
        )

    def _vps_command(self) -> tuple[str, ...]:
        """The argv that runs monitord.pyz on the VPS (its tree-digest verb)."""
        assert self.config.remote is not None
        return artifact.remote_command(self.config.remote)

    def _copy_dirs(
        self, txn: Transaction, *, source: Side, source_generation: int,
        destination_generation: int,
    ) -> tuple[Path, str]:
        """(local data dir, remote data dir) of a copy from `source`."""
        section = self._section(txn)
        local_gen, remote_gen = (
            (source_generation, destination_generation)
            if source is Side.LOCAL
            else (destination_generation, source_generation)
        )
        local = local_data_dir(section, area=txn.area, generation=local_gen)
        remote_dir, _ = remote_paths(
            self.config, service=txn.service, area=txn.area, generation=remote_gen
        )
        return local, remote_dir

    async def _pre_copy(self, txn: Transaction) -> None:
        """Best effort, while the source still runs: stage its data on the destination so
        that the copy after the stop moves only what changed (monitord.remote.area_copy).
        Only where the lineage says the copy will happen; any failure just means a full
        copy later, so it is logged and never fails the move."""
        plan = lineage.copy_plan(
            self.state.lineage(txn.area), source=txn.source, destination=txn.destination
        )
        if plan is not CopyPlan.COPY or self.remote is None or not self.remote.connected():
            return
        local, remote_dir = self._copy_dirs(
            txn, source=txn.source, source_generation=txn.source_generation,
            destination_generation=txn.generation,
        )
        log = txn_log.bound(txn)
        started = self._clock()
        agent = AreaCopy(self.remote.agent, txn.area, remote_dir)
        try:
            async with self.remote.session() as conn:
                if txn.source is Side.LOCAL:
                    staged = await area_copy.pre_upload(
                        conn, local_dir=local, remote_dir=remote_dir,
                        vps_command=self._vps_command(), agent=agent,
                    )
                else:
                    staged = await area_copy.pre_download(
                        conn, remote_dir=remote_dir, local_dir=local,
                        vps_command=self._vps_command(), agent=agent,
                    )
        except MonitordError as e:
            log.warning("area_pre_copy_failed", error_code=e.code, detail=e.detail)
            return
        self._staged[txn.transaction_id] = staged
        log.info("area_pre_copied", files=len(staged.files),
                 seconds=round(self._clock() - started, 3))

    # -- ROLLBACK: the destination's newer data back to the source --------------------------

    async def return_data(self, txn: Transaction, action: phases.ReturnData) -> Outcome:
        """Stop the destination again (copy only from a stopped process), copy its data back
        to the source, record the lineage. When that data cannot be reached, the configured
        `rollback_data` decides: wait for it (raise ROLLBACK_DATA_UNREACHABLE) or give it
        up (DATA_DISCARDED, recorded as an event)."""
        log = txn_log.bound(txn)
        try:
            await self.stop_side(
                txn, side=action.source, generation=action.source_generation, keep_entry=True
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

    async def discard_data(self, txn: Transaction, *, keep: Side, reason: str) -> None:
        """Give up the other side's newer data: `keep` holds the newest from now on."""
        current = self.state.lineage(txn.area)
        await self.state.record_lineage(lineage.discarded(current, keep=keep))
        fields = {**txn_log.identity(txn), "kept": keep.value, "reason": reason,
                  "epoch": current.epoch + 1}
        txn_log.bound(txn).warning("remote_data_discarded", kept=keep.value, reason=reason)
        await self.store.record_event("remote_data_discarded", fields)

    # -- CREATE_DESTINATION / RestartSource -----------------------------------------------

    async def create(self, txn: Transaction, *, side: Side, generation: int) -> None:
        # The destination takes the data over BEFORE anything starts there: from now on a
        # rollback must bring its data back before the source may run again.
        await self.state.claim_data(txn.area, side)
        if side is Side.LOCAL:
            run = area_run(service=txn.service, section=self._section(txn), area=txn.area,
                           generation=generation)
            self.supervisor.set_desired(self.local_runs())
            view = await self.supervisor.start_area(run)
            if view.generation != generation:
                raise error_for(ErrorCode.DAEMON_START_FAILED, f"{txn.area} did not start")
            return
        await self.restart_remote(service=txn.service, area=txn.area, generation=generation)

    async def restart_remote(self, *, service: str, area: str, generation: int) -> None:
        """Create (or confirm) the agent's entry at `generation` with a fresh lease; start it."""
        link = self._link()
        data_dir, command = remote_paths(self.config, service=service, area=area,
                                         generation=generation)
        section = self.config.services[service]
        epoch = self.renewer.epoch() if self.renewer is not None else 0
        try:
            await link.agent.create(
                area=area, service=service, generation=generation, owner_id=self.owner_id,
                lease_ttl_s=link.remote.area_lease_ttl_s, command=command, data_dir=data_dir,
                env=section.env, user=section.user, group=section.group,
                log_max_bytes=self.config.monitord.area_log_max_bytes,
                log_keep=self.config.monitord.area_log_keep,
            )
        except MonitordError as e:
            if self.renewer is not None:
                self.renewer.grant_failed(area, generation, epoch=epoch, error=e)
            raise
        if self.renewer is not None:
            self.renewer.acknowledge(area, generation)

    async def restart_source(self, txn: Transaction, *, side: Side, generation: int) -> None:
        """Let the source run again: locally the supervisor feed does it; remotely, a grant."""
        await self.state.claim_data(txn.area, side)
        if side is Side.LOCAL:
            self.supervisor.set_desired(self.local_runs())
            return
        await self.restart_remote(service=txn.service, area=txn.area, generation=generation)

    # -- HEALTHCHECK_DESTINATION ----------------------------------------------------------

    async def check_health(self, txn: Transaction, *, side: Side, generation: int) -> None:
        """The destination runs at `generation` for min_uptime_s (and its probe passes)."""
        section = self._section(txn)
        deadline = self._clock() + section.min_uptime_s + section.healthcheck_timeout_s
        if side is Side.REMOTE and await self._remote_healthy(txn, generation, deadline):
            return
        while True:
            uptime = await self._uptime(txn.area, side=side, generation=generation)
            if uptime is not None and uptime >= section.min_uptime_s:
                if await self._probe(section, txn, side=side):
                    return
            now = self._clock()
            if now >= deadline:
                raise _health_timeout(txn, section, side)
            await asyncio.sleep(_next_health_look(uptime, section.min_uptime_s, deadline - now))

    async def _remote_healthy(self, txn: Transaction, generation: int, deadline: float) -> bool:
        """Ask the agent until `deadline` whether the destination has run min_uptime_s: it
        answers the moment the window closes (one question held open instead of a poll of
        its whole inventory). False only for an agent without that question (an older
        one): the caller then looks at the inventory; a timeout raises as there."""
        section = self._section(txn)
        agent = self._link().agent
        while True:
            asked = self._clock()
            wait_s = max(0.0, min(deadline - asked, HEALTH_WAIT_S))
            try:
                answer = await agent.health(
                    area=txn.area, generation=generation, min_uptime_s=section.min_uptime_s,
                    wait_s=wait_s,
                )
            except MonitordError as e:
                if e.code == ErrorCode.UNKNOWN_AREA:  # no such route on this agent
                    return False
                raise
            if answer.healthy:
                return True
            now = self._clock()
            if now >= deadline:
                raise _health_timeout(txn, section, Side.REMOTE)
            if now - asked < wait_s:  # an early "no" (it should wait): never a busy loop
                await asyncio.sleep(min(POLL_S, deadline - now))

    async def _uptime(self, area: str, *, side: Side, generation: int) -> float | None:
        if side is Side.LOCAL:
            for view in self.supervisor.inventory():
                if view.area == area and view.generation == generation and view.pid:
                    return view.uptime_s
            return None
        raw = await self._link().agent.inventory_raw()
        for proc in raw.get("processes", []):
            if proc.get("area") == area and proc.get("generation") == generation:
                if proc.get("alive", True) and proc.get("pid"):
                    return float(proc.get("uptime_s") or 0.0)
        return None

    async def _probe(self, section: ServiceSection, txn: Transaction, *, side: Side) -> bool:
        if not section.probe or side is not Side.LOCAL:
            return True
        argv = [part.format(area=txn.area) for part in section.probe]
        proc = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
        )
        try:
            async with asyncio.timeout(section.healthcheck_timeout_s):
                return await proc.wait() == 0
        except TimeoutError:
            proc.kill()
            await proc.wait()
            return False

    # -- CLEANUP_SOURCE -------------------------------------------------------------------

    async def cleanup_source(self, txn: Transaction, *, side: Side, generation: int) -> None:
        """Remove the migrated-away source at its generation (local data is archived)."""
        if side is Side.LOCAL:
            if not await self.supervisor.stop_area(txn.area, grace_s=STOP_GRACE_S):
                raise error_for(ErrorCode.DAEMON_STOP_FAILED, f"{txn.area} would not stop")
            section = self._section(txn)
            source_dir = local_data_dir(section, area=txn.area, generation=generation)
            target = self.archive_dir / txn.service / f"{txn.area}-g{generation}"
            await asyncio.to_thread(_archive, source_dir, target)
            return
        await self._link().agent.delete(area=txn.area, generation=generation)
        await self._verify_remote_gone(txn.area, generation=generation, entry_gone=True)

    # -- helpers --------------------------------------------------------------------------

    def local_runs(self) -> dict[str, AreaRun]:
        """What may run locally now (the supervisor's wanted set)."""
        return self._local_runs(self.state)


class LocalRuns:
    """The supervisor's wanted set: every area that may run locally, as AreaRuns. Asked on
    every change of the placement state (each phase of each area), so an AreaRun is built
    once per (area, service, generation) and reused while that stays what may run."""

    def __init__(self, config: Config) -> None:
        self._config = config
        self._built: dict[tuple[str, str, int], AreaRun] = {}

    def __call__(self, state: PlacementState) -> dict[str, AreaRun]:
        runs: dict[str, AreaRun] = {}
        built: dict[tuple[str, str, int], AreaRun] = {}
        for area, generation in state.runs(Side.LOCAL).items():
            committed = state.committed.get(area)
            txn = state.transactions.get(area)
            service = txn.service if txn else committed.service if committed else None
            if service is None or service not in self._config.services:
                continue
            key = (area, service, generation)
            run = self._built.get(key)
            if run is None:
                run = area_run(service=service, section=self._config.services[service],
                               area=area, generation=generation)
            runs[area] = built[key] = run
        self._built = built
        return runs


def _tree_size(root: Path) -> int:
    if not root.is_dir():
        return 0
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def _remove_staging(target: Path) -> None:
    shutil.rmtree(target.with_name(target.name + area_copy.STAGING_SUFFIX), ignore_errors=True)


def _archive(source: Path, target: Path) -> None:
    if not source.exists():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(target, ignore_errors=True)
    try:
        source.rename(target)
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
        _move_across_filesystems(source, target)


def _move_across_filesystems(source: Path, target: Path) -> None:
    """The data dir and work_dir are on different file systems (EXDEV): copy to a temporary
    name next to the target, fsync every file, rename it into place, then remove the source
    — a crash at any point leaves the source whole."""
    staging = target.with_name(target.name + ".moving")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(source, staging, symlinks=True)
    for path in staging.rglob("*"):
        if path.is_file() and not path.is_symlink():
            with path.open("rb") as f:
                os.fsync(f.fileno())
    staging.rename(target)
    shutil.rmtree(source)

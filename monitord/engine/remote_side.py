"""The VPS as a side (monitord.engine.area_side): the agent runs the area under a grant
and an area lease, its data is a directory on the VPS, and a copy to it goes up the SSH
connection (monitord.remote.copy).

Every call goes through the one `RemoteLink`; without a `[remote]` section each raises
PREFLIGHT_REMOTE_CONFIG. A start is a grant: the lease renewer learns of it (acknowledged,
or failed with what is known), so the lease bound of every grant is on record.
"""

from __future__ import annotations

import asyncio
import posixpath
import time
from collections.abc import Callable, Collection
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from monitord.base import area_paths, logs
from monitord.base.config import Config
from monitord.engine.area_side import copy_over, health_timeout
from monitord.engine.lease_renewer import LeaseRenewer
from monitord.engine.placement_state import PlacementState
from monitord.remote import artifact
from monitord.remote.shared_facts import SharedFacts
from orchestrator import area_health, disk_space, memory_room, names
from orchestrator import lineage as lineages
from orchestrator.cleanup_policy import SideObservation
from orchestrator.errors import ErrorCode, MonitordError, error_for
from orchestrator.lineage import Lineage
from orchestrator.models import Side, Transaction

if TYPE_CHECKING:  # the SSH side loads after readiness (monitord/remote/ssh_side.py)
    import asyncssh

    from monitord.remote import copy as area_copy
    from monitord.remote.remote_link import RemoteLink

log = logs.get_logger(__name__)

POLL_S = 0.1
USAGE_TIMEOUT_S = 30.0
# The longest one health question to the agent is held open (it answers when the window
# closes); several are asked in turn up to the health check's deadline.
HEALTH_WAIT_S = 5.0
WARM_TIMEOUT_S = 10.0


class RemoteSide:
    side = Side.REMOTE

    def __init__(
        self,
        *,
        config: Config,
        link: RemoteLink | None,
        renewer: LeaseRenewer | None,
        owner_id: str,
        state: PlacementState | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._link_or_none = link
        self.renewer = renewer
        self.owner_id = owner_id
        self._state = state  # which VPS copies were given up (set aside, never deleted)
        self._clock = clock
        # One probe and one self-check of the VPS for the areas whose preflights run together.
        self._preflight_facts = SharedFacts()

    def _link(self) -> RemoteLink:
        if self._link_or_none is None:
            raise error_for(ErrorCode.PREFLIGHT_REMOTE_CONFIG, "no [remote] section configured")
        return self._link_or_none

    def reachable(self) -> bool:
        return self._link_or_none is not None and self._link_or_none.connected()

    def data_dir(self, *, service: str, area: str, generation: int) -> str:
        data_dir, _ = area_paths.remote_paths(self.config, service=service, area=area,
                                              generation=generation)
        return data_dir

    async def usage(
        self, *, service: str, area: str, generation: int
    ) -> disk_space.Usage | None:
        """What the area's data dir on the VPS takes (a move home's preflight judges the
        PBX's free space by it); None when the VPS cannot tell now."""
        if not self.reachable():
            return None
        data_dir = self.data_dir(service=service, area=area, generation=generation)
        from monitord.remote import remote_usage

        try:
            async with self._link().session() as conn:
                return await remote_usage.area_usage(conn, data_dir, timeout_s=USAGE_TIMEOUT_S)
        except MonitordError as e:
            log.warning("remote_data_usage_failed", area=area, error_code=e.code,
                        detail=e.detail)
            return None

    # -- preflight -------------------------------------------------------------------------

    def resident_bytes(self, *, area: str) -> int | None:
        return None  # a move home is not judged by memory (module doc of memory_room)

    async def check_ready(
        self, txn: Transaction, *, incoming: disk_space.Usage | None = None,
        memory: memory_room.Need | None = None,
    ) -> None:
        """Every preflight check of a move to the VPS (monitord.remote.preflight), the free
        space measured where the area's data dir and staging dir will be (their parent), the
        VPS's memory against `memory`; an agent that is not running but can be is started."""
        from monitord.remote import preflight as preflight_checks

        link = self._link()
        data_root = posixpath.dirname(
            self.data_dir(service=txn.service, area=txn.area, generation=txn.generation)
            .rstrip("/"))
        ours, owner_id, owner_label = link.tunnel_owner()
        last = link.keeper.status().last_error
        async with link.session() as conn:
            report = await preflight_checks.run_preflight(
                conn,
                config=self.config,
                service=txn.service,
                artifacts=link.artifacts,
                need=preflight_checks.AreaNeed(
                    usage=incoming or disk_space.Usage(bytes=0), data_root=data_root,
                    memory=memory,
                ),
                tunnel=preflight_checks.TunnelView(
                    owner=preflight_checks.TunnelOwnerView(
                        ours=ours, owner_id=owner_id, owner_label=owner_label
                    ),
                    forwards_ready=link.forwards_ready(),
                    auth_error=f"{last.code}: {last.detail}" if last else "",
                ),
                agent=link.agent,
                shared=self._preflight_facts,
            )
        failure = report.first_failure()
        if failure is None and not report.ok and link.connected():
            # Only "startable" failed: the agent is not running but can be; start it.
            await link.ensure_agent()
        if failure is not None:
            raise error_for(failure.code, f"{failure.detail} — {failure.hint}".rstrip(" —"),
                            facts=failure.facts)

    async def warm(self, conn: asyncssh.SSHClientConnection) -> None:
        """A connection just came up: fetch what every preflight over it will ask first
        (monitord.remote.preflight.warm), and what a copy asks before its first byte (the
        agent's routes, an SFTP session), so that no move waits for them, least of all
        while its area is down."""
        from monitord.remote import preflight as preflight_checks

        link = self._link()
        link.agent.forget_routes()  # the agent behind a new connection may be another
        await asyncio.gather(
            preflight_checks.warm(conn, config=self.config, artifacts=link.artifacts,
                                  shared=self._preflight_facts),
            self._warm_copies(conn, link),
        )

    async def _warm_copies(self, conn: asyncssh.SSHClientConnection, link: RemoteLink) -> None:
        """Best effort: a copy asks again for what could not be had now."""
        from monitord.remote.copy import sftp_session

        try:
            async with asyncio.timeout(WARM_TIMEOUT_S):
                await asyncio.gather(link.agent.routes(), sftp_session.warm(conn))
        except Exception as e:  # whatever it was, the copy meets it again and names it
            log.info("copy_warm_failed", error=f"{type(e).__name__}: {e}")

    # -- stopping and removing -------------------------------------------------------------

    async def stop(self, *, area: str, generation: int) -> None:
        result = await self._link().agent.stop(area=area, generation=generation)
        if result != "stopped":
            # "stopped" is the agent's own verified stop: the area's guard and daemon are
            # gone, and with them its one process handle, all an inventory would show.
            # Anything else (no entry at that generation) is looked at.
            await self.verify_gone(area=area, generation=generation, entry_gone=False)

    async def remove(self, *, service: str, area: str, generation: int) -> None:
        await self._delete(area=area, generation=generation)
        await self.verify_gone(area=area, generation=generation)

    async def _delete(self, *, area: str, generation: int) -> None:
        """The agent removes the area at `generation`; a copy an operator gave up is set
        aside on the VPS instead of deleted (kept for forensics, never started)."""
        agent = self._link().agent
        if self._state is None or not self._state.is_abandoned(area, generation):
            await agent.delete(area=area, generation=generation)
            return
        path = await agent.set_aside(area=area, generation=generation)
        problem = None if path is None else names.set_aside_problem(
            path, base_dir=self._link().section.remote_bin_dir, area=area, generation=generation)
        if problem is not None:  # never recorded: the keeper would remove what it names
            log.error("abandoned_data_set_aside_refused", area=area, generation=generation,
                      detail=f"the VPS set the copy aside at {problem}")
        elif path is not None:
            await self._state.record_set_aside(area=area, generation=generation, path=path)
            log.warning("abandoned_data_set_aside", area=area, generation=generation,
                        path=path)

    async def remove_set_aside(self, path: str) -> str:
        """Remove a copy `_delete` set aside (its keep time passed): 'deleted' or 'absent'."""
        return await self._link().agent.remove_set_aside(name=PurePosixPath(path).name)

    async def fetch_set_aside(
        self, *, path: str, local_dir: Path, progress: area_copy.Progress | None = None,
    ) -> area_copy.CopyReport:
        """Download a set-aside copy into `local_dir` for forensics, verified as a move home
        verifies its copy (listed by the tree-digest verb: the agent's listing route serves
        an area's data dir, and this is none)."""
        from monitord.remote import copy as area_copy

        link = self._link()
        async with link.session() as conn:
            return await area_copy.download(
                conn, remote_dir=path, local_dir=local_dir,
                vps_command=artifact.remote_command(link.section), progress=progress,
            )

    async def verify_gone(self, *, area: str, generation: int, entry_gone: bool = True) -> None:
        inventory = await self._link().agent.inventory()
        running = [p for p in inventory.processes if p.area == area and p.generation <= generation]
        entries = [e for e in inventory.entries if e.area == area and e.generation == generation]
        if running or (entry_gone and entries):
            raise error_for(
                ErrorCode.DAEMON_STOP_FAILED,
                f"{area} still present on the VPS at generation {generation}",
            )

    async def observe(self, areas: Collection[str]) -> dict[str, SideObservation] | None:
        if not self.reachable():
            return None
        try:
            inventory = await self._link().agent.inventory()
        except MonitordError as e:
            log.warning("remote_inventory_failed", error_code=e.code, detail=e.detail)
            return None
        wanted = set(areas)
        entries: dict[str, set[int]] = {area: set() for area in wanted}
        processes: dict[str, set[int]] = {area: set() for area in wanted}
        for entry in inventory.entries:
            if entry.area in wanted:
                entries[entry.area].add(entry.generation)
        for proc in inventory.processes:
            if proc.area in wanted:
                processes[proc.area].add(proc.generation)
        return {
            area: SideObservation(side=Side.REMOTE, area=area,
                                  entry_generations=frozenset(entries[area]),
                                  process_generations=frozenset(processes[area]))
            for area in wanted
        }

    async def retire(self, *, service: str, area: str, generation: int) -> None:
        await self.remove(service=service, area=area, generation=generation)

    async def stop_at(self, *, area: str, generation: int) -> None:
        await self._link().agent.stop(area=area, generation=generation)

    async def remove_unless_newest(
        self, *, area: str, generation: int, lineage: Lineage
    ) -> bool:
        agent = self._link().agent
        if lineages.may_discard_data(lineage, Side.REMOTE):
            await self._delete(area=area, generation=generation)
            return True
        # Its data there is the newest (not brought back yet): fence the process, keep the data.
        await agent.stop(area=area, generation=generation)
        return False

    # -- starting and health ---------------------------------------------------------------

    async def start(self, *, service: str, area: str, generation: int) -> None:
        """Create (or confirm) the agent's entry at `generation` with a fresh lease; start it."""
        link = self._link()
        data_dir, command = area_paths.remote_paths(self.config, service=service, area=area,
                                                    generation=generation)
        section = self.config.services[service]
        epoch = self.renewer.epoch() if self.renewer is not None else 0
        try:
            await link.agent.create(
                area=area, service=service, generation=generation, owner_id=self.owner_id,
                lease_ttl_s=link.section.area_lease_ttl_s, command=command, data_dir=data_dir,
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

    async def resume(self, *, service: str, area: str, generation: int) -> None:
        await self.start(service=service, area=area, generation=generation)

    async def uptime(self, *, area: str, generation: int) -> float | None:
        raw = await self._link().agent.inventory_raw()
        for proc in raw.get("processes", []):
            if proc.get("area") == area and proc.get("generation") == generation \
                    and area_health.is_live(proc):
                return float(proc.get("uptime_s") or 0.0)
        return None

    async def healthy_by(
        self, txn: Transaction, *, generation: int, min_uptime_s: float, deadline: float
    ) -> bool:
        """Ask the agent until `deadline` whether the area has run min_uptime_s: it answers
        the moment the window closes (one question held open instead of a poll of its whole
        inventory). False only for an agent without that question (an older one): the
        caller then looks at `uptime`; a timeout raises as there."""
        agent = self._link().agent
        while True:
            asked = self._clock()
            wait_s = max(0.0, min(deadline - asked, HEALTH_WAIT_S))
            try:
                answer = await agent.health(
                    area=txn.area, generation=generation, min_uptime_s=min_uptime_s,
                    wait_s=wait_s,
                )
            except MonitordError as e:
                if e.code in (ErrorCode.UNKNOWN_AREA, ErrorCode.AGENT_ROUTE_MISSING):
                    # no such route on this agent (an older one answers UNKNOWN_AREA)
                    return False
                raise
            if answer.healthy:
                return True
            now = self._clock()
            if now >= deadline:
                raise health_timeout(txn, self.config.services[txn.service], Side.REMOTE)
            if now - asked < wait_s:  # an early "no" (it should wait): never a busy loop
                await asyncio.sleep(min(POLL_S, deadline - now))

    async def probe(self, txn: Transaction) -> bool:
        return True  # a probe is a local command; the VPS's health is its uptime

    # -- receiving a copy from the PBX -----------------------------------------------------

    async def pre_receive(
        self, *, local_dir: Path, remote_dir: str, service: str, area: str,
        progress: area_copy.Progress | None = None,
    ) -> area_copy.Staged:
        from monitord.remote import copy as area_copy

        return await copy_over(self._link(), area_copy.pre_upload, local_dir=local_dir,
                               remote_dir=remote_dir, area=area, progress=progress)

    async def receive(
        self, *, local_dir: Path, remote_dir: str, service: str, area: str,
        staged: area_copy.Staged | None, progress: area_copy.Progress | None = None,
    ) -> area_copy.CopyReport:
        from monitord.remote import copy as area_copy

        return await copy_over(self._link(), area_copy.upload, local_dir=local_dir,
                               remote_dir=remote_dir, area=area, staged=staged, progress=progress)

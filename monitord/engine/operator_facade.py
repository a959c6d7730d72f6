"""The operator facade: everything the surface (HTTP API, status page, CLI) may ask of the engine.

One typed object between `monitord.surface` and the running parts, built by
`monitord.surface.wiring`. The surface never reaches into the engine, the reconciler or the
tunnel directly; it calls these methods:

    record_placement(service, area, location)   durable wish + transactions (the 202 intake)
    record_area_placement(area, location)       the same for one area named by its UUID
    retry(service)                              leave PARKED with fresh generations
    discard_remote_data(service, area)          a waiting rollback gives the newer data up
    give_up_remote(service, area)               the VPS is given up: areas home on the PBX's copy
    area_log(area, side, lines, position)       an area's log, local or through the agent
    snapshot()                                  the status document (GET /v1/status)
    status_key()                                what the status document is built from
    transactions(limit) / cleanup(limit)        history and the cleanup queue
    metrics_text()                              the Prometheus exposition
    bundle_sections()                           what a diagnostic bundle holds
    remote_state_rows()                         the remote_state.json projection's rows

Per-service states, counts and projections come from the pure `orchestrator.status`, so the
page, the CLI, the PHP UI and the metrics agree.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from monitord import __version__
from monitord.base import log_tail
from monitord.base.config import Config
from monitord.base.metrics import Metrics
from monitord.base.periodic import LoopBook
from monitord.engine.cleanup_worker import CleanupWorker
from monitord.engine.migration_engine import MigrationEngine
from monitord.engine.operator_verbs import GivenUp, OperatorVerbs
from monitord.engine.placement_state import PlacementState
from monitord.engine.reconciler import Reconciler
from monitord.engine.warm_copier import WarmCopier
from monitord.local.supervisor import LocalSupervisor, ProcessView
from monitord.remote import agent_client
from monitord.store import spool_files
from monitord.store.state_db import Store
from orchestrator import area_health
from orchestrator import status as status_rules
from orchestrator.errors import ErrorCode, MonitordError, PermanentError, error_for
from orchestrator.models import Area, Side

if TYPE_CHECKING:  # the SSH side loads after readiness (monitord/remote/ssh_side.py)
    from monitord.remote.remote_link import RemoteLink

_CONFLICT_STATES = frozenset({"lease_conflict", "port_occupied"})


class Intake(Protocol):
    """Whether placement requests are taken now (the surface's admission)."""

    @property
    def accepting(self) -> bool: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class OperatorFacade:
    """The surface's one handle on the running engine (see the module docstring)."""

    config: Config
    owner_id: str
    engine: MigrationEngine
    verbs: OperatorVerbs
    reconciler: Reconciler
    cleanup_worker: CleanupWorker
    supervisor: LocalSupervisor
    link: RemoteLink | None
    loops: LoopBook
    admission: Intake
    custom_config_path: Path
    remote_state_path: Path
    warm: WarmCopier | None = None

    @property
    def state(self) -> PlacementState:
        return self.engine.state

    @property
    def store(self) -> Store:
        return self.engine.store

    @property
    def metrics(self) -> Metrics:
        return self.engine.metrics

    def accepting(self) -> bool:
        return self.admission.accepting

    # -- changes ---------------------------------------------------------------------------

    async def record_placement(
        self, *, service: str, area: str | None, location: str
    ) -> list[str]:
        """Durably record a wish and open its transactions; their ids (for the 202).

        custom_config.json is checked here, once per request (re-read only if it changed): a
        corrupt file refuses the request (CONFIG_CORRUPT, 409) before anything is recorded
        or stops. The engine records on the areas this check left in the placement state."""
        self._side_configured(location)
        try:
            await self.state.usable()
        except spool_files.ConfigCorrupt as e:
            raise PermanentError(
                ErrorCode.CONFIG_CORRUPT, f"custom_config.json is unreadable: {e.detail}"
            ) from e
        return await self.engine.record_placement(service=service, area=area, location=location)

    async def record_area_placement(self, area: str, *, location: str) -> tuple[str, list[str]]:
        """`record_placement` for one area named by its UUID: (its service, the transaction
        ids). The same one check of custom_config.json finds the area: CONFIG_CORRUPT (409)
        while the file cannot be used, UNKNOWN_AREA (404) when it does not list the area."""
        self._side_configured(location)
        committed = (await self.state.usable()).get(area)
        if committed is None:
            raise PermanentError(
                ErrorCode.UNKNOWN_AREA, f"area {area} is not in {self.custom_config_path.name}"
            )
        ids = await self.engine.record_placement(
            service=committed.service, area=area, location=location
        )
        return committed.service, ids

    def _side_configured(self, location: str) -> None:
        """A move that can only fail is refused before anything is recorded: without a
        `[remote]` section nothing can run on a VPS (PREFLIGHT_REMOTE_CONFIG, 409)."""
        if location == Side.REMOTE.value and self.config.remote is None:
            raise PermanentError(
                ErrorCode.PREFLIGHT_REMOTE_CONFIG,
                "no [remote] section is configured: nothing can run on a VPS"
                " (docs/vps-setup.md, then restart monitord)",
            )

    async def retry(self, service: str) -> list[str]:
        """Let a parked service try again; the ids of the transactions resumed."""
        return await self.verbs.retry(service)

    async def discard_remote_data(self, service: str, *, area: str | None) -> list[str]:
        """Rollbacks waiting for the other side's newer data give it up (the operator's
        explicit choice, recorded as events); the ids of the transactions that did."""
        return await self.verbs.discard_remote_data(service, area=area)

    async def give_up_remote(self, service: str, *, area: str | None) -> GivenUp:
        """The VPS is given up for `service` (or one area): its areas start on the PBX's own
        copy — or their warm copies — once every remote copy is provably fenced
        (VPS_NOT_FENCED until then); the transactions that take them home, and what each
        area starts on."""
        return await self.verbs.give_up_remote(service, area=area)

    def fetch_abandoned(self, area: str, *, generation: int | None) -> dict[str, Any]:
        """Start fetching a given-up copy set aside on the VPS to the PBX (forensics); what
        is fetched where (monitord/engine/abandoned_data.py)."""
        abandoned = self.cleanup_worker.abandoned
        if abandoned is None:
            raise error_for(ErrorCode.NOT_FOUND, "no given-up copies are kept here")
        return abandoned.start_fetch(area, generation)

    def _abandoned_rows(self) -> list[dict[str, Any]]:
        """VPS copies given up: where each was set aside (once the VPS answered), when it
        will be removed, and a forensic fetch's progress."""
        abandoned = self.cleanup_worker.abandoned
        if abandoned is None:
            return [dict(row) for _, row in sorted(self.state.abandoned.items())]
        return abandoned.rows()

    async def area_log(
        self, area: str, *, side: str | None, lines: int,
        position: tuple[int | None, int] | None,
    ) -> dict[str, Any]:
        """The area's log on `side` (default: where it is placed), read-only and bounded
        (monitord.base.log_tail): its last `lines` lines, or what was appended since
        `position` (file, offset). A local log is read here; a remote one is asked of the
        agent over the tunnel. UNKNOWN_AREA for an area not in custom_config.json unless the
        side is named (the log of an area removed since); NOT_FOUND when there is no log to
        tail; PREFLIGHT_REMOTE_CONFIG for the VPS without a [remote] section; the agent
        client's codes (AGENT_UNREACHABLE, AGENT_ROUTE_MISSING) when the VPS cannot answer."""
        committed = self.state.committed.get(area)
        if side is None:
            if committed is None:
                raise PermanentError(ErrorCode.UNKNOWN_AREA,
                                     f"area {area} is not in {self.custom_config_path.name}")
            side = committed.location.value
        if side == Side.LOCAL.value:
            path = str(self.supervisor.logs_dir / f"{area}.log")
            if position is None:
                found = await asyncio.to_thread(log_tail.tail, path, lines=lines)
            else:
                found = await asyncio.to_thread(log_tail.read_from, path, file=position[0],
                                                offset=position[1])
        else:
            self._side_configured(side)
            assert self.link is not None
            found = await self.link.agent.area_log(
                area=area, lines=lines, file=None if position is None else position[0],
                offset=None if position is None else position[1])
        if found["missing"] and position is None:
            raise error_for(ErrorCode.NOT_FOUND, f"area {area} has no log on the {side} side"
                                                 " (yet)")
        return {"area": area, "side": side, **found}

    def knows_service(self, service: str) -> bool:
        return service in self.config.services

    def knows_area(self, service: str, area: str) -> bool:
        committed = self.state.committed.get(area)
        return committed is not None and committed.service == service

    # -- reads -----------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The status document of GET /v1/status.

        Fields: docs/design.md, "HTTP API and service states".
        """
        local = {v.area: v for v in self.supervisor.inventory()}
        remote = area_health.index_inventory(
            self.reconciler.remote_inventory if self.link and self.link.connected() else None)
        # each copy's progress read once, so that the area and its transaction say the same
        copies = {t.transaction_id: self.engine.actions.copies.view(t.transaction_id)
                  for t in self.state.active()}
        services = {name: self._service_view(name, local, remote, copies)
                    for name in sorted(self.config.services)}
        counts = {"local": 0, "remote": 0, "migrating": 0, "orphan": 0}
        for view in services.values():
            for key in counts:
                counts[key] += view["counts"].get(key, 0)
        corrupt = self.state.corrupt
        last = self.reconciler.last
        return {
            "owner_id": self.owner_id,
            "owner_label": self.config.monitord.owner_label,
            "version": __version__,
            "at": time.time(),
            "accepting": self.accepting(),
            "config_error": {"code": str(corrupt.code), "detail": corrupt.detail}
            if corrupt else None,
            "quarantined": [
                {"position": e.position, "code": e.code, "detail": e.detail}
                for e in self.state.quarantined
            ],
            # areas held on both sides after state.db was lost or found older (state_loss.py)
            "held": [{"area": area, "service": self.state.committed[area].service,
                      "detail": why.detail}
                     for area, why in sorted(self.state.held.items())
                     if area in self.state.committed],
            "tunnel": self._tunnel_view(),
            "vps_memory": self._vps_memory_view(),
            # VPS copies given up: where each was set aside on the VPS (once it answered)
            "abandoned_data": self._abandoned_rows(),
            "counts": counts,
            "services": services,
            # each with its copy's progress while one runs (docs/design.md, "Copy progress")
            "transactions": [{**t.to_storage(), "copy": copies.get(t.transaction_id)}
                             for t in self.state.active()],
            "cleanup": {"backlog": self.cleanup_worker.backlog, "stuck": self.cleanup_worker.stuck},
            "drift": last.to_dict() if last else {"before": 0, "after": 0},
            "loops": self.loops.to_status(),
        }

    def status_key(self) -> tuple[Any, ...]:
        """Everything `snapshot()` reads that can change, as one comparable value: while it
        stays equal, the document is the same but for `at` (the status API serves the one it
        built). A new field of the snapshot that reads anything else must add it here."""
        tunnel = self.link.keeper.status() if self.link else None
        return (
            self.engine.status_version,  # every placement change, the engine's errors, moves
            self.engine.actions.copies.key(),  # a copy's bytes, rate and ETA
            self.accepting(),
            self.state.corrupt,  # these two change without a placement notification
            self.state.quarantined,
            tunnel,
            self.reconciler.last,
            tuple(sorted(self.reconciler.orphans_by_service.items())),
            self.cleanup_worker.backlog,
            self.cleanup_worker.stuck,
            tuple(sorted(self.cleanup_worker.backlog_by_service.items())),
            self.loops.version,  # a root loop failed or recovered
            self.supervisor.version,  # a local daemon started, exited or left its crash loop
            self.reconciler.remote_inventory_at,  # the agent's last inventory (remote areas)
            self.link.connected() if self.link else None,
            # a forensic fetch started, moved on or ended
            self.cleanup_worker.abandoned.version if self.cleanup_worker.abandoned else 0,
            0 if self.warm is None else self.warm.version,  # a warm copy failed or recovered
        )

    async def transactions(self, *, limit: int) -> list[dict[str, Any]]:
        return await self.store.list_transactions(limit=limit)

    async def cleanup(self, *, limit: int) -> dict[str, Any]:
        items = await self.store.list_cleanup(limit=limit)
        return {"items": items, "backlog": await self.store.cleanup_backlog()}

    async def moves_since(self, since: float) -> list[dict[str, Any]]:
        """The moves whose transactions ended since `since` (the page's history)."""
        return await self.engine.downtime.moves_since(since)

    def metrics_text(self) -> bytes:
        """The metrics, with the per-area and per-service gauges set from the status now."""
        snapshot = self.snapshot()
        services = snapshot["services"]
        up: dict[tuple[str, str], int] = {}
        expected: dict[tuple[str, str], int] = {}
        judged = {str(h) for h in (area_health.Health.UP, area_health.Health.DOWN,
                                   area_health.Health.CRASH_LOOP)}
        for name, view in services.items():
            for placed in Side:
                up[(name, placed.value)] = expected[(name, placed.value)] = 0
            for area in view["areas"]:
                process = area["process"]
                if process.get("health") == str(area_health.Health.UP):
                    up[(name, process["side"])] += 1
                if process.get("health") in judged:
                    expected[(name, process["side"])] += 1
            for state in status_rules.ServiceState:
                self.metrics.service_state.labels(service=name, state=state.value).set(
                    1 if view["state"] == state.value else 0)
        for (name, where), count in up.items():
            self.metrics.area_up.labels(service=name, side=where).set(count)
            self.metrics.area_expected_up.labels(service=name, side=where).set(
                expected[(name, where)])
        self.metrics.config_corrupt.set(1 if snapshot["config_error"] else 0)
        self.metrics.quarantined.set(len(snapshot["quarantined"]))
        return self.metrics.render()

    def restart_counts(self) -> dict[tuple[str, str], int]:
        """Area daemon restarts per (service, side) since this monitord started: the
        supervisor's, and the agent's as the reconciler saw them grow."""
        counts = {(s, Side.LOCAL.value): n for s, n in self.supervisor.restarts_by_service.items()}
        counts.update({(s, Side.REMOTE.value): n
                       for s, n in self.reconciler.remote_restarts_by_service.items()})
        return counts

    async def bundle_sections(self) -> dict[str, Any]:
        """Every section of a diagnostic bundle, by file name (spool files as raw bytes)."""
        sections: dict[str, Any] = {
            "status.json": self.snapshot(),
            "transactions.json": await self.store.list_transactions(limit=5000),
            "cleanup.json": await self.store.list_cleanup(limit=100_000),
            "events.json": await self.store.recent_events(limit=1000),
            "local_inventory.json": [v.to_json() for v in self.supervisor.inventory()],
            "remote_inventory.json": self.reconciler.remote_inventory,
            "tunnel.json": self.link.keeper.status().to_dict() if self.link else None,
            "config.json": self.config.model_dump(mode="json"),
        }
        for name, path in (
            ("custom_config.json", self.custom_config_path),
            ("remote_state.json", self.remote_state_path),
        ):
            try:
                sections[name] = path.read_bytes()
            except OSError as e:
                sections[name] = f"unreadable: {e}\n"
        return sections

    def side_counts(self) -> dict[str, int]:
        """Committed areas per side (the monitord_areas gauge)."""
        counts = {"local": 0, "remote": 0}
        for area in self.state.committed.values():
            counts[area.location.value] += 1
        return counts

    def remote_state_rows(self) -> dict[str, spool_files.ServiceCompatState]:
        """remote_state.json rows, one per configured service (never a source of truth)."""
        rows = {}
        for name in sorted(self.config.services):
            error = self.engine.last_errors.get(name)
            row = status_rules.remote_state_row(
                transactions=[t for t in self.state.active() if t.service == name],
                fail_count=self.engine.failures(name),
                last_error=f"{error['code']}: {error['detail']}" if error else "",
            )
            rows[name] = spool_files.ServiceCompatState(**row)
        return rows

    # -- views -----------------------------------------------------------------------------

    def _area_process(
        self, area: Area, *, moving: bool, local: Mapping[str, ProcessView],
        remote: area_health.RemoteInventoryIndex | None,
    ) -> dict[str, Any]:
        """How the area's daemon does on the side it is placed on (orchestrator/area_health.py);
        an area a transaction owns is `moving` (its phase tells more)."""
        if moving:
            return {"side": area.location.value, "health": str(area_health.Health.MOVING)}
        min_uptime_s = self.config.services[area.service].min_uptime_s
        if area.location is Side.REMOTE:
            process = area_health.remote_process(
                remote, area=area.uuid, generation=area.generation,
                as_of=self.reconciler.remote_inventory_at, min_uptime_s=min_uptime_s,
            )
            return process.to_dict()
        view = local.get(area.uuid)
        if view is None or view.generation != area.generation:
            return area_health.AreaProcess(side="local", state="stopped").to_dict()
        return area_health.AreaProcess(
            side="local", state=view.state, pid=view.pid, started_at=view.started_at,
            restarts=view.restarts, restarts_1h=view.restarts_1h, failures=view.failures,
            last_exit_status=view.last_exit_status,
        ).to_dict()

    def _vps_memory_view(self) -> dict[str, Any] | None:
        """The VPS's memory from the agent's last inventory (None: not connected, or an agent
        that does not say it). What a move there is judged by: docs/design.md, "Memory for
        a move"."""
        raw = self.reconciler.remote_inventory
        if raw is None or not (self.link and self.link.connected()) or "host" not in raw:
            return None
        try:
            host = agent_client.to_host(raw["host"], where="the inventory's host")
        except MonitordError:
            return None  # (the VPS said something else: shown as unknown, never an error)
        return {"total_bytes": host.total_bytes, "available_bytes": host.available_bytes,
                "as_of": self.reconciler.remote_inventory_at}

    def _tunnel_view(self) -> dict[str, Any]:
        if self.link is None:
            return {"state": "not_configured", "connected": False, "last_error": "",
                    "attempts": 0, "lease": None}
        tunnel = self.link.keeper.status().to_dict()
        err = tunnel.get("last_error")
        # The PHP UI reads `last_error` as one string; the code is kept beside it.
        tunnel["last_error_code"] = err["code"] if err else ""
        tunnel["last_error"] = f"{err['code']}: {err['detail']}" if err else ""
        return tunnel

    def _service_view(self, service: str, local: Mapping[str, ProcessView],
                      remote: area_health.RemoteInventoryIndex | None,
                      copies: Mapping[str, dict[str, Any] | None]) -> dict[str, Any]:
        state = self.state
        areas = state.areas_of(service)
        txns = [t for t in state.active() if t.service == service]
        tunnel = self.link.keeper.status() if self.link else None
        view = status_rules.service_view(
            service=service,
            areas=areas,
            transactions=txns,
            desired=state.service_desired(service),
            area_desired={a.uuid: state.desired_location(a) for a in areas},
            orphans=self.reconciler.orphans_by_service.get(service, 0),
            tunnel_conflict=bool(tunnel and tunnel.state.value in _CONFLICT_STATES),
            cleanup_pending=self.cleanup_worker.backlog_by_service.get(service, 0) > 0,
        )
        by_area = {t.area: t for t in txns}
        downtimes = self.engine.downtime.last_move_downtimes(service)
        warm = {} if self.warm is None else self.warm.status()
        return {
            "desired": view.desired,
            "state": str(view.state),
            "counts": dict(view.counts),
            "areas": [
                {
                    "uuid": a.uuid,
                    "title": state.titles.get(a.uuid),
                    "location": a.location.value,
                    "generation": a.generation,
                    "desired": state.desired_location(a).value,
                    "phase": by_area[a.uuid].phase.value if a.uuid in by_area else None,
                    "copy": copies.get(by_area[a.uuid].transaction_id)
                    if a.uuid in by_area else None,
                    "process": self._area_process(a, moving=a.uuid in by_area, local=local,
                                                  remote=remote),
                    # in the service's last move, if it was part of it (see last_move)
                    "last_downtime_s": downtimes.get(a.uuid),
                    # a remote area's newest warm copy (None: the service declares none)
                    "warm_copy": warm.get(a.uuid),
                }
                for a in areas
            ],
            "last_error": self.engine.last_errors.get(service) or view.last_error,
            "last_move": self.engine.last_move(service),
            # Offered only while the VPS does not answer: a reachable VPS moves home whole.
            "give_up": None if tunnel is None or tunnel.connected
            else self.verbs.give_up_view(service),
        }

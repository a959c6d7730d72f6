"""The orchestration component of `monitord run`: builds and wires the working parts.

`assemble(ctx)` is what `monitord.surface.daemon` runs by default: it loads what the node keeps
in its work_dir (`NodeFiles.load`, in a thread: the owner id, the agent's secret, the agent's
pyz built and fsynced), then builds one `Orchestration` component from those values and the
config with plain constructors (no I/O, no callbacks but bound methods), and the operator
facade (monitord.engine.operator_facade) that the HTTP API serves. The component owns:

    placement state    committed areas (custom_config.json), transactions, wishes
    local supervisor   runs exactly `state.runs(LOCAL)` (fed on every state change)
    tunnel keeper      the one SSH connection; provisions the VPS before forwards are proven
    lease ledger       the grants acknowledged or uncertain (the expiry bound's source)
    lease renewer      grants `state.runs(REMOTE)` to the agent every TTL/3
    migration engine   transactions, phase by phase (it is also the placement intake)
    cleanup worker     the durable cleanup queue
    warm copier        recent verified copies of remote areas that declare how (if any)
    reconciler         planner passes on connect, periodically and after transactions

Start order: state -> (legacy remote_state.json normalised) -> engine recovery (every
unfinished transaction's next step decided and stored) -> survivors adopted or stopped ->
supervisor -> keeper -> renewer -> engine -> cleanup -> warm copier -> reconciler.
Stop: the engine finishes its current steps; the keeper releases the tunnel lease; the
supervisor stops supervising but leaves local daemons running for the next instance to
adopt (a restart must not take areas down).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from monitord.base import area_paths, atomic_file, logs
from monitord.base.config import Config, RemoteSection
from monitord.base.metrics import Metrics
from monitord.base.periodic import LoopBook
from monitord.engine.abandoned_data import AbandonedData
from monitord.engine.cleanup_worker import CleanupWorker
from monitord.engine.lease_ledger import LeaseLedger
from monitord.engine.lease_renewer import LeaseRenewer
from monitord.engine.migration_engine import MigrationEngine
from monitord.engine.operator_facade import OperatorFacade
from monitord.engine.operator_verbs import OperatorVerbs
from monitord.engine.phase_actions import PhaseActions
from monitord.engine.placement_state import PlacementState
from monitord.engine.reconciler import Reconciler
from monitord.engine.warm_copier import WarmCopier
from monitord.local.supervisor import LocalSupervisor
from monitord.remote import agent_channel, artifact
from monitord.remote.agent_client import AgentClient
from monitord.remote.artifact import LocalArtifact
from monitord.remote.remote_link import RemoteLink
from monitord.remote.tunnel.keeper import TunnelKeeper, TunnelState, TunnelStatus
from monitord.store import owner_id
from monitord.store.remote_state import RemoteStateFile
from monitord.surface.components import Assembly, RuntimeContext
from orchestrator import status as status_rules
from orchestrator.area_leases import LeasePolicy
from orchestrator.migration_step import StepRules
from orchestrator.models import Transaction
from orchestrator.rules import LinkEpoch

if TYPE_CHECKING:  # the SSH side loads after readiness (monitord/remote/ssh_side.py)
    import asyncssh

log = logs.get_logger(__name__)

SECRET_FILE = "agent.secret"


async def assemble(ctx: RuntimeContext) -> Assembly:
    """Load what the node keeps on disk (in a thread), then build the parts from values."""
    files = await asyncio.to_thread(NodeFiles.load, ctx.config)
    orchestration = Orchestration(ctx, files)
    operator = orchestration.operator
    return Assembly(components=[orchestration], operator=operator, intake=operator)


def load_or_create_secret(work_dir: Path) -> bytes:
    """The agent's bearer secret, created once (0600) in work_dir; never logged."""
    path = work_dir / SECRET_FILE
    try:
        secret = path.read_bytes().strip()
    except FileNotFoundError:
        secret = b""
    if not secret:
        secret = secrets.token_hex(32).encode()
        atomic_file.atomic_write_bytes(path, secret + b"\n", mode=0o600)
    return secret


@dataclass(frozen=True, slots=True)
class NodeFiles:
    """What this node keeps in its work_dir: its owner id and, with a [remote] section, the
    agent's secret and the artifacts it pushes (the agent's pyz built, fsynced, hashed)."""

    owner_id: str
    secret: bytes = b""
    artifacts: tuple[LocalArtifact, ...] = ()

    @classmethod
    def load(cls, config: Config) -> NodeFiles:
        """Read (creating on first use) every file; blocking, run it in a thread."""
        work_dir = config.monitord.work_dir
        node = owner_id.load_or_create(work_dir)
        if config.remote is None:
            return cls(owner_id=node)
        pyz = artifact.build(work_dir / "artifacts")
        return cls(owner_id=node, secret=load_or_create_secret(work_dir),
                   artifacts=tuple(artifact.local_artifacts(config.remote, agent=pyz)))


def lease_policy(remote: RemoteSection | None) -> LeasePolicy:
    """The area leases' policy from [remote] (its defaults without one)."""
    if remote is None:
        return LeasePolicy(ttl_s=30.0, clock_margin=0.1, safety_margin_s=2.0)
    return LeasePolicy(ttl_s=remote.area_lease_ttl_s, clock_margin=remote.lease_clock_margin,
                       safety_margin_s=remote.lease_safety_margin_s)


def step_bounds(config: Config, policy: LeasePolicy) -> StepRules:
    section = config.monitord
    return StepRules(
        park_after_failures=section.park_after_failures,
        retry_backoff_base_s=section.retry_backoff_base_s,
        retry_backoff_cap_s=section.retry_backoff_cap_s,
        rollback_data_wait_s=section.rollback_data_wait_s,
        policy=policy,
    )


class Orchestration:
    name = "orchestration"

    def __init__(self, ctx: RuntimeContext, files: NodeFiles) -> None:
        config: Config = ctx.config
        self.ctx = ctx
        self.config = config
        section = config.monitord
        self.owner_id = files.owner_id
        self.metrics = Metrics(work_dir=section.work_dir)
        # Every root loop's error record (monitord/base/periodic.py), shown as status `loops`.
        self.loops = LoopBook(metrics=self.metrics)
        self.state = PlacementState(store=ctx.store, custom_config_path=ctx.custom_config_path)
        self.supervisor = LocalSupervisor(state_dir=section.work_dir / area_paths.SUPERVISOR_DIR,
                                          log_max_bytes=section.area_log_max_bytes,
                                          log_keep=section.area_log_keep, loops=self.loops)
        self.policy = lease_policy(config.remote)
        self.link: RemoteLink | None = None
        self.ledger: LeaseLedger | None = None
        self.renewer: LeaseRenewer | None = None
        if config.remote is not None:
            self._build_remote(config.remote, files)
        self.actions = PhaseActions(
            config=config, state=self.state, supervisor=self.supervisor, link=self.link,
            renewer=self.renewer, store=ctx.store, owner_id=self.owner_id,
        )
        self.engine = MigrationEngine(
            state=self.state, actions=self.actions, store=ctx.store, metrics=self.metrics,
            bounds=step_bounds(config, self.policy),
            parallelism={name: s.parallelism for name, s in config.services.items()},
            leases=self.ledger, link_epoch=self._link_epoch,
            on_finished=self._transaction_finished, loops=self.loops,
        )
        self.verbs = OperatorVerbs(
            engine=self.engine, actions=self.actions, vps_lost_after_s=section.vps_lost_after_s,
            vps_lost_services=frozenset(name for name, s in config.services.items()
                                        if s.on_vps_lost == "home"),
        )
        self.engine.add_tick_hook(self._vps_lost_tick)
        self.cleanup = CleanupWorker(
            store=ctx.store, sides=self.actions.sides, metrics=self.metrics,
            interval_s=section.cleanup_interval_s, lineage_of=self.state.lineage,
            loops=self.loops,
            abandoned=AbandonedData(state=self.state, store=ctx.store,
                                    remote=self.actions.remote_side,
                                    keep_s=section.abandoned_data_keep_s),
        )
        self.warm = WarmCopier(config=config, state=self.state, link=self.link,
                               local_side=self.actions.local_side, metrics=self.metrics,
                               loops=self.loops)
        self.reconciler = Reconciler(
            state=self.state, store=ctx.store, supervisor=self.supervisor, link=self.link,
            sides=self.actions.sides, metrics=self.metrics, intake_lock=self.engine.intake_lock,
            interval_s=section.reconcile_interval_s, legacy_grace_s=section.legacy_grace_s,
            loops=self.loops,
        )
        self.operator = OperatorFacade(
            config=config, owner_id=self.owner_id, engine=self.engine, verbs=self.verbs,
            reconciler=self.reconciler, cleanup_worker=self.cleanup, supervisor=self.supervisor,
            link=self.link, loops=self.loops, admission=ctx.admission,
            custom_config_path=ctx.custom_config_path, remote_state_path=ctx.remote_state_path,
            warm=self.warm,
        )
        self.metrics.count_restarts_with(self.operator.restart_counts)
        self.remote_state = RemoteStateFile(ctx.remote_state_path)
        self._was_connected = False
        self._last_state: TunnelState | None = None
        self._down_since: float | None = None  # monotonic, since the tunnel was last up

    def _build_remote(self, remote: RemoteSection, files: NodeFiles) -> None:
        """The parts that reach the VPS: the tunnel keeper, the agent client, the link that
        holds them, the lease ledger and its renewer."""
        for message in remote.deprecations:
            log.warning("config_deprecated", detail=message)
        keeper = TunnelKeeper(remote, owner_id=self.owner_id,
                              owner_label=self.config.monitord.owner_label,
                              before_forwards=self._provision, loops=self.loops)
        agent = AgentClient(channel=agent_channel.over_ssh(keeper.session, remote.agent_socket()),
                            secret=files.secret, open_ahead=True)
        link = RemoteLink(config=self.config, keeper=keeper, agent=agent,
                          artifacts=list(files.artifacts), secret=files.secret)
        self.link = link
        self.ledger = LeaseLedger(owner_id=self.owner_id, policy=self.policy,
                                  tunnel_connected=link.connected,
                                  connection_epoch=link.connections)
        self.renewer = LeaseRenewer(state=self.state, agent=link.connected_agent,
                                    ledger=self.ledger, recycle=link.recycle, loops=self.loops)
        keeper.add_listener(self._tunnel_changed)

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self, ctx: RuntimeContext) -> None:
        self.config.monitord.spool_dir.mkdir(parents=True, exist_ok=True)
        await self.state.load()
        if self.state.corrupt is not None:
            log.error("config_corrupt", error_code="CONFIG_CORRUPT", detail=str(self.state.corrupt))
        await self._normalise_legacy_remote_state()
        # Recovery first: every unfinished transaction gets its next step decided (and
        # stored) before the supervisor adopts, stops or starts anything, so both read the
        # same records through the same rule (orchestrator.rules.desired_runs).
        await self.engine.recover()
        report = await self.supervisor.adopt_or_stop_survivors(self.actions.local_runs())
        log.info("survivors_handled", adopted=list(report.adopted), stopped=list(report.stopped),
                 replaced=list(report.replaced), stuck=list(report.stuck))
        self.state.add_listener(self._state_changed)
        tasks = ctx.tasks
        # A guarded root task: if the supervisor's loop ever died, the daemon would say so
        # (/livez 503) and stop, instead of silently no longer restarting local daemons.
        tasks.spawn("local supervisor", self.supervisor.run())
        if self.link is not None:
            self.link.keeper.add_reconnect_hook("cleanup worker", self._after_connect)
            self.link.keeper.add_reconnect_hook("preflight facts", self.actions.warm_preflight)
            tasks.spawn("tunnel keeper", self.link.keeper.run())
        if self.renewer is not None:
            tasks.spawn("lease renewer", self.renewer.run())
        tasks.spawn("migration engine", self.engine.run())
        tasks.spawn("cleanup worker", self.cleanup.run())
        if self.link is not None and self.warm.services():
            tasks.spawn("warm copier", self.warm.run())
        tasks.spawn("reconciler", self.reconciler.run())
        self._state_changed()

    async def stop(self) -> None:
        self.warm.close()  # (first: it would only find the link going)
        await self.engine.stop()
        if self.link is not None:
            await self.link.agent.close()  # (its channel opened ahead, before the goodbye)
            await self.link.keeper.close()
        await self.supervisor.close()
        self.remote_state.publish(self.operator.remote_state_rows())

    # -- wiring ------------------------------------------------------------------------------

    async def _provision(self, conn: asyncssh.SSHClientConnection) -> None:
        """Keeper hook, after the lease and before forwards: the VPS has what we need."""
        from monitord.remote import provisioning

        assert self.link is not None
        await provisioning.provision(
            conn,
            remote=self.link.section,
            artifacts=self.link.artifacts,
            secret=self.link.secret,
        )

    async def _after_connect(self, conn: asyncssh.SSHClientConnection) -> None:
        self.metrics.tunnel_reconnects.inc()
        self.cleanup.wake()
        self.reconciler.wake()
        self.engine.wake()
        if self.renewer is not None:
            self.renewer.wake()

    async def _vps_lost_tick(self) -> None:
        await self.verbs.give_up_lost_vps(self._down_since)

    def _link_epoch(self) -> LinkEpoch | None:
        if self.link is None:
            return None
        status = self.link.keeper.status()
        return LinkEpoch(connections=status.reconnects, connected=status.connected)

    def _tunnel_changed(self, status: TunnelStatus) -> None:
        self.metrics.tunnel_up.set(1 if status.connected else 0)
        if self._was_connected and not status.connected and self.ledger is not None:
            self.ledger.tunnel_down()
        # Count each conflict once, when the keeper enters the state (it publishes often).
        if status.state is TunnelState.LEASE_CONFLICT and self._last_state is not status.state:
            self.metrics.tunnel_lease_conflicts.inc()
        if status.connected:
            self._down_since = None
        elif self._down_since is None:
            # Unreachable since now (or since start-up): the clock of vps_lost_after_s.
            self._down_since = time.monotonic()
        self._was_connected = status.connected
        self._last_state = status.state

    def _state_changed(self) -> None:
        self.supervisor.set_desired(self.actions.local_runs())
        self.engine.wake()
        counts = self.operator.side_counts()
        for side in ("local", "remote"):
            self.metrics.areas.labels(side=side).set(counts[side])
        self.remote_state.publish(self.operator.remote_state_rows())

    def _transaction_finished(self, txn: Transaction) -> None:
        self.actions.forget(txn)
        self.reconciler.wake()
        self.cleanup.wake()

    # -- remote_state.json ---------------------------------------------------------------------

    async def _normalise_legacy_remote_state(self) -> None:
        legacy = await asyncio.to_thread(self.remote_state.read_legacy)
        if legacy is None:
            return
        normalised = status_rules.normalise_legacy(
            {name: state.to_json() for name, state in legacy.items()},
            services=set(self.config.services),
            transactions=list(self.state.active()),
        )
        if normalised.notes:
            log.info("legacy_remote_state_normalised", notes=list(normalised.notes))
        self.remote_state.publish(self.operator.remote_state_rows())

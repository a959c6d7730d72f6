"""A model of the PBX, the VPS and the SSH link, driven only by the decision core.

The model is the runtime in miniature: it performs the actions the core returns (the
migration engine's steps, reconcile plans, cleanup decisions, lease renewals, the
supervisor's wanted set) against simulated processes and entries, and feeds what happened
back. Its migration steps are the engine's own: `engine_step` asks
orchestrator/migration_step.py's `decide()`, performs, and stores what it returns, keeping
the core's `Memory` as the engine does, so a rule broken in orchestrator/ is a rule broken
here. Faults: the link drops (also right after a request took effect, so its answer is
lost), the VPS reboots (its processes die, its entry cache survives, nothing restarts until
granted), monitord crashes between performing a step and storing its outcome (volatile
lease acknowledgements and the step's memory are lost, durable records survive), preflight
and copy failures, time passing (remote daemons die when their lease lapses: the agent's
self-fencing, on a VPS clock running 5 % slow), and the operator reversing or retrying
placements.

Data: every side keeps a version of each area's data; a process that starts writes a new
version (the area's newest). A start on a side whose version is not the newest is a
`Violation` (data went back in time), and so is deleting the only newest copy. The lineage
(orchestrator/lineage.py) is the durable record the runtime keeps; this model checks it
against the versions it really has.

`check()` raises `Violation` when a safety promise breaks. `broken_lease_wait=True` swaps in
a deliberately wrong runtime whose lease ledger takes every grant as long gone (so it
restarts a source without waiting for the lease), `broken_copy_back=True` one that reports
the rollback's copy-back done without copying, and `broken_give_up=True` an operator's
give-up of the VPS (orchestrator/give_up.py) that does not wait for the remote copies'
lease bound, and `broken_warm_copy=True` one whose move home from the VPS starts from the
warm copy and whose give-up chooses whatever warm copy it holds, so tests can prove the
checks catch them.

Giving the VPS up (`give_up_vps`) is the one explicit way to start an area on older data: the
operator accepts the loss, so from then on the newest data is what the PBX holds (its live
data dir or its archive of a migrated-away source) — or the area's warm copy, when
orchestrator/warm_copy.py lets the give-up choose it.

Warm copies: the copier snapshots the VPS's copy into the area's warm slot on the PBX when
`warm_copy.due` says so (`take_warm_copy`, which a cut can break mid-way) and drops what
`warm_copy.kept` does not keep (`drop_warm_copies`). A version put in place from a warm slot
is marked (`WarmData`): starting on it anywhere but in the epoch a give-up of its own epoch
opened is a `Violation`, and so is a warm slot holding a version the VPS's copy never had,
as the newest data, in the epoch its record names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from orchestrator import (
    area_leases,
    cleanup_policy,
    give_up,
    lineage,
    migration_step,
    phases,
    planner,
    rules,
    warm_copy,
)
from orchestrator.area_leases import LeasePolicy
from orchestrator.cleanup_policy import CleanupPolicy, SideObservation
from orchestrator.lineage import CopyPlan, Lineage
from orchestrator.migration_step import Memory, Record, Result, Seen, StepRules
from orchestrator.models import (
    Area,
    AreaLease,
    CleanupItem,
    LocalInventory,
    Phase,
    ProcessInfo,
    RemoteEntry,
    RemoteInventory,
    Route,
    Side,
    Transaction,
)
from orchestrator.phases import Outcome
from orchestrator.warm_copy import WarmCopy

SERVICE = "tg"
TTL = 2.0
POLICY = LeasePolicy(ttl_s=TTL, clock_margin=0.1, safety_margin_s=0.5)
REMOTE_SLOWNESS = 1.05  # the VPS clock runs slow, within the configured margin
PARK_AFTER = 3
CLEANUP = CleanupPolicy(base_s=0.5, cap_s=4.0, stuck_after_attempts=6)
LEGACY_GRACE = 5.0
LEGACY_AREA = "legacy-1"
DATA_WAIT = 3.0  # rollback_data_wait_s: a rollback waiting this long for its data parks
WARM_INTERVAL = 1.0  # warm_copy_interval_s, on the model's clock
BOUNDS = StepRules(park_after_failures=PARK_AFTER, retry_backoff_base_s=0.5,
                   retry_backoff_cap_s=4.0, rollback_data_wait_s=DATA_WAIT, policy=POLICY)


class Violation(AssertionError):
    """A safety promise (docs/design.md, "Invariants") broke in the model."""


class WarmData(int):
    """A data version put in place from a warm slot, marked with the lineage epoch of the copy
    it came from. A start writes a plain int: the mark lasts until a process ran on it."""

    epoch: int

    def __new__(cls, version: int, *, epoch: int) -> WarmData:
        made = super().__new__(cls, version)
        made.epoch = epoch
        return made


@dataclass
class EntryState:
    generation: int
    lease_until: float
    created_at: float


class World:
    def __init__(
        self,
        *,
        broken_lease_wait: bool = False,
        broken_copy_back: bool = False,
        discard_unreachable_data: bool = False,
        broken_give_up: bool = False,
        broken_warm_copy: bool = False,
    ) -> None:
        self.broken_lease_wait = broken_lease_wait
        self.broken_copy_back = broken_copy_back
        self.broken_give_up = broken_give_up
        self.broken_warm_copy = broken_warm_copy
        # rollback_data = "discard": a copy-back the VPS cannot serve gives its data up
        self.discard_unreachable_data = discard_unreachable_data
        self.t = 100.0
        # PBX, durable
        self.committed: dict[str, Area] = {
            "a1": Area(uuid="a1", service=SERVICE, location=Side.LOCAL, generation=1),
            "a2": Area(uuid="a2", service=SERVICE, location=Side.REMOTE, generation=2),
        }
        self.desired: dict[str, Side] = {a: x.location for a, x in self.committed.items()}
        self.transactions: dict[str, Transaction] = {}
        self.ledger = rules.GenerationLedger()
        self.cleanup: dict[str, CleanupItem] = {}
        self.stored: dict[str, Transaction] = {}  # every transaction's last record, by id
        self.txn_counter = 0
        # PBX, volatile (lost when monitord crashes): the step's memory, the grants known
        self.memory = Memory()
        self.leases: dict[str, AreaLease] = {
            "a2": AreaLease(area="a2", generation=2, owner_id="me", acknowledged_at=self.t, ttl=TTL)
        }
        # PBX daemons (survive a monitord crash: the supervisor adopts them)
        self.local_procs: dict[str, int] = {"a1": 1}
        # VPS, and the link to it (the tunnel's connections so far: rules.LinkEpoch)
        self._vps_up = True
        self._link_up = True
        self.connections = 1
        self.entries: dict[str, EntryState] = {
            "a2": EntryState(2, self.t + TTL * REMOTE_SLOWNESS, self.t),
            LEGACY_AREA: EntryState(3, self.t + 1.0, 0.0),  # the VPS's stale config
        }
        self.remote_procs: dict[str, int] = {"a2": 2, LEGACY_AREA: 3}
        # data: the version each side holds (None: no data dir), the newest ever written,
        # and the durable lineage the runtime keeps
        self.data: dict[tuple[Side, str], int | None] = {
            (Side.LOCAL, "a1"): 1, (Side.REMOTE, "a2"): 1, (Side.REMOTE, LEGACY_AREA): 1,
        }
        self.newest: dict[str, int] = {"a1": 1, "a2": 1, LEGACY_AREA: 1}
        self.lineages: dict[str, Lineage] = {}
        # the PBX's archive of migrated-away sources' data (CLEANUP_SOURCE moves it there)
        self.archive: dict[str, int | None] = {}
        self.given_up: set[str] = set()
        self.given_up_in: dict[str, int] = {}  # the epoch each area's last give-up ended
        # the PBX's warm copies (durable): the record and the data version each slot holds;
        # the copier's last try of each area (volatile)
        self.warm: dict[str, WarmCopy] = {}
        self.warm_version: dict[str, int] = {}
        self.warm_tried: dict[str, float] = {}
        self.warm_starts = 0  # starts on a warm copy (a give-up's), for the tests' coverage
        # (area, epoch, version): what the VPS's copy was while it held the newest data
        self.vps_held: set[tuple[str, int, int]] = set()
        for area in self.committed:
            self._note_vps(area)
        self.started_at = self.t  # monitord's start: what an unknown grant is assumed at
        # faults
        self.preflight_fault = False
        self.copy_fault = False
        self.preflight_failures_seen = 0
        self.talked = False

    # ------------------------------------------------------------------ observations

    @property
    def areas(self) -> list[str]:
        return sorted(self.committed)

    @property
    def reachable(self) -> bool:
        return self.vps_up and self.link_up

    @property
    def link_up(self) -> bool:
        return self._link_up

    @link_up.setter
    def link_up(self, up: bool) -> None:
        self._reconnects(lambda: setattr(self, "_link_up", up))

    @property
    def vps_up(self) -> bool:
        return self._vps_up

    @vps_up.setter
    def vps_up(self, up: bool) -> None:
        self._reconnects(lambda: setattr(self, "_vps_up", up))

    def _reconnects(self, change: Callable[[], None]) -> None:
        """The tunnel connects anew whenever the VPS becomes reachable again."""
        was = self.reachable
        change()
        if self.reachable and not was:
            self.connections += 1

    def active(self) -> list[Transaction]:
        return [t for t in self.transactions.values() if t.is_active]

    def desired_runs(self, side: Side) -> dict[str, int]:
        return dict(
            rules.desired_runs(
                side=side,
                authoritative=self.committed.values(),
                transactions=self.active(),
                lineages=self.lineages,
            )
        )

    def lineage(self, area: str) -> Lineage:
        return rules.lineage_of(area, lineages=self.lineages, committed=self.committed)

    def _start(self, side: Side, area: str, generation: int) -> None:
        """A process starts on `side`: it must find the newest data, then it writes."""
        found = self.data.get((side, area))
        if isinstance(found, WarmData):  # never by a move or a rollback (docs/design.md)
            if self.given_up_in.get(area) != found.epoch \
                    or self.lineage(area).epoch != found.epoch + 1:
                raise Violation(
                    f"t={self.t:.2f}: {area}@{generation} started on {side} on a warm copy of "
                    f"epoch {found.epoch}, outside the epoch a give-up of that epoch opened; "
                    f"lineage {self.lineages.get(area)}; "
                    f"transaction {self.transactions.get(area)}"
                )
            self.warm_starts += 1
        if area in self.newest and found != self.newest[area]:
            raise Violation(
                f"t={self.t:.2f}: {area}@{generation} started on {side} with data version "
                f"{found}, but version {self.newest[area]} was written; "
                f"lineage {self.lineages.get(area)}; transaction {self.transactions.get(area)}"
            )
        version = (found or 0) + 1
        self._put(side, area, version)
        self.newest[area] = version
        self._procs(side)[area] = generation

    def _delete_data(self, side: Side, area: str) -> None:
        managed = area in self.committed  # an orphan's data (a stale VPS entry) is not ours
        if managed and self.data.get((side, area)) == self.newest[area]:
            newest = self.newest[area]
            if not any(self.data.get((s, area)) == newest for s in Side if s is not side):
                raise Violation(f"t={self.t:.2f}: the only newest copy of {area} ({side}) deleted")
        self.data.pop((side, area), None)

    def _claim(self, side: Side, area: str) -> None:
        self._set_lineage(area, lineage.claimed(self.lineage(area), side))

    def _put(self, side: Side, area: str, version: int | None) -> None:
        self.data[(side, area)] = version
        self._note_vps(area)

    def _set_lineage(self, area: str, new: Lineage) -> None:
        self.lineages[area] = new
        self._note_vps(area)

    def _note_vps(self, area: str) -> None:
        """Remember each (epoch, version) the VPS's copy had while it held the newest data:
        the only things a warm copy may ever be of. Every data and lineage write passes here."""
        version = self.data.get((Side.REMOTE, area))
        if area in self.committed and version is not None \
                and Side.REMOTE in self.lineage(area).holders:
            self.vps_held.add((area, self.lineage(area).epoch, int(version)))

    def parked(self) -> bool:
        return any(t.phase is Phase.PARKED for t in self.transactions.values())

    def check(self) -> None:
        """Safety: never two running processes for one area, on any sides; a warm copy is
        always of a version the VPS's copy really had, as the newest data, in the epoch its
        record names (never torn, never of another epoch)."""
        for area in set(self.local_procs) & set(self.remote_procs):
            raise Violation(
                f"t={self.t:.2f}: area {area} runs locally at generation "
                f"{self.local_procs[area]} and remotely at {self.remote_procs[area]}; "
                f"transaction: {self.transactions.get(area)}"
            )
        for area, copy in self.warm.items():
            version = self.warm_version[area]
            if (area, copy.epoch, version) not in self.vps_held:
                raise Violation(
                    f"t={self.t:.2f}: the warm copy of {area} holds version {version} for epoch "
                    f"{copy.epoch}, which the VPS never held as the newest data then"
                )

    def _check_stop_allowed(self, actor: str, side: Side, area: str, generation: int) -> None:
        """Cleanup and reconcile never stop what the rules say may run (e.g. a newer gen)."""
        if self.desired_runs(side).get(area) == generation:
            raise Violation(f"{actor} stopped {area}@{generation} on {side}, which may run")

    # ------------------------------------------------------------------ the VPS (agent)

    def _lease_until(self) -> float:
        return self.t + TTL * REMOTE_SLOWNESS

    def agent_create(self, area: str, generation: int) -> bool:
        entry = self.entries.get(area)
        if entry is not None and entry.generation > generation:
            return False  # 409: a newer generation holds the area
        if entry is not None and entry.generation < generation:
            self.remote_procs.pop(area, None)
        self.entries[area] = EntryState(generation, self._lease_until(), self.t)
        if self.remote_procs.get(area) != generation:
            self._start(Side.REMOTE, area, generation)
        return True

    def agent_stop(self, area: str, generation: int) -> None:
        if self.remote_procs.get(area) == generation:
            del self.remote_procs[area]

    def agent_delete(self, area: str, generation: int) -> None:
        entry = self.entries.get(area)
        if entry is not None and entry.generation != generation:
            return  # 409: touches nothing
        if entry is not None:
            self._delete_data(Side.REMOTE, area)
        self.entries.pop(area, None)
        if self.remote_procs.get(area) == generation:
            del self.remote_procs[area]

    def renew(self) -> None:
        """The lease renewer: grant exactly rules.desired_runs(side=REMOTE)."""
        if not self.reachable:
            return
        for area, generation in self.desired_runs(Side.REMOTE).items():
            self.leases[area] = AreaLease(
                area=area, generation=generation, owner_id="me", acknowledged_at=self.t, ttl=TTL
            )
            entry = self.entries.get(area)
            if entry is not None and entry.generation == generation:
                entry.lease_until = self._lease_until()
                if area not in self.remote_procs:
                    self._start(Side.REMOTE, area, generation)

    # ------------------------------------------------------------------ the PBX

    def supervise(self) -> None:
        """The local supervisor runs exactly rules.desired_runs(side=LOCAL)."""
        wanted = self.desired_runs(Side.LOCAL)
        for area, generation in list(self.local_procs.items()):
            if wanted.get(area) != generation:
                del self.local_procs[area]
        for area, generation in wanted.items():
            if area not in self.local_procs:
                self._start(Side.LOCAL, area, generation)

    def _seen(self, txn: Transaction, result: Result | None = None) -> Seen:
        return Seen(
            at=self.t, now=self.t, desired=self.desired.get(txn.area),
            lineage=self.lineage(txn.area), leases=self._known_leases(txn),
            link=rules.LinkEpoch(connections=self.connections, connected=self.reachable),
            result=result,
        )

    def _known_leases(self, txn: Transaction) -> dict[int, AreaLease]:
        """The grants the runtime knows for the record's generations, as its lease ledger has
        them; a deliberately broken runtime takes every grant as long gone."""
        given_up = txn.route is Route.GIVEN_UP_TO_LOCAL
        if self.broken_lease_wait or (self.broken_give_up and given_up):
            return {g: AreaLease(area=txn.area, generation=g, owner_id="me",
                                 acknowledged_at=-1e9, ttl=TTL)
                    for g in (txn.generation, txn.source_generation)}
        lease = self.leases.get(txn.area)
        return {} if lease is None else {lease.generation: lease}

    def _store(self, decision: Record) -> Transaction:
        """Keep what the core decided: the record (durable) and its memory (volatile)."""
        new = decision.record
        self.memory = decision.memory
        self.transactions[new.area] = new
        self.stored[new.transaction_id] = new
        return new

    def _apply(self, txn: Transaction, outcome: Outcome, *, new_generation: int | None = None
               ) -> Transaction:
        """Recovery's or an operator's outcome, through the engine's own step."""
        return self._store(migration_step.advance(
            txn, outcome, self._seen(txn), self.memory, BOUNDS, new_generation=new_generation
        ))

    def start_transaction(self, area: str) -> None:
        committed = self.committed[area]
        self.ledger, generation = self.ledger.issue(area, floor=committed.generation)
        self.txn_counter += 1
        self.transactions[area] = Transaction(
            transaction_id=f"t{self.txn_counter}",
            service=SERVICE,
            area=area,
            source=committed.location,
            destination=committed.location.other,  # (move_to_open: never where it is)
            generation=generation,
            source_generation=committed.generation,
            started_at=self.t,
            updated_at=self.t,
            source_abandoned=give_up.abandons_source(committed, self.lineage(area)),
        )
        self.stored[f"t{self.txn_counter}"] = self.transactions[area]

    def engine_step(self, area: str, *, crash_before_persist: bool, cut_link_after: bool) -> None:
        """One step of the migration engine, decided by orchestrator/migration_step.py:
        ask, perform, store (the model has no move slots: one is always free at once)."""
        txn = self.transactions.get(area)
        if txn is None or not txn.is_active:
            destination = give_up.move_to_open(self.committed[area], self.lineage(area),
                                               desired=self.desired[area])
            if destination is not None and not self.parked() \
                    and self.memory.may_open(area, now=self.t):
                self.start_transaction(area)
            return
        if txn.phase is Phase.PARKED:
            return
        source_was_running = txn.area in self._procs(txn.source)
        decision = self._decide(txn, None)
        performed = False
        while not isinstance(decision, Record | migration_step.Idle):
            if isinstance(decision, migration_step.TakeSlot):
                result = decision.free
            else:
                result = self._perform_step(txn, decision.actions, cut_link_after=cut_link_after)
                performed = True
            decision = self._decide(txn, result)
        if isinstance(decision, migration_step.Idle):
            return
        if performed and crash_before_persist:
            self.crash_local()
            return
        self._store(decision)
        self.supervise()
        if txn.phase is Phase.PREFLIGHT and decision.outcome is not Outcome.OK:
            self.preflight_failures_seen += 1
            if source_was_running and area not in self._procs(txn.source):
                raise Violation(f"a failed preflight stopped the source of {area}")

    def _decide(self, txn: Transaction, result: Result | None) -> migration_step.Decision:
        decision = migration_step.decide(txn, self._seen(txn, result), self.memory, BOUNDS)
        if isinstance(decision, migration_step.Perform):
            self.memory = decision.memory
        return decision

    def _perform_step(self, txn: Transaction, actions: tuple[phases.Action, ...], *,
                      cut_link_after: bool) -> Result:
        self.talked = False
        reported = self._perform(txn, actions)
        if reported is None:
            return Result(actions=actions)  # nothing to report: no fault either
        outcome, error = reported
        if cut_link_after and self.link_up:
            self.link_up = False
            if self.talked and Outcome.UNREACHABLE in phases.allowed(txn):
                error = "SSH_UNREACHABLE"  # the answer was lost
        if error is not None:
            return Result(actions=actions, error_code=error)
        return Result(actions=actions, outcome=outcome)

    def _vps(self) -> bool:
        """Whether the VPS answers; remembers that this step talked to it."""
        if self.reachable:
            self.talked = True
        return self.reachable

    def _procs(self, side: Side) -> dict[str, int]:
        return self.local_procs if side is Side.LOCAL else self.remote_procs

    def _perform(
        self, txn: Transaction, actions: tuple[phases.Action, ...]
    ) -> tuple[Outcome, str | None] | None:
        remote_dest = txn.destination is Side.REMOTE
        for action in actions:
            match action:
                case phases.RunPreflight(source_given_up=given_up):
                    if given_up:  # a given-up VPS is never asked
                        if self.preflight_fault:
                            return Outcome.FAILED, "PREFLIGHT_DISK_SPACE"
                        return Outcome.OK, None
                    if not self._vps():
                        return Outcome.UNREACHABLE, "PREFLIGHT_AGENT"
                    if self.preflight_fault:
                        return Outcome.FAILED, "PREFLIGHT_DISK_SPACE"
                    return Outcome.OK, None
                case phases.SuppressSource(side=side, generation=generation):
                    if side is Side.LOCAL:
                        if self.local_procs.get(txn.area) == generation:
                            del self.local_procs[txn.area]
                        return Outcome.OK, None
                    if not self._vps():
                        return Outcome.UNREACHABLE, "AGENT_UNREACHABLE"
                    self.agent_stop(txn.area, generation)
                    if txn.area in self.remote_procs:
                        return Outcome.FAILED, "DAEMON_STOP_FAILED"
                    return Outcome.OK, None
                case phases.CopyData(source=source, destination=destination, own_copy=own_copy):
                    if own_copy:  # the warm copy a give-up chose, else the PBX's own
                        copy = self.warm.pop(txn.area, None)
                        version = self.warm_version.pop(txn.area, None)
                        if copy is not None and version is not None \
                                and warm_copy.restores(copy, self.lineage(txn.area)):
                            self._put(Side.LOCAL, txn.area, WarmData(version, epoch=copy.epoch))
                        elif (Side.LOCAL, txn.area) not in self.data:
                            kept = self.archive.pop(txn.area, None)
                            self._put(Side.LOCAL, txn.area, kept or 0)
                        return Outcome.OK, None
                    if not self._vps():
                        return Outcome.UNREACHABLE, "SSH_UNREACHABLE"
                    if self.copy_fault:
                        return Outcome.FAILED, "COPY_INCOMPLETE"
                    plan = lineage.copy_plan(
                        self.lineage(txn.area), source=source, destination=destination
                    )
                    if plan is CopyPlan.REFUSE:
                        return Outcome.FAILED, "COPY_INCOMPLETE"
                    if plan is CopyPlan.COPY:
                        found = self.data.get((source, txn.area))
                        if self.broken_warm_copy and destination is Side.LOCAL \
                                and txn.area in self.warm:
                            # deliberately wrong: a move home starts from the warm copy
                            found = WarmData(self.warm_version[txn.area],
                                             epoch=self.warm[txn.area].epoch)
                        self._put(destination, txn.area, found)
                        self._set_lineage(txn.area, lineage.copied(
                            self.lineage(txn.area), source=source, destination=destination
                        ))
                    return Outcome.OK, None
                case phases.ReturnData(source=source, destination=destination):
                    if not self._vps():
                        if self.discard_unreachable_data:
                            self._set_lineage(txn.area, lineage.discarded(
                                self.lineage(txn.area), keep=destination
                            ))
                            kept = self.data.get((destination, txn.area))
                            self.newest[txn.area] = kept or 0  # the loss is accepted
                            return Outcome.DATA_DISCARDED, None
                        return Outcome.UNREACHABLE, "SSH_UNREACHABLE"
                    # Stop the destination again first: copy only from a stopped process.
                    if source is Side.REMOTE:
                        self.agent_stop(txn.area, action.source_generation)
                    elif self.local_procs.get(txn.area) == action.source_generation:
                        del self.local_procs[txn.area]
                    if not self.broken_copy_back:
                        self._put(destination, txn.area, self.data.get((source, txn.area)))
                    self._set_lineage(txn.area, lineage.copied(
                        self.lineage(txn.area), source=source, destination=destination
                    ))
                    return Outcome.DATA_RETURNED, None
                case phases.CreateDestination(generation=generation):
                    if not remote_dest:
                        self._claim(Side.LOCAL, txn.area)
                        self._start(Side.LOCAL, txn.area, generation)
                        return Outcome.OK, None
                    if not self._vps():
                        return Outcome.UNREACHABLE, "AGENT_UNREACHABLE"
                    self._claim(Side.REMOTE, txn.area)
                    self.leases[txn.area] = AreaLease(
                        area=txn.area, generation=generation, owner_id="me",
                        acknowledged_at=self.t, ttl=TTL,
                    )
                    if not self.agent_create(txn.area, generation):
                        return Outcome.FAILED, "DESTINATION_CONFLICT"
                    return Outcome.OK, None
                case phases.CheckHealth(generation=generation):
                    if remote_dest and not self._vps():
                        return Outcome.UNREACHABLE, "AGENT_UNREACHABLE"
                    if self._procs(txn.destination).get(txn.area) == generation:
                        return Outcome.OK, None
                    return Outcome.FAILED, "HEALTHCHECK_TIMEOUT"
                case phases.CommitLocation(location=location, generation=generation):
                    self.committed[txn.area] = Area(
                        uuid=txn.area, service=SERVICE, location=location, generation=generation
                    )
                    return Outcome.OK, None
                case phases.CleanupSource(side=side, generation=generation):
                    if side is Side.LOCAL:
                        if self.local_procs.get(txn.area) == generation:
                            del self.local_procs[txn.area]
                        self.archive[txn.area] = self.data.get((Side.LOCAL, txn.area))
                        self._delete_data(Side.LOCAL, txn.area)  # archived away
                        return Outcome.OK, None
                    if not self._vps():
                        return Outcome.UNREACHABLE, "AGENT_UNREACHABLE"
                    self.agent_delete(txn.area, generation)
                    return Outcome.OK, None
                case phases.FenceDestination(generation=generation, keep_data=keep_data):
                    if not remote_dest:
                        if self.local_procs.get(txn.area) == generation:
                            del self.local_procs[txn.area]
                        return Outcome.FENCED, None
                    if not self._vps():
                        return Outcome.UNREACHABLE, "AGENT_UNREACHABLE"
                    if keep_data:
                        self.agent_stop(txn.area, generation)
                    else:
                        self.agent_delete(txn.area, generation)
                    return Outcome.FENCED, None
                case phases.EnqueueCleanup(item=item):
                    self.cleanup.setdefault(item.id, item)
                case phases.WaitLeaseExpiry(until=until, lease=lease):
                    self.leases[txn.area] = lease  # the grant being waited out
                    if self.t >= until:
                        return Outcome.LEASE_EXPIRED, None
                    return None
                case phases.RestartSource(side=side):
                    self._claim(side, txn.area)
                    return Outcome.OK, None
                case phases.Park() | phases.Finish():
                    return None
        return None

    def give_up_vps(self, area: str) -> bool:
        """The operator gives the VPS up for `area` (orchestrator/give_up.py): False when it
        is refused; otherwise the loss is accepted — the newest data is what the PBX holds, or
        the warm copy the give-up chose (orchestrator/warm_copy.py)."""
        committed = self.committed[area]
        txn = self.transactions.get(area)
        generations = give_up.remote_generations(committed, txn)
        leases = {g: self._known_lease(area, g) for g in generations}
        before = self.lineage(area)
        decision = give_up.decide(area=committed, txn=txn, lineage=before,
                                  leases=leases, now=self.t, policy=POLICY)
        if not isinstance(decision, give_up.Abandon):
            return False
        self.memory = self.memory.forgiven(SERVICE, areas=[area])
        self.desired[area] = Side.LOCAL
        copy = self.warm.get(area)
        chose = copy is not None and (
            self.broken_warm_copy  # deliberately wrong: whatever copy the slot holds
            or warm_copy.usable_at_give_up(copy, before, generations=generations)
        )
        if copy is not None and chose:  # recorded before the give-up, as the runtime does
            self.warm[area] = warm_copy.chosen(copy, before)
        self._set_lineage(area, lineage.discarded(before, keep=Side.LOCAL))
        if chose:  # the loss accepted is the warm copy's age
            kept: int | None = self.warm_version[area]
        else:
            kept = self.data.get((Side.LOCAL, area), self.archive.get(area))
        self.newest[area] = kept or 0
        self.given_up.add(area)
        self.given_up_in[area] = before.epoch
        if txn is not None and decision.outcome is not None:
            generation = None
            if decision.outcome is Outcome.SOURCE_ABANDONED:
                self.ledger, generation = self.ledger.issue(
                    area, floor=max(committed.generation, txn.generation)
                )
            self._apply(txn, decision.outcome, new_generation=generation)
        self.supervise()
        return True

    def _known_lease(self, area: str, generation: int) -> AreaLease:
        """The best-known grant of (area, generation), as the runtime's renewer has it."""
        if self.broken_give_up:  # deliberately wrong: as if every grant were long gone
            return AreaLease(area=area, generation=generation, owner_id="me",
                             acknowledged_at=-1e9, ttl=TTL)
        lease = self.leases.get(area)
        if lease is not None and lease.generation == generation:
            return lease
        return area_leases.after_restart(area=area, generation=generation, owner_id="me",
                                         now=self.started_at, policy=POLICY)

    def crash_local(self) -> None:
        """monitord dies and restarts: volatile state is lost, recovery runs on start."""
        self.started_at = self.t
        self.warm_tried = {}
        history = sorted(self.stored.values(), key=lambda t: t.updated_at, reverse=True)
        self.memory = Memory.from_history(t.to_storage() for t in history)
        self.leases = {
            t.area: area_leases.after_restart(
                area=t.area, generation=t.generation, owner_id="me", now=self.t, policy=POLICY
            )
            for t in self.active()
        }
        for txn in self.active():
            outcome = rules.recovery_outcome(txn, committed=self.committed[txn.area])
            if outcome is not None:
                self._apply(txn, outcome)
        self.supervise()

    def retry_parked(self) -> None:
        """The operator's retry (monitord/engine/operator_verbs.py), as the engine does it."""
        self.memory = self.memory.forgiven(SERVICE, areas=self.areas)
        for txn in list(self.transactions.values()):
            if txn.phase is Phase.PARKED and phases.parked_rollback(txn) and phases.awaits_data(
                txn, self.lineage(txn.area)
            ):
                self._apply(txn, Outcome.ROLLBACK_RESUMED)
            elif txn.phase is Phase.PARKED:
                self.ledger, generation = self.ledger.issue(
                    txn.area, floor=max(self.committed[txn.area].generation, txn.generation)
                )
                self._apply(txn, Outcome.RETRY_REQUESTED, new_generation=generation)

    # ------------------------------------------------------------------ background work

    def advance(self, dt: float) -> None:
        self.t += dt
        for area, generation in list(self.remote_procs.items()):
            entry = self.entries.get(area)
            if entry is None or entry.generation != generation or entry.lease_until <= self.t:
                del self.remote_procs[area]  # the agent's timer / the lease guard

    def take_warm_copy(self, area: str, *, cut: bool = False) -> bool:
        """The warm copier's pass over `area` (orchestrator/warm_copy.py): when `due`, a
        snapshot of the VPS's copy into the PBX's warm slot, recorded with the epoch and
        generation it was taken in. `cut`: the link drops mid-way, nothing is recorded and the
        slot keeps its previous copy. True when a copy was recorded."""
        committed = self.committed[area]
        now_lineage = self.lineage(area)
        if not warm_copy.due(committed, now_lineage, moving=bool(self.active()),
                             last_try=self.warm_tried.get(area), now=self.t,
                             interval_s=WARM_INTERVAL):
            return False
        self.warm_tried[area] = self.t
        version = self.data.get((Side.REMOTE, area))
        if cut:
            self.link_up = False
        if not self.reachable or version is None:
            return False
        self.warm[area] = WarmCopy(
            area=area, service=SERVICE, generation=committed.generation,
            epoch=now_lineage.epoch, taken_at=self.t, received_at=self.t, files=1,
            bytes=version, sent_bytes=version, digest=f"{version:064x}",
        )
        self.warm_version[area] = version
        return True

    def drop_warm_copies(self) -> None:
        """The copier's sweep: a warm copy no rule keeps (`warm_copy.kept`) goes."""
        for area, copy in list(self.warm.items()):
            txn = self.transactions.get(area)
            moving = txn is not None and txn.is_active
            if not warm_copy.kept(copy, self.committed.get(area), self.lineage(area),
                                  moving=moving):
                del self.warm[area], self.warm_version[area]

    def crash_vps(self) -> None:
        self.vps_up = False
        self.remote_procs.clear()

    def boot_vps(self) -> None:
        self.vps_up = True  # entries come back from the cache; nothing runs until granted

    def observe(self, side: Side, area: str) -> SideObservation:
        if side is Side.LOCAL:
            procs = {self.local_procs[area]} if area in self.local_procs else set()
            return SideObservation(side=side, area=area, process_generations=frozenset(procs))
        entry = self.entries.get(area)
        return SideObservation(
            side=side,
            area=area,
            entry_generations=frozenset({entry.generation} if entry else set()),
            process_generations=frozenset(
                {self.remote_procs[area]} if area in self.remote_procs else set()
            ),
        )

    def run_cleanup(self, jitter: float = 0.5) -> None:
        for item in sorted(self.cleanup.values(), key=lambda i: i.next_attempt_at):
            if not cleanup_policy.is_due(item, now=self.t):
                continue
            if item.side is Side.REMOTE and not self.reachable:
                self.cleanup[item.id] = cleanup_policy.after_failure(
                    item, now=self.t, jitter=jitter, error="SSH_UNREACHABLE", policy=CLEANUP
                )
                continue
            decision = cleanup_policy.decide(item, self.observe(item.side, item.area))
            if isinstance(decision, cleanup_policy.RemoveAt):
                if decision.generation != item.generation:
                    raise Violation(f"cleanup of {item.id} acts on {decision.generation}")
                self._check_stop_allowed("cleanup", item.side, item.area, item.generation)
                if not lineage.may_discard_data(self.lineage(item.area), item.side):
                    if item.side is Side.REMOTE:  # fence the process, keep the newest data
                        self.agent_stop(item.area, item.generation)
                    elif self.local_procs.get(item.area) == item.generation:
                        del self.local_procs[item.area]
                    continue
                self._remove(item.side, item.area, item.generation)
                decision = cleanup_policy.decide(item, self.observe(item.side, item.area))
            if isinstance(decision, cleanup_policy.Done):
                del self.cleanup[item.id]

    def _remove(self, side: Side, area: str, generation: int) -> None:
        if side is Side.REMOTE:
            self.agent_delete(area, generation)
        elif self.local_procs.get(area) == generation:
            del self.local_procs[area]

    def inventories(self) -> tuple[LocalInventory, RemoteInventory | None]:
        local = LocalInventory(
            processes=tuple(
                ProcessInfo(area=a, service=SERVICE, generation=g, pid=1, started_at=0.0)
                for a, g in self.local_procs.items()
            )
        )
        if not self.reachable:
            return local, None
        remote = RemoteInventory(
            entries=tuple(
                RemoteEntry(
                    area=a, service=SERVICE, generation=e.generation, created_at=e.created_at
                )
                for a, e in self.entries.items()
            ),
            processes=tuple(
                ProcessInfo(area=a, service=SERVICE, generation=g, pid=1, started_at=0.0)
                for a, g in self.remote_procs.items()
            ),
        )
        return local, remote

    def plan(self) -> planner.Plan:
        local, remote = self.inventories()
        return planner.plan(
            authoritative=self.committed.values(),
            transactions=self.active(),
            cleanup_items=self.cleanup.values(),
            local_inventory=local,
            remote_inventory=remote,
            now=self.t,
            legacy_grace_s=LEGACY_GRACE,
        )

    def reconcile(self) -> None:
        result = self.plan()
        for action in result.actions:
            match action:
                case planner.CreateRemoteEntry(area=area, generation=generation):
                    self._claim(Side.REMOTE, area)  # raises if the VPS lacks the newest data
                    self.leases[area] = AreaLease(
                        area=area, generation=generation, owner_id="me",
                        acknowledged_at=self.t, ttl=TTL,
                    )
                    self.agent_create(area, generation)
                case planner.RemoveRemoteEntry(area=area, generation=generation, side=side):
                    self._check_stop_allowed("reconcile", side, area, generation)
                    if lineage.may_discard_data(self.lineage(area), side):
                        self._remove(side, area, generation)
                    else:
                        self.agent_stop(area, generation)
                case planner.StopProcess(area=area, generation=generation, side=side):
                    self._check_stop_allowed("reconcile", side, area, generation)
                    if side is Side.REMOTE:
                        self.agent_stop(area, generation)
                    else:
                        self._remove(side, area, generation)
        again = self.plan()
        if again.actions:
            raise Violation(f"reconcile is not idempotent: second pass plans {again.actions}")

    # ------------------------------------------------------------------ convergence

    def settle(self, *, rounds: int = 400) -> None:
        """Faults stop: the link and VPS come back, the operator retries parked services."""
        self.link_up = True
        self.preflight_fault = self.copy_fault = False
        if not self.vps_up:
            self.boot_vps()
        for _ in range(rounds):
            self.retry_parked()
            self.supervise()
            self.renew()
            for area in self.areas:
                self.engine_step(area, crash_before_persist=False, cut_link_after=False)
                self.check()
            self.run_cleanup()
            if self.reachable:
                self.reconcile()
            self.check()
            if self.converged():
                return
            self.advance(0.5)
            self.check()
        raise Violation(f"did not converge: {self.describe()}")

    def converged(self) -> bool:
        if self.active() or self.cleanup:
            return False
        for area, placed in self.committed.items():
            if placed.location is not self.desired[area]:
                return False
            runs = self._procs(placed.location)
            if runs.get(area) != placed.generation or area in self._procs(placed.location.other):
                return False
        remote_entries = {a: e.generation for a, e in self.entries.items()}
        expected = {a: p.generation for a, p in self.committed.items() if p.location is Side.REMOTE}
        return remote_entries == expected

    def describe(self) -> str:
        return (
            f"t={self.t} committed={self.committed} desired={self.desired} "
            f"txns={self.transactions} cleanup={list(self.cleanup)} local={self.local_procs} "
            f"remote={self.remote_procs} entries={self.entries} link={self.link_up} "
            f"vps={self.vps_up}"
        )

"""The reconcile planner: compare what should run with what does, return actions.

`plan()` is one pass over the authoritative placement (custom_config.json), the active
transactions, the cleanup queue and both sides' inventories. It indexes everything in
dicts first and then looks at each area once, so a pass is O(n) in areas + entries +
processes. Its rules:

* an area in an active transaction belongs to the migration engine: not touched;
* anything a cleanup item already covers (same area, side and generation) is left to it;
* a remote entry or process at an older generation than committed, or for an area
  committed local, is an orphan: removed / stopped AT ITS generation;
* a local process for an area committed remote (or at an older generation) is an orphan;
* an area committed remote with no entry at its generation gets one created (at the
  committed generation; the runtime grants the lease);
* a generation newer than the committed one is never touched (a rollback's cleanup item
  owns it, or an operator must look): it is reported as drift;
* a legacy area (in no authoritative entry, no transaction, no cleanup item) is removed
  only once it has been seen for `legacy_grace_s` AND both sides were observed this pass.

Nothing here ever moves an area: only transactions do. Running the plan's actions and
planning again yields no actions (tested as a property). Called by
monitord/engine/reconciler.py on connect, periodically and after each transaction.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from orchestrator.models import (
    Area,
    CleanupItem,
    LocalInventory,
    ProcessInfo,
    RemoteEntry,
    RemoteInventory,
    Side,
    Transaction,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanAction:
    """One reconcile step for the runtime; always names the generation it acts on."""

    service: str
    area: str
    side: Side
    generation: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RemoveRemoteEntry(PlanAction):
    """Agent: stop the area's process and delete its entry and data, at `generation` only."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StopProcess(PlanAction):
    """Stop the area's daemon on `side`, at `generation` only."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CreateRemoteEntry(PlanAction):
    """Agent: create the entry at the committed `generation` with a fresh lease, start it."""


@dataclass(frozen=True, slots=True)
class Drift:
    """Discrepancies between what should run and what does, by kind."""

    orphan_entries: int = 0
    orphan_processes: int = 0
    missing_entries: int = 0
    legacy: int = 0
    newer_generation: int = 0
    awaiting_cleanup: int = 0

    @property
    def total(self) -> int:
        return (
            self.orphan_entries
            + self.orphan_processes
            + self.missing_entries
            + self.legacy
            + self.newer_generation
            + self.awaiting_cleanup
        )


@dataclass(frozen=True, slots=True)
class Plan:
    """The actions of one pass and the drift they are expected to leave."""

    actions: tuple[PlanAction, ...]
    drift_before: Drift
    drift_after_expected: Drift


@dataclass(slots=True)
class _Tally:
    before: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    after: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def fixed(self, kind: str) -> None:
        self.before[kind] += 1

    def kept(self, kind: str) -> None:
        self.before[kind] += 1
        self.after[kind] += 1

    def drifts(self) -> tuple[Drift, Drift]:
        return Drift(**self.before), Drift(**self.after)


@dataclass(frozen=True, slots=True)
class _Index:
    committed: dict[str, Area]
    busy: frozenset[str]  # areas in an active transaction
    cleanup_keys: frozenset[tuple[str, Side, int]]
    cleanup_areas: frozenset[str]


def _classify(index: _Index, *, area: str, side: Side, generation: int) -> str:
    """'ok' | 'busy' | 'cleanup' | 'legacy' | 'newer' | 'orphan' for one thing on one side."""
    if area in index.busy:
        return "busy"
    if (area, side, generation) in index.cleanup_keys:
        return "cleanup"
    committed = index.committed.get(area)
    if committed is None:
        return "cleanup" if area in index.cleanup_areas else "legacy"
    if generation > committed.generation:
        return "newer"
    if committed.location is side and generation == committed.generation:
        return "ok"
    return "orphan"


def _legacy_due(first_seen: float, *, now: float, grace: float, both_sides: bool) -> bool:
    return both_sides and now - first_seen >= grace


def plan(
    *,
    authoritative: Iterable[Area],
    transactions: Iterable[Transaction],
    cleanup_items: Iterable[CleanupItem],
    local_inventory: LocalInventory,
    remote_inventory: RemoteInventory | None,
    now: float,
    legacy_grace_s: float,
    held: Iterable[str] = (),
) -> Plan:
    """One reconcile pass. `remote_inventory` None: the VPS was not observed this pass.

    `now` is wall time, compared with entries' `created_at` and processes' `started_at`.
    `held`: areas left alone as those in a transaction are (orchestrator/state_loss.py: a
    VPS entry of one may hold its newest data, never an orphan to remove).
    """
    items = list(cleanup_items)
    index = _Index(
        committed={area.uuid: area for area in authoritative},
        busy=frozenset(t.area for t in transactions if t.is_active) | frozenset(held),
        cleanup_keys=frozenset((c.area, c.side, c.generation) for c in items),
        cleanup_areas=frozenset(c.area for c in items),
    )
    one = _Pass(index=index, now=now, legacy_grace_s=legacy_grace_s,
                both_sides=remote_inventory is not None)
    if remote_inventory is not None:
        one.remote(remote_inventory)
    one.local(local_inventory)
    before, after = one.tally.drifts()
    return Plan(actions=tuple(one.actions), drift_before=before, drift_after_expected=after)


@dataclass(slots=True)
class _Pass:
    """One pass's verdicts: the actions, and the tally of what was found and what stays."""

    index: _Index
    now: float
    legacy_grace_s: float
    both_sides: bool
    actions: list[PlanAction] = field(default_factory=list)
    tally: _Tally = field(default_factory=lambda: _Tally())

    def _consider(self, kind: str, thing: RemoteEntry | ProcessInfo, first_seen: float) -> bool:
        """Tally one discrepancy; True when an action should remove it now."""
        if kind in ("ok", "busy"):
            return False
        if kind == "cleanup":
            self.tally.kept("awaiting_cleanup")
            return False
        if kind == "newer":
            self.tally.kept("newer_generation")
            return False
        if kind == "legacy":
            if _legacy_due(first_seen, now=self.now, grace=self.legacy_grace_s,
                           both_sides=self.both_sides):
                self.tally.fixed("legacy")
                return True
            self.tally.kept("legacy")
            return False
        self.tally.fixed(
            "orphan_entries" if isinstance(thing, RemoteEntry) else "orphan_processes")
        return True

    def remote(self, inventory: RemoteInventory) -> None:
        """The VPS's entries and processes, then the committed areas it lacks an entry for."""
        entries_at: set[tuple[str, int]] = set()
        newest_entry: dict[str, int] = {}
        removed: set[tuple[str, int]] = set()
        for entry in inventory.entries:
            entries_at.add((entry.area, entry.generation))
            newest_entry[entry.area] = max(newest_entry.get(entry.area, -1), entry.generation)
            kind = _classify(self.index, area=entry.area, side=Side.REMOTE,
                             generation=entry.generation)
            if self._consider(kind, entry, entry.created_at):
                removed.add((entry.area, entry.generation))
                self.actions.append(RemoveRemoteEntry(
                    service=entry.service, area=entry.area, side=Side.REMOTE,
                    generation=entry.generation,
                ))
        for proc in inventory.processes:
            if (proc.area, proc.generation) in removed:
                continue  # removing the entry stops its process
            kind = _classify(self.index, area=proc.area, side=Side.REMOTE,
                             generation=proc.generation)
            if kind == "ok" and (proc.area, proc.generation) not in entries_at:
                kind = "orphan"  # a process the agent has no entry for
            if self._consider(kind, proc, proc.started_at):
                self.actions.append(StopProcess(
                    service=proc.service, area=proc.area, side=Side.REMOTE,
                    generation=proc.generation,
                ))
        self._missing_entries(entries_at, newest_entry)

    def _missing_entries(self, entries_at: set[tuple[str, int]],
                         newest_entry: dict[str, int]) -> None:
        for area in self.index.committed.values():
            if area.location is not Side.REMOTE or area.uuid in self.index.busy:
                continue
            if (area.uuid, area.generation) in entries_at:
                continue
            if newest_entry.get(area.uuid, -1) > area.generation:
                continue  # already tallied as newer_generation; never replaced by planner
            if (area.uuid, Side.REMOTE, area.generation) in self.index.cleanup_keys:
                self.tally.kept("awaiting_cleanup")  # never recreate what a cleanup removes
                continue
            self.tally.fixed("missing_entries")
            self.actions.append(CreateRemoteEntry(
                service=area.service, area=area.uuid, side=Side.REMOTE,
                generation=area.generation,
            ))

    def local(self, inventory: LocalInventory) -> None:
        for proc in inventory.processes:
            kind = _classify(self.index, area=proc.area, side=Side.LOCAL,
                             generation=proc.generation)
            if self._consider(kind, proc, proc.started_at):
                self.actions.append(StopProcess(
                    service=proc.service, area=proc.area, side=Side.LOCAL,
                    generation=proc.generation,
                ))

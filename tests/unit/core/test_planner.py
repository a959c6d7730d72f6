"""The reconcile planner: orphans go, missing remote entries come, nothing else is touched."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from hypothesis import given
from hypothesis import strategies as st

from orchestrator import planner
from orchestrator.models import (
    Area,
    CleanupItem,
    LocalInventory,
    Phase,
    ProcessInfo,
    RemoteEntry,
    RemoteInventory,
    Side,
    Transaction,
)

from .profiles import PROFILE

NOW = 10_000.0
GRACE = 600.0


def area(uuid: str, location: Side, generation: int) -> Area:
    return Area(uuid=uuid, service="tg", location=location, generation=generation)


def proc(uuid: str, generation: int, started_at: float = 0.0) -> ProcessInfo:
    return ProcessInfo(
        area=uuid, service="tg", generation=generation, pid=100, started_at=started_at
    )


def entry(uuid: str, generation: int, created_at: float = 0.0) -> RemoteEntry:
    return RemoteEntry(area=uuid, service="tg", generation=generation, created_at=created_at)


def busy(uuid: str) -> Transaction:
    return Transaction(
        transaction_id=f"t-{uuid}", service="tg", area=uuid, source=Side.LOCAL,
        destination=Side.REMOTE, phase=Phase.COPY, generation=9, source_generation=1,
        started_at=0.0, updated_at=0.0,
    )


def cleanup(uuid: str, side: Side, generation: int) -> CleanupItem:
    return CleanupItem(
        id=f"c-{uuid}", service="tg", area=uuid, side=side, generation=generation,
        next_attempt_at=0.0, created_at=0.0,
    )


@dataclass
class Snapshot:
    authoritative: list[Area] = field(default_factory=list)
    transactions: list[Transaction] = field(default_factory=list)
    cleanup_items: list[CleanupItem] = field(default_factory=list)
    local: list[ProcessInfo] = field(default_factory=list)
    entries: list[RemoteEntry] = field(default_factory=list)
    remote: list[ProcessInfo] = field(default_factory=list)
    remote_observed: bool = True

    def plan(self, *, now: float = NOW) -> planner.Plan:
        return planner.plan(
            authoritative=self.authoritative,
            transactions=self.transactions,
            cleanup_items=self.cleanup_items,
            local_inventory=LocalInventory(processes=tuple(self.local)),
            remote_inventory=self.remote_inventory(),
            now=now,
            legacy_grace_s=GRACE,
        )

    def remote_inventory(self) -> RemoteInventory | None:
        if not self.remote_observed:
            return None
        return RemoteInventory(entries=tuple(self.entries), processes=tuple(self.remote))

    def apply(self, actions: tuple[planner.PlanAction, ...]) -> None:
        """What the runtime does with the actions (the agent and supervisor check generations)."""
        for action in actions:
            key = (action.area, action.generation)
            match action:
                case planner.RemoveRemoteEntry():
                    self.entries = [e for e in self.entries if (e.area, e.generation) != key]
                    self.remote = [p for p in self.remote if (p.area, p.generation) != key]
                case planner.StopProcess(side=Side.REMOTE):
                    self.remote = [p for p in self.remote if (p.area, p.generation) != key]
                case planner.StopProcess(side=Side.LOCAL):
                    self.local = [p for p in self.local if (p.area, p.generation) != key]
                case planner.CreateRemoteEntry():
                    self.entries = [e for e in self.entries if e.area != action.area]
                    self.remote = [p for p in self.remote if p.area != action.area]
                    self.entries.append(entry(action.area, action.generation, created_at=NOW))
                    self.remote.append(proc(action.area, action.generation, started_at=NOW))


def _kinds(plan: planner.Plan) -> list[tuple[str, str, Side, int]]:
    return [(type(a).__name__, a.area, a.side, a.generation) for a in plan.actions]


class TestOrphans:
    """Orphans on either side are removed at their own generation."""

    def test_remote_entry_of_an_older_generation_is_removed_at_that_generation(self) -> None:
        world = Snapshot(
            authoritative=[area("a", Side.REMOTE, 5), area("b", Side.REMOTE, 3)],
            entries=[entry("a", 5), entry("b", 2)],
            remote=[proc("a", 5), proc("b", 2)],
        )
        result = world.plan()
        assert ("RemoveRemoteEntry", "b", Side.REMOTE, 2) in _kinds(result)
        assert ("CreateRemoteEntry", "b", Side.REMOTE, 3) in _kinds(result)
        assert not any(a.area == "a" for a in result.actions)

    def test_remote_entry_of_an_area_committed_local_is_removed(self) -> None:
        world = Snapshot(
            authoritative=[area("a", Side.LOCAL, 4)],
            local=[proc("a", 4)],
            entries=[entry("a", 3)],
            remote=[proc("a", 3)],
        )
        assert _kinds(world.plan()) == [("RemoveRemoteEntry", "a", Side.REMOTE, 3)]

    def test_local_process_of_an_area_committed_remote_is_stopped(self) -> None:
        world = Snapshot(
            authoritative=[area("a", Side.REMOTE, 4)],
            local=[proc("a", 3)],
            entries=[entry("a", 4)],
            remote=[proc("a", 4)],
        )
        assert _kinds(world.plan()) == [("StopProcess", "a", Side.LOCAL, 3)]

    def test_remote_process_without_an_entry_is_stopped(self) -> None:
        world = Snapshot(authoritative=[area("a", Side.LOCAL, 4)], local=[proc("a", 4)],
                         remote=[proc("a", 2)])
        assert _kinds(world.plan()) == [("StopProcess", "a", Side.REMOTE, 2)]

    def test_drift_is_reported_before_and_expected_after(self) -> None:
        world = Snapshot(
            authoritative=[area("a", Side.LOCAL, 4)],
            local=[proc("a", 4)],
            entries=[entry("a", 3)],
            remote=[proc("a", 3)],
        )
        result = world.plan()
        assert result.drift_before.orphan_entries == 1
        assert result.drift_before.total == 1
        assert result.drift_after_expected.total == 0


class TestMissingEntries:
    """Remote entries are created only for areas committed remote, at the committed generation."""

    def test_missing_entry_of_an_area_committed_remote_is_created(self) -> None:
        world = Snapshot(authoritative=[area("a", Side.REMOTE, 6)])
        result = world.plan()
        assert _kinds(result) == [("CreateRemoteEntry", "a", Side.REMOTE, 6)]
        assert result.drift_before.missing_entries == 1

    def test_area_committed_local_is_never_created_remotely(self) -> None:
        world = Snapshot(authoritative=[area("a", Side.LOCAL, 6)])
        assert world.plan().actions == ()

    def test_nothing_is_planned_for_the_remote_side_when_it_was_not_observed(self) -> None:
        world = Snapshot(authoritative=[area("a", Side.REMOTE, 6)], remote_observed=False)
        assert world.plan().actions == ()


class TestWhatIsNeverTouched:
    """Newer generations, areas in a transaction and items owned by cleanup are left alone."""

    def test_newer_remote_generation_is_never_touched_and_reported(self) -> None:
        world = Snapshot(
            authoritative=[area("a", Side.LOCAL, 4)],
            local=[proc("a", 4)],
            entries=[entry("a", 7)],
            remote=[proc("a", 7)],
        )
        result = world.plan()
        assert result.actions == ()
        assert result.drift_after_expected.newer_generation == 2  # entry and process

    def test_newer_local_generation_is_never_touched(self) -> None:
        world = Snapshot(authoritative=[area("a", Side.REMOTE, 4)], local=[proc("a", 5)],
                         entries=[entry("a", 4)], remote=[proc("a", 4)])
        assert world.plan().actions == ()

    def test_area_in_an_active_transaction_is_left_to_it(self) -> None:
        world = Snapshot(
            authoritative=[area("a", Side.REMOTE, 4)],
            transactions=[busy("a")],
            local=[proc("a", 1)],
        )
        assert world.plan().actions == ()

    def test_what_a_cleanup_item_covers_is_left_to_the_cleanup_queue(self) -> None:
        world = Snapshot(
            authoritative=[area("a", Side.LOCAL, 4)],
            cleanup_items=[cleanup("a", Side.REMOTE, 3)],
            local=[proc("a", 4)],
            entries=[entry("a", 3)],
        )
        result = world.plan()
        assert result.actions == ()
        assert result.drift_after_expected.awaiting_cleanup == 1


class TestLegacy:
    """Legacy areas go only after the grace period, and only with both sides observed."""

    def test_legacy_entry_within_the_grace_period_stays(self) -> None:
        world = Snapshot(entries=[entry("old", 2, created_at=NOW - GRACE + 1)])
        result = world.plan()
        assert result.actions == () and result.drift_after_expected.legacy == 1

    def test_legacy_entry_after_the_grace_period_is_removed(self) -> None:
        world = Snapshot(entries=[entry("old", 2, created_at=NOW - GRACE)], remote=[proc("old", 2)])
        assert _kinds(world.plan()) == [("RemoveRemoteEntry", "old", Side.REMOTE, 2)]

    def test_legacy_local_process_is_kept_while_the_remote_side_is_unobserved(self) -> None:
        world = Snapshot(local=[proc("old", 2, started_at=0.0)], remote_observed=False)
        assert world.plan().actions == ()

    def test_legacy_local_process_goes_once_both_sides_are_observed(self) -> None:
        world = Snapshot(local=[proc("old", 2, started_at=0.0)])
        assert _kinds(world.plan()) == [("StopProcess", "old", Side.LOCAL, 2)]

    def test_area_with_a_cleanup_item_is_not_legacy(self) -> None:
        world = Snapshot(cleanup_items=[cleanup("old", Side.REMOTE, 1)], entries=[entry("old", 2)])
        assert world.plan().actions == ()


UUIDS = [f"u{i}" for i in range(6)]


@st.composite
def snapshots(draw: st.DrawFn) -> Snapshot:
    gens = st.integers(min_value=0, max_value=4)
    world = Snapshot(remote_observed=draw(st.booleans()))
    for uuid in UUIDS:
        if draw(st.booleans()):
            location = draw(st.sampled_from(list(Side)))
            world.authoritative.append(area(uuid, location, draw(gens)))
        if draw(st.integers(0, 4)) == 0:
            world.transactions.append(busy(uuid))
        if draw(st.integers(0, 4)) == 0:
            world.cleanup_items.append(cleanup(uuid, draw(st.sampled_from(list(Side))), draw(gens)))
        if draw(st.booleans()):
            world.local.append(proc(uuid, draw(gens), started_at=draw(st.sampled_from([0.0, NOW]))))
        if draw(st.booleans()):
            generation = draw(gens)
            created_at = draw(st.sampled_from([0.0, NOW]))
            world.entries.append(entry(uuid, generation, created_at=created_at))
            if draw(st.booleans()):
                world.remote.append(proc(uuid, generation))
    return world


class TestPlannerProperties:
    """Planning is idempotent, never acts on busy areas or newer generations."""

    @PROFILE
    @given(world=snapshots())
    def test_applying_the_plan_then_planning_again_plans_nothing(self, world: Snapshot) -> None:
        first = world.plan()
        world.apply(first.actions)
        second = world.plan()
        assert second.actions == ()
        # The expectation is an upper bound per kind: creating an entry at the committed
        # generation also replaces an older one that was only awaiting its cleanup item.
        for kind in (f.name for f in dataclasses.fields(planner.Drift)):
            assert getattr(second.drift_before, kind) <= getattr(first.drift_after_expected, kind)

    @PROFILE
    @given(world=snapshots())
    def test_actions_never_touch_busy_areas_or_newer_generations(self, world: Snapshot) -> None:
        committed = {a.uuid: a for a in world.authoritative}
        busy_areas = {t.area for t in world.transactions}
        for action in world.plan().actions:
            assert action.area not in busy_areas
            if action.area in committed:
                assert action.generation <= committed[action.area].generation


def synthetic(n: int) -> Snapshot:
    """n areas in a realistic mix: mostly healthy, some orphans, missing, busy and legacy."""
    world = Snapshot()
    for i in range(n):
        uuid = f"area-{i:06d}"
        kind = i % 10
        location = Side.LOCAL if kind < 5 else Side.REMOTE
        world.authoritative.append(area(uuid, location, 3))
        if kind == 0:
            world.transactions.append(busy(uuid))
        if kind == 1:
            world.entries.append(entry(uuid, 2))  # orphan remote entry
        if kind == 6:
            continue  # missing remote entry
        if location is Side.REMOTE:
            world.entries.append(entry(uuid, 3))
            world.remote.append(proc(uuid, 3))
        else:
            world.local.append(proc(uuid, 3))
    return world


class TestScale:
    """One pass over 100 000 areas plans exactly the expected actions."""

    def test_a_100k_area_pass_plans_every_orphan_and_missing_entry(self) -> None:
        result = synthetic(100_000).plan()
        removed = sum(isinstance(a, planner.RemoveRemoteEntry) for a in result.actions)
        created = sum(isinstance(a, planner.CreateRemoteEntry) for a in result.actions)
        assert removed == 10_000
        assert created == 10_000
        assert len(result.actions) == 20_000

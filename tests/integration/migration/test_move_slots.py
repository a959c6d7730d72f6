"""A service's areas move as a pipeline: while `parallelism` areas are stopped for their
move, the next ones prepare (preflight, pre-copy); none stops before a move slot is free,
and one that waited for its slot checks again before its source stops. Real engine, real
state store and placement file; phase actions that record what they were asked to do."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

from monitord.base.metrics import Metrics
from monitord.engine.migration_engine import MigrationEngine
from monitord.engine.move_slots import MoveSlots
from monitord.engine.placement_state import PlacementState
from monitord.store.state_db import Store
from orchestrator import phases
from orchestrator.migration_step import StepRules
from orchestrator.models import Side, Transaction
from orchestrator.phases import Outcome

AREAS = ("a1", "a2")


class RecordingActions:
    """Every action succeeds; a destination's health check waits until the test says so."""

    def __init__(self, state: PlacementState) -> None:
        self.state = state
        self.done: list[tuple[str, str, bool]] = []  # (area, action, again)
        self.healthy = {area: asyncio.Event() for area in AREAS}
        self.changed = asyncio.Event()

    async def perform(self, txn: Transaction, action: phases.Action) -> Outcome:
        if isinstance(action, phases.CheckHealth):
            await self.healthy[txn.area].wait()
        if isinstance(action, phases.CommitLocation):
            await self.state.commit(area=txn.area, location=action.location,
                                    generation=action.generation)
        self.done.append((txn.area, type(action).__name__, getattr(action, "again", False)))
        self.changed.set()
        return Outcome.OK

    async def discard_data(self, txn: Transaction, *, keep: Side, reason: str) -> None:
        raise AssertionError("not reached")

    async def until(self, *wanted: tuple[str, str, bool]) -> None:
        async with asyncio.timeout(20):
            while not set(wanted) <= set(self.done):
                self.changed.clear()
                await self.changed.wait()


async def until(state: PlacementState, condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(20):
        while not condition():
            state.changed.clear()
            await state.changed.wait()  # set on every saved record


async def test_the_next_area_prepares_while_one_is_out_of_service(tmp_path: Path) -> None:
    path = tmp_path / "custom_config.json"
    path.write_text(json.dumps(
        {"custom_daemons": [{"uuid": area, "service": "tg"} for area in AREAS]}
    ))
    async with await Store.open(tmp_path / "work") as store:
        state = PlacementState(store=store, custom_config_path=path)
        await state.load()
        actions = RecordingActions(state)
        engine = MigrationEngine(
            state=state, actions=actions, store=store,  # type: ignore[arg-type]
            metrics=Metrics(),
            parallelism={"tg": 1},
            bounds=StepRules(park_after_failures=5, retry_backoff_base_s=0.01,
                             retry_backoff_cap_s=0.02),
        )
        running = asyncio.create_task(engine.run(), name="engine under test")
        try:
            await engine.record_placement(service="tg", area=None, location="remote")

            def phases_now() -> dict[str, str]:
                return {a: t.phase.value for a, t in state.transactions.items()}

            # one area is in its health window, the other has prepared meanwhile and waits
            await until(state, lambda: sorted(phases_now().values()) == [
                "HEALTHCHECK_DESTINATION", "PREFLIGHT"])
            first = next(a for a, p in phases_now().items() if p == "HEALTHCHECK_DESTINATION")
            second = next(a for a in AREAS if a != first)
            await actions.until((second, "RunPreflight", False))
            await asyncio.sleep(0.2)  # ...and keeps waiting: its source is not stopped
            assert phases_now()[second] == "PREFLIGHT"
            assert (second, "SuppressSource", False) not in actions.done
            actions.healthy[first].set()
            await actions.until((first, "CleanupSource", False),
                                (second, "RunPreflight", True), (second, "SuppressSource", False))
            # it waited for its slot: checked again, then (and only then) its source stopped
            cleaned_at = actions.done.index((first, "CleanupSource", False))
            again_at = actions.done.index((second, "RunPreflight", True))
            stop_at = actions.done.index((second, "SuppressSource", False))
            assert cleaned_at < again_at < stop_at
            actions.healthy[second].set()
        finally:
            await engine.stop()
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)


async def test_the_slots_give_back_what_they_hold() -> None:
    slots = MoveSlots(1)
    async with slots.held(preparing=True) as held:
        assert held.stage == "prepare"
        assert not await held.to_move()  # free: no wait
        assert held.stage == "move"
        async with slots.held(preparing=True) as other:  # the prepare slot is free again
            waiting = asyncio.create_task(other.to_move())
            await asyncio.sleep(0.01)
            assert not waiting.done()  # the move slot is ours
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
            assert other.stage == "prepare"
    async with slots.held(preparing=False) as held:  # everything was given back
        assert held.stage == "move"


class CountingActions:
    """Every action succeeds after a moment; counts the areas out of service at once (from
    their source's stop to their cleanup) and those preparing at once."""

    def __init__(self, state: PlacementState) -> None:
        self.state = state
        self.out: set[str] = set()
        self.preparing: set[str] = set()
        self.most_out = self.most_preparing = 0

    async def perform(self, txn: Transaction, action: phases.Action) -> Outcome:
        preparing = isinstance(action, phases.RunPreflight) and not action.again
        if preparing:  # (the check again runs in the area's move slot)
            self.preparing.add(txn.area)
            self.most_preparing = max(self.most_preparing, len(self.preparing))
        if isinstance(action, phases.SuppressSource):
            self.out.add(txn.area)
            self.most_out = max(self.most_out, len(self.out))
        await asyncio.sleep(0.02)
        if preparing:
            self.preparing.discard(txn.area)
        if isinstance(action, phases.CommitLocation):
            await self.state.commit(area=txn.area, location=action.location,
                                    generation=action.generation)
        if isinstance(action, phases.CleanupSource):
            self.out.discard(txn.area)
        return Outcome.OK

    async def discard_data(self, txn: Transaction, *, keep: Side, reason: str) -> None:
        raise AssertionError("not reached")


async def test_never_more_than_parallelism_out_of_service(tmp_path: Path) -> None:
    areas = [f"b{i}" for i in range(8)]
    path = tmp_path / "custom_config.json"
    path.write_text(json.dumps(
        {"custom_daemons": [{"uuid": area, "service": "tg"} for area in areas]}
    ))
    async with await Store.open(tmp_path / "work") as store:
        state = PlacementState(store=store, custom_config_path=path)
        await state.load()
        actions = CountingActions(state)
        engine = MigrationEngine(
            state=state, actions=actions, store=store,  # type: ignore[arg-type]
            metrics=Metrics(),
            parallelism={"tg": 2},
            bounds=StepRules(park_after_failures=5, retry_backoff_base_s=0.01,
                             retry_backoff_cap_s=0.02),
        )
        running = asyncio.create_task(engine.run(), name="engine under test")
        try:
            await engine.record_placement(service="tg", area=None, location="remote")
            await until(state, lambda: all(
                state.committed[a].location is Side.REMOTE for a in areas))
        finally:
            await engine.stop()
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
    assert actions.most_out == 2  # the bound, reached
    assert actions.most_preparing == 2  # and as many prepared meanwhile, no more

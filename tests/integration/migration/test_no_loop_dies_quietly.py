"""No loop dies quietly: an unexpected exception in a phase action is a classified INTERNAL
error that counts towards parking and shows in the status; one area that the supervisor
cannot converge never stops it from converging the others; the watcher of a rolled-back
source outlives whatever its health check raises; and no exception in an iteration of a
root loop (cleanup worker, reconciler, lease renewer, engine intake, supervisor) ends that
loop (monitord/base/periodic.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import structlog

from monitord.base.config import Config, MonitordSection
from monitord.base.metrics import Metrics
from monitord.engine import migration_engine
from monitord.engine.cleanup_worker import CleanupWorker
from monitord.engine.lease_ledger import LeaseLedger
from monitord.engine.lease_renewer import LeaseRenewer
from monitord.engine.local_side import LocalSide
from monitord.engine.migration_engine import MigrationEngine
from monitord.engine.placement_state import PlacementState
from monitord.engine.reconciler import Reconciler
from monitord.local.supervisor import AreaRun, LocalSupervisor
from monitord.store.state_db import Store, StoreError
from orchestrator import phases
from orchestrator.area_leases import LeasePolicy
from orchestrator.migration_step import StepRules
from orchestrator.models import Phase, Side, Transaction
from orchestrator.phases import Outcome


class ExplodingActions:
    """Phase actions whose preflight meets an error that is not a MonitordError."""

    def __init__(self) -> None:
        self.calls = 0

    async def perform(self, txn: Transaction, action: phases.Action) -> Outcome:
        if isinstance(action, phases.RunPreflight):
            self.calls += 1
            raise OSError(18, "Invalid cross-device link")
        raise AssertionError(f"not reached: {action}")

    async def discard_data(self, txn: Transaction, *, keep: Side, reason: str) -> None:
        raise AssertionError("not reached")


class TestAnUnexpectedErrorInAPhaseAction:
    """It is INTERNAL, shown with its text, counted, and the service parks at the limit."""

    async def test_an_oserror_in_preflight_parks_the_service_with_internal(
        self, tmp_path: Path
    ) -> None:
        path = tmp_path / "custom_config.json"
        path.write_text(json.dumps({"custom_daemons": [{"uuid": "a1", "service": "tg"}]}))
        async with await Store.open(tmp_path / "work") as store:
            state = PlacementState(store=store, custom_config_path=path)
            await state.load()
            actions = ExplodingActions()
            engine = MigrationEngine(
                state=state, actions=actions, store=store,  # type: ignore[arg-type]
                metrics=Metrics(),
                parallelism={"tg": 1},
                bounds=StepRules(park_after_failures=2, retry_backoff_base_s=0.01,
                                 retry_backoff_cap_s=0.02),
            )
            running = asyncio.create_task(engine.run(), name="engine under test")
            try:
                await engine.record_placement(service="tg", area=None, location="remote")

                async def parked() -> None:
                    while not any(t.phase is Phase.PARKED for t in state.transactions.values()):
                        state.changed.clear()
                        await state.changed.wait()  # set on every saved record

                await asyncio.wait_for(parked(), timeout=20)
            finally:
                await engine.stop()
                running.cancel()
                await asyncio.gather(running, return_exceptions=True)
        assert actions.calls == 2, "every failed preflight counted towards parking"
        shown: dict[str, Any] = engine.last_errors["tg"]
        assert shown["code"] == "INTERNAL" and "cross-device" in shown["detail"]


class TestOneAreaTheSupervisorCannotConverge:
    """The supervisor's loop survives an area whose start keeps failing unexpectedly."""

    async def test_the_other_areas_still_run(self, tmp_path: Path) -> None:
        supervisor = LocalSupervisor(state_dir=tmp_path / "supervisor", tick_s=0.05)
        good = AreaRun(area="good", service="tg", generation=1,
                       command=("sleep", "30"), data_dir=str(tmp_path / "good"))
        broken = AreaRun(area="broken", service="tg", generation=1,
                         command=("sleep", "30"), data_dir=str(tmp_path / "broken"))
        original = supervisor._spawn

        async def spawn(area: str, slot: Any) -> None:
            if area == "broken":
                raise KeyError("data_dir")  # a template that cannot be expanded, say
            await original(area, slot)

        supervisor._spawn = spawn  # type: ignore[method-assign]
        loop = asyncio.create_task(supervisor.run(), name="supervisor under test")
        try:
            supervisor.set_desired({"broken": broken, "good": good})

            for _ in range(200):  # up to 10 s
                if any(v.area == "good" and v.pid for v in supervisor.inventory()):
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the good area never started")
            await asyncio.sleep(0.3)  # several more ticks over the broken area
            assert not loop.done(), "the loop died"
            assert supervisor.internal_errors >= 2
        finally:
            supervisor.set_desired({})
            await asyncio.sleep(0.3)
            await supervisor.close()
            await asyncio.wait_for(loop, timeout=10)


class SourceHealth:
    """Phase actions whose health check raises each of `errors` in turn, then passes (or,
    with `forever`, raises the last one again and again)."""

    def __init__(self, errors: list[Exception], *, forever: bool = False) -> None:
        self.errors = errors
        self.forever = forever
        self.calls = 0

    async def check_health(self, txn: Transaction, *, side: Side, generation: int) -> None:
        self.calls += 1
        if self.forever:
            raise self.errors[-1]
        if self.errors:
            raise self.errors.pop(0)

    async def perform(self, txn: Transaction, action: phases.Action) -> Outcome:
        raise AssertionError(f"not reached: {action}")

    async def discard_data(self, txn: Transaction, *, keep: Side, reason: str) -> None:
        raise AssertionError("not reached")


ROLLED_BACK = Transaction(transaction_id="t1", service="tg", area="a1", source=Side.LOCAL,
                          destination=Side.REMOTE, phase=Phase.ROLLED_BACK, generation=2,
                          source_generation=1, started_at=1.0, updated_at=2.0)


async def _watch(tmp_path: Path, actions: SourceHealth) -> tuple[list[str], list[Any]]:
    """Watch ROLLED_BACK's source to the end: (what the downtime log was told, log events)."""
    path = tmp_path / "custom_config.json"
    path.write_text(json.dumps({"custom_daemons": [{"uuid": "a1", "service": "tg"}]}))
    told: list[str] = []
    async with await Store.open(tmp_path / "work") as store:
        state = PlacementState(store=store, custom_config_path=path)
        await state.load()
        engine = MigrationEngine(
            state=state, actions=actions, store=store,  # type: ignore[arg-type]
            metrics=Metrics(), parallelism={"tg": 1},
            bounds=StepRules(park_after_failures=2, retry_backoff_base_s=0.01,
                             retry_backoff_cap_s=0.02),
        )

        async def healthy(txn: Transaction, *, side: Side, at: float, now: float) -> None:
            told.append(f"healthy on {side.value}")

        engine.downtime.healthy = healthy  # type: ignore[method-assign]
        engine.downtime.unmeasured = lambda txn: told.append("unmeasured")  # type: ignore[method-assign]
        with structlog.testing.capture_logs() as events:
            engine._watch_source(ROLLED_BACK)
            watchers = engine._watcher_tasks.running()
            try:
                await asyncio.wait_for(asyncio.gather(*watchers), timeout=10)
            finally:
                await engine._watcher_tasks.close()
    return told, events


class TestTheWatcherOfARolledBackSource:
    """A health check that raises what is not a MonitordError (an OverflowError from a
    reply, a bug) is logged once, INTERNAL with its traceback, and the source looked at
    again: the watcher ends with the downtime measured or unmeasured, never as a crash."""

    async def test_it_looks_again_and_measures_the_downtime(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(migration_engine, "SOURCE_WATCH_PAUSE_S", 0.01)
        actions = SourceHealth([OverflowError("int too large to convert to float"),
                                OverflowError("int too large to convert to float")])
        told, events = await _watch(tmp_path, actions)
        assert told == ["healthy on local"] and actions.calls == 3
        failed = [e for e in events if e["event"] == "area_downtime_watch_failed"]
        assert [(e["error_code"], e["log_level"]) for e in failed] == [("INTERNAL", "error")]
        assert "OverflowError" in failed[0]["detail"] and failed[0]["exc_info"]
        assert not [e for e in events if e["event"] == "task_crashed"]

    async def test_an_error_to_the_end_leaves_the_downtime_unmeasured_and_says_why(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(migration_engine, "SOURCE_WATCH_PAUSE_S", 0.01)
        monkeypatch.setattr(migration_engine, "SOURCE_WATCH_S", 0.2)
        actions = SourceHealth([KeyError("uptime_s")], forever=True)
        told, events = await _watch(tmp_path, actions)
        assert told == ["unmeasured"] and actions.calls > 2
        assert len([e for e in events if e["event"] == "area_downtime_watch_failed"]) == 1
        (unmeasured,) = [e for e in events if e["event"] == "area_downtime_unmeasured"]
        assert "KeyError" in unmeasured["reason"]
        assert not [e for e in events if e["event"] == "task_crashed"]


# -- every root loop under one error policy ----------------------------------------------------

INJECTED: dict[str, Callable[[], BaseException]] = {
    "ValueError": lambda: ValueError("invalid literal for int() with base 10: 'x'"),
    "KeyError": lambda: KeyError("an area that was not asked"),
    "OverflowError": lambda: OverflowError("int too large to convert"),
    "RecursionError": lambda: RecursionError("maximum recursion depth exceeded"),
    "StoreError": lambda: StoreError("database or disk is full"),
}


class Fault:
    """Wraps a callable of a loop's iteration: raises `error` on the first call, then
    passes through; counts the calls (a second one means the next iteration ran)."""

    def __init__(self, original: Callable[..., Any], error: BaseException) -> None:
        self.original = original
        self.error: BaseException | None = error
        self.calls = 0
        self.called_again = asyncio.Event()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls >= 2:
            self.called_again.set()
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        return self.original(*args, **kwargs)


async def _loop_under_test(
    which: str, error: BaseException, tmp_path: Path, store: Store
) -> tuple[Any, Callable[[], Any], Fault, Callable[[], Awaitable[None]]]:
    """(the loop's owner, its run() coroutine function, the fault, a clean-up)."""
    path = tmp_path / "custom_config.json"
    path.write_text(json.dumps({"custom_daemons": [{"uuid": "a1", "service": "tg"}]}))
    state = PlacementState(store=store, custom_config_path=path)
    await state.load()
    supervisor = LocalSupervisor(state_dir=tmp_path / "supervisor", tick_s=0.05)

    async def nothing() -> None:
        return None

    if which == "cleanup worker":
        local = LocalSide(config=Config(monitord=MonitordSection(work_dir=tmp_path / "work")),
                          supervisor=supervisor, runs=dict, link=None)
        worker = CleanupWorker(
            store=store, sides={Side.LOCAL: local}, metrics=Metrics(),
            interval_s=0.05, lineage_of=state.lineage,
        )
        fault = Fault(store.take_due, error)
        store.take_due = fault  # type: ignore[method-assign]
        return worker, worker.run, fault, nothing
    if which == "reconciler":
        reconciler = Reconciler(
            state=state, store=store, supervisor=supervisor, link=None,
            sides={},  # no action is planned here
            metrics=Metrics(), intake_lock=asyncio.Lock(), interval_s=0.05, legacy_grace_s=60,
        )
        fault = Fault(state.reload_committed, error)
        state.reload_committed = fault  # type: ignore[method-assign]
        return reconciler, reconciler.run, fault, nothing
    if which == "lease renewer":
        ledger = LeaseLedger(
            owner_id="me", policy=LeasePolicy(ttl_s=0.15, clock_margin=0.1, safety_margin_s=0.1),
            tunnel_connected=lambda: True, connection_epoch=lambda: 1,
        )
        renewer = LeaseRenewer(state=state, agent=lambda: None, ledger=ledger)
        fault = Fault(state.runs, error)
        state.runs = fault  # type: ignore[method-assign]
        return renewer, renewer.run, fault, nothing
    if which == "migration engine":
        engine = MigrationEngine(
            state=state, actions=ExplodingActions(), store=store,  # type: ignore[arg-type]
            metrics=Metrics(),
            parallelism={"tg": 1},
            bounds=StepRules(park_after_failures=2, retry_backoff_base_s=0.01,
                             retry_backoff_cap_s=0.02),
        )
        fault = Fault(state.parked_services, error)
        state.parked_services = fault  # type: ignore[method-assign]
        return engine, engine.run, fault, engine.stop
    assert which == "local supervisor"
    # the first step of every pass: the log hub's check (it raises once, then passes through)
    fault = Fault(supervisor._pipes.tick, error)
    supervisor._pipes.tick = fault  # type: ignore[method-assign]
    return supervisor, supervisor.run, fault, supervisor.close


LOOPS = ("cleanup worker", "reconciler", "lease renewer", "migration engine",
         "local supervisor")


class TestEveryRootLoopSurvivesAnyErrorInAnIteration:
    """An exception in one iteration is counted and shown; the next iteration runs."""

    @pytest.mark.parametrize("kind", sorted(INJECTED))
    @pytest.mark.parametrize("which", LOOPS)
    async def test_the_next_iteration_runs_and_the_error_is_counted(
        self, which: str, kind: str, tmp_path: Path
    ) -> None:
        error = INJECTED[kind]()
        async with await Store.open(tmp_path / "work") as store:
            owner, run, fault, stop = await _loop_under_test(which, error, tmp_path, store)
            loop = asyncio.create_task(run(), name=f"{which} under test")
            try:
                again = asyncio.ensure_future(fault.called_again.wait())
                await asyncio.wait({loop, again}, timeout=20,
                                   return_when=asyncio.FIRST_COMPLETED)
                again.cancel()
                await asyncio.gather(again, return_exceptions=True)
                assert fault.calls >= 2 or loop.done(), "no second iteration within 20 s"
                assert not loop.done(), f"the {which} loop died of {kind}"
                record = owner.loop.record
                assert record.errors == 1
                expected = "STORE_WRITE_FAILED" if kind == "StoreError" else "INTERNAL"
                assert record.last_error is not None and record.last_error.code == expected
                shown = owner.loop.book.to_status()[which]
                assert shown["errors"] == 1 and shown["last_error"]["code"] == expected
            finally:
                await stop()
                loop.cancel()
                await asyncio.gather(loop, return_exceptions=True)

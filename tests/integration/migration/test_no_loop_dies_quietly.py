"""No loop dies quietly: an unexpected exception in a phase action is a classified INTERNAL
error that counts towards parking and shows in the status, and one area that the
supervisor cannot converge never stops it from converging the others."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from monitord.base.metrics import Metrics
from monitord.engine.migration_engine import MigrationEngine
from monitord.engine.placement_state import PlacementState
from monitord.local.supervisor import AreaRun, LocalSupervisor
from monitord.store.state_db import Store
from orchestrator import phases
from orchestrator.area_leases import LeasePolicy
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
                metrics=Metrics(), policy=LeasePolicy(), renewer=None,
                parallelism={"tg": 1}, park_after_failures=2,
                retry_backoff_base_s=0.01, retry_backoff_cap_s=0.02,
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

"""A generation at the end of SQLite's INTEGER range (2^63 - 1) can be committed but no move
can follow it: a wish for that area is refused at the intake with AREA_ENTRY_INVALID and the
intake loop never meets an OverflowError; the other areas of the service still move."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from monitord.base.metrics import Metrics
from monitord.base.periodic import LoopBook
from monitord.engine.migration_engine import MigrationEngine
from monitord.engine.placement_state import PlacementState
from monitord.store.state_db import Store
from orchestrator import phases
from orchestrator.errors import PermanentError
from orchestrator.migration_step import StepRules
from orchestrator.models import Side, Transaction
from orchestrator.phases import Outcome

LAST = 2**63 - 1


class HeldActions:
    """Phase actions that hold every step (the test only looks at what was opened)."""

    async def perform(self, txn: Transaction, action: phases.Action) -> Outcome:
        await asyncio.Event().wait()
        raise AssertionError("not reached")

    async def discard_data(self, txn: Transaction, *, keep: Side, reason: str) -> None:
        raise AssertionError("not reached")


class TestTheLastGeneration:
    """No move opens past 2^63 - 1; the loop and the other areas go on."""

    async def test_a_wish_for_the_service_moves_the_others_and_never_raises(
        self, tmp_path: Path
    ) -> None:
        path = tmp_path / "custom_config.json"
        path.write_text(json.dumps({"custom_daemons": [
            {"uuid": "last", "service": "tg", "generation": LAST},
            {"uuid": "ok", "service": "tg", "generation": 5},
        ]}))
        book = LoopBook(metrics=Metrics())
        async with await Store.open(tmp_path / "work") as store:
            state = PlacementState(store=store, custom_config_path=path)
            await state.load()
            engine = MigrationEngine(
                state=state, actions=HeldActions(), store=store,  # type: ignore[arg-type]
                metrics=Metrics(),
                parallelism={"tg": 2},
                bounds=StepRules(park_after_failures=2, retry_backoff_base_s=0.01,
                                 retry_backoff_cap_s=0.02), loops=book,
            )
            running = asyncio.create_task(engine.run(), name="engine under test")
            try:
                with pytest.raises(PermanentError) as refused:
                    await engine.record_placement(service="tg", area="last", location="remote")
                assert refused.value.code == "AREA_ENTRY_INVALID"
                assert "last" not in state.transactions
                await engine.record_placement(service="tg", area=None, location="remote")

                async def opened() -> None:
                    while "ok" not in state.transactions:
                        state.changed.clear()
                        await state.changed.wait()  # set on every saved record

                await asyncio.wait_for(opened(), timeout=20)
                assert state.transactions["ok"].generation > 5
                for _ in range(5):  # several intake passes over the wish
                    engine.wake()
                    await asyncio.sleep(0.05)
                assert not running.done(), "the engine loop ended"
                errors = {name: record["errors"] for name, record in book.to_status().items()}
                assert not any(errors.values()), errors
                assert set(state.transactions) == {"ok"}
            finally:
                await engine.stop()
                running.cancel()
                await asyncio.gather(running, return_exceptions=True)

"""Every line logged during one step of a transaction carries its id: the engine binds
`transaction_id`, `service` and `area` through structlog's contextvars around `perform`
(monitord/engine/txn_log.py, `step`), so a line the agent client logs — a module that knows
nothing of transactions — names the move it served, and a line logged outside any step names
none."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import structlog

from monitord.base import logs
from monitord.base.metrics import Metrics
from monitord.engine.migration_engine import MigrationEngine
from monitord.engine.placement_state import PlacementState
from monitord.remote.agent_client import AgentClient, unix_channel
from monitord.store.state_db import Store
from orchestrator import phases
from orchestrator.errors import ErrorCode, error_for
from orchestrator.migration_step import StepRules
from orchestrator.models import Phase, Side, Transaction
from orchestrator.phases import Outcome
from tests.support.agent_process import running_agent
from tests.support.stacks import StackFactory

AREA = "0b6f3c1e-4d2a-4b8e-9f10-5a6b7c8d9e0f"


class AgentAskingActions:
    """Phase actions whose preflight asks the real agent twice (once in a task of its own),
    then fails permanently, so the move parks after its one step."""

    def __init__(self, client: AgentClient) -> None:
        self.client = client

    async def perform(self, txn: Transaction, action: phases.Action) -> Outcome:
        if isinstance(action, phases.RunPreflight):
            await asyncio.gather(self.client.inventory(), self.client.inventory())
            raise error_for(ErrorCode.PREFLIGHT_ARCH, "the test's VPS is not x86_64")
        raise AssertionError(f"not reached: {action}")

    async def discard_data(self, txn: Transaction, *, keep: Side, reason: str) -> None:
        raise AssertionError("not reached")


@contextlib.contextmanager
def captured_logs() -> Iterator[list[dict[str, Any]]]:
    """Every line, debug included, through the project's context processors."""
    wrapper = structlog.get_config()["wrapper_class"]
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    try:
        with structlog.testing.capture_logs(processors=logs.CONTEXT_PROCESSORS) as lines:
            yield lines
    finally:
        structlog.configure(wrapper_class=wrapper)


class TestTheStepBindsTheTransaction:
    async def test_agent_calls_inside_a_step_carry_the_transaction_id_and_outside_none(
        self, tmp_path: Path
    ) -> None:
        path = tmp_path / "custom_config.json"
        path.write_text(json.dumps({"custom_daemons": [{"uuid": AREA, "service": "tg"}]}))
        async with running_agent(tmp_path / "vps") as agent, \
                await Store.open(tmp_path / "work") as store:
            client = AgentClient(channel=unix_channel(agent.address),
                                 secret=agent.secret.encode())
            state = PlacementState(store=store, custom_config_path=path)
            await state.load()
            engine = MigrationEngine(
                state=state, actions=AgentAskingActions(client),  # type: ignore[arg-type]
                store=store, metrics=Metrics(),
                parallelism={"tg": 1},
                bounds=StepRules(park_after_failures=1, retry_backoff_base_s=0.01,
                                 retry_backoff_cap_s=0.02),
            )
            with captured_logs() as lines:
                await client.inventory()  # before any move
                await engine.recover()  # nothing to recover: the move below is the only one
                running = asyncio.create_task(engine.run(), name="engine under test")
                try:
                    [txn_id] = await engine.record_placement(
                        service="tg", area=None, location="remote"
                    )

                    async def parked() -> None:
                        while not any(t.phase is Phase.PARKED
                                      for t in state.transactions.values()):
                            state.changed.clear()
                            await state.changed.wait()

                    await asyncio.wait_for(parked(), timeout=20)
                finally:
                    await engine.stop()
                    running.cancel()
                    await asyncio.gather(running, return_exceptions=True)
                await client.inventory()  # after the step ended

        calls = [line for line in lines if line["event"] == "agent_call"]
        assert len(calls) == 4, calls
        before, *during, after = calls
        assert len(during) == 2
        for line in during:  # the step's own call and the one in a task it started
            assert line["transaction_id"] == txn_id
            assert (line["service"], line["area"]) == ("tg", AREA)
            assert line["logger_name"] == "monitord.remote.agent_client"
        for line in (before, after):
            assert "transaction_id" not in line and "area" not in line


class TestARealMove:
    """The whole daemon (monitord run, the VPS over SSH, the real agent): the preflight's
    report, logged by monitord/remote/preflight.py during the move's first step, names the
    move's transaction."""

    async def test_the_preflight_line_of_a_move_carries_its_transaction_id(
        self, stack_factory: StackFactory
    ) -> None:
        stack = await stack_factory(services={"tg": 1})
        await stack.wait_settled(expect={"tg": "local"}, timeout_s=60)
        moves = set(await stack.place("tg", "remote"))
        await stack.wait_settled(expect={"tg": "remote"}, timeout_s=60)
        [area] = stack.areas["tg"]
        preflights = stack.events("preflight")
        assert preflights and moves
        for line in preflights:
            assert line["transaction_id"] in moves, line
            assert (line["service"], line["area"]) == ("tg", area)

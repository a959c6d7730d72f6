"""No lock across the network: a hung agent never keeps an operator's placement waiting."""

from __future__ import annotations

import asyncio
import signal
import time

from tests.integration.migration.conftest import StackFactory


class TestAHungAgent:
    """While a reconcile pass waits on a hung agent, the placement API still answers."""

    async def test_placement_answers_while_the_reconciler_waits_on_the_agent(
        self, stack_factory: StackFactory
    ) -> None:
        stack = await stack_factory(services={"tg": 1}, reconcile_interval_s=0.5)
        await stack.wait_settled(expect={"tg": "local"})
        assert stack.kill_agent(signal.SIGSTOP)
        try:
            await asyncio.sleep(2.0)  # a reconcile pass is now waiting on the agent
            started = time.monotonic()
            code, _ = await stack.request(
                "PUT", "/v1/services/tg/placement", {"location": "remote"}
            )
            took = time.monotonic() - started
        finally:
            stack.kill_agent(signal.SIGCONT)
        assert code == 202
        # The agent client waits far longer than this for an answer (its timeout), so an
        # answer this fast means the intake lock was not held across that call.
        assert took < 5.0, f"the placement waited {took:.1f} s behind the hung agent"
        await stack.wait_settled(expect={"tg": "remote"}, timeout_s=90)

"""A remote area keeps its lease while every iteration of the lease renewer raises: the
renewer's loop goes on under the root loops' error policy (monitord/base/periodic.py), the
daemon keeps running, and the failures show in the status document and `status --check`;
the same for every other root loop of a running daemon."""

from __future__ import annotations

import asyncio

import pytest

from monitord.base.periodic import FAULT_ENV
from orchestrator import health_check
from orchestrator.health_check import CheckState
from tests.integration.migration.conftest import StackFactory, settle_remote


class TestTheRenewerRaisesInEveryIteration:
    """Its renewals still go out every TTL/3, so the VPS keeps running the area."""

    async def test_a_remote_area_keeps_running_for_three_ttls(
        self, stack_factory: StackFactory
    ) -> None:
        stack = await stack_factory(
            services={"tg": 1}, extra_env={FAULT_ENV: "lease renewer:KeyError"}
        )
        await settle_remote(stack)
        [area] = stack.areas["tg"]
        [serving] = [k for k in stack.detector.alive(area) if k.side == "remote"]

        await asyncio.sleep(3 * stack.options.area_lease_ttl_s)  # the span under test

        assert stack.daemon is not None and stack.daemon.returncode is None, "monitord died"
        assert [k for k in stack.detector.alive(area)] == [serving], \
            "the remote area stopped (its lease lapsed) or another process took over"
        assert [life.key for life in stack.detector.lives(area) if life.key.side == "remote"] \
            == [serving]
        status = await stack.status()
        renewer = status["loops"]["lease renewer"]
        assert renewer["errors"] >= 3 and renewer["failing"] >= 3
        assert renewer["last_error"]["code"] == "INTERNAL"
        assert "KeyError" in renewer["last_error"]["detail"]
        verdict = health_check.classify(status)
        assert verdict.state is CheckState.WARNING and "lease renewer loop" in verdict.line()


class TestEveryRootLoopOfARunningDaemon:
    """Whichever root loop raises in every iteration, `monitord run` keeps running, the loop
    keeps iterating (its count grows) and the status document shows it."""

    @pytest.mark.parametrize(("loop", "kind"), [
        ("cleanup worker", "OverflowError"),
        ("reconciler", "RecursionError"),
        ("migration engine", "ValueError"),
        ("local supervisor", "KeyError"),
    ])
    async def test_the_daemon_keeps_running_and_shows_the_count(
        self, stack_factory: StackFactory, loop: str, kind: str
    ) -> None:
        stack = await stack_factory(services={"tg": 1}, extra_env={FAULT_ENV: f"{loop}:{kind}"})

        async def failed_twice() -> bool:
            shown = (await stack.status()).get("loops", {}).get(loop, {})
            return int(shown.get("errors", 0)) >= 2

        await stack.wait_until(failed_twice, timeout_s=30, what=f"two failed {loop} iterations")
        assert stack.daemon is not None and stack.daemon.returncode is None, "monitord died"
        shown = (await stack.status())["loops"][loop]
        assert shown["last_error"]["code"] == "INTERNAL" and kind in shown["last_error"]["detail"]
        assert [e for e in stack.events("root_task_died")] == []

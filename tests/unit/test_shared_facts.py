"""SharedFacts: one fetch for the callers asking together, failures never kept, a producer's
cancellation never seen by its waiters."""

from __future__ import annotations

import asyncio

import pytest

from monitord.remote.shared_facts import SharedFacts


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_callers_asking_together_share_one_fetch() -> None:
    calls = 0
    release = asyncio.Event()

    async def make() -> int:
        nonlocal calls
        calls += 1
        await release.wait()
        return 42

    facts = SharedFacts()
    waiting = [asyncio.create_task(facts.get("k", make)) for _ in range(5)]
    await asyncio.sleep(0)
    release.set()
    assert await asyncio.gather(*waiting) == [42] * 5 and calls == 1


async def test_a_value_is_kept_for_max_age_then_fetched_again() -> None:
    clock = Clock()
    calls = 0

    async def make() -> int:
        nonlocal calls
        calls += 1
        return calls

    facts = SharedFacts(max_age_s=10.0, clock=clock)
    assert await facts.get("k", make) == 1
    clock.now += 9.9
    assert await facts.get("k", make) == 1
    clock.now += 0.2
    assert await facts.get("k", make) == 2
    assert await facts.get("other", make) == 3  # keys never share


async def test_a_failure_reaches_every_waiter_and_is_not_kept() -> None:
    calls = 0
    release = asyncio.Event()

    async def make() -> int:
        nonlocal calls
        calls += 1
        if calls == 1:
            await release.wait()
            raise RuntimeError("the VPS said no")
        return 7

    facts = SharedFacts()
    waiting = [asyncio.create_task(facts.get("k", make)) for _ in range(3)]
    await asyncio.sleep(0)
    release.set()
    results = await asyncio.gather(*waiting, return_exceptions=True)
    assert all(isinstance(r, RuntimeError) for r in results)
    assert await facts.get("k", make) == 7 and calls == 2


async def test_a_value_the_caller_does_not_keep_is_fetched_again() -> None:
    calls = 0

    async def make() -> str:
        nonlocal calls
        calls += 1
        return "could not run"

    facts = SharedFacts()
    for _ in range(2):
        await facts.get("k", make, keep=lambda value: value != "could not run")
    assert calls == 2


async def test_a_cancelled_producer_leaves_its_waiter_to_fetch() -> None:
    started = asyncio.Event()
    calls = 0

    async def make() -> int:
        nonlocal calls
        calls += 1
        if calls == 1:
            started.set()
            await asyncio.sleep(3600)
        return 5

    facts = SharedFacts()
    producer = asyncio.create_task(facts.get("k", make))
    await started.wait()
    waiter = asyncio.create_task(facts.get("k", make))
    await asyncio.sleep(0)
    producer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await producer
    assert await waiter == 5 and calls == 2


async def test_a_key_may_be_kept_longer_than_the_default() -> None:
    clock = Clock()
    calls = 0

    async def make() -> int:
        nonlocal calls
        calls += 1
        return calls

    facts = SharedFacts(max_age_s=10.0, clock=clock)
    assert await facts.get("long", make, max_age_s=3600.0) == 1
    clock.now += 600.0
    assert await facts.get("long", make, max_age_s=3600.0) == 1
    assert await facts.get("short", make) == 2
    clock.now += 20.0
    assert await facts.get("short", make) == 3  # the default still applies to other keys

"""The round trips a piece of work waited for in turn (monitord/base/round_trips.py): one
wave per request sent while nothing of that work was in flight, counted only for the work
whose context it runs in."""

from __future__ import annotations

import asyncio

from monitord.base import round_trips
from monitord.base.round_trips import RoundTrips


async def _request(answered: asyncio.Event | None = None, *, trips: int = 1) -> None:
    with round_trips.exchange(trips):
        if answered is None:
            await asyncio.sleep(0)
        else:
            await answered.wait()


class TestWaves:
    async def test_requests_in_turn_are_one_round_trip_each(self) -> None:
        trips = RoundTrips()
        with round_trips.counted_by(trips):
            for _ in range(3):
                await _request()
            await _request(trips=2)  # a new channel, then the request on it
        assert trips.count == 5

    async def test_requests_on_the_wire_together_share_their_round_trip(self) -> None:
        trips = RoundTrips()
        with round_trips.counted_by(trips):
            await asyncio.gather(*(_request() for _ in range(8)))
            await asyncio.gather(_request(trips=3), _request(trips=3))
        assert trips.count == 1 + 3

    async def test_a_request_sent_while_a_long_one_waits_adds_nothing(self) -> None:
        trips = RoundTrips()
        held = asyncio.Event()
        with round_trips.counted_by(trips):
            waiting = asyncio.ensure_future(_request(held, trips=2))
            await asyncio.sleep(0)
            await _request()
            held.set()
            await waiting
            await _request()
        assert trips.count == 2 + 1

    async def test_only_the_work_in_whose_context_a_request_runs_counts_it(self) -> None:
        mine, other = RoundTrips(), RoundTrips()
        with round_trips.counted_by(other):
            others = asyncio.ensure_future(_request())  # a task keeps its context
        with round_trips.counted_by(mine):
            await _request()
        await others
        await _request()  # no work counts this one
        assert (mine.count, other.count) == (1, 1)

    async def test_a_failed_request_leaves_nothing_in_flight(self) -> None:
        trips = RoundTrips()
        with round_trips.counted_by(trips):
            try:
                with round_trips.exchange():
                    raise OSError("lost")
            except OSError:
                pass
            await _request()
        assert trips.count == 2

"""Per-area downtime end to end: every transaction records, durably, how long its area was
served by no side — from the moment its source may no longer run to the first healthy moment
of the side that serves it next (docs/design.md, "Observability") — and the status shows each
service's last move, the metrics the histogram `monitord_area_downtime_seconds`."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from monitord.testing.stack import Stack
from tests.integration.migration.conftest import (
    StackFactory,
    destination_runs_held_at_healthcheck,
)
from tests.integration.operator.conftest import run_cli


async def last_move(stack: Stack, service: str) -> Any:
    return (await stack.status())["services"][service]["last_move"]


async def measured_move(stack: Stack, service: str, direction: str) -> Any:
    """The last move once it is the one in `direction` with its one area measured: the
    areas settle on their side a moment before the transaction ends and is measured."""
    async def measured() -> bool:
        move = await last_move(stack, service)
        return bool(move and move["direction"] == direction and move["downtime_s"]
                    and move["downtime_s"]["measured"] == 1)

    await stack.wait_until(measured, timeout_s=30, what=f"the {direction} move measured")
    return await last_move(stack, service)


async def downtime_samples(stack: Stack) -> dict[tuple[str, str], float]:
    """(service, direction) -> how many downtimes the histogram counted."""
    url = f"http://127.0.0.1:{stack.http_port}/metrics"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session, \
            session.get(url) as resp:
        text = await resp.text()
    counts = {}
    for family in text_string_to_metric_families(text):
        if family.name != "monitord_area_downtime_seconds":
            continue
        assert family.type == "histogram"
        for sample in family.samples:
            if sample.name.endswith("_count"):
                counts[(sample.labels["service"], sample.labels["direction"])] = sample.value
    return counts


class TestDowntimeOfAMove:
    """Each area of a move has its downtime recorded, shown as the service's last move,
    counted in the histogram and kept across a restart."""

    async def test_every_area_of_a_move_reports_its_downtime(
        self, stack_factory: StackFactory
    ) -> None:
        stack = await stack_factory(services={"tg": 2, "chats": 1})
        await stack.wait_settled(expect={"tg": "local", "chats": "local"})
        assert await last_move(stack, "tg") is None

        ids = await stack.place("tg", "remote")
        await stack.wait_settled(expect={"tg": "remote", "chats": "local"})

        # The transaction is stored DONE a moment before its downtime record ends (the
        # record's own write): settled can see the one and not yet the other under load.
        async def both_ended() -> bool:
            move = await last_move(stack, "tg")
            return move is not None and move["in_flight"] == 0 and move["areas"] == 2

        await stack.wait_until(both_ended, timeout_s=10, what="both areas' downtime ended")
        move = await last_move(stack, "tg")
        assert move["direction"] == "local_to_remote"
        assert move["transaction_id"] in ids
        assert (move["areas"], move["in_flight"]) == (2, 0)
        assert move["outcomes"] == {"done": 2, "rolled_back": 0, "parked": 0}
        downtime = move["downtime_s"]
        assert downtime["measured"] == 2
        # The destination passes its health check only after min_uptime_s of running.
        assert stack.options.min_uptime_s <= downtime["p50"] <= downtime["max"]
        assert await last_move(stack, "chats") is None  # nothing moved there

        events = stack.events("area_downtime")
        assert sorted(e["transaction_id"] for e in events) == sorted(ids)
        assert {(e["outcome"], e["healthy_side"], e["direction"]) for e in events} == {
            ("done", "remote", "local_to_remote")
        }
        assert max(e["downtime_s"] for e in events) >= downtime["max"] - 0.001
        assert await downtime_samples(stack) == {("tg", "local_to_remote"): 2}

        result = await run_cli("status", "-c", str(stack.config_path))
        assert result.code == 0, result.stderr
        [line] = [x for x in result.stdout.splitlines() if x.startswith("tg: last move")]
        assert line.startswith("tg: last move local to remote, 2 areas (done 2), ended ")
        assert line.endswith(f"downtime max {downtime['max']:.2f} s, p50"
                             f" {downtime['p50']:.2f} s (2 measured)")
        assert not any(x.startswith("chats: last move") for x in result.stdout.splitlines())

    async def test_the_last_move_survives_a_restart_and_a_move_back_replaces_it(
        self, stack_factory: StackFactory
    ) -> None:
        stack = await stack_factory(services={"tg": 1})
        await stack.place("tg", "remote")
        await stack.wait_settled(expect={"tg": "remote"})
        before = await measured_move(stack, "tg", "local_to_remote")

        assert await stack.stop_monitord() == 0
        await stack.start_monitord()
        assert await last_move(stack, "tg") == before  # read back from state.db

        await stack.place("tg", "local")
        await stack.wait_settled(expect={"tg": "local"})
        back = await measured_move(stack, "tg", "remote_to_local")
        assert back["move_id"] != before["move_id"]
        assert back["outcomes"]["done"] == 1
        assert back["downtime_s"]["measured"] == 1
        assert await downtime_samples(stack) == {("tg", "remote_to_local"): 1}


class TestDowntimeOfARollback:
    """A rollback's downtime runs until the source is healthy again."""

    async def test_a_reversed_move_is_down_until_its_source_is_healthy(
        self, stack_factory: StackFactory
    ) -> None:
        stack = await stack_factory(services={"tg": 1})
        area = stack.areas["tg"][0]
        await destination_runs_held_at_healthcheck(stack, area, writes_for_s=0.5)
        await stack.place("tg", "local")  # the operator reverses: a rollback
        stack.release_hold()
        await stack.wait_settled(expect={"tg": "local"})

        async def measured() -> bool:
            move = await last_move(stack, "tg")
            return bool(move and move["downtime_s"])

        await stack.wait_until(measured, timeout_s=30, what="the rollback's downtime")
        move = await last_move(stack, "tg")
        assert move["outcomes"] == {"done": 0, "rolled_back": 1, "parked": 0}
        assert move["direction"] == "local_to_remote"
        [event] = stack.events("area_downtime")
        assert (event["outcome"], event["healthy_side"]) == ("rolled_back", "local")
        # The source passes the same health check: up for at least min_uptime_s.
        assert event["downtime_s"] >= stack.options.min_uptime_s
        assert await downtime_samples(stack) == {("tg", "local_to_remote"): 1}


def _logged(stack: Stack, since: int) -> list[dict[str, Any]]:
    found = []
    for line in stack.log_lines[since:]:
        try:
            found.append(json.loads(line))
        except ValueError:
            continue
    return found


class TestRoundTripsWhileDown:
    """Each area's `area_downtime` says how many round trips to the VPS its steps waited for
    while the area was down; and none of them is a question the answer before had settled."""

    async def test_the_downtime_event_counts_the_round_trips_of_both_directions(
        self, stack_factory: StackFactory
    ) -> None:
        stack = await stack_factory(services={"tg": 1}, log_level="debug")
        await stack.wait_settled(expect={"tg": "local"})
        for side, direction in (("remote", "local_to_remote"), ("local", "remote_to_local")):
            since = len(stack.log_lines)
            await stack.place("tg", side)
            await measured_move(stack, "tg", direction)
            await stack.wait_until(
                lambda since=since: any(e["event"] == "area_downtime"
                                        for e in _logged(stack, since)),
                timeout_s=10, what="the area_downtime line")
            events = _logged(stack, since)
            downtime = next(e for e in events if e["event"] == "area_downtime")
            txn = downtime["transaction_id"]
            stopped = next(i for i, e in enumerate(events) if e["event"] == "transaction_phase"
                           and e.get("transaction_id") == txn
                           and e["phase"] == "SUPPRESS_SOURCE")
            calls = [e for e in events[stopped:] if e["event"] == "agent_call"
                     and e.get("transaction_id") == txn]
            # every agent call waited for its answer at least (its channel opened ahead)
            assert downtime["round_trips"] >= len(calls) > 0, (downtime, calls)

    async def test_a_verified_stop_on_the_vps_is_not_asked_again(
        self, stack_factory: StackFactory
    ) -> None:
        """The agent answers "stopped" only once the area's guard and daemon are gone: the
        move home asks nothing more of the VPS before its copy (no inventory after it)."""
        stack = await stack_factory(services={"tg": 1}, log_level="debug")
        await stack.wait_settled(expect={"tg": "local"})
        await stack.place("tg", "remote")
        await stack.wait_settled(expect={"tg": "remote"})
        since = len(stack.log_lines)
        await stack.place("tg", "local")
        await measured_move(stack, "tg", "remote_to_local")
        events = _logged(stack, since)
        txn = next(e["transaction_id"] for e in events if e["event"] == "transaction_started")
        phases = [i for i, e in enumerate(events) if e["event"] == "transaction_phase"
                  and e.get("transaction_id") == txn]
        suppress = next(i for i in phases if events[i]["phase"] == "SUPPRESS_SOURCE")
        copy = next(i for i in phases if events[i]["phase"] == "COPY")
        calls = [e["call"] for e in events[suppress:copy] if e["event"] == "agent_call"
                 and e.get("transaction_id") == txn]
        assert len(calls) == 1 and calls[0].endswith("/stop"), calls

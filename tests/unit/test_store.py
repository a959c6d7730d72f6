"""The durable store (state.db): crash-safe writes, unique generations, an exact cleanup queue."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from monitord.store import state_db as store_module
from monitord.store.state_db import Store, StoreError
from orchestrator.errors import PermanentError

TX = {
    "transaction_id": "t-1",
    "service": "tg",
    "area": "a-1",
    "source": "local",
    "destination": "remote",
    "phase": "PREFLIGHT",
    "attempt": 1,
    "generation": 3,
    "started_at": 100.0,
    "updated_at": 100.0,
    "last_error_code": None,
    "last_error_detail": None,
    "cleanup_required": False,
}


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[Store]:
    opened = await Store.open(tmp_path)
    try:
        yield opened
    finally:
        await opened.close()


class TestSchema:
    """The database is created, migrated forward once, and refuses a newer schema."""

    async def test_fresh_database_is_at_latest_version_in_wal_mode(self, store: Store) -> None:
        assert await store.schema_version() == len(store_module.MIGRATIONS)
        with sqlite3.connect(store.path) as probe:
            assert probe.execute("PRAGMA journal_mode").fetchone()[0] == "wal"

    async def test_reopening_keeps_data_and_does_not_remigrate(self, tmp_path: Path) -> None:
        async with await Store.open(tmp_path) as first:
            await first.put_transaction(TX)
        async with await Store.open(tmp_path) as second:
            assert await second.get_transaction("t-1") == TX

    async def test_a_newer_schema_is_refused(self, tmp_path: Path) -> None:
        async with await Store.open(tmp_path):
            pass
        with sqlite3.connect(tmp_path / "state.db") as db:
            db.execute("UPDATE schema_version SET version = 99")
        with pytest.raises(StoreError, match="newer"):
            await Store.open(tmp_path)

    async def test_an_older_database_is_migrated_forward_keeping_its_rows(
        self, tmp_path: Path
    ) -> None:
        with sqlite3.connect(tmp_path / "state.db", isolation_level=None) as db:
            store_module._migrate(db, target=1)
            for n in range(3):
                db.execute(
                    "INSERT INTO cleanup_items VALUES (?, 'tg', ?, 'remote', 1, 'remove_area', "
                    "0, 0, NULL, 0)",
                    (f"id-{n}", f"a-{n}"),
                )
        async with await Store.open(tmp_path) as upgraded:
            assert await upgraded.schema_version() == len(store_module.MIGRATIONS)
            assert await upgraded.cleanup_backlog() == 3
            await upgraded.complete("id-0")
            assert await upgraded.cleanup_backlog() == 2

    async def test_the_event_loop_never_runs_sqlite(self, store: Store) -> None:
        seen: list[str] = []
        original = store._db

        def spy() -> sqlite3.Connection:
            seen.append(threading.current_thread().name)
            return original()

        store._db = spy  # type: ignore[method-assign]
        await store.put_transaction(TX)
        await store.list_transactions()
        assert seen and all(name.startswith("monitord-store") for name in seen)


class TestTransactions:
    """Transaction records round-trip with the contract field names and any extra fields."""

    async def test_put_then_get_round_trips_extra_fields(self, store: Store) -> None:
        record = {**TX, "rollback_from": None, "source_generation": 2, "destination_fenced": True}
        await store.put_transaction(record)
        assert await store.get_transaction("t-1") == record

    async def test_put_replaces_by_transaction_id(self, store: Store) -> None:
        await store.put_transaction(TX)
        await store.put_transaction({**TX, "phase": "COPY", "updated_at": 101.0})
        assert (await store.get_transaction("t-1") or {})["phase"] == "COPY"
        assert len(await store.list_transactions()) == 1

    async def test_active_only_leaves_out_finished_ones(self, store: Store) -> None:
        await store.put_transaction(TX)
        await store.put_transaction({**TX, "transaction_id": "t-2", "phase": "DONE"})
        await store.put_transaction({**TX, "transaction_id": "t-3", "phase": "ROLLED_BACK"})
        await store.put_transaction({**TX, "transaction_id": "t-4", "phase": "PARKED"})
        active = await store.list_transactions(active_only=True)
        assert sorted(t["transaction_id"] for t in active) == ["t-1", "t-4"]

    async def test_a_record_missing_a_spec_field_is_rejected(self, store: Store) -> None:
        with pytest.raises(ValueError, match="phase"):
            await store.put_transaction({k: v for k, v in TX.items() if k != "phase"})


class TestTextThatDoesNotEncode:
    """A record carrying text UTF-8 cannot encode (a lone surrogate) is written whole, never
    lost: an error's detail or a cleanup item's last error is stored with U+FFFD in its
    place, an extra field exactly as given; a key that does not encode is a StoreError, like
    any other failed write, and nothing of it is written."""

    async def test_a_transaction_whose_error_detail_does_not_encode_is_saved(
        self, store: Store
    ) -> None:
        record = {**TX, "phase": "ROLLBACK", "last_error_code": "BAD_REQUEST",
                  "last_error_detail": "POST /v1/areas/a-1/stop: \udc80 \x1b[2J"}
        await store.put_transaction(record)
        assert await store.get_transaction("t-1") == {
            **record, "last_error_detail": "POST /v1/areas/a-1/stop: \ufffd \x1b[2J"}

    async def test_an_extra_field_that_does_not_encode_round_trips_exactly(
        self, store: Store
    ) -> None:
        record = {**TX, "note": "cut \ud83d"}
        await store.put_transaction(record)
        assert await store.get_transaction("t-1") == record

    async def test_a_cleanup_items_last_error_that_does_not_encode_is_saved(
        self, store: Store
    ) -> None:
        item = await store.enqueue_cleanup(**cleanup_key(1), now=0.0)
        assert await store.reschedule(item["id"], next_attempt_at=5.0, last_error="x \udc80")
        [due] = await store.take_due(5.0, 1)
        assert due["last_error"] == "x \ufffd"

    async def test_a_key_that_does_not_encode_is_a_store_error_and_nothing_is_written(
        self, store: Store
    ) -> None:
        await store.put_transaction(TX)
        with pytest.raises(StoreError):
            await store.put_transaction({**TX, "transaction_id": "t-\udc80"})
        with pytest.raises(StoreError):
            await store.put_transaction({**TX, "area": "a-\udc80", "phase": "COPY"})
        assert await store.list_transactions() == [TX]


class TestGenerations:
    """A generation is issued once: each is above every earlier one and above the floor."""

    async def test_issue_is_strictly_increasing_and_durable(self, tmp_path: Path) -> None:
        async with await Store.open(tmp_path) as first:
            issued = [await first.issue_generation("a") for _ in range(3)]
        async with await Store.open(tmp_path) as second:
            issued.append(await second.issue_generation("a"))
            assert await second.highest_generation("a") == 4
        assert issued == [1, 2, 3, 4]

    async def test_floor_lifts_the_next_generation_above_a_committed_one(
        self, store: Store
    ) -> None:
        assert await store.issue_generation("a", floor=7) == 8
        assert await store.issue_generation("a", floor=2) == 9

    async def test_concurrent_issues_never_collide(self, store: Store) -> None:
        issued = await asyncio.gather(*(store.issue_generation("a") for _ in range(50)))
        assert sorted(issued) == list(range(1, 51))

    async def test_no_generation_is_issued_past_2_63_minus_1(self, store: Store) -> None:
        """SQLite's INTEGER ends there: past it the write raised OverflowError (not a
        StoreError), out of the engine's loop."""
        assert await store.issue_generation("a", floor=2**63 - 2) == 2**63 - 1
        for floor in (2**63 - 1, 2**63, 2**70):
            with pytest.raises(PermanentError) as refused:
                await store.issue_generation("b", floor=floor)
            assert refused.value.code == "AREA_ENTRY_INVALID"
        with pytest.raises(PermanentError):
            await store.issue_generation("a")
        assert await store.highest_generation("a") == 2**63 - 1
        assert await store.highest_generation("b") == 0

    async def test_areas_are_independent(self, store: Store) -> None:
        assert await store.issue_generation("a") == 1
        assert await store.issue_generation("b") == 1
        assert await store.highest_generation("never") == 0


def cleanup_key(n: int) -> dict[str, Any]:
    return {"service": "tg", "area": f"a-{n}", "side": "remote", "generation": 1,
            "action": "remove_area"}


class TestCleanupQueue:
    """Cleanup items are enqueued idempotently, handed out once per claim and never lost."""

    async def test_enqueue_of_the_same_obligation_is_idempotent(self, store: Store) -> None:
        first = await store.enqueue_cleanup(**cleanup_key(1), now=10.0)
        again = await store.enqueue_cleanup(**cleanup_key(1), now=20.0)
        assert again == first
        assert await store.cleanup_backlog() == 1
        await store.complete(first["id"])
        await store.complete(first["id"])
        assert await store.cleanup_backlog() == 0

    async def test_items_are_not_due_before_next_attempt_at(self, store: Store) -> None:
        await store.enqueue_cleanup(**cleanup_key(1), now=10.0)
        assert await store.take_due(9.0, 10) == []
        assert len(await store.take_due(10.0, 10)) == 1

    async def test_a_claimed_item_is_not_handed_out_again_until_the_claim_lapses(
        self, store: Store
    ) -> None:
        await store.enqueue_cleanup(**cleanup_key(1), now=0.0)
        [item] = await store.take_due(1.0, 10, claim_for_s=30.0)
        assert item["attempts"] == 1
        assert await store.take_due(2.0, 10) == []
        [again] = await store.take_due(31.0, 10)
        assert again["id"] == item["id"] and again["attempts"] == 2

    async def test_reschedule_records_error_and_backs_off(self, store: Store) -> None:
        item = await store.enqueue_cleanup(**cleanup_key(1), now=0.0)
        await store.take_due(0.0, 1)
        assert await store.reschedule(item["id"], next_attempt_at=50.0, last_error="SSH_TIMEOUT")
        assert await store.take_due(49.0, 1) == []
        [due] = await store.take_due(50.0, 1)
        assert due["last_error"] == "SSH_TIMEOUT"

    async def test_complete_removes_once(self, store: Store) -> None:
        item = await store.enqueue_cleanup(**cleanup_key(1), now=0.0)
        assert await store.complete(item["id"])
        assert not await store.complete(item["id"])
        assert await store.list_cleanup() == []

    async def test_take_due_uses_the_index_not_a_scan(self, store: Store) -> None:
        with sqlite3.connect(store.path) as db:
            plan = " ".join(
                str(row)
                for row in db.execute(
                    "EXPLAIN QUERY PLAN SELECT * FROM cleanup_items WHERE next_attempt_at <= 1 "
                    "ORDER BY next_attempt_at LIMIT 10"
                )
            )
        assert "cleanup_items_due" in plan and "SCAN cleanup_items " not in plan + " "

    async def test_queue_drains_completely_many_times_nothing_lost_nothing_twice(
        self, store: Store
    ) -> None:
        for cycle in range(3):
            enqueued = set()
            for n in range(2000):
                item = await store.enqueue_cleanup(
                    **{**cleanup_key(n), "generation": cycle + 1}, now=float(n % 7)
                )
                enqueued.add(item["id"])
            completed: list[str] = []
            while batch := await store.take_due(10.0, 128):
                for item in batch:
                    assert await store.complete(item["id"]), "an item was completed twice"
                    completed.append(item["id"])
            assert len(completed) == len(set(completed)) == 2000
            assert set(completed) == enqueued
            assert await store.cleanup_backlog() == 0


class TestEventsAndPlacement:
    """Recent events form a capped ring; desired placement keeps one row per service or area."""

    async def test_events_ring_keeps_only_the_newest(self, tmp_path: Path) -> None:
        async with await Store.open(tmp_path, events_cap=5) as capped:
            for n in range(12):
                await capped.record_event("tick", {"n": n}, at=float(n))
            events = await capped.recent_events(limit=100)
        assert [e["n"] for e in events] == [7, 8, 9, 10, 11]
        assert events[-1] == {"at": 11.0, "event": "tick", "n": 11}

    async def test_desired_placement_upserts_per_service_and_per_area(self, store: Store) -> None:
        await store.set_desired_placement(service="tg", area=None, location="remote", now=1.0)
        await store.set_desired_placement(service="tg", area=None, location="local", now=2.0)
        await store.set_desired_placement(service="tg", area="a-1", location="remote", now=3.0)
        assert await store.desired_placements() == [
            {"service": "tg", "area": None, "location": "local", "updated_at": 2.0},
            {"service": "tg", "area": "a-1", "location": "remote", "updated_at": 3.0},
        ]

    async def test_use_after_close_raises_store_error(self, tmp_path: Path) -> None:
        closed = await Store.open(tmp_path)
        await closed.close()
        with pytest.raises(StoreError):
            await closed.record_event("late")


WRITER_SCRIPT = """
import asyncio, sys
from pathlib import Path
from monitord.store.state_db import Store

async def main():
    store = await Store.open(Path(sys.argv[1]))
    n = 0
    while True:
        await store.enqueue_cleanup(service="tg", area=f"a-{n}", side="remote", generation=n,
                                    action="remove_area", now=float(n))
        await store.issue_generation("area-x")
        print(n, flush=True)
        n += 1

asyncio.run(main())
"""


class TestCrashDurability:
    """A write whose call returned survives kill -9 of the writing process."""

    async def test_returned_writes_survive_kill_9(self, tmp_path: Path) -> None:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", WRITER_SCRIPT, str(tmp_path),
            stdout=asyncio.subprocess.PIPE,
        )
        acknowledged = -1
        try:
            assert proc.stdout is not None
            while acknowledged < 200:
                line = await asyncio.wait_for(proc.stdout.readline(), timeout=20)
                assert line, "writer exited early"
                acknowledged = int(line)
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            await asyncio.wait_for(proc.wait(), timeout=10)
        async with await Store.open(tmp_path) as reopened:
            items = await reopened.list_cleanup(limit=100_000)
            generations = {item["generation"] for item in items}
            assert set(range(acknowledged + 1)) <= generations
            assert await reopened.highest_generation("area-x") >= acknowledged + 1
        assert json.loads(json.dumps(items[0]))  # plain data, no sqlite objects


class TestReadOnlySections:
    """`monitord bundle --offline` reads state.db without writing a byte beside it."""

    async def test_a_cleanly_closed_database_is_read_and_nothing_is_created(
        self, tmp_path: Path
    ) -> None:
        async with await Store.open(tmp_path) as store:
            await store.put_transaction(TX)
            await store.record_event("area_downtime", {"area": "a-1", "downtime_s": 1.5})
        before = sorted(p.name for p in tmp_path.iterdir())
        found = store_module.read_only_sections(tmp_path / store_module.DB_NAME)
        assert [t["transaction_id"] for t in found["transactions.json"]] == ["t-1"]
        assert found["events.json"][0]["downtime_s"] == 1.5
        assert sorted(p.name for p in tmp_path.iterdir()) == before  # no -wal, no -shm

    async def test_writes_still_in_the_wal_of_a_crashed_monitord_are_read(
        self, tmp_path: Path
    ) -> None:
        """The files as a kill -9 leaves them: the commits in state.db-wal, not checkpointed."""
        crashed = tmp_path / "crashed"
        crashed.mkdir()
        async with await Store.open(tmp_path) as store:
            await store.put_transaction(TX)
            for name in ("state.db", "state.db-wal", "state.db-shm"):
                (crashed / name).write_bytes((tmp_path / name).read_bytes())
        found = store_module.read_only_sections(crashed / store_module.DB_NAME)
        assert [t["transaction_id"] for t in found["transactions.json"]] == ["t-1"]

    def test_a_missing_database_is_a_store_error(self, tmp_path: Path) -> None:
        with pytest.raises(StoreError, match="does not exist"):
            store_module.read_only_sections(tmp_path / store_module.DB_NAME)


class TestWarmCopies:
    """Each area's newest warm copy (orchestrator/warm_copy.py) is one durable row."""

    async def test_the_newest_replaces_the_last_survives_a_reopen_and_can_go(
        self, tmp_path: Path
    ) -> None:
        from orchestrator.warm_copy import WarmCopy

        first = WarmCopy(area="a1", service="tg", generation=3, epoch=2, taken_at=10.5,
                         received_at=11.0, files=2, bytes=8192, sent_bytes=8192,
                         digest="a" * 64)
        newer = WarmCopy(area="a1", service="tg", generation=3, epoch=2, taken_at=40.5,
                         received_at=41.0, files=2, bytes=8192, sent_bytes=512,
                         digest="b" * 64, restore_epoch=3)
        with sqlite3.connect(tmp_path / "state.db", isolation_level=None) as db:
            store_module._migrate(db)  # a state.db of the release before them
            assert not db.execute("SELECT name FROM sqlite_master WHERE name = 'warm_copies'"
                                  ).fetchall()
        async with await Store.open(tmp_path) as store:
            await store.put_warm_copy(first.to_storage())
            await store.put_warm_copy(newer.to_storage())
            await store.put_warm_copy({**first.to_storage(), "area": "a2"})
        async with await Store.open(tmp_path) as store:
            rows = [WarmCopy.from_storage(r) for r in await store.warm_copies()]
            assert rows == [newer, WarmCopy.from_storage({**first.to_storage(), "area": "a2"})]
            await store.forget_warm_copy("a2")
            assert [r["area"] for r in await store.warm_copies()] == ["a1"]
            # no new schema version: the previous release still opens it (a rollback)
            assert await store.schema_version() == 4

"""The store's downtime records (schema v4, table `area_downtime`): one per transaction,
grouped by move, added to an older database without touching what it holds."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from monitord.store import state_db as store_module
from monitord.store.state_db import Store


def record(transaction_id: str, *, move: str, service: str = "tg", **fields: Any
           ) -> dict[str, Any]:
    return {"transaction_id": transaction_id, "service": service, "area": f"a-{transaction_id}",
            "direction": "local_to_remote", "move_id": move, "stopped_at": None,
            "healthy_at": None, "healthy_side": None, "downtime_s": None, "outcome": None,
            "finished_at": None, **fields}


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[Store]:
    opened = await Store.open(tmp_path)
    try:
        yield opened
    finally:
        await opened.close()


class TestDowntimeRecords:
    """A record round-trips by transaction id and the last ended move of each service is
    found whole."""

    async def test_a_record_is_replaced_by_transaction_id(self, store: Store) -> None:
        await store.put_downtime(record("t1", move="m1"))
        done = record("t1", move="m1", stopped_at=10.0, healthy_at=12.5, healthy_side="remote",
                      downtime_s=2.5, outcome="done", finished_at=13.0)
        await store.put_downtime(done)
        assert await store.downtimes(["t1", "unknown"]) == [done]

    async def test_many_ids_are_looked_up_in_chunks(self, store: Store) -> None:
        ids = [f"t{n}" for n in range(1200)]  # beyond SQLite's parameter limit
        for transaction_id in ids:
            await store.put_downtime(record(transaction_id, move="m"))
        assert sorted(r["transaction_id"] for r in await store.downtimes(ids)) == sorted(ids)

    async def test_the_last_move_of_each_service_holds_its_ended_records(
        self, store: Store
    ) -> None:
        await store.put_downtime(record("old", move="m1", outcome="done", finished_at=1.0))
        await store.put_downtime(record("a", move="m2", outcome="done", finished_at=5.0))
        await store.put_downtime(record("b", move="m2", outcome="rolled_back",
                                        finished_at=6.0))
        await store.put_downtime(record("c", move="m2"))  # still in flight
        await store.put_downtime(record("x", move="m3", service="chats", outcome="done",
                                        finished_at=2.0))
        await store.put_downtime(record("y", move="m4", service="max"))  # none ended yet
        moves = await store.last_moves()
        assert {s: [r["transaction_id"] for r in rows] for s, rows in moves.items()} == {
            "tg": ["a", "b"], "chats": ["x"],
        }
        assert [r["transaction_id"] for r in await store.move_downtimes("m2")] == ["a", "b"]


class TestSchemaV4:
    """A version 3 database gains the downtime table and keeps its rows."""

    async def test_a_v3_database_is_migrated_forward(self, tmp_path: Path) -> None:
        with sqlite3.connect(tmp_path / "state.db", isolation_level=None) as db:
            store_module._migrate(db, target=3)
            db.execute("INSERT INTO lineage VALUES ('a-1', '[\"local\"]', 4, 1.0)")
        async with await Store.open(tmp_path) as upgraded:
            assert await upgraded.schema_version() == len(store_module.MIGRATIONS) >= 4
            assert await upgraded.lineages() == [
                {"area": "a-1", "holders": ["local"], "epoch": 4}
            ]
            await upgraded.put_downtime(record("t1", move="m1"))
            assert len(await upgraded.downtimes(["t1"])) == 1

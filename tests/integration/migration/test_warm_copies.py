"""Warm copies: a remote area's SQLite store copied to the PBX while it runs, so that giving a
lost VPS up costs the copy's age, not everything since the move out.

The areas' fake daemons keep their hash-chained session records in a SQLite database in WAL
mode (`--store sqlite`), one committed transaction each: a copy taken file by file would be
torn, and the next start would refuse it (exit 4). Every test ends with the stack's
after-check: no overlap ever, and no start on older data except where the operator gave the
VPS up.
"""

from __future__ import annotations

import asyncio
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

from monitord.testing.stack import Stack
from tests.integration.migration.conftest import StackFactory, settle_remote
from tests.integration.operator.conftest import run_cli

INTERVAL_S = 1.0
WARM = {"warm_copy": "sqlite", "warm_copy_databases": ["session.sqlite"],
        "warm_copy_interval_s": INTERVAL_S}
SQLITE_STORE = ("--store", "sqlite")


async def _warm_stack(stack_factory: StackFactory, **options: Any) -> Stack:
    return await stack_factory(services={"tg": 1}, service_overrides=WARM,
                               local_daemon_args=SQLITE_STORE, remote_daemon_args=SQLITE_STORE,
                               **options)


async def _warm_copy(stack: Stack, area: str) -> dict[str, Any] | None:
    [row] = [a for a in (await stack.status())["services"]["tg"]["areas"] if a["uuid"] == area]
    return row["warm_copy"]


async def _taken(stack: Stack, area: str) -> dict[str, Any] | None:
    """The area's warm copy once one has been taken (before: its row says none yet)."""
    row = await _warm_copy(stack, area)
    return row if row is not None and row["taken_at"] is not None else None


def _records(data_dir: Path) -> int:
    with sqlite3.connect(f"file:{data_dir / 'session.sqlite'}?mode=ro", uri=True) as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        return int(db.execute("SELECT count(*) FROM records").fetchone()[0])


def _remote_records(stack: Stack, area: str) -> int:
    newest = max((life for life in stack.detector.lives(area) if life.key.side == "remote"),
                 key=lambda life: life.records)
    return newest.records


class TestWarmCopies:
    async def test_a_remote_area_is_copied_every_interval_whole_and_never_run(
        self, stack_factory: StackFactory
    ) -> None:
        stack = await _warm_stack(stack_factory)
        area = stack.areas["tg"][0]
        await settle_remote(stack)
        first = await stack.wait_until(lambda: _taken(stack, area), timeout_s=30,
                                       what="a first warm copy")
        assert first["generation"] is not None

        async def newer() -> dict[str, Any] | None:
            row = await _warm_copy(stack, area)
            return row if row and row["taken_at"] and row["taken_at"] > first["taken_at"] + 2 \
                else None

        later = await stack.wait_until(newer, timeout_s=30, what="a later warm copy")
        assert later["error"] is None and later["overdue_at"] > time.time()
        warm_dir = stack.work_dir / "warm" / "tg" / area
        held = _records(warm_dir)  # a whole SQLite database: the backup API's snapshot
        assert 0 < held <= _remote_records(stack, area)
        # a delta against the previous copy: far less than the store crossed the link
        assert later["sent_bytes"] < later["bytes"]
        # and the VPS's snapshot goes once fetched (kept, it doubles the area's room there)
        await stack.wait_until(lambda: not list(stack.vps_dir.rglob(".monitord-copy/*/warm")),
                               timeout_s=10, what="the VPS's snapshot removed once fetched")
        assert not any(life.key.side == "local" for life in stack.detector.lives(area)
                       if life.first_seen > first["taken_at"]), "a warm copy never runs"
        _, metrics = await stack.request("GET", "/metrics")
        assert 'monitord_area_warm_copy_age_seconds{service="tg"}' in metrics

        # moved home, the area's warm copy has no use left: it goes with its record
        await stack.place("tg", "local")
        await stack.wait_settled(expect={"tg": "local"}, timeout_s=60)
        await stack.wait_until(lambda: not warm_dir.exists(), timeout_s=15,
                               what="the warm copy removed once the area is home")
        assert await _warm_copy(stack, area) is None

    async def test_a_give_up_starts_the_area_on_its_warm_copy_and_says_what_was_lost(
        self, stack_factory: StackFactory
    ) -> None:
        stack = await _warm_stack(stack_factory)
        area = stack.areas["tg"][0]
        await settle_remote(stack)
        moved_out = _remote_records(stack, area)
        await asyncio.sleep(3.0)  # the account lives on the VPS: records the PBX has not got

        async def copied_since_move() -> dict[str, Any] | None:
            row = await _warm_copy(stack, area)
            return row if row and row["taken_at"] and row["taken_at"] > time.time() - 1.5 \
                else None

        await stack.wait_until(copied_since_move, timeout_s=30, what="a fresh warm copy")
        await stack.partition()  # the VPS is gone
        lost_at = time.time()
        written = _remote_records(stack, area)
        stack.accepted_data_loss.add(area)
        while True:
            result = await run_cli("give-up", "tg", "-c", str(stack.config_path))
            if result.code == 0:
                break
            assert "VPS_NOT_FENCED" in result.stderr, result.stderr
            await asyncio.sleep(1.0)
        await stack.wait_until(
            lambda: any(k.side == "local" for k in stack.detector.alive(area)), timeout_s=30,
            what="tg runs on the PBX")
        [abandoned] = stack.events("remote_data_abandoned")
        assert abandoned["kept_copy"] == "warm"
        # the loss: the copy's age when the VPS went, within two intervals and a copy's time
        assert abandoned["warm_copy_taken_at"] > lost_at - 2 * INTERVAL_S - 2.0
        assert abandoned["kept_copy_age_s"] >= lost_at - abandoned["warm_copy_taken_at"]
        [home] = [life for life in stack.detector.lives(area) if life.key.side == "local"
                  and life.first_seen > lost_at]
        assert home.start_records is not None
        # it started on the warm copy: newer than the move out, no newer than the VPS's last
        assert moved_out < home.start_records <= written
        assert not (stack.work_dir / "warm" / "tg" / area).exists()

    async def test_a_warm_copy_changed_since_it_arrived_is_not_started_from(
        self, stack_factory: StackFactory
    ) -> None:
        """A warm copy whose files no longer hash to the listing received (a disk error, a
        hand edit) is never the start: the give-up says so and uses the PBX's own copy."""
        stack = await _warm_stack(stack_factory)
        area = stack.areas["tg"][0]
        await settle_remote(stack)
        moved_out = _remote_records(stack, area)
        await stack.wait_until(lambda: _taken(stack, area), timeout_s=30,
                               what="a warm copy")
        await stack.partition()
        warm_db = stack.work_dir / "warm" / "tg" / area / "session.sqlite"
        with warm_db.open("r+b") as f:  # one byte of a page the records live in
            f.seek(warm_db.stat().st_size - 100)
            f.write(b"\xff")
        stack.accepted_data_loss.add(area)
        lost_at = time.time()
        while (result := await run_cli("give-up", "tg", "-c", str(stack.config_path))).code:
            assert "VPS_NOT_FENCED" in result.stderr, result.stderr
            await asyncio.sleep(1.0)
        assert "starts on the PBX's own copy" in result.stdout, result.stdout
        await stack.wait_until(
            lambda: any(k.side == "local" for k in stack.detector.alive(area)), timeout_s=30,
            what="tg runs on the PBX")
        [abandoned] = stack.events("remote_data_abandoned")
        assert (abandoned["kept_copy"], abandoned["warm_copy_taken_at"]) == ("pbx", None)
        [home] = [life for life in stack.detector.lives(area) if life.key.side == "local"
                  and life.first_seen > lost_at]
        # the PBX's own copy: what it kept at the move out (and the stop's last record)
        assert home.start_records is not None and home.start_records <= moved_out + 1
        assert stack.events("warm_copy_unusable")

    async def test_a_services_own_snapshot_command_is_its_warm_copy(
        self, stack_factory: StackFactory
    ) -> None:
        """`warm_copy = {command = [...]}`: the agent runs it as the daemon runs, in its data
        dir; what it leaves in $MONITORD_SNAPSHOT_DIR is what the PBX receives."""
        dump = ("import os, shutil; shutil.copy('session.db', os.environ['MONITORD_SNAPSHOT_DIR']);"
                " open(os.path.join(os.environ['MONITORD_SNAPSHOT_DIR'], 'area'), 'w')"
                ".write('{area}')")
        stack = await stack_factory(services={"tg": 1}, service_overrides={
            "warm_copy": {"command": [sys.executable, "-c", dump], "timeout_s": 10},
            "warm_copy_interval_s": INTERVAL_S})
        area = stack.areas["tg"][0]
        await settle_remote(stack)
        await stack.wait_until(lambda: _taken(stack, area), timeout_s=30, what="a warm copy")
        warm_dir = stack.work_dir / "warm" / "tg" / area
        assert sorted(p.name for p in warm_dir.iterdir()) == ["area", "session.db"]
        assert (warm_dir / "area").read_text() == area
        assert (warm_dir / "session.db").read_bytes().count(b"\n") >= 1

    async def test_a_service_that_declares_nothing_is_never_warm_copied(
        self, stack_factory: StackFactory
    ) -> None:
        stack = await stack_factory(services={"tg": 1})
        area = stack.areas["tg"][0]
        await settle_remote(stack)
        await asyncio.sleep(3 * INTERVAL_S)
        assert await _warm_copy(stack, area) is None
        assert not (stack.work_dir / "warm").exists()

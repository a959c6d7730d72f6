"""The newest data, one runner at a time: moves, rollbacks, restarts and a corrupt
authoritative file never start an area on data older than its processes wrote.

Every test here also ends with the fixture's two checks: no overlap, and no data regression
(the fake daemons' hash-chained session DBs report how many records they found at start).
"""

from __future__ import annotations

import asyncio
import datetime
import signal
import time
from pathlib import Path

from monitord.testing.stack import Stack
from tests.integration.migration.conftest import (
    StackFactory,
    destination_runs_held_at_healthcheck,
    parked_waiting_for_data,
    settle_remote,
)
from tests.integration.operator.conftest import run_cli

R2L = "remote_to_local"


def _custom_config(stack: Stack) -> Path:
    return stack.root / "spool" / "custom_config.json"


def _truncate(path: Path) -> bytes:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return data


def _logged_at(event: dict[str, object]) -> float:
    stamp = str(event["timestamp"]).replace("Z", "+00:00")
    return datetime.datetime.fromisoformat(stamp).timestamp()


class TestCorruptAuthoritativeFile:
    """A custom_config.json that no longer parses stops nothing and loses nothing."""

    async def test_a_truncated_file_refuses_the_placement_and_nothing_stops(
        self, stack_factory: StackFactory
    ) -> None:
        stack = await stack_factory(services={"tg": 1})
        area = stack.areas["tg"][0]
        await stack.wait_settled(expect={"tg": "local"})
        [running] = stack.detector.alive(area)
        good = _truncate(_custom_config(stack))

        code, body = await stack.request(
            "PUT", "/v1/services/tg/placement", {"location": "remote"}
        )
        assert (code, body["error"]["code"]) == (409, "CONFIG_CORRUPT")
        code, body = await stack.request(
            "PUT", f"/v1/areas/{area}/placement", {"location": "remote"}
        )
        assert (code, body["error"]["code"]) == (409, "CONFIG_CORRUPT")
        status = await stack.status()
        assert status["config_error"]["code"] == "CONFIG_CORRUPT"
        assert "custom_config.json" in status["config_error"]["detail"]
        assert status["transactions"] == []
        await asyncio.sleep(1.0)
        assert stack.detector.alive(area) == [running], "the source was never touched"

        _custom_config(stack).write_bytes(good)
        await stack.place("tg", "remote")
        await stack.wait_settled(expect={"tg": "remote"}, timeout_s=60)
        assert (await stack.status())["config_error"] is None

    async def test_corruption_before_the_commit_rolls_back_with_the_data_it_wrote(
        self, stack_factory: StackFactory
    ) -> None:
        stack = await stack_factory(services={"tg": 1})
        area = stack.areas["tg"][0]
        await destination_runs_held_at_healthcheck(stack, area)
        good = _truncate(_custom_config(stack))
        truncated = _custom_config(stack).read_bytes()
        stack.release_hold()

        async def rolled_back() -> bool:
            status = await stack.status()
            return not status["transactions"] and any(
                k.side == "local" for k in stack.detector.alive(area)
            )

        await stack.wait_until(rolled_back, timeout_s=60, what="the rollback to local")
        assert _custom_config(stack).read_bytes() == truncated, "a corrupt file is never rewritten"
        remote_wrote = max(
            life.records for life in stack.detector.lives(area) if life.key.side == "remote"
        )
        newest_local = max(
            (life for life in stack.detector.lives(area) if life.key.side == "local"),
            key=lambda life: life.first_seen,
        )
        assert newest_local.start_records is not None
        assert newest_local.start_records >= remote_wrote > 0

        _custom_config(stack).write_bytes(good)
        await stack.wait_settled(expect={"tg": "remote"}, timeout_s=90)


class TestRecoveryFirst:
    """After a restart nothing starts for an area in flight before recovery decided."""

    async def test_restart_in_healthcheck_of_a_move_home_starts_nothing_locally_early(
        self, stack_factory: StackFactory
    ) -> None:
        stack = await stack_factory(services={"tg": 1})
        area = stack.areas["tg"][0]
        await settle_remote(stack)
        assert await stack.stop_monitord() == 0
        await stack.start_monitord(env={"MONITORD_CRASH_AT": f"{R2L}:HEALTHCHECK_DESTINATION"})
        await stack.place("tg", "local")
        assert await stack.wait_monitord_exit(timeout_s=60) == -signal.SIGKILL
        await asyncio.sleep(1.5)  # the local destination keeps running and writing
        [survivor] = [k for k in stack.detector.alive(area) if k.side == "local"]
        restarted_at = time.time()
        await stack.start_monitord()
        await stack.wait_settled(expect={"tg": "local"}, timeout_s=90)

        [recovering] = [e for e in stack.events("transaction_recovering") if e["area"] == area]
        recovered_at = _logged_at(recovering)
        early = [
            life.key for life in stack.detector.lives(area)
            if life.key.side == "local" and life.key != survivor
            and restarted_at < life.first_seen < recovered_at
        ]
        assert early == [], "a local daemon started before recovery decided"
        # The survivor was fenced (not adopted: its transaction was rolled back), and the area
        # came home again on data no older than anything written (the fixture checks that).
        [survivor_life] = [life for life in stack.detector.lives(area) if life.key == survivor]
        assert survivor_life.goodbye_at is not None


class TestOperatorOverride:
    """A rollback that waits too long for its data parks with both choices named; the
    operator's `rollback --discard-remote-data` restarts the source and says so."""

    async def test_parked_after_the_wait_then_discarded_by_the_operator(
        self, stack_factory: StackFactory
    ) -> None:
        stack = await stack_factory(services={"tg": 1}, rollback_data_wait_s=3.0)
        area = stack.areas["tg"][0]
        service = await parked_waiting_for_data(stack, area)
        code, body = await stack.request(
            "POST", "/v1/services/tg/discard-remote-data", {"nonsense": 1}
        )
        assert (code, body["error"]["code"]) == (400, "BAD_REQUEST")
        error = service["last_error"]
        assert isinstance(error, dict) and error["code"] == "ROLLBACK_DATA_UNREACHABLE"
        assert "--discard-remote-data" in error["action"] and "VPS" in error["action"]
        assert not any(k.side == "local" for k in stack.detector.alive(area))

        stack.accepted_data_loss.add(area)  # the operator's explicit choice
        result = await run_cli(
            "rollback", "--discard-remote-data", "tg", "-c", str(stack.config_path)
        )
        assert result.code == 0, result.stderr
        await stack.wait_until(
            lambda: any(k.side == "local" for k in stack.detector.alive(area)),
            timeout_s=30, what="the source runs again on its own data",
        )
        [discarded] = stack.events("remote_data_discarded")
        assert (discarded["area"], discarded["reason"]) == (area, "operator")
        again = await run_cli(
            "rollback", "--discard-remote-data", "tg", "-c", str(stack.config_path)
        )
        assert again.code == 1 and "TRANSACTION_CONFLICT" in again.stderr

        await stack.heal()
        assert (await run_cli("retry", "tg", "-c", str(stack.config_path))).code == 0
        await stack.wait_settled(expect={"tg": "local"}, timeout_s=90)

    async def test_parked_then_retried_after_heal_brings_the_data_back(
        self, stack_factory: StackFactory
    ) -> None:
        stack = await stack_factory(services={"tg": 1}, rollback_data_wait_s=3.0)
        area = stack.areas["tg"][0]
        await parked_waiting_for_data(stack, area)
        await stack.heal()
        await asyncio.sleep(2.0)
        assert not any(k.side == "local" for k in stack.detector.alive(area)), (
            "parked: nothing moves until the operator says so"
        )
        result = await run_cli("retry", "tg", "-c", str(stack.config_path))
        assert result.code == 0, result.stderr
        await stack.wait_settled(expect={"tg": "local"}, timeout_s=90)
        remote_wrote = max(
            life.records for life in stack.detector.lives(area) if life.key.side == "remote"
        )
        [back] = [life for life in stack.detector.alive(area) if life.side == "local"]
        [life] = [lf for lf in stack.detector.lives(area) if lf.key == back]
        assert life.start_records is not None and life.start_records >= remote_wrote
        assert stack.events("remote_data_discarded") == []


class TestStateDbLost:
    """state.db lost while a move out was under way: custom_config.json still commits the
    area to the PBX, the VPS's copy holds newer data. Nothing may start the area on the
    PBX's older copy, nor remove the VPS's as an orphan: it is held on both sides, and the
    status names the step."""

    async def test_lost_mid_move_the_area_is_held_never_started_on_older_data(
        self, stack_factory: StackFactory
    ) -> None:
        stack = await stack_factory(services={"tg": 1})
        area = stack.areas["tg"][0]
        await stack.wait_settled(expect={"tg": "local"}, timeout_s=60)
        assert await stack.stop_monitord() == 0
        await stack.start_monitord(env={"MONITORD_CRASH_AT": "local_to_remote:COMMIT_LOCATION"})
        await stack.place("tg", "remote")
        assert await stack.wait_monitord_exit(timeout_s=60) == -signal.SIGKILL
        await asyncio.sleep(1.0)  # the destination on the VPS writes records the PBX never saw
        for name in ("state.db", "state.db-wal", "state.db-shm"):
            (stack.work_dir / name).unlink(missing_ok=True)
        restarted_at = time.time()
        await stack.start_monitord()

        async def held() -> list[dict[str, object]]:
            return [h for h in (await stack.status())["held"] if h["area"] == area]
        await stack.wait_until(held, timeout_s=30, what="the area held")
        await asyncio.sleep(8.0)  # a few reconcile passes with the VPS answering
        [row] = await held()
        assert "the VPS holds generation 1" in str(row["detail"]), row
        started = [life.key for life in stack.detector.lives(area)
                   if life.key.side == "local" and life.first_seen >= restarted_at]
        assert started == [], "the area started on the PBX's older copy"
        assert area in stack.agent_cache(), "the VPS's newer copy was removed as an orphan"
        assert _custom_config(stack).exists()
        check = await run_cli("status", "--check", "-c", str(stack.config_path))
        assert check.code == 2 and "held" in check.stdout, check

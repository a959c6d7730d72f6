"""Given-up VPS copies after they were set aside: removed only once kept long enough, never
while being fetched, never before they were set aside (that record is what makes the next
removal on the VPS set the copy aside instead of deleting it)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from monitord.engine.abandoned_data import AbandonedData
from monitord.remote.copy import CopyReport
from orchestrator.errors import ErrorCode, MonitordError, error_for

DAY = 86400.0


class _State:
    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.abandoned = {(r["area"], r["generation"]): r for r in rows}
        self.changed = asyncio.Event()

    async def forget_abandoned(self, *, area: str, generation: int) -> None:
        del self.abandoned[(area, generation)]

    def notify(self) -> None:
        self.changed.set()


class _Store:
    def __init__(self, path: Path) -> None:
        self.path = path / "state.db"
        self.events: list[tuple[str, dict[str, Any]]] = []

    async def record_event(self, event: str, fields: dict[str, Any]) -> None:
        self.events.append((event, dict(fields)))


class _Vps:
    def __init__(self) -> None:
        self.up = True
        self.removed: list[str] = []
        self.fetch_may_end = asyncio.Event()
        self.refuse: MonitordError | None = None

    def reachable(self) -> bool:
        return self.up

    async def remove_set_aside(self, path: str) -> str:
        if self.refuse is not None:
            raise self.refuse
        self.removed.append(path)
        return "deleted"

    async def fetch_set_aside(self, *, path: str, local_dir: Path, progress: Any) -> CopyReport:
        progress(5, 5)
        await self.fetch_may_end.wait()
        return CopyReport(files=1, bytes=5, reused=0)


def _row(area: str, generation: int, *, set_aside_at: float | None) -> dict[str, Any]:
    path = None if set_aside_at is None else f"/opt/abandoned/{area}-g{generation}-1"
    return {"area": area, "generation": generation, "abandoned_at": 0.0,
            "set_aside_path": path, "set_aside_at": set_aside_at}


def _made(tmp_path: Path, rows: list[dict[str, Any]], *, now: float
          ) -> tuple[AbandonedData, _State, _Store, _Vps]:
    state, store, vps = _State(rows), _Store(tmp_path), _Vps()
    data = AbandonedData(state=state, store=store, remote=vps,  # type: ignore[arg-type]
                         keep_s=7 * DAY, wall=lambda: now)
    return data, state, store, vps


class TestRemoval:
    async def test_only_copies_set_aside_longer_than_the_keep_time_are_removed(
        self, tmp_path: Path
    ) -> None:
        rows = [_row("old", 1, set_aside_at=0.0), _row("young", 1, set_aside_at=DAY),
                _row("never-set-aside", 1, set_aside_at=None)]
        data, state, store, vps = _made(tmp_path, rows, now=7 * DAY + 1)
        assert await data.expire() == 1
        assert vps.removed == ["/opt/abandoned/old-g1-1"]
        assert set(state.abandoned) == {("young", 1), ("never-set-aside", 1)}
        [(event, fields)] = store.events
        assert (event, fields["area"], fields["kept_s"]) == ("set_aside_removed", "old", 604801)
        assert [r["remove_after"] for r in data.rows()] == [None, 8 * DAY]

    async def test_a_vps_that_refuses_or_is_away_keeps_record_and_copy(
        self, tmp_path: Path
    ) -> None:
        data, state, store, vps = _made(tmp_path, [_row("old", 1, set_aside_at=0.0)],
                                        now=8 * DAY)
        vps.up = False
        assert await data.expire() == 0
        vps.up, vps.refuse = True, error_for(ErrorCode.AGENT_UNREACHABLE, "timed out")
        assert await data.expire() == 0
        assert list(state.abandoned) == [("old", 1)] and store.events == []


class TestFetch:
    async def test_a_copy_being_fetched_is_not_removed_and_not_fetched_twice(
        self, tmp_path: Path
    ) -> None:
        data, state, store, vps = _made(tmp_path, [_row("old", 1, set_aside_at=0.0)],
                                        now=8 * DAY)
        started = data.start_fetch("old", None)
        assert started["to"] == str(tmp_path / "abandoned" / "old-g1-1")
        with pytest.raises(MonitordError) as twice:
            data.start_fetch("old", 1)
        assert twice.value.code is ErrorCode.TRANSACTION_CONFLICT
        await asyncio.sleep(0)
        assert await data.expire() == 0 and vps.removed == []
        state.changed.clear()
        vps.fetch_may_end.set()
        await asyncio.wait_for(state.changed.wait(), timeout=10)  # the fetch ended
        [row] = data.rows()
        assert (row["fetch"]["state"], row["fetch"]["files"]) == ("done", 1)
        assert [event for event, _ in store.events] == ["set_aside_fetched"]
        assert await data.expire() == 1, "once fetched, it goes at its time"
        await data.close()

    async def test_nothing_set_aside_or_no_vps_is_refused(self, tmp_path: Path) -> None:
        data, _, _, vps = _made(tmp_path, [_row("waiting", 1, set_aside_at=None)], now=0.0)
        for area, generation in (("waiting", None), ("other", None), ("waiting", 2)):
            with pytest.raises(MonitordError) as refused:
                data.start_fetch(area, generation)
            assert refused.value.code is ErrorCode.NOT_FOUND
        data, _, _, vps = _made(tmp_path, [_row("old", 1, set_aside_at=0.0)], now=0.0)
        vps.up = False
        with pytest.raises(MonitordError) as away:
            data.start_fetch("old", None)
        assert away.value.code is ErrorCode.SSH_UNREACHABLE
        await data.close()

    async def test_a_fetch_cut_by_shutdown_is_shown_failed(self, tmp_path: Path) -> None:
        data, _, _, _ = _made(tmp_path, [_row("old", 1, set_aside_at=0.0)], now=0.0)
        data.start_fetch("old", None)
        await asyncio.sleep(0)
        await data.close()
        [row] = data.rows()
        assert (row["fetch"]["state"], row["fetch"]["error"]["code"]) == ("failed", "INTERNAL")

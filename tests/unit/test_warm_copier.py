"""The warm copier gives the link up to moves: no copy starts while a transaction is open,
and copies under way are cancelled the moment one opens, leaving nothing recorded; a few
areas are copied at once; a failure is counted per cause and keeps the last copy.

The VPS here is a double whose snapshot waits until released: what these tests control is
*when* a copy is under way, which a real link cannot be made to hold (the integration tier,
tests/integration/migration/test_warm_copies.py, runs the real agent and download)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from monitord.base import config as config_mod
from monitord.base.metrics import Metrics
from monitord.engine.local_side import LocalSide
from monitord.engine.placement_state import PlacementState
from monitord.engine.warm_copier import COPIES_AT_ONCE, WarmCopier
from monitord.store.state_db import Store
from orchestrator.errors import ErrorCode, MonitordError, error_for
from orchestrator.lineage import Lineage
from orchestrator.models import Area, Side, Transaction

AREAS = [f"a{n}" for n in range(6)]


class HeldAgent:
    """An agent whose snapshots wait for `release` (or fail with `error`)."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.cancelled: list[str] = []
        self.release = asyncio.Event()
        self.error: Exception | None = None

    async def snapshot(self, *, area: str, **_: Any) -> Any:
        self.started.append(area)
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled.append(area)
            raise
        raise self.error or AssertionError("not released in these tests")


class Link:
    def __init__(self) -> None:
        self.agent = HeldAgent()

    def connected(self) -> bool:
        return True


@pytest.fixture
async def copier(tmp_path: Path) -> AsyncIterator[tuple[WarmCopier, PlacementState, Link]]:
    config = config_mod.parse({
        "monitord": {"work_dir": str(tmp_path / "work")},
        "remote": {"host": "vps", "user": "u", "key_file": str(tmp_path / "key"),
                   "accept_any_host_key": True},
        "services": {"tg": {"command": ["tgd"], "local_data_dir": f"{tmp_path}/l/{{area}}",
                            "remote_data_dir": "/r/{area}", "warm_copy": "sqlite",
                            "warm_copy_databases": ["*.sqlite"], "warm_copy_interval_s": 1}},
    })
    async with await Store.open(tmp_path) as store:
        state = PlacementState(store=store, custom_config_path=tmp_path / "custom_config.json")
        for uuid in AREAS:
            state.committed[uuid] = Area(uuid=uuid, service="tg", location=Side.REMOTE,
                                         generation=3)
            state.lineages[uuid] = Lineage(area=uuid, holders=frozenset({Side.REMOTE}), epoch=2)
        link = Link()
        local = LocalSide(config=config, supervisor=None, runs=dict,  # type: ignore[arg-type]
                          link=None)
        yield WarmCopier(config=config, state=state, link=link,  # type: ignore[arg-type]
                         local_side=local, metrics=Metrics()), state, link


def _a_move_opens(state: PlacementState) -> None:
    state.transactions["a0"] = Transaction(transaction_id="t1", service="tg", area="a0",
                                           source=Side.REMOTE, destination=Side.LOCAL,
                                           generation=4, source_generation=3,
                                           started_at=0.0, updated_at=0.0)
    state.notify()


async def _until(predicate: Any) -> None:
    for _ in range(200):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("never happened")


async def test_a_move_opening_cancels_every_copy_under_way_and_nothing_is_recorded(
    copier: tuple[WarmCopier, PlacementState, Link],
) -> None:
    warm, state, link = copier
    with capture_logs() as logs:
        passing = asyncio.create_task(warm.run_once())
        await _until(lambda: len(link.agent.started) == COPIES_AT_ONCE)
        assert COPIES_AT_ONCE > 1, "a few at once: a copy's time is its round trips"
        _a_move_opens(state)
        taken = await asyncio.wait_for(passing, timeout=5)
    assert taken == 0
    assert sorted(link.agent.cancelled) == sorted(link.agent.started)
    # the rest of the pass waits for the move: not one more copy started
    assert len(link.agent.started) == COPIES_AT_ONCE
    assert state.warm == {}
    assert [e["event"] for e in logs].count("warm_copy_yielded") == COPIES_AT_ONCE


async def test_no_copy_starts_while_a_move_runs(
    copier: tuple[WarmCopier, PlacementState, Link],
) -> None:
    warm, state, link = copier
    _a_move_opens(state)
    assert await asyncio.wait_for(warm.run_once(), timeout=5) == 0
    assert link.agent.started == []


async def test_a_failure_is_counted_and_logged_once_per_cause(
    copier: tuple[WarmCopier, PlacementState, Link],
) -> None:
    warm, _, link = copier
    link.agent.error = error_for(ErrorCode.WARM_COPY_FAILED, "db.sqlite kept changing")
    link.agent.release.set()
    with capture_logs() as logs:
        assert await asyncio.wait_for(warm.run_once(), timeout=5) == 0
        for tries in warm._tries.values():
            tries.last_try = None  # (due again at once)
        await asyncio.wait_for(warm.run_once(), timeout=5)
    failed = [e for e in logs if e["event"] == "warm_copy_failed"]
    assert sorted(e["area"] for e in failed) == AREAS, "once per area, not per try"
    sample = warm.metrics.registry.get_sample_value(
        "monitord_warm_copy_failures_total", {"service": "tg", "code": "WARM_COPY_FAILED"})
    assert sample == 2 * len(AREAS)
    row = warm.status()["a1"]
    assert row["error"] == {"code": "WARM_COPY_FAILED", "detail": "db.sqlite kept changing"}
    assert row["taken_at"] is None


async def test_a_warm_copy_gives_way_before_it_would_leave_a_move_home_no_room(
    copier: tuple[WarmCopier, PlacementState, Link], tmp_path: Path,
) -> None:
    """The file system's real free space: a copy that would leave less than a move home of
    the same area needs (the copy again, plus the margin) is not taken."""
    import os

    warm, _, _ = copier
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    await warm.local_side.check_room_for_warm_copy(tmp_path / "w", bytes_=1 << 20, files=3)
    with pytest.raises(MonitordError) as refused:
        await warm.local_side.check_room_for_warm_copy(tmp_path / "w", bytes_=free // 2,
                                                       files=3)
    assert refused.value.code is ErrorCode.LOCAL_DISK_FULL
    assert "no warm copy" in refused.value.detail


async def test_a_copy_recorded_but_not_yet_in_place_is_still_found_and_restored(
    copier: tuple[WarmCopier, PlacementState, Link], tmp_path: Path,
) -> None:
    """A copy is received beside the recorded one and recorded before it is moved into
    place: a cut between the two leaves the record naming the arriving dir's files, which a
    give-up finds there; files that hash otherwise are found nowhere."""
    from monitord.base import area_paths
    from monitord.remote.copy import local_tree
    from orchestrator.warm_copy import WarmCopy

    warm, state, _ = copier
    placed = warm.dir_of(service="tg", area="a1")
    arriving = area_paths.arriving_warm_copy_dir(placed)
    arriving.mkdir(parents=True)
    (arriving / "session.sqlite").write_bytes(b"the newest copy")
    placed.mkdir(parents=True)
    (placed / "session.sqlite").write_bytes(b"the one before")
    copy = WarmCopy(area="a1", service="tg", generation=3, epoch=2, taken_at=1.0,
                    received_at=2.0, files=1, bytes=15, sent_bytes=15,
                    digest=local_tree.tree_sha256(arriving), restore_epoch=3)
    local = warm.local_side
    assert await local.warm_copy_dir_of(copy) == arriving
    restored = await local.restore_own_copy(service="tg", area="a1", generation=4, warm=copy)
    assert restored == str(arriving)
    target = Path(local.data_dir(service="tg", area="a1", generation=4))
    assert (target / "session.sqlite").read_bytes() == b"the newest copy"
    assert await local.warm_copy_dir_of(copy) is None  # (moved: found nowhere now)


async def test_the_next_copy_first_puts_a_recorded_arrival_in_place(
    copier: tuple[WarmCopier, PlacementState, Link],
) -> None:
    from monitord.base import area_paths
    from monitord.remote.copy import local_tree
    from orchestrator.warm_copy import WarmCopy

    warm, state, _ = copier
    area = state.committed["a1"]
    placed = warm.dir_of(service="tg", area="a1")
    arriving = area_paths.arriving_warm_copy_dir(placed)
    arriving.mkdir(parents=True)
    (arriving / "session.sqlite").write_bytes(b"recorded, not yet moved")
    await state.record_warm_copy(WarmCopy(
        area="a1", service="tg", generation=3, epoch=2, taken_at=1.0, received_at=2.0,
        files=1, bytes=23, sent_bytes=23, digest=local_tree.tree_sha256(arriving)))
    await warm._finish_install(area, arriving, placed)
    assert (placed / "session.sqlite").read_bytes() == b"recorded, not yet moved"
    assert not arriving.exists()
    arriving.mkdir()
    (arriving / "session.sqlite").write_bytes(b"never recorded")
    await warm._finish_install(area, arriving, placed)
    assert not arriving.exists()
    assert (placed / "session.sqlite").read_bytes() == b"recorded, not yet moved"


async def test_the_loop_waits_for_the_next_due_area_never_spins(
    copier: tuple[WarmCopier, PlacementState, Link],
) -> None:
    """The loop takes what an iteration returns as its wait: a pass that copied nothing
    (every area tried a moment ago) must not ask for 0 s, or the loop spins."""
    warm, _, link = copier
    link.agent.error = error_for(ErrorCode.WARM_COPY_FAILED, "kept changing")
    link.agent.release.set()
    first = await asyncio.wait_for(warm._pass(), timeout=5)
    assert 0.5 < first <= 1.0, "the areas are due again one interval (1 s) after their try"
    started = len(link.agent.started)
    again = await asyncio.wait_for(warm._pass(), timeout=5)
    assert len(link.agent.started) == started, "nothing was due"
    assert again > 0.5

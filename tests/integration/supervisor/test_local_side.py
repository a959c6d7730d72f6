"""The PBX's side of a move (monitord/engine/local_side.py) alone: a real supervisor, real
daemons and real data dirs, no engine. What the phase actions, the reconciler and the
cleanup worker ask of the PBX, each asked here directly and checked on the processes and
the files themselves."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from monitord.base.config import Config, MonitordSection, ServiceSection
from monitord.engine.local_side import LocalSide
from monitord.local.supervisor import AreaRun, LocalSupervisor
from orchestrator import disk_space
from orchestrator.errors import ErrorCode, MonitordError
from orchestrator.models import Side, Transaction

AREA = "a1"


@pytest.fixture
async def side(tmp_path: Path) -> AsyncIterator[LocalSide]:
    # A daemon that writes its data dir and keeps running: what a messenger does.
    writer = "import pathlib, sys, time; d = pathlib.Path(sys.argv[1]); d.mkdir(parents=True," \
             " exist_ok=True); (d / 'session.db').write_bytes(b'x' * 5000); time.sleep(600)"
    service = ServiceSection(command=(sys.executable, "-c", writer, "{data_dir}"),
                             local_data_dir=str(tmp_path / "data" / "{area}"),
                             remote_data_dir="/srv/{area}", min_uptime_s=0.2)
    config = Config(monitord=MonitordSection(work_dir=tmp_path / "work"),
                    services={"tg": service})
    supervisor = LocalSupervisor(state_dir=tmp_path / "work" / "supervisor", stop_grace_s=1.0)
    wanted: dict[str, AreaRun] = {}
    local = LocalSide(config=config, supervisor=supervisor, runs=lambda: dict(wanted),
                      link=None)
    try:
        yield local
    finally:
        await supervisor.close()
        assert await supervisor.stop_all(grace_s=0.5)


def _move_home(generation: int) -> Transaction:
    return Transaction(transaction_id="t-1", service="tg", area=AREA, source=Side.REMOTE,
                       destination=Side.LOCAL, generation=generation, source_generation=1,
                       started_at=0.0, updated_at=0.0)


async def _running(side: LocalSide) -> frozenset[int]:
    observed = await side.observe([AREA])
    assert observed is not None
    return observed[AREA].process_generations


class TestStartAndStop:
    async def test_a_start_runs_the_area_at_its_generation_and_a_stop_ends_it(
        self, side: LocalSide
    ) -> None:
        await side.start(service="tg", area=AREA, generation=3)
        assert await _running(side) == {3}
        assert await side.uptime(area=AREA, generation=3) is not None
        assert await side.uptime(area=AREA, generation=2) is None, "another generation"
        await side.stop(area=AREA, generation=3)
        assert await _running(side) == frozenset()
        await side.verify_gone(area=AREA, generation=3)

    async def test_a_stop_at_another_generation_leaves_the_running_one(
        self, side: LocalSide
    ) -> None:
        await side.start(service="tg", area=AREA, generation=3)
        await side.stop_at(area=AREA, generation=2)
        assert await _running(side) == {3}
        with pytest.raises(MonitordError) as still:
            await side.verify_gone(area=AREA, generation=3)
        assert still.value.code == ErrorCode.DAEMON_STOP_FAILED


class TestTheData:
    async def test_the_usage_is_the_footprint_and_the_content_of_the_data_dir(
        self, side: LocalSide
    ) -> None:
        empty = await side.usage(service="tg", area=AREA, generation=3)
        assert empty == disk_space.Usage(bytes=0, content_bytes=0)
        data = Path(side.data_dir(service="tg", area=AREA, generation=3))
        (data / "sub").mkdir(parents=True)
        (data / "session.db").write_bytes(b"x" * 5000)
        (data / "sub" / "keys").write_bytes(b"k" * 10)
        usage = await side.usage(service="tg", area=AREA, generation=3)
        assert usage == disk_space.Usage(bytes=2 * 4096 + 4096 + 2 * 4096, inodes=4,
                                         content_bytes=5010)

    async def test_a_move_home_that_cannot_fit_is_refused_naming_the_shortage(
        self, side: LocalSide
    ) -> None:
        await side.check_ready(_move_home(4), incoming=disk_space.Usage(bytes=1024))
        with pytest.raises(MonitordError) as refused:
            await side.check_ready(_move_home(4), incoming=disk_space.Usage(bytes=1 << 60))
        assert refused.value.code == ErrorCode.PREFLIGHT_DISK_SPACE
        assert "PBX" in refused.value.detail

    async def test_a_retired_source_is_archived_and_is_the_pbxs_own_copy_later(
        self, side: LocalSide
    ) -> None:
        data = Path(side.data_dir(service="tg", area=AREA, generation=3))
        data.mkdir(parents=True)
        (data / "session.db").write_bytes(b"x" * 5000)
        await side.start(service="tg", area=AREA, generation=3)
        await side.retire(service="tg", area=AREA, generation=3)
        assert await _running(side) == frozenset() and not data.exists()
        copy = await side.own_copy(service="tg", area=AREA, generation=5)
        assert copy["path"] is not None and copy["path"].endswith(f"{AREA}-g3")
        restored = await side.restore_own_copy(service="tg", area=AREA, generation=5)
        assert restored == copy["path"]
        moved = Path(side.data_dir(service="tg", area=AREA, generation=5))
        assert (moved / "session.db").read_bytes() == b"x" * 5000

"""The instruments themselves: the detector catches a real split brain between fake daemons,
stays quiet for a clean handover, and the fake daemon's session DB exposes a torn copy."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from monitord.local.supervisor import LocalSupervisor
from monitord.testing import fake_daemon
from monitord.testing.split_brain import Detector
from tests.integration.supervisor.conftest import fake_run

AREA = "0b0b0b0b-0000-4000-8000-000000000001"


class TestDetectorOnRealDaemons:
    """Two live daemons for one area are reported; stop-then-start is not."""

    async def test_two_daemons_for_one_area_on_purpose_are_reported(
        self, supervisor: LocalSupervisor, detector: Detector, tmp_path: Path
    ) -> None:
        local = fake_run(detector, tmp_path / "local", area=AREA, generation=1)
        await supervisor.start_area(local)
        remote = fake_run(detector, tmp_path / "remote", area=AREA, generation=2, side="remote")
        duplicate = await asyncio.create_subprocess_exec(*remote.command)
        try:
            assert await detector.wait_for(lambda d: bool(d.overlaps()), timeout_s=10)
        finally:
            duplicate.terminate()
            await asyncio.wait_for(duplicate.wait(), timeout=10)
        [overlap] = detector.overlaps()
        assert {overlap.first.side, overlap.second.side} == {"local", "remote"}
        assert {overlap.first.pid, overlap.second.pid} >= {duplicate.pid}
        assert overlap.end > overlap.start

    async def test_clean_handover_stop_then_start_reports_no_overlap(
        self, supervisor: LocalSupervisor, detector: Detector, tmp_path: Path
    ) -> None:
        await supervisor.start_area(fake_run(detector, tmp_path, area=AREA, generation=1))
        assert await detector.wait_for(lambda d: d.alive(AREA), timeout_s=10)
        assert await supervisor.stop_area(AREA)
        await supervisor.start_area(fake_run(detector, tmp_path, area=AREA, generation=2))
        assert await detector.wait_for(
            lambda d: [k.generation for k in d.alive(AREA)] == [2], timeout_s=10
        )
        assert [life.key.generation for life in detector.lives(AREA)] == [1, 2]
        assert detector.overlaps() == []


class TestHeartbeatLink:
    """The fake daemon re-dials its heartbeat endpoint when the connection drops."""

    async def test_heartbeats_resume_after_the_detector_restarts_on_the_same_port(
        self, supervisor: LocalSupervisor, tmp_path: Path
    ) -> None:
        async with Detector() as first:
            await supervisor.start_area(fake_run(first, tmp_path, area=AREA))
            assert await first.wait_for(lambda d: d.alive(AREA), timeout_s=10)
            port = first.port
        async with Detector(port=port) as second:
            assert await second.wait_for(lambda d: d.alive(AREA), timeout_s=10)


class TestSessionDb:
    """The fake daemon's hash-chained session DB survives restarts and exposes a torn copy."""

    async def _run_once(self, detector: Detector, data: Path, *, starts: bool = True) -> int:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "monitord.testing.fake_daemon", "--area", AREA,
            "--data", str(data), "--side", "local", "--generation", "1",
            "--heartbeat", detector.address, stderr=asyncio.subprocess.DEVNULL,
        )
        if starts:
            assert await detector.wait_for(
                lambda d: any(life.key.pid == process.pid for life in d.lives(AREA)),
                timeout_s=10,
            )
            process.terminate()
        return await asyncio.wait_for(process.wait(), timeout=10)

    async def test_a_daemon_continues_an_intact_session_db(
        self, detector: Detector, tmp_path: Path
    ) -> None:
        assert await self._run_once(detector, tmp_path) == 0
        records, _ = fake_daemon.verify_session_db(tmp_path / fake_daemon.SESSION_DB)
        assert await self._run_once(detector, tmp_path) == 0
        assert fake_daemon.verify_session_db(tmp_path / fake_daemon.SESSION_DB)[0] > records

    async def test_a_torn_session_db_stops_the_daemon_at_start(
        self, detector: Detector, tmp_path: Path
    ) -> None:
        assert await self._run_once(detector, tmp_path) == 0
        db = tmp_path / fake_daemon.SESSION_DB
        db.write_bytes(db.read_bytes()[:-7])  # a copy cut short
        status = await self._run_once(detector, tmp_path, starts=False)
        assert status == fake_daemon.EXIT_DB_BROKEN
        assert len(detector.lives(AREA)) == 1


class TestChurn:
    """`--churn-pages-per-s`: the data changes as a live store's does, whole pages in place."""

    def test_pages_are_rewritten_in_place_and_the_size_is_kept(self, tmp_path: Path) -> None:
        store = tmp_path / fake_daemon.CHURNED
        before = bytes(64 * fake_daemon.PAGE_BYTES)
        store.write_bytes(before)
        churn = fake_daemon.Churn(store, per_tick=2.5)
        for _ in range(4):  # ten pages owed in all
            churn.tick()
        after = store.read_bytes()
        assert len(after) == len(before)
        pages = [after[i:i + fake_daemon.PAGE_BYTES]
                 for i in range(0, len(after), fake_daemon.PAGE_BYTES)]
        changed = sum(1 for p in pages if p != bytes(fake_daemon.PAGE_BYTES))
        assert 5 <= changed <= 10  # (two of the ten random picks may land on one page)

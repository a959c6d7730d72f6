"""The local supervisor: restarts with capped backoff, stops with escalation, and adopts or
stops what a killed predecessor left running — never a duplicate."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import pytest

from monitord.base import atomic_file, proc_identity
from monitord.local.supervisor import LocalSupervisor
from monitord.testing.split_brain import Detector
from tests.integration.supervisor.conftest import fake_run, host_killed_with_sigkill
from tests.support.agent_process import wait_until

AREA = "0a0a0a0a-0000-4000-8000-000000000001"
OTHER = "0a0a0a0a-0000-4000-8000-000000000002"


class TestCrashLoop:
    """A daemon that keeps crashing is restarted with growing, capped delays, without end."""

    async def test_crash_loop_backs_off_and_keeps_retrying(
        self, supervisor: LocalSupervisor, detector: Detector, tmp_path: Path
    ) -> None:
        run = fake_run(detector, tmp_path, area=AREA, extra=("--crash-after", "0.2"))
        await supervisor.start_area(run)
        await supervisor.start()
        saw_backoff = []

        def six_lives_and_backoff_seen() -> bool:
            view = supervisor.inventory()[0]
            if view.state == "backoff" and view.next_retry_at is not None:
                saw_backoff.append(view)
            return len(detector.lives(AREA)) >= 6

        await wait_until(six_lives_and_backoff_seen, timeout_s=30, what="six runs",
                         interval_s=0.02)
        assert saw_backoff, "the next retry time was never visible in the inventory"
        lives = detector.lives(AREA)
        gaps = [b.first_seen - a.last_seen for a, b in zip(lives, lives[1:], strict=False)]
        # delays are 0.2, 0.4, 0.8, 0.8, ... (cap 0.8); a gap is never shorter than its delay
        # minus one heartbeat period (the crash comes up to 0.1 s after the last heartbeat)
        for gap, delay in zip(gaps, (0.2, 0.4, 0.8, 0.8, 0.8), strict=False):
            assert gap >= delay - 0.1, (gaps, delay)
        assert supervisor.inventory()[0].restarts >= 5
        assert len({life.key.pid for life in lives}) == len(lives)
        assert detector.overlaps() == []


class TestStop:
    """Stop sends SIGTERM to the group, waits the grace, SIGKILLs, and verifies it is gone."""

    async def test_stop_of_a_daemon_ignoring_sigterm_escalates_to_sigkill(
        self, supervisor: LocalSupervisor, detector: Detector, tmp_path: Path
    ) -> None:
        view = await supervisor.start_area(
            fake_run(detector, tmp_path, area=AREA, extra=("--ignore-sigterm",))
        )
        assert await detector.wait_for(lambda d: d.alive(AREA), timeout_s=10)
        assert await supervisor.stop_area(AREA, grace_s=0.5)
        assert view.pid is not None and not proc_identity.is_alive(view.pid)
        [life] = detector.lives(AREA)
        assert life.goodbye_at is None  # it never ran its SIGTERM path: SIGKILL ended it
        assert supervisor.inventory() == []

    async def test_stop_of_a_well_behaved_daemon_ends_with_its_goodbye(
        self, supervisor: LocalSupervisor, detector: Detector, tmp_path: Path
    ) -> None:
        await supervisor.start_area(fake_run(detector, tmp_path, area=AREA))
        assert await detector.wait_for(lambda d: d.alive(AREA), timeout_s=10)
        assert await supervisor.stop_area(AREA, grace_s=5)
        [life] = detector.lives(AREA)
        assert life.goodbye_at is not None

    async def test_a_stopped_area_is_not_restarted(
        self, supervisor: LocalSupervisor, detector: Detector, tmp_path: Path
    ) -> None:
        await supervisor.start_area(fake_run(detector, tmp_path, area=AREA))
        await supervisor.start()
        assert await detector.wait_for(lambda d: d.alive(AREA), timeout_s=10)
        assert await supervisor.stop_area(AREA)
        assert not await detector.wait_for(lambda d: d.alive(AREA), timeout_s=1.0)


class TestSurvivors:
    """After the owning process is killed with -9, the next supervisor adopts the wanted
    survivors and stops the rest before starting anything; the detector sees no overlap."""

    async def test_next_supervisor_adopts_wanted_and_stops_unwanted_survivors(
        self, detector: Detector, tmp_path: Path
    ) -> None:
        state_dir = tmp_path / "state"
        keep = fake_run(detector, tmp_path, area=AREA, generation=1)
        move = fake_run(detector, tmp_path, area=OTHER, generation=1)
        await host_killed_with_sigkill(state_dir, [keep, move])
        assert await detector.wait_for(lambda d: len(d.alive()) == 2, timeout_s=10)
        kept_pid = detector.alive(AREA)[0].pid

        successor = LocalSupervisor(state_dir=state_dir, stop_grace_s=2.0)
        try:
            newer = fake_run(detector, tmp_path, area=OTHER, generation=2)
            report = await successor.adopt_or_stop_survivors({AREA: keep, OTHER: newer})
            assert (report.adopted, report.stopped, report.stuck) == ((AREA,), (OTHER,), ())
            await successor.start()
            assert await detector.wait_for(
                lambda d: [k.generation for k in d.alive(OTHER)] == [2], timeout_s=10
            )
            views = {view.area: view for view in successor.inventory()}
            assert (views[AREA].pid, views[AREA].adopted) == (kept_pid, True)
            assert [life.key.pid for life in detector.lives(AREA)] == [kept_pid]
            assert detector.overlaps() == []
        finally:
            await successor.close()
            assert await successor.stop_all(grace_s=1.0)

    async def test_a_survivor_without_its_record_is_stopped_not_duplicated(
        self, detector: Detector, tmp_path: Path
    ) -> None:
        state_dir = tmp_path / "state"
        run = fake_run(detector, tmp_path, area=AREA)
        await host_killed_with_sigkill(state_dir, [run])
        assert await detector.wait_for(lambda d: d.alive(AREA), timeout_s=10)
        old_pid = detector.alive(AREA)[0].pid
        (state_dir / "records" / f"{AREA}.json").unlink()  # as if killed before recording

        successor = LocalSupervisor(state_dir=state_dir, stop_grace_s=2.0)
        try:
            report = await successor.adopt_or_stop_survivors({AREA: run})
            assert report.stopped == (AREA,)
            assert not proc_identity.is_alive(old_pid)
            await successor.start()
            assert await detector.wait_for(
                lambda d: [k.pid for k in d.alive(AREA)] not in ([], [old_pid]), timeout_s=10
            )
            assert detector.overlaps() == []
        finally:
            await successor.close()
            assert await successor.stop_all(grace_s=1.0)


class TestGenerationCheckedStop:
    """A stop for one generation never touches the same area running at another."""

    async def test_stop_at_an_older_generation_leaves_the_newer_one_running(
        self, supervisor: LocalSupervisor, detector: Detector, tmp_path: Path
    ) -> None:
        view = await supervisor.start_area(fake_run(detector, tmp_path, area=AREA, generation=2))
        assert await supervisor.stop_area_at(AREA, 1)
        assert [(v.generation, v.pid) for v in supervisor.inventory()] == [(2, view.pid)]
        assert proc_identity.read(view.pid or 0) is not None
        assert await supervisor.stop_area_at(AREA, 2)
        assert all(v.pid is None for v in supervisor.inventory())


class TestLoopStaysResponsive:
    """Converging many areas (a daemon start with every area local, a batch of moves home)
    never holds the event loop for more than one area at a time: the HTTP API, the tunnel's
    keepalives and the lease renewals run between the starts."""

    async def test_other_tasks_run_between_the_starts_of_many_areas(
        self, supervisor: LocalSupervisor, detector: Detector, tmp_path: Path
    ) -> None:
        areas = [f"0a0a0a0a-0000-4000-8000-{n:012d}" for n in range(10, 16)]
        seen: list[int] = []  # how many daemons were started, at each turn of the loop

        async def watch() -> None:
            while True:
                seen.append(sum(v.pid is not None for v in supervisor.inventory()))
                await asyncio.sleep(0)

        watcher = asyncio.create_task(watch())
        try:
            supervisor.set_desired({a: fake_run(detector, tmp_path, area=a) for a in areas})
            await supervisor.start()
            await wait_until(lambda: all(v.pid for v in supervisor.inventory()), timeout_s=20,
                             what="every area started")
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
        assert set(range(1, len(areas))) <= set(seen), f"the loop waited for a batch: {seen}"


class TestPassesScale:
    """Every change of the wanted set (each phase of each move) wakes the supervisor; the
    pass it wakes converges the areas that changed, not every area: a service's move stays
    linear in its areas. The tick's pass still looks at every area."""

    async def test_a_change_converges_the_areas_it_changed_and_no_others(
        self, detector: Detector, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # No tick during the test: only wake-ups drive the passes after the first.
        supervisor = LocalSupervisor(state_dir=tmp_path / "state", stop_grace_s=1.0,
                                     tick_s=600.0)
        converged: list[str] = []
        converge = supervisor._converge

        async def recording(area: str) -> None:
            converged.append(area)
            await converge(area)

        monkeypatch.setattr(supervisor, "_converge", recording)
        areas = [f"0a0a0a0a-0000-4000-8000-{n:012d}" for n in range(20, 24)]
        runs = {a: fake_run(detector, tmp_path, area=a) for a in areas}
        try:
            supervisor.set_desired(dict(list(runs.items())[:3]))
            await supervisor.start()
            await wait_until(lambda: len(detector.alive()) == 3, timeout_s=20,
                             what="three areas up")
            assert sorted(converged) == sorted(areas[:3])  # the first pass: every area

            converged.clear()
            supervisor.set_desired(runs)  # one more area
            await wait_until(lambda: bool(detector.alive(areas[3])), timeout_s=20,
                             what="the added area up")
            assert converged == [areas[3]]

            converged.clear()
            supervisor.set_desired({a: runs[a] for a in areas[1:]})  # one less
            await wait_until(lambda: not detector.alive(areas[0]), timeout_s=20,
                             what="the removed area stopped")
            supervisor.set_desired({a: runs[a] for a in areas[1:]})  # the same again
            await asyncio.sleep(0.3)  # (a pass it woke would run in a loop turn)
            assert converged == [areas[0]]
            assert detector.overlaps() == []
        finally:
            await supervisor.close()
            assert await supervisor.stop_all(grace_s=0.5)


class TestShutdownDuringTheRecordWrite:
    """A shutdown that lands while a new daemon's record is being written (in a thread)
    leaves that daemon recorded: the next instance adopts it, never a second one."""

    async def test_the_next_instance_adopts_the_daemon_whose_record_was_being_written(
        self, detector: Detector, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        state_dir = tmp_path / "state"
        writing, release = threading.Event(), threading.Event()
        original = atomic_file.atomic_write_bytes

        def slow_write(path: Path, data: bytes, **kwargs: Any) -> None:
            if path.parent.name == "records":
                writing.set()
                release.wait(10)
            original(path, data, **kwargs)

        monkeypatch.setattr(atomic_file, "atomic_write_bytes", slow_write)
        run = fake_run(detector, tmp_path, area=AREA)
        first = LocalSupervisor(state_dir=state_dir, stop_grace_s=2.0)
        first.set_desired({AREA: run})
        await first.start()
        assert await asyncio.to_thread(writing.wait, 10), "the record write never began"
        pid = first.inventory()[0].pid
        assert pid is not None
        await first.close()  # the shutdown, while the write waits
        release.set()
        record = state_dir / "records" / f"{AREA}.json"
        await wait_until(record.exists, timeout_s=10, what="the record, written after all")
        assert json.loads(record.read_text())["identity"]["pid"] == pid

        successor = LocalSupervisor(state_dir=state_dir, stop_grace_s=2.0)
        try:
            report = await successor.adopt_or_stop_survivors({AREA: run})
            assert report.adopted == (AREA,), report
            await successor.start()
            await asyncio.sleep(0.5)  # time for a wrong second start to show
            assert [k.pid for k in detector.alive(AREA)] == [pid]
            assert detector.overlaps() == []
        finally:
            await successor.close()
            assert await successor.stop_all(grace_s=1.0)
            # the daemon is this process's child (the first instance started it
            # in-process): reap it now that the successor stopped it
            slot = first._slots[AREA]
            if slot.popen is not None:
                await asyncio.to_thread(slot.popen.wait, 10)

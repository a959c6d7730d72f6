"""A daemon's child that leaves its process group (setsid(), as a daemon that daemonizes does)
is stopped with its daemon: the local supervisor runs each area in a cgroup v2 of its own and
a fence empties it (monitord/base/cgroup_fence.py) — on a stop, after an exit, and for a
survivor of a previous instance, adopted or stopped."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from monitord.base import cgroup_fence, proc_identity
from monitord.local.supervisor import AreaRun, LocalSupervisor
from monitord.testing.split_brain import Detector
from tests.integration.supervisor.conftest import fake_run, host_killed_with_sigkill
from tests.support.agent_process import wait_until
from tests.support.escaped_children import Escapees, killed_at_the_end, require_cgroup_v2

AREA = "0c0c0c0c-0000-4000-8000-000000000001"


@pytest.fixture
def escapees() -> Iterator[Escapees]:
    with killed_at_the_end() as children:
        yield children


class TestEscapedChildIsFenced:
    """Where this process owns a cgroup v2, no fence leaves a daemon's escaped child running."""

    @pytest.fixture(autouse=True)
    def _cgroup_v2(self) -> None:
        require_cgroup_v2()

    async def test_a_stop_kills_the_child_that_left_the_daemons_process_group(
        self, supervisor: LocalSupervisor, detector: Detector, escapees: Escapees,
        tmp_path: Path,
    ) -> None:
        run = fake_run(detector, tmp_path, area=AREA, extra=("--escape-child",))
        view = await supervisor.start_area(run)
        child = await escapees.found(Path(run.data_dir))
        assert os.getpgid(child.pid) != view.pid  # out of the group the stop signals
        assert await supervisor.stop_area(AREA, grace_s=1.0)
        assert not proc_identity.is_same_process(child)

    async def test_a_daemon_that_exits_takes_its_escaped_child_with_it(
        self, supervisor: LocalSupervisor, detector: Detector, escapees: Escapees,
        tmp_path: Path,
    ) -> None:
        run = fake_run(detector, tmp_path, area=AREA, extra=("--escape-child",
                                                             "--crash-after", "0.5"))
        await supervisor.start_area(run)
        await supervisor.start()
        first = await escapees.found(Path(run.data_dir))
        await escapees.found(Path(run.data_dir), not_this=first.pid)  # the restart's own
        assert not proc_identity.is_same_process(first)

    async def test_an_adopted_daemon_is_fenced_with_its_escaped_child(
        self, detector: Detector, escapees: Escapees, tmp_path: Path
    ) -> None:
        state_dir = tmp_path / "state"
        run = fake_run(detector, tmp_path, area=AREA, extra=("--escape-child",))
        await host_killed_with_sigkill(state_dir, [run])
        child = await escapees.found(Path(run.data_dir))
        successor = LocalSupervisor(state_dir=state_dir, stop_grace_s=1.0)
        try:
            report = await successor.adopt_or_stop_survivors({AREA: run})
            assert report.adopted == (AREA,)
            assert proc_identity.is_same_process(child)
            assert await successor.stop_area(AREA)
            assert not proc_identity.is_same_process(child)
        finally:
            await successor.close()
            assert await successor.stop_all(grace_s=0.5)

    async def test_a_survivor_stopped_for_want_of_its_record_takes_its_child_with_it(
        self, detector: Detector, escapees: Escapees, tmp_path: Path
    ) -> None:
        # A child without the spawner's markers: no scan of environments finds it.
        state_dir = tmp_path / "state"
        run = fake_run(detector, tmp_path, area=AREA, extra=("--escape-child-clean",))
        await host_killed_with_sigkill(state_dir, [run])
        child = await escapees.found(Path(run.data_dir))
        (state_dir / "records" / f"{AREA}.json").unlink()  # as if killed before recording
        successor = LocalSupervisor(state_dir=state_dir, stop_grace_s=1.0)
        try:
            report = await successor.adopt_or_stop_survivors({})
            assert report.stopped == (AREA,)
            assert not proc_identity.is_same_process(child)
        finally:
            await successor.close()
            assert await successor.stop_all(grace_s=0.5)

    async def test_no_area_cgroup_is_left_once_every_area_stopped(
        self, supervisor: LocalSupervisor, detector: Detector, escapees: Escapees,
        tmp_path: Path,
    ) -> None:
        run = fake_run(detector, tmp_path, area=AREA, extra=("--escape-child",))
        await supervisor.start_area(run)
        await escapees.found(Path(run.data_dir))
        base = supervisor.fences.base
        assert base is not None
        assert [name for name in os.listdir(base) if Path(base, name).is_dir()] == [f"{AREA}@1"]
        assert await supervisor.stop_area(AREA)
        await wait_until(lambda: not os.path.exists(base), timeout_s=2, what="no area cgroup")


    async def test_a_start_that_fails_leaves_no_cgroup(
        self, supervisor: LocalSupervisor, tmp_path: Path
    ) -> None:
        run = AreaRun(service="tg", area=AREA, generation=1, data_dir=str(tmp_path / AREA),
                      command=(str(tmp_path / "no-such-daemon"),))
        view = await supervisor.start_area(run)
        assert (view.state, view.pid) == ("backoff", None)
        assert supervisor.fences.base is not None
        assert not os.path.exists(supervisor.fences.base)


class TestWithoutCgroupV2:
    """Where no cgroup v2 can be used, areas start and stop as before, fenced by process group."""

    async def test_the_process_group_fence_alone_starts_and_stops_the_daemon(
        self, detector: Detector, tmp_path: Path
    ) -> None:
        supervisor = LocalSupervisor(
            state_dir=tmp_path / "state", stop_grace_s=1.0,
            fences=cgroup_fence.Fences(None, why="cgroup v2 is not mounted here"),
        )
        try:
            view = await supervisor.start_area(fake_run(detector, tmp_path, area=AREA))
            assert await detector.wait_for(lambda d: bool(d.alive(AREA)), timeout_s=10)
            assert view.pid is not None  # where monitord runs: no cgroup was made for it
            assert Path(f"/proc/{view.pid}/cgroup").read_text() == \
                Path("/proc/self/cgroup").read_text()
            assert await supervisor.stop_area(AREA, grace_s=1.0)
            assert not proc_identity.is_alive(view.pid)
            assert supervisor.fences.describe("local areas").startswith(
                "local areas are fenced by process group only: cgroup v2 is not mounted here")
        finally:
            await supervisor.close()
            assert await supervisor.stop_all(grace_s=0.5)

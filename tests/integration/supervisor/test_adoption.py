"""Adoption after a restart of monitord is by identity, not by argv text: a daemon started
through a `#!` script, a PATH lookup or a wrapper that execs is adopted (same pid, one life),
and only a daemon whose configured command really changed is replaced — on purpose, with a
`survivor_replaced` event saying why."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from monitord.base import proc_identity
from monitord.local.supervisor import AreaRun, LocalSupervisor, SurvivorReport
from monitord.testing.split_brain import Detector
from tests.integration.supervisor.conftest import host_killed_with_sigkill, script_run
from tests.support import script_daemons

AREA = "0a0a0a0a-0000-4000-8000-000000000021"

# Which release wrote the survivor's record: this one (it names the configured command), or
# the previous one (only the process identity, whose argv is the kernel's at the spawn).
RECORDS = ("this_release", "previous_release")
# A wrapper's argv after its exec cannot be derived from the configured command: a record of
# the previous release that caught it after the exec is not adopted (docs/supervisor.md).
CASES = [(kind, record) for kind in script_daemons.KINDS for record in RECORDS
         if (kind, record) != ("exec_wrapper", "previous_release")]


def _as_previous_release_wrote_it(state_dir: Path, area: str) -> None:
    """The record as the previous release wrote it: area, service, generation, identity."""
    path = state_dir / "records" / f"{area}.json"
    record = json.loads(path.read_text())
    path.write_text(json.dumps({key: record[key]
                                for key in ("area", "service", "generation", "identity")}))


async def _survivor(detector: Detector, state_dir: Path, run: AreaRun, *, record: str) -> int:
    """Run `run` under a supervisor in another process, kill that one with -9, and return
    the pid of the daemon it left running."""
    await host_killed_with_sigkill(state_dir, [run])
    assert await detector.wait_for(lambda d: d.alive(run.area), timeout_s=10)
    if record == "previous_release":
        _as_previous_release_wrote_it(state_dir, run.area)
    [key] = detector.alive(run.area)
    return key.pid


@pytest.fixture
async def successor(tmp_path: Path) -> AsyncIterator[LocalSupervisor]:
    found = LocalSupervisor(state_dir=tmp_path / "state", stop_grace_s=2.0)
    try:
        yield found
    finally:
        await found.close()
        assert await found.stop_all(grace_s=1.0)


async def _handle_survivors(
    successor: LocalSupervisor, run: AreaRun
) -> tuple[SurvivorReport, list[dict[str, Any]]]:
    with capture_logs() as events:
        report = await successor.adopt_or_stop_survivors({run.area: run})
    return report, [e for e in events if e["event"].startswith("survivor_")]


class TestScriptDaemonsAreAdopted:
    """A daemon whose kernel argv is not its configured command — a `#!` script (python, sh,
    `/usr/bin/env python3`), one found through PATH, a wrapper that execs — is adopted by the
    next instance at its unchanged command: same pid, one life, nothing restarted."""

    @pytest.mark.parametrize(("kind", "record"), CASES)
    async def test_an_unchanged_command_is_adopted_not_restarted(
        self, kind: str, record: str, detector: Detector, tmp_path: Path,
        successor: LocalSupervisor,
    ) -> None:
        run = script_run(detector, tmp_path, kind=kind, area=AREA)
        pid = await _survivor(detector, tmp_path / "state", run, record=record)

        report, events = await _handle_survivors(successor, run)
        assert (report.adopted, report.stopped, report.replaced) == ((AREA,), (), ()), events
        assert [e["event"] for e in events] == ["survivor_adopted"]
        await successor.start()
        assert not await detector.wait_for(lambda d: len(d.lives(AREA)) > 1, timeout_s=0.5)
        [view] = successor.inventory()
        assert (view.state, view.adopted) == ("running", True)
        assert [life.key.pid for life in detector.lives(AREA)] == [pid]
        assert proc_identity.is_alive(pid)
        assert detector.overlaps() == []

    async def test_the_same_executable_named_another_way_is_the_same_command(
        self, detector: Detector, tmp_path: Path, successor: LocalSupervisor
    ) -> None:
        # started as `tg-daemon …` through PATH, now configured by its full path
        run = script_run(detector, tmp_path, kind="path_lookup", area=AREA)
        pid = await _survivor(detector, tmp_path / "state", run, record="this_release")
        spelled = dataclasses.replace(
            run, command=(str(tmp_path / "bin" / run.command[0]), *run.command[1:])
        )

        report, _ = await _handle_survivors(successor, spelled)
        assert report.adopted == (AREA,)
        assert [life.key.pid for life in detector.lives(AREA)] == [pid]


class TestChangedCommandIsReplaced:
    """A survivor whose configured command changed (an argument, or another executable) is
    stopped, verified gone, and started with the new command — never silently: the
    `survivor_replaced` event carries `reason: "command_changed"` and both commands."""

    @pytest.mark.parametrize("record", RECORDS)
    @pytest.mark.parametrize("change", ["argument", "executable"])
    async def test_a_changed_command_is_replaced_on_purpose_and_says_why(
        self, change: str, record: str, detector: Detector, tmp_path: Path,
        successor: LocalSupervisor,
    ) -> None:
        run = script_run(detector, tmp_path, kind="python_shebang", area=AREA)
        pid = await _survivor(detector, tmp_path / "state", run, record=record)
        if change == "argument":
            changed = script_run(detector, tmp_path, kind="python_shebang", area=AREA,
                                 extra=("--interval", "0.05"))
        else:
            other = script_daemons.write("python_shebang", tmp_path / "bin", name="tg-other")
            changed = dataclasses.replace(run, command=(*other.head, *run.command[1:]))

        report, events = await _handle_survivors(successor, changed)
        assert (report.adopted, report.replaced, report.stuck) == ((), (AREA,), ())
        [event] = events
        assert (event["event"], event["reason"], event["pid"]) == (
            "survivor_replaced", "command_changed", pid)
        assert (event["was"], event["now"]) == (
            None if record == "previous_release" else list(run.command), list(changed.command))
        assert not proc_identity.is_alive(pid)
        await successor.start()
        assert await detector.wait_for(
            lambda d: [k.pid for k in d.alive(AREA)] not in ([], [pid]), timeout_s=10
        )
        assert detector.overlaps() == []

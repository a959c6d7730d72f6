"""monitord.base.cgroup_fence: where this process owns a cgroup v2 its areas get cgroups of
their own and a fence empties one; anywhere else it says why not and nothing fails."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from monitord.base import cgroup_fence, group_stop, proc_identity
from tests.support.escaped_children import require_cgroup_v2

MOUNT_LINE = "41 31 0:38 / {mount} rw,relatime - cgroup2 cgroup2 rw\n"
V1_LINE = "40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd\n"


def _proc_files(tmp_path: Path, *, mountinfo: str, cgroup: str = "0::/\n") -> dict[str, str]:
    (tmp_path / "mountinfo").write_text(mountinfo)
    (tmp_path / "cgroup").write_text(cgroup)
    return {"mountinfo": str(tmp_path / "mountinfo"), "own_cgroup": str(tmp_path / "cgroup")}


class TestWithoutCgroupV2:
    """Where no cgroup v2 can be used, `prepare` says why, and the areas' fence is their
    process group alone: nothing raises, nothing is left behind."""

    def test_no_cgroup2_mount_means_the_process_group_fence(self, tmp_path: Path) -> None:
        fences = cgroup_fence.prepare("areas-x", **_proc_files(
            tmp_path, mountinfo=V1_LINE, cgroup="1:name=systemd:/\n"))
        assert (fences.by_cgroup, fences.base) == (False, None)
        assert fences.why == "cgroup v2 is not mounted here"
        assert fences.describe("local areas") == (
            "local areas are fenced by process group only: cgroup v2 is not mounted here: a"
            " daemon's child that calls setsid() escapes the fence")

    def test_a_read_only_mount_names_systemds_protect_control_groups(
        self, tmp_path: Path
    ) -> None:
        mountinfo = MOUNT_LINE.format(mount=tmp_path).replace(" rw,relatime ", " ro,relatime ")
        fences = cgroup_fence.prepare("areas-x", **_proc_files(tmp_path, mountinfo=mountinfo))
        assert not fences.by_cgroup
        assert "read-only" in fences.why and "ProtectControlGroups=yes" in fences.why

    def test_a_hierarchy_without_cgroup_kill_is_not_used_and_left_as_it_was(
        self, tmp_path: Path
    ) -> None:
        hierarchy = tmp_path / "hierarchy"  # a plain directory: mkdir works, no cgroup.kill
        hierarchy.mkdir()
        fences = cgroup_fence.prepare("areas-x", **_proc_files(
            tmp_path, mountinfo=V1_LINE + MOUNT_LINE.format(mount=hierarchy)))
        assert not fences.by_cgroup
        assert "no cgroup.kill (5.14 or later has)" in fences.why
        assert list(hierarchy.iterdir()) == []

    def test_a_process_in_no_cgroup_v2_is_told_so(self, tmp_path: Path) -> None:
        fences = cgroup_fence.prepare("areas-x", **_proc_files(
            tmp_path, mountinfo=MOUNT_LINE.format(mount=tmp_path), cgroup="1:cpu:/\n"))
        assert fences.why == "this process is in no cgroup v2"

    async def test_emptying_a_cgroup_that_is_not_there_is_done_at_once(
        self, tmp_path: Path
    ) -> None:
        assert await group_stop.empty_cgroup(str(tmp_path / "gone@1"), timeout_s=0.1)

    def test_the_note_for_check_says_the_same_as_the_decision(self, tmp_path: Path) -> None:
        assert cgroup_fence.read_note(tmp_path) is None
        fences = cgroup_fence.Fences(None, why="cgroup v2 is not mounted here")
        cgroup_fence.write_note(tmp_path, fences)
        read = cgroup_fence.read_note(tmp_path)
        assert read is not None and read.describe("x") == fences.describe("x")


class TestRecordedCgroup:
    """A survivor's recorded cgroup is believed only if it is that very area run's, below the
    cgroup v2 mount."""

    @pytest.mark.parametrize("value", [None, 7, "relative/a@1", "/elsewhere/a@1"])
    def test_anything_else_is_no_cgroup(self, tmp_path: Path, value: object) -> None:
        fences = cgroup_fence.Fences(None, mount=str(tmp_path / "mount"))
        assert cgroup_fence.recorded_dir(value, fences=fences, area="a", generation=1) is None

    def test_only_the_run_of_that_area_and_generation(self, tmp_path: Path) -> None:
        fences = cgroup_fence.Fences(None, mount=str(tmp_path))
        run = tmp_path / "areas-x" / "a@1"
        run.mkdir(parents=True)
        assert cgroup_fence.recorded_dir(str(run), fences=fences, area="a",
                                         generation=1) == str(run)
        assert cgroup_fence.recorded_dir(str(run), fences=fences, area="a",
                                         generation=2) is None
        assert cgroup_fence.recorded_dir(f"{tmp_path}/areas-x/../areas-x/b@1", fences=fences,
                                         area="b", generation=1) is None  # not a directory


class TestOnThisMachine:
    """With a cgroup v2 of its own, a child that joined before exec keeps its descendants in
    the area's cgroup whatever they do with sessions, and emptying it kills them all."""

    def test_a_joined_child_and_its_setsid_grandchild_are_killed_together(
        self, tmp_path: Path
    ) -> None:
        require_cgroup_v2()
        fences = cgroup_fence.prepare(cgroup_fence.instance_name(str(tmp_path)))
        assert fences.base is not None
        path = cgroup_fence.area_dir(fences.base, area="a", generation=1)
        procs = cgroup_fence.open_procs(path)
        script = ("import os, signal, sys\n"
                  "if os.fork() == 0:\n    os.setsid()\n    print(os.getpid(), flush=True)\n"
                  "    signal.pause()\nsignal.pause()\n")
        try:
            child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                                     preexec_fn=lambda: cgroup_fence.join(procs))
        finally:
            os.close(procs)
        assert child.stdout is not None
        try:
            grandchild = proc_identity.read(int(child.stdout.readline()))
            assert grandchild is not None and os.getsid(grandchild.pid) == grandchild.pid
            assert cgroup_fence.cgroup_of(grandchild.pid, fences=fences) == path
            assert cgroup_fence.joined(path, child.pid) and cgroup_fence.populated(path)
            assert asyncio.run(group_stop.empty_cgroup(path, timeout_s=2.0))
            assert child.wait(timeout=2) < 0
            assert not proc_identity.is_same_process(grandchild)
            assert not os.path.exists(path) and not os.path.exists(fences.base)
        finally:  # (after a failure: nothing of it may outlive the test)
            asyncio.run(group_stop.empty_cgroup(path, timeout_s=2.0))
            child.kill()
            child.wait()
            child.stdout.close()

"""A full VPS disk against the namespace VPS, its data root a small tmpfs of its own mounted
in the VPS's mount namespace: a move that cannot fit is refused before anything stops and
parks with both numbers; a disk that fills after the preflight is named REMOTE_DISK_FULL
(never SSH_UNREACHABLE), stops the source once, parks at once and gives the space back;
`monitord check --remote` reports the free space under the data root."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from monitord.testing.stack import Stack
from tests.faults.conftest import RELEASE_MATRIX, FaultStackFactory
from tests.faults.netns_vps import NetnsVps, run_command

MIB = 1024 * 1024
AREA_BYTES = 40 * MIB
L2R = "local_to_remote"


def data_root(stack: Stack) -> Path:
    return stack.vps_dir / "data"


async def service(stack: Stack, name: str = "tg") -> dict[str, Any]:
    result = (await stack.status())["services"][name]
    assert isinstance(result, dict)
    return result


async def wait_parked(stack: Stack, *, timeout_s: float) -> dict[str, Any]:
    async def parked() -> bool:
        return bool((await service(stack))["state"] == "parked")

    await stack.wait_until(parked, timeout_s=timeout_s, what="tg parked")
    return await service(stack)


async def wait_connected(stack: Stack) -> None:
    async def connected() -> bool:
        return bool((await stack.status())["tunnel"]["connected"])

    await stack.wait_until(connected, timeout_s=60, what="the tunnel connected")


def local_lives(stack: Stack, area: str) -> list[Any]:
    return [life for life in stack.detector.lives(area) if life.key.side == "local"]


def staging_dirs(netns_vps: NetnsVps, root: Path) -> list[str]:
    out = netns_vps.in_mounts(["find", str(root), "-maxdepth", "3", "-name", "*.staging"])
    return out.split()


class TestAMoveThatCannotFit:
    """16 MiB free on the VPS's data file system, a 40 MiB area: the preflight refuses with
    PREFLIGHT_DISK_SPACE naming the VPS, the path, needed and free bytes; the source never
    stops, nothing is written there, and once the space is there a retry moves it."""

    async def test_is_refused_before_the_source_stops_and_parks_with_both_numbers(
        self, fault_stack: FaultStackFactory, netns_vps: NetnsVps
    ) -> None:
        stack = await fault_stack(services={"tg": 1}, data_bytes=AREA_BYTES)
        (area,) = stack.areas["tg"]
        await stack.wait_settled(expect={"tg": "local"}, timeout_s=60)
        netns_vps.mount_tmpfs(data_root(stack), size_bytes=16 * MIB)
        used_before, free = netns_vps.fs_usage(data_root(stack))
        (life,) = local_lives(stack, area)

        await stack.place("tg", "remote")
        parked = await wait_parked(stack, timeout_s=60)

        error = parked["last_error"]
        assert error["code"] == "PREFLIGHT_DISK_SPACE", error
        assert error["phase"] == "PREFLIGHT", error
        detail = error["detail"]
        assert detail.startswith(f"VPS: {data_root(stack)}/tg has {free} bytes free"), detail
        assert error["free_bytes"] == free and error["needed_bytes"] > AREA_BYTES, error
        assert f"the area needs {error['needed_bytes']} bytes" in detail, detail
        assert "monitord retry" in error["action"], error
        # The source was never stopped: one local life, the one from before, still alive.
        assert [x.key for x in local_lives(stack, area)] == [life.key]
        assert [k.side for k in stack.detector.alive(area)] == ["local"]
        assert not [e for e in stack.events("transaction_phase")
                    if e.get("phase") == "SUPPRESS_SOURCE"]
        # Nothing of it was written on the VPS (no pre-copy, no staging dir).
        assert netns_vps.fs_usage(data_root(stack))[0] == used_before
        assert staging_dirs(netns_vps, data_root(stack)) == []
        # `monitord status` shows the shortage with both numbers.
        code, text = await run_cli("status", "-c", str(stack.config_path))
        assert "PREFLIGHT_DISK_SPACE" in text and f"has {free} bytes free" in text, text
        assert f"the area needs {error['needed_bytes']} bytes" in text, text

        # The operator makes room (the file system grows) and retries: the move goes through.
        netns_vps.in_mounts(["mount", "-o", f"remount,size={256 * MIB}",
                             str(data_root(stack))])
        code, _ = await stack.request("POST", "/v1/services/tg/retry")
        assert code in (200, 202), code
        await stack.wait_settled(expect={"tg": "remote"}, timeout_s=120)


@pytest.mark.parametrize("netns_vps", RELEASE_MATRIX, indirect=True)
class TestADiskThatFillsDuringTheCopy:
    """The preflight passed; the disk fills while the stopped area is being copied: the copy
    fails with REMOTE_DISK_FULL (never SSH_UNREACHABLE) naming the numbers, the source runs
    again and the service parks at once (the source stopped once, not five times), and the
    half-written staging dir is gone: the disk's usage is what it was before the copy. On
    each Debian release: its sftp-server's bare "Failure" and its statvfs answer decide."""

    async def test_is_named_by_its_cause_parks_at_once_and_gives_the_space_back(
        self, fault_stack: FaultStackFactory, netns_vps: NetnsVps
    ) -> None:
        # No pre-copy: the whole area goes after the stop, into what the filler left.
        stack = await fault_stack(services={"tg": 1}, data_bytes=AREA_BYTES,
                                  remote_overrides={"pre_copy_min_bytes": 1 << 40})
        (area,) = stack.areas["tg"]
        await stack.wait_settled(expect={"tg": "local"}, timeout_s=60)
        netns_vps.mount_tmpfs(data_root(stack), size_bytes=160 * MIB)
        assert await stack.stop_monitord() == 0
        await stack.start_monitord(env={"MONITORD_HOLD_AT": f"{L2R}:COPY"})
        await wait_connected(stack)
        await stack.place("tg", "remote")
        await stack.wait_event("hold_point", timeout_s=60)
        # The race after the preflight: something else fills the disk to 8 MiB free.
        _, free = netns_vps.fs_usage(data_root(stack))
        netns_vps.in_mounts(["dd", "if=/dev/zero", f"of={data_root(stack)}/filler", "bs=1M",
                             f"count={free // MIB - 8}", "status=none"])
        used_before_copy, _ = netns_vps.fs_usage(data_root(stack))
        stack.release_hold()

        parked = await wait_parked(stack, timeout_s=90)
        error = parked["last_error"]
        assert error["code"] == "REMOTE_DISK_FULL", error
        assert "VPS: " in error["detail"] and "bytes free" in error["detail"], error
        assert error["needed_bytes"] > error["free_bytes"], error
        failures = [(e.get("phase"), e.get("error_code"), e.get("detail"))
                    for e in stack.events("phase_failed")]
        # One copy failed, named by its cause (a preflight may have met the restarted
        # daemon's tunnel still connecting: that is no part of the copy).
        assert [code for phase, code, _ in failures if phase != "PREFLIGHT"] == [
            "REMOTE_DISK_FULL"], failures
        # The source runs again; it was stopped exactly once (two local lives in all).
        await stack.wait_until(
            lambda: [k.side for k in stack.detector.alive(area)] == ["local"],
            timeout_s=30, what="the source serving again")
        assert len(local_lives(stack, area)) == 2, local_lives(stack, area)
        assert stack.committed()[area].get("location", "local") == "local"
        # The space is given back: no staging dir, the disk as it was before the copy.
        assert staging_dirs(netns_vps, data_root(stack)) == []
        assert netns_vps.fs_usage(data_root(stack))[0] <= used_before_copy

        netns_vps.in_mounts(["rm", "-f", f"{data_root(stack)}/filler"])
        code, _ = await stack.request("POST", "/v1/services/tg/retry")
        assert code in (200, 202), code
        await stack.wait_settled(expect={"tg": "remote"}, timeout_s=120)


class TestAMoveHomeThatCannotFit:
    """The PBX's data file system too small for an area coming home: PREFLIGHT_DISK_SPACE
    names the PBX, the path and both numbers (the area's size asked on the VPS), and the
    area keeps running on the VPS."""

    async def test_is_refused_on_the_pbx_and_the_vps_keeps_running_it(
        self, fault_stack: FaultStackFactory, netns_vps: NetnsVps
    ) -> None:
        stack = await fault_stack(services={"tg": 1}, data_bytes=AREA_BYTES)
        (area,) = stack.areas["tg"]
        await stack.place("tg", "remote")
        await stack.wait_settled(expect={"tg": "remote"}, timeout_s=120)
        home = stack.root / "pbx" / "tg"  # the local data dirs' parent (archived: empty)
        run_command(["mount", "-t", "tmpfs", "-o", f"size={16 * MIB}", "tmpfs", str(home)])
        try:
            (remote_life,) = [life for life in stack.detector.lives(area)
                              if life.key.side == "remote"]
            await stack.place("tg", "local")
            parked = await wait_parked(stack, timeout_s=60)
            error = parked["last_error"]
            assert error["code"] == "PREFLIGHT_DISK_SPACE", error
            free = os.statvfs(home).f_bavail * os.statvfs(home).f_frsize
            assert error["detail"].startswith(f"PBX: {home} has {free} bytes free"), error
            # the VPS's area, measured there, plus the margin
            assert error["needed_bytes"] >= AREA_BYTES + 64 * MIB, error
            assert [x.key for x in stack.detector.lives(area) if x.key.side == "remote"] == [
                remote_life.key]
            assert [k.side for k in stack.detector.alive(area)] == ["remote"]
        finally:
            run_command(["umount", "--lazy", str(home)])


class TestAPbxDiskThatFillsDuringTheCopyHome:
    """The same race on the PBX's side of a move home: the disk fills after the preflight,
    before the copy. The copy holds what the VPS declares against the free space before its
    first byte, so it is LOCAL_DISK_FULL (never SSH_UNREACHABLE) with nothing written, the
    VPS's daemon runs again, the service parks at once, and no staging dir is left. (A disk
    that fills while the bytes cross is the ENOSPC path, tests/unit/test_copy_causes.py.)"""

    async def test_is_named_local_disk_full_and_the_pbx_gets_its_space_back(
        self, fault_stack: FaultStackFactory, netns_vps: NetnsVps
    ) -> None:
        stack = await fault_stack(services={"tg": 1}, data_bytes=AREA_BYTES,
                                  remote_overrides={"pre_copy_min_bytes": 1 << 40})
        (area,) = stack.areas["tg"]
        await stack.place("tg", "remote")
        await stack.wait_settled(expect={"tg": "remote"}, timeout_s=120)
        home = stack.root / "pbx" / "tg"
        run_command(["mount", "-t", "tmpfs", "-o", f"size={160 * MIB}", "tmpfs", str(home)])
        try:
            assert await stack.stop_monitord() == 0
            await stack.start_monitord(env={"MONITORD_HOLD_AT": "remote_to_local:COPY"})
            await wait_connected(stack)
            await stack.place("tg", "local")
            await stack.wait_event("hold_point", timeout_s=60)
            st = os.statvfs(home)
            filler_mib = st.f_bavail * st.f_frsize // MIB - 8
            (home / "filler").write_bytes(b"\0" * (filler_mib * MIB))
            used_before_copy = _used(home)
            stack.release_hold()

            parked = await wait_parked(stack, timeout_s=90)
            error = parked["last_error"]
            assert error["code"] == "LOCAL_DISK_FULL", error
            assert error["detail"].startswith("download refused: PBX: "), error
            assert "MiB missing" in error["detail"], error
            failures = [(e.get("phase"), e.get("error_code"))
                        for e in stack.events("phase_failed")]
            assert [c for p, c in failures if p != "PREFLIGHT"] == ["LOCAL_DISK_FULL"], failures
            await stack.wait_until(
                lambda: [k.side for k in stack.detector.alive(area)] == ["remote"],
                timeout_s=30, what="the VPS's daemon serving again")
            assert [p.name for p in home.iterdir() if p.name.endswith(".staging")] == []
            assert _used(home) <= used_before_copy
        finally:
            run_command(["umount", "--lazy", str(home)])


def _used(path: Path) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


async def run_cli(*args: str) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "monitord", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, out.decode() + err.decode()


class TestCheckRemoteReportsFreeSpace:
    """`monitord check --remote` states the free space under the service's data root on the
    VPS, and fails disk_space when even the margin does not fit."""

    async def test_the_disk_space_line_names_the_data_root_and_its_free_bytes(
        self, fault_stack: FaultStackFactory, netns_vps: NetnsVps
    ) -> None:
        stack = await fault_stack(services={"tg": 1})
        await stack.wait_settled(expect={"tg": "local"}, timeout_s=60)
        root = data_root(stack)
        netns_vps.mount_tmpfs(root, size_bytes=16 * MIB)
        _, free = netns_vps.fs_usage(root)
        code, text = await run_check(stack.config_path)
        assert code == 1, text
        (line,) = [x for x in text.splitlines() if x[2:].startswith("disk_space ")]
        assert line.startswith("✘ disk_space"), text
        assert f"VPS: {root}/tg has {free} bytes free" in line, line

        netns_vps.in_mounts(["mount", "-o", f"remount,size={512 * MIB}", str(root)])
        _, free = netns_vps.fs_usage(root)
        code, text = await run_check(stack.config_path)
        (line,) = [x for x in text.splitlines() if x[2:].startswith("disk_space ")]
        assert line.startswith("✔ disk_space"), text
        assert f"VPS: {free} bytes free under {root}/tg" in line, line


async def run_check(config_path: Path) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "monitord", "check", "-c", str(config_path), "--remote",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode is not None
    return process.returncode, out.decode() + err.decode()

"""The lease guard on its own (a real process guarding a real daemon): it sleeps while there
is nothing to do, and still wakes for each thing it watches — the lease's expiry, a removed
lease file, a signal, the daemon's exit."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from monitord.base import proc_identity
from monitord.vps import area_runner, lease_file, lease_guard
from monitord.vps.lease_table import AreaSpec

AREA = "9a7e0c2e-0000-4000-8000-00000000000c"


def _voluntary_switches(pid: int) -> int:
    """How often the process has gone to sleep of its own accord (each wait it makes)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            return int(line.split()[1])
    raise AssertionError(f"no voluntary_ctxt_switches in /proc/{pid}/status")


class _Guarded:
    def __init__(self, guard: subprocess.Popen[bytes], lease: Path) -> None:
        self.guard = guard
        self.lease = lease

    def daemon_pid(self) -> int | None:
        children = proc_identity.children_of({self.guard.pid}).get(self.guard.pid, [])
        return children[0] if children else None


@contextmanager
def _guard(tmp_path: Path, *, ttl_s: float,
           daemon_file: Path | None = None) -> Iterator[_Guarded]:
    """A guard over `sleep 60` on a lease of `ttl_s`, its daemon started."""
    lease = tmp_path / "lease.json"
    lease_file.write(lease, area=AREA, generation=1, owner_id="o", ttl_s=ttl_s)
    report = [] if daemon_file is None else ["--daemon-file", str(daemon_file)]
    guard = subprocess.Popen(
        [sys.executable, "-m", "monitord.vps.lease_guard", "--lease-file", str(lease),
         "--stop-grace", "2", "--fence-grace", "0.5", *report, "--", "sleep", "60"],
        stderr=subprocess.DEVNULL,
    )
    guarded = _Guarded(guard, lease)
    try:
        deadline = time.monotonic() + 10
        while guarded.daemon_pid() is None:
            assert guard.poll() is None, f"the guard exited with {guard.returncode}"
            assert time.monotonic() < deadline, "the guard did not start its daemon"
            time.sleep(0.02)
        yield guarded
    finally:
        if guard.poll() is None:
            guard.kill()
        guard.wait(timeout=10)


@pytest.fixture
def guarded(tmp_path: Path) -> Iterator[_Guarded]:
    with _guard(tmp_path, ttl_s=60.0) as guarded:
        yield guarded


def test_an_idle_guard_sleeps_between_its_looks(guarded: _Guarded) -> None:
    # A look every 50 ms was 20 sleeps a second per guard; a guard now sleeps until
    # something it watches can have changed, at most LOOK_S.
    time.sleep(0.3)  # past the start
    before = _voluntary_switches(guarded.guard.pid)
    time.sleep(1.0)
    assert _voluntary_switches(guarded.guard.pid) - before <= 2 / lease_guard.LOOK_S


def test_it_fences_at_the_lease_expiry(tmp_path: Path) -> None:
    with _guard(tmp_path, ttl_s=1.0) as guarded:
        daemon = guarded.daemon_pid()
        assert guarded.guard.wait(timeout=10) == lease_guard.EXIT_LEASE_LAPSED
        assert daemon is not None and not proc_identity.is_alive(daemon)


def test_it_sees_a_removed_lease_and_fences(guarded: _Guarded) -> None:
    daemon = guarded.daemon_pid()
    lease_file.revoke(guarded.lease)
    assert guarded.guard.wait(timeout=lease_guard.LOOK_S + 5) == lease_guard.EXIT_LEASE_LAPSED
    assert daemon is not None and not proc_identity.is_alive(daemon)


def test_a_renewed_lease_keeps_the_daemon(guarded: _Guarded) -> None:
    lease_file.write(guarded.lease, area=AREA, generation=1, owner_id="o", ttl_s=1.0)
    for _ in range(4):  # renewed every 0.5 s past several of the first expiries
        time.sleep(0.5)
        lease_file.write(guarded.lease, area=AREA, generation=1, owner_id="o", ttl_s=1.0)
    assert guarded.guard.poll() is None
    assert guarded.daemon_pid() is not None


def test_sigterm_stops_the_daemon_and_ends_the_guard(guarded: _Guarded) -> None:
    daemon = guarded.daemon_pid()
    guarded.guard.send_signal(signal.SIGTERM)
    assert guarded.guard.wait(timeout=10) == 0
    assert daemon is not None and not proc_identity.is_alive(daemon)


def test_a_daemon_that_exits_ends_the_guard_with_its_status(guarded: _Guarded) -> None:
    daemon = guarded.daemon_pid()
    assert daemon is not None
    proc_identity.signal_group(daemon, signal.SIGKILL)
    assert guarded.guard.wait(timeout=10) == 128 + signal.SIGKILL


def test_it_reports_its_daemon_pid_when_asked(tmp_path: Path) -> None:
    reported = tmp_path / "area.daemon"
    with _guard(tmp_path, ttl_s=60.0, daemon_file=reported) as guarded:
        deadline = time.monotonic() + 10
        while not reported.exists():
            assert time.monotonic() < deadline, "the guard wrote no daemon file"
            time.sleep(0.02)
        pid = int(reported.read_text())
        assert proc_identity.parent_of(pid) == guarded.guard.pid
        assert proc_identity.children_of({guarded.guard.pid})[guarded.guard.pid] == [pid]


async def test_the_agent_believes_a_reported_pid_only_from_the_guards_own_child(
    tmp_path: Path,
) -> None:
    runner = area_runner.AreaRunner(base_dir=tmp_path / "agent", stop_grace_s=2.0,
                                    fence_grace_s=0.5)
    spec = AreaSpec(area=AREA, service="tg", generation=1, owner_id="o",
                    command=("sleep", "60"), data_dir=str(tmp_path / "data"))
    runner.grant(spec, ttl_s=60.0)
    handle = runner.spawn(spec)
    try:
        deadline = time.monotonic() + 10
        while (daemon := runner.daemon_pids([handle])[handle.pid]) is None:
            assert time.monotonic() < deadline, "the daemon was never found"
            await asyncio.sleep(0.02)
        assert proc_identity.parent_of(daemon) == handle.pid
        assert handle.daemon_file is not None
        handle.daemon_file.write_text(f"{os.getpid()}\n")  # a pid that is not its child
        assert runner.daemon_pids([handle])[handle.pid] in (None, daemon)
        assert await runner.stop(handle, fence=False)
        assert not handle.daemon_file.exists()
    finally:
        if not handle.exited():
            proc_identity.signal_group(handle.pid, signal.SIGKILL)
        if handle.popen is not None:  # reaped, as the agent's tick does
            handle.popen.wait(timeout=10)
        runner.close()


async def test_a_stop_waits_for_a_member_still_dying_after_its_guard(tmp_path: Path) -> None:
    """The guard SIGKILLs its daemon's group and exits once the daemon itself is reaped; a
    member of that group may take a while longer to die (here: 1 GiB of memory to give
    back, about 0.1 s). The stop waits for it rather than calling the area stuck."""
    runner = area_runner.AreaRunner(base_dir=tmp_path / "agent", stop_grace_s=2.0,
                                    fence_grace_s=0.5)
    ready = tmp_path / "member-ready"
    member = (f"x = b'\\x01' * (1 << 30); open({str(ready)!r}, 'w').close(); "
              "import time; time.sleep(60)")
    spec = AreaSpec(area=AREA, service="tg", generation=1, owner_id="o",
                    command=("sh", "-c", '"$0" -c "$1" & wait', sys.executable, member),
                    data_dir=str(tmp_path / "data"))
    runner.grant(spec, ttl_s=60.0)
    handle = runner.spawn(spec)
    members: list[int] = []
    try:
        deadline = time.monotonic() + 20
        while (daemon := runner.daemon_pids([handle])[handle.pid]) is None or not ready.exists():
            assert not handle.exited(), "the guard exited before its daemon was up"
            assert time.monotonic() < deadline, "the daemon's member never got ready"
            await asyncio.sleep(0.02)
        members = [pid for pid in proc_identity.group_members(daemon) if pid != daemon]
        assert len(members) == 1, members
        assert await runner.stop(handle, fence=False)
        assert proc_identity.group_members(daemon) == []
    finally:
        for pid in members:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if not handle.exited():
            proc_identity.signal_group(handle.pid, signal.SIGKILL)
        if handle.popen is not None:
            handle.popen.wait(timeout=10)
        runner.close()

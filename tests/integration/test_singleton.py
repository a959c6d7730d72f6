"""The instance lock: one live holder per directory, decided by the lock alone."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from monitord.base import singleton
from tests.support import daemon_process

HOLDER_SCRIPT = """
import sys
from pathlib import Path
from monitord.base import singleton
from tests.support import daemon_process
lock = singleton.acquire(Path(sys.argv[1]))
print("locked", flush=True)
sys.stdin.read()
"""


@contextmanager
def lock_held_by_other_process(directory: Path) -> Iterator[subprocess.Popen[str]]:
    """A real second process holding the lock until the block ends (then killed and reaped)."""
    with subprocess.Popen(
        [sys.executable, "-c", HOLDER_SCRIPT, str(directory)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as proc:
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "locked"
            yield proc
        finally:
            proc.kill()
            proc.wait(timeout=10)


def dead_pid() -> int:
    """The PID of a process that has exited and been reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=10)
    return proc.pid


class TestOneHolderPerDirectory:
    """A second acquire of the same directory fails while the first holder lives."""

    def test_second_acquire_in_same_directory_raises_already_running(self, tmp_path: Path) -> None:
        with singleton.acquire(tmp_path), pytest.raises(singleton.AlreadyRunning) as caught:
            singleton.acquire(tmp_path)
        assert caught.value.holder_pid == os.getpid()
        assert caught.value.code == "DUPLICATE_INSTANCE"

    def test_lock_held_by_another_process_blocks(self, tmp_path: Path) -> None:
        with lock_held_by_other_process(tmp_path) as holder:
            with pytest.raises(singleton.AlreadyRunning) as caught:
                singleton.acquire(tmp_path)
            assert caught.value.holder_pid == holder.pid
            assert singleton.is_held(tmp_path)

    def test_different_directories_never_conflict(self, tmp_path: Path) -> None:
        with singleton.acquire(tmp_path / "a"), singleton.acquire(tmp_path / "b"):
            assert singleton.is_held(tmp_path / "a") and singleton.is_held(tmp_path / "b")

    def test_different_names_in_one_directory_never_conflict(self, tmp_path: Path) -> None:
        with singleton.acquire(tmp_path), singleton.acquire(tmp_path, name="agent"):
            assert singleton.is_held(tmp_path, name="agent")

    def test_acquire_creates_the_directory_and_writes_the_pid_file(self, tmp_path: Path) -> None:
        directory = tmp_path / "deep" / "work"
        with singleton.acquire(directory) as lock:
            assert (directory / "monitord.pid").read_text().strip() == str(os.getpid())
            assert lock.held


class TestReleaseAndRecovery:
    """The lock is free again after release or after its holder dies, whatever the PID file says."""

    def test_release_frees_the_lock_and_removes_the_pid_file(self, tmp_path: Path) -> None:
        lock = singleton.acquire(tmp_path)
        lock.release()
        lock.release()  # idempotent
        assert not singleton.is_held(tmp_path)
        assert not (tmp_path / "monitord.pid").exists()
        singleton.acquire(tmp_path).release()

    def test_stale_pid_file_naming_a_dead_process_does_not_block(self, tmp_path: Path) -> None:
        (tmp_path / "monitord.pid").write_text(f"{dead_pid()}\n")
        (tmp_path / "monitord.lock").touch()
        with singleton.acquire(tmp_path) as lock:
            assert lock.held
            assert (tmp_path / "monitord.pid").read_text().strip() == str(os.getpid())

    def test_live_lock_blocks_even_if_pid_file_names_another_pid(self, tmp_path: Path) -> None:
        with lock_held_by_other_process(tmp_path):
            stale = dead_pid()
            (tmp_path / "monitord.pid").write_text(f"{stale}\n")
            with pytest.raises(singleton.AlreadyRunning) as caught:
                singleton.acquire(tmp_path, holder_wait_s=0)
            assert caught.value.holder_pid == stale  # diagnostic only; the lock decided

    def test_live_lock_blocks_even_without_a_pid_file(self, tmp_path: Path) -> None:
        with lock_held_by_other_process(tmp_path):
            (tmp_path / "monitord.pid").unlink()
            with pytest.raises(singleton.AlreadyRunning) as caught:
                singleton.acquire(tmp_path, holder_wait_s=0)
            assert caught.value.holder_pid is None

    def test_kill_9_of_the_holder_frees_the_lock(self, tmp_path: Path) -> None:
        with lock_held_by_other_process(tmp_path) as holder:
            holder.kill()
            holder.wait(timeout=10)
            with singleton.acquire(tmp_path) as lock:
                assert lock.held

    def test_is_held_is_false_for_a_never_used_directory(self, tmp_path: Path) -> None:
        assert not singleton.is_held(tmp_path / "nothing-here")
        assert not (tmp_path / "nothing-here").exists()


class TestDuplicateDaemonStart:
    """Of two `monitord run` on one work_dir exactly one serves; the other exits 3 and says so."""

    async def test_two_runs_started_at_the_same_instant_leave_exactly_one(
        self, tmp_path: Path
    ) -> None:
        config_path = daemon_process.write_config(tmp_path)
        first, second = await asyncio.gather(
            daemon_process.DaemonProcess.start(config_path),
            daemon_process.DaemonProcess.start(config_path),
        )
        try:
            done, _ = await asyncio.wait(
                {asyncio.create_task(first.proc.wait()), asyncio.create_task(second.proc.wait())},
                timeout=10,
                return_when=asyncio.FIRST_COMPLETED,
            )
            assert len(done) == 1, "one of the two must exit"
            loser = first if first.proc.returncode is not None else second
            winner = second if loser is first else first
            assert await loser.wait_exit() == 3
            await winner.wait_ready()
            assert await winner.status_of("/livez") == 200
            [event] = loser.events("duplicate_instance")
            assert event["error_code"] == "DUPLICATE_INSTANCE"
            assert event["holder_pid"] == winner.pid
            assert "Traceback" not in "\n".join(loser.lines)
            assert await winner.stop() == 0
        finally:
            await first.close()
            await second.close()

    async def test_the_loser_exits_before_it_starts_anything(self, tmp_path: Path) -> None:
        """The lock comes before the store, HTTP, SSH or any daemon: the loser's only event
        is `duplicate_instance` (no wall-clock bound: a busy machine slows its start)."""
        async with daemon_process.running_daemon(tmp_path) as holder:
            duplicate = await daemon_process.DaemonProcess.start(holder.config_path)
            try:
                assert await duplicate.wait_exit(timeout_s=60) == 3
                assert [e.get("event") for e in duplicate.events()] == ["duplicate_instance"]
                assert await holder.status_of("/livez") == 200
            finally:
                await duplicate.close()

    async def test_different_work_dirs_both_run(self, tmp_path: Path) -> None:
        async with (
            daemon_process.running_daemon(tmp_path / "a") as a,
            daemon_process.running_daemon(tmp_path / "b") as b,
        ):
            assert await a.status_of("/livez") == 200
            assert await b.status_of("/livez") == 200

    async def test_a_new_start_succeeds_after_kill_9_of_the_holder(self, tmp_path: Path) -> None:
        config_path = daemon_process.write_config(tmp_path)
        async with daemon_process.running_daemon(tmp_path, config_path=config_path) as victim:
            victim.kill()
            assert await victim.wait_exit() == -9
        assert (tmp_path / "work" / "monitord.pid").exists()  # stale PID file left behind
        async with daemon_process.running_daemon(tmp_path, config_path=config_path) as successor:
            assert await successor.status_of("/livez") == 200
            pid_file = tmp_path / "work" / "monitord.pid"
            assert pid_file.read_text().strip() == str(successor.pid)

"""The log hub (monitord/base/log_hub.py): one process copies every area's FIFO into its log.
100 areas writing at full speed each get every line once, whole, in order; a hub killed while
they write is restarted without stopping any of them and loses at most what it held in memory
(one read and one unfinished line per area, marked by a note); a daemon's last words written
while no hub runs still reach its log."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from monitord.base import log_hub, proc_identity
from monitord.base.log_hub import LogPipes
from tests.support.agent_process import wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]
AREAS = 100
MiB = 1024 * 1024
PAD = "x" * 60
_LINE = re.compile(rb"(\d{9}) a(\d{3}) x{60}")


def make_pipes(root: Path) -> LogPipes:
    (root / "logs").mkdir(parents=True, exist_ok=True)
    return LogPipes(
        pipes_dir=str(root / "log-pipes"), logs_dir=str(root / "logs"),
        hub_command=[sys.executable, "-m", "monitord", "log-hub"],
        hub_env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )


def area(index: int) -> str:
    return f"1e9a0000-0000-4000-8000-{index:012d}"


def start_writer(pipes: LogPipes, index: int, lines: int) -> subprocess.Popen[bytes]:
    """A daemon writing `lines` numbered lines of 76 bytes as fast as it can (seq's stdio
    writes 4 KiB blocks, so lines straddle writes and reads)."""
    fd, _name = pipes.open(area(index), max_bytes=64 * MiB, keep=1)
    return subprocess.Popen(
        ["seq", "-f", f"%09.0f a{index:03d} {PAD}", "0", str(lines - 1)],
        stdin=subprocess.DEVNULL, stdout=fd, stderr=fd, start_new_session=True,
    )


def fifos(pipes: LogPipes) -> list[str]:
    return [n for n in os.listdir(pipes.pipes_dir) if log_hub.parse_name(n) is not None]


async def end_areas(pipes: LogPipes, writers: list[subprocess.Popen[bytes]]) -> None:
    """Every writer exited 0 (none was stopped), its area is retired, and the hub has written
    the last of every FIFO (it removes each at its end)."""
    for writer in writers:
        assert writer.wait(timeout=300) == 0
    for index in range(len(writers)):
        pipes.retire(area(index))

    def all_written() -> bool:
        pipes.tick()
        return not fifos(pipes)

    await wait_until(all_written, timeout_s=120, what="the hub to end every FIFO")


def is_part(line: bytes, index: int, *, head: bool) -> bool:
    """Whether `line` is the beginning (head) or the end of a shorter, well-formed line."""
    template = b"000000000 a%03d %s" % (index, PAD.encode())
    if not 0 < len(line) < len(template):
        return False
    start = 0 if head else len(template) - len(line)
    return all(chr(got).isdigit() if start + i < 9 else got == template[start + i]
               for i, got in enumerate(line))


def log_lines(pipes: LogPipes, index: int) -> list[bytes]:
    return (Path(pipes.logs_dir) / f"{area(index)}.log").read_bytes().split(b"\n")


class TestFullSpeed:
    async def test_a_hundred_areas_get_every_line_once_whole_and_in_order(
        self, tmp_path: Path
    ) -> None:
        pipes = make_pipes(tmp_path)
        lines = 20_000
        try:
            writers = [start_writer(pipes, i, lines) for i in range(AREAS)]
            await end_areas(pipes, writers)
            hub = pipes.hub_pid()
            for index in range(AREAS):
                expected = [b"%09d a%03d %s" % (n, index, PAD.encode()) for n in range(lines)]
                assert log_lines(pipes, index) == [*expected, b""], index
            assert hub, "one hub served them"
            await wait_until(lambda: pipes.hub_pid() is None, timeout_s=log_hub._IDLE_EXIT_S + 10,
                             what="the idle hub to exit")
        finally:
            pipes.close()

    async def test_one_hub_however_many_spawners_start_one(self, tmp_path: Path) -> None:
        spawners = [make_pipes(tmp_path) for _ in range(4)]
        try:
            for spawner in spawners:
                spawner.ensure_hub()
            for spawner in spawners:
                spawner.close()  # (waits for its hub's launcher, which returns at once)
            await wait_until(lambda: len(hubs_of(spawners[0])) == 1, timeout_s=30,
                             what="all hubs but one to give up")
            assert hubs_of(spawners[0]) == [spawners[0].hub_pid()]
        finally:
            for pid in hubs_of(spawners[0]):
                os.kill(pid, signal.SIGKILL)


def hubs_of(pipes: LogPipes) -> list[int]:
    """Live hub processes serving `pipes`' directory (found by their command line)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            identity = proc_identity.read(int(entry.name))
            if identity and "log-hub" in identity.cmdline \
                    and pipes.pipes_dir in identity.cmdline:
                found.append(identity.pid)
    return found


class TestHubRestart:
    async def test_a_killed_hub_is_restarted_and_loses_only_what_it_held(
        self, tmp_path: Path
    ) -> None:
        """SIGKILL while 100 areas write: no writer is stopped, every line they wrote while no
        hub ran arrives after, and each area misses at most one run of lines — what the dead
        hub had read and not yet written (one read and one unfinished line) — with the note
        in its place and, right after it, at most one fragment: that unfinished line's rest."""
        pipes = make_pipes(tmp_path)
        lines = 40_000  # 3 MB per area: more than its pipe holds while no hub runs
        line_bytes = 77
        try:
            writers = [start_writer(pipes, i, lines) for i in range(AREAS)]
            await wait_until(pipes.hub_pid, timeout_s=30, what="the hub")
            first = pipes.hub_pid()
            assert first
            biggest = Path(pipes.logs_dir) / f"{area(0)}.log"
            await wait_until(lambda: biggest.exists() and biggest.stat().st_size > 200_000,
                             timeout_s=60, what="the hub to be copying")
            os.kill(first, signal.SIGKILL)
            await wait_until(lambda: not proc_identity.is_alive(first), timeout_s=10,
                             what="the hub to die")
            # the writers fill their pipes, then block; none of them is stopped
            assert all(w.poll() in (None, 0) for w in writers)
            pipes._checked_at -= log_hub._CHECK_EVERY_S  # its periodic check is due
            pipes.tick()
            await wait_until(lambda: pipes.hub_pid() not in (None, first), timeout_s=30,
                             what="a new hub")
            await end_areas(pipes, writers)
        finally:
            pipes.close()
        note = (log_hub._NOTE.format(pid=first)).rstrip("\n").encode()
        for index in range(AREAS):
            numbers: list[int] = []
            gap_at = -1
            fragment_seen = False
            got = log_lines(pipes, index)
            assert got[-1] == b""
            for position, line in enumerate(got[:-1]):
                match = _LINE.fullmatch(line)
                if match:
                    assert int(match.group(2)) == index, (index, line)
                    numbers.append(int(match.group(1)))
                elif line == note:
                    assert gap_at < 0, "one note per restart"
                    gap_at = len(numbers)
                elif got[position + 1] == note and is_part(line, index, head=True):
                    pass  # the held line's head, written by the dead hub's hold timeout
                elif position > 0 and got[position - 1] == note and not fragment_seen:
                    fragment_seen = True  # the rest of the line the dead hub held
                    assert is_part(line, index, head=False), line
                else:
                    raise AssertionError(f"area {index}: a cut or foreign line: {line[:100]!r}")
            assert gap_at >= 0, f"area {index}: no note from the restarted hub"
            before, after = numbers[:gap_at], numbers[gap_at:]
            assert before == list(range(len(before))), f"area {index}: before the kill"
            assert after == list(range(lines - len(after), lines)), f"area {index}: after"
            missing = lines - len(numbers)
            assert missing * line_bytes <= log_hub._READ_BYTES + log_hub._PARTIAL_HOLD_BYTES, \
                (index, missing)

    async def test_last_words_written_while_no_hub_runs_reach_the_log(
        self, tmp_path: Path
    ) -> None:
        pipes = make_pipes(tmp_path)
        try:
            fd, _name = pipes.open(area(1), max_bytes=MiB, keep=1)
            await wait_until(pipes.hub_pid, timeout_s=30, what="the hub")
            hub = pipes.hub_pid()
            assert hub
            os.kill(hub, signal.SIGKILL)
            await wait_until(lambda: pipes.hub_pid() is None, timeout_s=10, what="no hub")
            daemon = await asyncio.to_thread(
                subprocess.run, ["sh", "-c", "echo last words; printf unfinished"],
                stdout=fd, stderr=fd, start_new_session=True, timeout=30)
            assert daemon.returncode == 0
            pipes.retire(area(1))  # no hub holds it: the spawner keeps it meanwhile
            assert fifos(pipes)
            pipes._checked_at -= log_hub._CHECK_EVERY_S

            def written() -> bool:
                pipes.tick()
                return not fifos(pipes)

            await wait_until(written, timeout_s=30, what="the restarted hub to write them")
        finally:
            pipes.close()
        text = (Path(pipes.logs_dir) / f"{area(1)}.log").read_bytes()
        assert text.endswith(b"last words\nunfinished")

    async def test_a_fifo_whose_writers_all_ended_while_no_hub_ran_is_ended_by_the_next(
        self, tmp_path: Path
    ) -> None:
        """Daemon, spawner and hub all gone: nothing is left to write, and the next hub
        removes the FIFO and, with nothing else to serve, exits."""
        pipes = make_pipes(tmp_path)
        fd, _name = pipes.open(area(2), max_bytes=MiB, keep=1)
        await wait_until(pipes.hub_pid, timeout_s=30, what="the hub")
        hub = pipes.hub_pid()
        assert hub
        os.kill(hub, signal.SIGKILL)
        await wait_until(lambda: pipes.hub_pid() is None, timeout_s=10, what="no hub")
        pipes.close()  # the spawner goes too: nobody holds the FIFO
        assert fifos(pipes)
        successor = make_pipes(tmp_path)
        successor.ensure_hub()
        await wait_until(lambda: not fifos(successor), timeout_s=30,
                         what="the next hub to end the FIFO")
        await wait_until(lambda: successor.hub_pid() is None,
                         timeout_s=log_hub._IDLE_EXIT_S + 10, what="the idle hub to exit")
        successor.close()

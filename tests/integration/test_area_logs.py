"""Area logs are size-capped and rotated on both sides: a daemon writing as fast as it can
keeps within (keep + 1) x max_bytes, its newest lines in the log file and none missing in
between, it is never stalled, and the log sink outlives monitord but not the daemon."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from monitord.base import group_stop, log_hub, log_sink, proc_identity
from monitord.base.proc_identity import ProcessIdentity
from monitord.local.supervisor import AreaRun, LocalSupervisor
from tests.integration.agent.conftest import OWNER
from tests.support.agent_process import AgentProcess, kill_left_processes, running_agent, wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]
AREA = "1e9a0000-0000-4000-8000-000000000001"
TOTAL_BYTES = 50_000_000
LINE_BYTES = 100
MiB = 1024 * 1024

# A daemon that writes TOTAL numbered lines of LINE bytes to stdout as fast as it can, then
# DONE on stderr, then (with "hold") stays up so that its supervisor does not restart it.
WRITER = r"""
import sys, time
total, line_bytes, hold = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "hold"
pad = b"x" * (line_bytes - 11)
out, n, written = sys.stdout.buffer, 0, 0
while written < total:
    batch = b"".join(b"%09d " % i + pad + b"\n" for i in range(n, n + 1000))
    out.write(batch)
    n, written = n + 1000, written + len(batch)
out.flush()
sys.stderr.write("DONE %d\n" % n)
sys.stderr.flush()
while hold:
    time.sleep(3600)
"""
# A daemon that writes one numbered line every 10 ms until it is stopped.
TICKER = r"""
import sys, time
n = 0
while True:
    print("tick %09d" % n, flush=True)
    n += 1
    time.sleep(0.01)
"""
_WRITER_LINE = re.compile(rb"(\d{9}) x+")
_TICK_LINE = re.compile(rb"tick (\d{9})")


def writer_command() -> tuple[str, ...]:
    return (sys.executable, "-c", WRITER, str(TOTAL_BYTES), str(LINE_BYTES), "hold")


def lines_written() -> int:
    per_batch = 1000 * LINE_BYTES
    return -(-TOTAL_BYTES // per_batch) * 1000


def writer_done(log: Path) -> bool:
    """The writer's last line, DONE, is in the log (a line of its own: the guard's "started"
    line quotes the writer's source, DONE included)."""
    return log.exists() and re.search(rb"(?m)^DONE \d+$", log.read_bytes()) is not None


def log_files(path: Path, keep: int) -> list[Path]:
    """Oldest first: path.keep ... path.1, path (those that exist)."""
    names = [path.with_name(f"{path.name}.{i}") for i in range(keep, 0, -1)] + [path]
    return [name for name in names if name.exists()]


def assert_rotated_within_cap(path: Path, *, max_bytes: int, keep: int, lines: int) -> None:
    """The cap holds, the newest line is in `path`, no line is missing between the oldest kept
    one and the newest, no line of the writer is split, and the rotated files are full."""
    files = log_files(path, keep)
    assert len(files) == keep + 1, [f.name for f in files]
    assert not path.with_name(f"{path.name}.{keep + 1}").exists()
    sizes = [f.stat().st_size for f in files]
    assert max(sizes) <= max_bytes, sizes
    assert sum(sizes) <= (keep + 1) * max_bytes
    numbers: list[int] = []
    for f in files:
        for line in f.read_bytes().splitlines():
            match = _WRITER_LINE.fullmatch(line)
            if match:
                numbers.append(int(match.group(1)))
            else:  # the daemon's last words, or one of the lease guard's JSON lines
                assert line.startswith((b"DONE ", b"{")), line[:120]
    assert numbers[-1] == lines - 1
    assert numbers == list(range(numbers[0], lines)), "a line is missing or out of order"
    assert f"\nDONE {lines}\n".encode() in path.read_bytes()
    for rotated in files[:-1]:
        assert rotated.stat().st_size > max_bytes - 2 * LINE_BYTES  # full, bar the next line


def log_process_pids(logs_dir: Path) -> list[int]:
    """Live processes writing area logs into `logs_dir`: a log hub, or per-daemon sinks."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        identity = proc_identity.read(int(entry.name))
        if identity and ("log-sink" in identity.cmdline or "log-hub" in identity.cmdline) \
                and any(str(logs_dir) in part for part in identity.cmdline):
            found.append(identity.pid)
    return found


def area_fifos(pipes_dir: Path) -> list[str]:
    """The area FIFOs in a pipes directory (monitord/base/log_hub.py)."""
    return sorted(n for n in os.listdir(pipes_dir) if log_hub.parse_name(n) is not None)


def assert_ticks_kept_across_the_restart(log_path: Path) -> None:
    """Every tick once and in order, except what the killed hub held (log_hub's promise): at
    most the ticks of one read, missing where the new hub's note stands, and right after the
    note at most one fragment — the rest of a line whose beginning was lost."""
    ticks: list[int] = []
    gap_at = -1
    lines = log_path.read_bytes().splitlines()
    for position, line in enumerate(lines):
        if _TICK_LINE.fullmatch(line):
            ticks.append(int(line.split()[1]))
        elif line.startswith(b"log-hub: the previous log hub ("):
            assert gap_at < 0, "one note for one restart"
            gap_at = len(ticks)
        elif line.startswith(b"{"):
            pass  # the lease guard's own lines, on the VPS
        else:
            assert position > 0 and lines[position - 1].startswith(b"log-hub:"), line
            assert len(line) < len(b"tick 000000000"), line
    if gap_at < 0:
        assert ticks == list(range(ticks[0], ticks[-1] + 1)), "a tick is lost or doubled"
        return
    before, after = ticks[:gap_at], ticks[gap_at:]
    assert before == list(range(before[0], before[0] + len(before))) if before else True
    assert after == list(range(after[0], after[0] + len(after))), "a tick lost after the note"
    if before:
        assert after[0] > before[-1]
        assert (after[0] - before[-1] - 1) * len(b"tick 000000000\n") <= \
            log_hub._READ_BYTES + log_hub._PARTIAL_HOLD_BYTES


def last_tick(log_path: Path) -> int:
    ticks = _TICK_LINE.findall(log_path.read_bytes()) if log_path.exists() else []
    return int(ticks[-1]) if ticks else -1


class TestLogSink:
    """The sink process copies its stdin into a capped, rotated file and ends at EOF."""

    def test_fifty_megabytes_at_full_speed_stay_within_the_cap(self, tmp_path: Path) -> None:
        log = tmp_path / "area.log"
        sink = subprocess.Popen(
            [sys.executable, "-m", "monitord", "log-sink", *log_sink.arguments(
                path=log, max_bytes=MiB, keep=2)],
            stdin=subprocess.PIPE, cwd=REPO_ROOT,
        )
        assert sink.stdin is not None
        writer = subprocess.run(
            [sys.executable, "-c", WRITER, str(TOTAL_BYTES), str(LINE_BYTES), "exit"],
            stdout=sink.stdin, stderr=sink.stdin, timeout=240, check=True,
        )
        assert writer.returncode == 0
        sink.stdin.close()
        assert sink.wait(timeout=60) == 0
        assert_rotated_within_cap(log, max_bytes=MiB, keep=2, lines=lines_written())

    def test_a_line_longer_than_a_file_is_cut_and_the_cap_still_holds(
        self, tmp_path: Path
    ) -> None:
        log = tmp_path / "area.log"
        data = b"short line\n" + b"y" * (3 * 8192 + 100) + b"\nafter\n"
        result = subprocess.run(
            [sys.executable, "-m", "monitord.base.log_sink", *log_sink.arguments(
                path=log, max_bytes=8192, keep=5)],
            input=data, cwd=REPO_ROOT, timeout=60, check=True,
        )
        assert result.returncode == 0
        files = log_files(log, 5)
        assert all(f.stat().st_size <= 8192 for f in files)
        assert b"".join(f.read_bytes() for f in files) == data  # cut, nothing lost
        assert log.read_bytes().endswith(b"\nafter\n")

    def test_keep_zero_starts_the_file_afresh(self, tmp_path: Path) -> None:
        log = tmp_path / "area.log"
        data = b"".join(b"%09d " % i + b"x" * 89 + b"\n" for i in range(1000))
        subprocess.run(
            [sys.executable, "-m", "monitord.base.log_sink", *log_sink.arguments(
                path=log, max_bytes=8192, keep=0)],
            input=data, cwd=REPO_ROOT, timeout=60, check=True,
        )
        assert log_files(log, 3) == [log]
        kept = log.read_bytes()
        assert len(kept) <= 8192 and data.endswith(kept) and kept.startswith(b"0")

    def test_two_sinks_on_one_file_still_keep_the_cap_and_the_history(
        self, tmp_path: Path
    ) -> None:
        """As when a restarted daemon's sink starts while the old one reads its last lines:
        neither rotates the other's fresh file away, nor keeps filling a rotated one."""
        log = tmp_path / "area.log"
        sinks = [subprocess.Popen(
            [sys.executable, "-m", "monitord.base.log_sink", *log_sink.arguments(
                path=log, max_bytes=MiB, keep=2)],
            stdin=subprocess.PIPE, cwd=REPO_ROOT) for _ in range(2)]
        number = 0
        for _ in range(300):  # 2 x 300 x 64 kB, strictly interleaved between the two sinks
            for sink in sinks:
                assert sink.stdin is not None
                sink.stdin.write(b"".join(b"%09d " % i + b"x" * 89 + b"\n"
                                          for i in range(number, number + 640)))
                sink.stdin.flush()
                number += 640
        for sink in sinks:
            assert sink.stdin is not None
            sink.stdin.close()
        assert [sink.wait(timeout=60) for sink in sinks] == [0, 0]
        files = log_files(log, 3)
        assert len(files) == 3  # log, .1, .2: nothing beyond keep
        one_write = 256 * 1024  # a sink's read size: what the other one may add in a race
        for rotated in files[:-1]:
            assert MiB - one_write < rotated.stat().st_size <= MiB + one_write
        assert all(_WRITER_LINE.fullmatch(line)
                   for f in files for line in f.read_bytes().splitlines())

    async def test_a_failing_log_file_drops_output_without_blocking_the_writer(
        self, tmp_path: Path
    ) -> None:
        logs_dir = tmp_path / "logs"
        logs_dir.mkdir()
        log = logs_dir / "area.log"
        sink = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "monitord.base.log_sink", *log_sink.arguments(
                path=log, max_bytes=64 * 1024, keep=1),
            stdin=asyncio.subprocess.PIPE, cwd=REPO_ROOT,
        )
        stdin = sink.stdin
        assert stdin is not None
        stdin.write(b"before\n")
        await wait_until(lambda: log.exists() and b"before" in log.read_bytes(),
                         timeout_s=30, what="the first line")
        shutil.rmtree(logs_dir)  # every rotation from now on fails to open the file
        for _ in range(200):  # 20 MB, far beyond the pipe: drain waits unless the sink reads
            stdin.write((b"w" * 99 + b"\n") * 1000)
            await asyncio.wait_for(stdin.drain(), timeout=30)
        logs_dir.mkdir()

        async def note_written() -> bool:
            stdin.write(b"again\n")
            await asyncio.wait_for(stdin.drain(), timeout=30)
            return log.exists() and b"bytes of output lost" in log.read_bytes()

        await wait_until(note_written, timeout_s=30, interval_s=0.1,
                         what="the sink to note the lost output")
        stdin.close()
        assert await asyncio.wait_for(sink.wait(), timeout=30) == 0
        assert log.stat().st_size <= 64 * 1024
        assert b"again\n" in log.read_bytes()


class TestLocalAreaLog:
    """Through the local supervisor: the daemon's stdout and stderr reach a capped log."""

    async def test_a_fast_daemon_is_not_stalled_and_its_log_stays_within_the_cap(
        self, tmp_path: Path
    ) -> None:
        supervisor = LocalSupervisor(state_dir=tmp_path / "state", stop_grace_s=1.0,
                                     log_max_bytes=MiB, log_keep=2)
        log = supervisor.logs_dir / f"{AREA}.log"
        run = AreaRun(service="tg", area=AREA, generation=1, command=writer_command(),
                      data_dir=str(tmp_path / "data"))
        try:
            await supervisor.start_area(run)
            await wait_until(lambda: writer_done(log), timeout_s=240,
                             what="the daemon to have written 50 MB")
            assert supervisor.inventory()[0].restarts == 0
            assert await supervisor.stop_area(AREA)
        finally:
            await supervisor.close()
            assert await supervisor.stop_all()
        assert_rotated_within_cap(log, max_bytes=MiB, keep=2, lines=lines_written())
        assert area_fifos(supervisor.state_dir / "log-pipes") == []  # the hub ended it

    async def test_the_hub_outlives_monitord_and_ends_the_area_with_the_daemon(
        self, tmp_path: Path
    ) -> None:
        state_dir = tmp_path / "state"
        log = state_dir / "logs" / f"{AREA}.log"
        runs = json.dumps([{"service": "tg", "area": AREA, "generation": 1,
                            "command": [sys.executable, "-c", TICKER],
                            "data_dir": str(tmp_path / "data")}])
        first = await _start_host(state_dir, runs)
        try:
            await wait_until(lambda: last_tick(log) >= 0, timeout_s=20, what="the first tick")
            await wait_until(lambda: len(log_process_pids(log.parent)) == 1, timeout_s=20,
                             what="one hub")
            [hub] = log_process_pids(log.parent)
            [fifo] = area_fifos(state_dir / "log-pipes")
        finally:
            os.killpg(first.pid, signal.SIGKILL)  # monitord and all of its process group die
            await first.wait()
        seen = last_tick(log)
        await wait_until(lambda: last_tick(log) > seen + 10, timeout_s=20,
                         what="ticks written after monitord died")
        second = await _start_host(state_dir, runs)  # adopts the daemon, its FIFO and the hub
        try:
            assert log_process_pids(log.parent) == [hub]
            assert area_fifos(state_dir / "log-pipes") == [fifo]
            seen = last_tick(log)
            await wait_until(lambda: last_tick(log) > seen + 10, timeout_s=20,
                             what="ticks written under the second monitord")
        finally:
            os.killpg(second.pid, signal.SIGKILL)
            await second.wait()
        record = json.loads((state_dir / "records" / f"{AREA}.json").read_text())
        daemon = ProcessIdentity.from_json(record["identity"])
        assert proc_identity.is_same_process(daemon)
        proc_identity.signal_group(daemon.pid, signal.SIGKILL)
        await wait_until(lambda: not area_fifos(state_dir / "log-pipes"), timeout_s=20,
                         what="the hub to end the area with its daemon")
        await wait_until(lambda: not proc_identity.is_alive(hub), timeout_s=20,
                         what="the hub to exit once no area is left")
        if record.get("cgroup"):  # (no monitord is left to remove the daemon's cgroup)
            assert await group_stop.empty_cgroup(record["cgroup"], timeout_s=2.0)

    async def test_a_killed_log_process_is_restarted_and_no_daemon_stops(
        self, tmp_path: Path
    ) -> None:
        supervisor = LocalSupervisor(state_dir=tmp_path / "state", stop_grace_s=1.0)
        log = supervisor.logs_dir / f"{AREA}.log"
        run = AreaRun(service="tg", area=AREA, generation=1, command=(sys.executable, "-c", TICKER),
                      data_dir=str(tmp_path / "data"))
        try:
            await supervisor.start()
            [before] = await _started(supervisor, run)
            await wait_until(lambda: last_tick(log) >= 0, timeout_s=20, what="the first tick")
            killed = log_process_pids(supervisor.logs_dir)
            assert killed
            for pid in killed:
                os.kill(pid, signal.SIGKILL)
            await wait_until(lambda: not any(proc_identity.is_alive(p) for p in killed),
                             timeout_s=10, what="the log process to die")
            seen = last_tick(log)
            await wait_until(lambda: last_tick(log) > seen + 50, timeout_s=30,
                             what="ticks written after the log process was killed")
            [after] = supervisor.inventory()
            assert (after.pid, after.restarts, after.state) == (before.pid, 0, "running")
            assert log_process_pids(supervisor.logs_dir)  # a new one
            assert_ticks_kept_across_the_restart(log)
            assert await supervisor.stop_area(AREA)
        finally:
            await supervisor.close()
            assert await supervisor.stop_all()


async def _started(supervisor: LocalSupervisor, run: AreaRun) -> list[Any]:
    await supervisor.start_area(run)
    return supervisor.inventory()


async def _start_host(state_dir: Path, runs_json: str) -> asyncio.subprocess.Process:
    host = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.integration.supervisor.supervisor_host",
        str(state_dir), runs_json, cwd=REPO_ROOT, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL, start_new_session=True,  # a group to kill whole
    )
    assert host.stdout is not None
    line = await asyncio.wait_for(host.stdout.readline(), timeout=30)
    assert line.strip() == b"ready", line
    return host


def _area_body(agent: AgentProcess, command: tuple[str, ...]) -> dict[str, Any]:
    return {"service": "tg", "generation": 1, "owner_id": OWNER, "lease_ttl_s": 120.0,
            "command": list(command), "env": {},
            "data_dir": str(agent.base_dir / "data" / "tg" / AREA)}


class TestRemoteAreaLog:
    """Through the agent's area runner: guard and daemon output reach a capped log."""

    async def test_a_fast_daemon_is_not_stalled_and_its_log_stays_within_the_cap(
        self, tmp_path: Path
    ) -> None:
        async with running_agent(tmp_path / "vps") as agent:
            log = agent.base_dir / "logs" / f"{AREA}.log"
            status, answer = await agent.request(
                "PUT", f"/v1/areas/{AREA}", json_body=_area_body(agent, writer_command()))
            assert status == 201, answer
            await wait_until(lambda: writer_done(log), timeout_s=240,
                             what="the daemon to have written 50 MB")
            status, answer = await agent.request("POST", f"/v1/areas/{AREA}/stop?generation=1")
            assert status == 200, answer
            await wait_until(lambda: not area_fifos(agent.base_dir / "log-pipes"), timeout_s=20,
                             what="the hub to end the area with the guard and its daemon")
        assert_rotated_within_cap(log, max_bytes=log_sink.DEFAULT_MAX_BYTES,
                                  keep=log_sink.DEFAULT_KEEP, lines=lines_written())
        assert b'"event": "fence_done"' in log.read_bytes()  # the guard's own lines too

    async def test_the_hub_outlives_the_agent_and_ends_the_area_with_the_daemon(
        self, tmp_path: Path
    ) -> None:
        async with running_agent(tmp_path / "vps", kill_daemons_on_exit=False) as agent:
            log = agent.base_dir / "logs" / f"{AREA}.log"
            command = (sys.executable, "-c", TICKER)
            status, answer = await agent.request(
                "PUT", f"/v1/areas/{AREA}", json_body=_area_body(agent, command))
            assert status == 201, answer
            await wait_until(lambda: last_tick(log) >= 0, timeout_s=20, what="the first tick")
            await wait_until(lambda: len(log_process_pids(log.parent)) == 1, timeout_s=20,
                             what="one hub")
            [hub] = log_process_pids(log.parent)
            await agent.kill(signal.SIGKILL)
        seen = last_tick(log)
        try:
            await wait_until(lambda: last_tick(log) > seen + 10, timeout_s=20,
                             what="ticks written after the agent died")
        finally:
            kill_left_processes(tmp_path / "vps")  # the guard, hence its daemon (PDEATHSIG)
        await wait_until(lambda: not area_fifos(tmp_path / "vps" / "log-pipes"), timeout_s=20,
                         what="the hub to end the area with its daemon")
        await wait_until(lambda: not proc_identity.is_alive(hub), timeout_s=20,
                         what="the hub to exit once no area is left")

    async def test_a_killed_hub_is_restarted_and_no_guard_or_daemon_stops(
        self, tmp_path: Path
    ) -> None:
        async with running_agent(tmp_path / "vps") as agent:
            log = agent.base_dir / "logs" / f"{AREA}.log"
            status, answer = await agent.request(
                "PUT", f"/v1/areas/{AREA}",
                json_body=_area_body(agent, (sys.executable, "-c", TICKER)))
            assert status == 201, answer
            await wait_until(lambda: last_tick(log) >= 0, timeout_s=20, what="the first tick")
            record = json.loads((agent.base_dir / "run" / f"{AREA}.json").read_text())
            guard = ProcessIdentity.from_json(record["guard"])
            await wait_until(lambda: len(log_process_pids(log.parent)) == 1, timeout_s=20,
                             what="one hub")
            [hub] = log_process_pids(log.parent)
            os.kill(hub, signal.SIGKILL)
            await wait_until(lambda: not proc_identity.is_alive(hub), timeout_s=10,
                             what="the hub to die")
            seen = last_tick(log)
            await wait_until(lambda: last_tick(log) > seen + 50, timeout_s=30,
                             what="ticks written after the hub was killed")
            assert proc_identity.is_same_process(guard)
            assert log_process_pids(log.parent) not in ([], [hub])
            assert_ticks_kept_across_the_restart(log)
            assert b"daemon_exited" not in log.read_bytes()

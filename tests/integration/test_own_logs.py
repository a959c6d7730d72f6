"""monitord's own log after `launch` (`{work_dir}/monitord.log`) and the VPS agent's
(`{dir}/logs/agent.log`) are written through a log sink, capped and rotated like an area's log.

Real processes throughout: a writer as fast as it can through `log_sink.spawn_logged`, a
`monitord launch`ed daemon, an `agent-launch`ed agent from the pyz under the system Python.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from monitord.base import log_sink, proc_identity, singleton
from tests.integration.agent.test_agent_instance import _run
from tests.support import daemon_process
from tests.support.agent_process import kill_left_processes, vps_command, wait_until, write_secret

# Writes N numbered lines of 100 bytes to stdout and stderr alternately, then exits.
WRITER = r"""
import sys
for i in range(int(sys.argv[1])):
    (sys.stdout if i % 2 else sys.stderr).write("%09d %s\n" % (i, "x" * 89))
"""


def pipe_of(pid: int, fd: int) -> str:
    return os.readlink(f"/proc/{pid}/fd/{fd}")


def sink_reading(pipe: str) -> list[str]:
    """The argv of the process whose stdin is `pipe` (the log sink of whoever writes it)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if os.readlink(entry / "fd" / "0") == pipe:
                return [a.decode() for a in (entry / "cmdline").read_bytes().split(b"\0") if a]
        except OSError:
            continue
    return []


class TestSpawnLogged:
    """A process started through `spawn_logged` writes into a bounded, rotated log."""

    def test_output_of_both_streams_stays_within_keep_plus_one_files(self, tmp_path: Path) -> None:
        log = tmp_path / "own.log"
        max_bytes, keep, lines = 8192, 2, 3000
        child, sink = log_sink.spawn_logged(
            [sys.executable, "-c", WRITER, str(lines)],
            sink_argv=[sys.executable, "-m", "monitord", "log-sink", *log_sink.arguments(
                path=log, max_bytes=max_bytes, keep=keep)],
        )
        assert child.wait(timeout=60) == 0
        assert sink.wait(timeout=60) == 0  # it ends with the writer
        files = sorted(tmp_path.glob("own.log*"))
        assert [f.name for f in files] == ["own.log", "own.log.1", "own.log.2"]
        assert all(f.stat().st_size <= max_bytes for f in files)
        newest = log.read_text().splitlines()
        assert newest[-1].startswith(f"{lines - 1:09d} ")  # the last line is in the live file
        kept = [int(line[:9]) for f in reversed(files) for line in f.read_text().splitlines()]
        assert kept == list(range(kept[0], lines))  # nothing lost between the kept files


class TestLaunchedDaemonLog:
    """`monitord launch` writes monitord.log through a sink with the area log settings."""

    def test_the_daemons_output_goes_through_a_sink_capped_by_the_config(
        self, tmp_path: Path
    ) -> None:
        config = daemon_process.write_config(tmp_path, services=False)
        text = config.read_text().replace(
            "[http]", "area_log_max_bytes = 4096\narea_log_keep = 1\n[http]", 1)
        config.write_text(text)
        work_dir = tmp_path / "work"
        launched = subprocess.run([sys.executable, "-m", "monitord", "launch", "-c", str(config)],
                                  capture_output=True, text=True, timeout=60)
        pid = singleton.read_holder_pid(work_dir / "monitord.pid")
        try:
            assert launched.returncode == 0, launched.stderr
            assert pid is not None
            pipe = pipe_of(pid, 2)
            assert pipe.startswith("pipe:") and pipe_of(pid, 1) == pipe
            sink = sink_reading(pipe)
            assert sink[-7:] == ["log-sink", "--path", str(work_dir / "monitord.log"),
                                 "--max-bytes", "4096", "--keep", "1"]
            deadline = time.monotonic() + 10
            while b"daemon_ready" not in (work_dir / "monitord.log").read_bytes():
                assert time.monotonic() < deadline, "daemon_ready never reached monitord.log"
                time.sleep(0.05)
        finally:
            if pid is not None and proc_identity.is_alive(pid):
                os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 15
            while singleton.is_held(work_dir) and time.monotonic() < deadline:
                time.sleep(0.05)
        # The daemon's last line goes through its sink, which may write it a moment after
        # the daemon let go of its lock: wait for the line, not only for the lock.
        deadline = time.monotonic() + 10
        while b"daemon_stopped" not in (work_dir / "monitord.log").read_bytes() \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert b"daemon_stopped" in (work_dir / "monitord.log").read_bytes()


class TestLaunchedAgentLog:
    """`agent-launch` writes the agent's agent.log through a sink, as on a VPS."""

    async def test_the_agents_output_goes_through_a_sink(self, tmp_path: Path) -> None:
        base_dir = tmp_path / "vps"
        write_secret(base_dir, "launch-secret")
        try:
            status, output = await _run(vps_command("agent-launch", "--dir", str(base_dir),
                                                    "--log-format", "json"))
            assert status == 0, output
            holder = singleton.read_holder_pid(base_dir / "agent.pid")
            assert holder is not None
            pipe = pipe_of(holder, 2)
            assert pipe.startswith("pipe:")
            sink = sink_reading(pipe)
            assert sink[-7:] == [
                "log-sink", "--path", str(base_dir.resolve() / "logs" / "agent.log"),
                "--max-bytes", str(log_sink.DEFAULT_MAX_BYTES),
                "--keep", str(log_sink.DEFAULT_KEEP)]
            assert "monitord.pyz" in " ".join(sink)  # the VPS's own sink, from the artifact
            await wait_until(
                lambda: b"agent_started" in (base_dir / "logs" / "agent.log").read_bytes(),
                timeout_s=10, what="the agent's first lines in agent.log")
        finally:
            holder = singleton.read_holder_pid(base_dir / "agent.pid")
            if holder is not None:
                os.kill(holder, signal.SIGTERM)
                await wait_until(lambda: not proc_identity.is_alive(holder), timeout_s=10,
                                 what="the launched agent to stop")
            kill_left_processes(base_dir)

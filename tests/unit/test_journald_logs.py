"""Log lines under systemd carry their journal priority, and `--log-level` drops lower lines.

Every test runs a real process whose stderr is a file; "the journal" is that file named by
`JOURNAL_STREAM=st_dev:st_ino`, exactly how systemd tells a unit its stderr is the journal.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from monitord.base import journal_native
from tests.support import daemon_process

# Logs one line per level through monitord's set-up, plus two from a standard-library logger.
EMITTER = """
import logging
from monitord.base import logs
logs.configure("json", level=logging.DEBUG)
log = logs.get_logger("emitter")
log.debug("at_debug")
log.info("at_info")
log.warning("at_warning")
log.error("at_error")
logging.getLogger("asyncio").info("foreign_info")
logging.getLogger("asyncio").error("foreign_error")
"""


def journal_env(stderr_file: Path, **extra: str) -> dict[str, str]:
    """stderr is the journal; its native socket is not there (unless `extra` names one), as
    on a machine without journald: the lines go to stderr with their prefixes."""
    st = os.stat(stderr_file)
    return {**os.environ, "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}",
            journal_native.SOCKET_ENV: str(stderr_file.parent / "no-journal-socket"), **extra}


def run_emitter(stderr_file: Path, env: dict[str, str]) -> list[str]:
    with stderr_file.open("ab") as err:
        subprocess.run([sys.executable, "-c", EMITTER], stderr=err, env=env, check=True,
                       timeout=60)
    return stderr_file.read_text().splitlines()


def by_event(lines: list[str]) -> dict[str, str]:
    """event -> the priority prefix its line starts with ('' when none)."""
    found = {}
    for line in lines:
        prefix, _, body = line.partition(">") if line.startswith("<") else ("", "", line)
        found[json.loads(body)["event"]] = f"{prefix}>" if prefix else ""
    return found


class TestJournalPriorities:
    """When stderr is the journal, each line starts with its sd-daemon(3) priority."""

    def test_each_level_gets_its_syslog_priority(self, tmp_path: Path) -> None:
        stderr_file = tmp_path / "stderr"
        stderr_file.touch()
        prefixes = by_event(run_emitter(stderr_file, journal_env(stderr_file)))
        assert prefixes == {
            "at_debug": "<7>", "at_info": "<6>", "at_warning": "<4>", "at_error": "<3>",
            # the standard library's loggers too; their info chatter stays out
            "foreign_error": "<3>",
        }

    def test_a_redirected_stderr_with_an_inherited_journal_stream_gets_no_prefix(
        self, tmp_path: Path
    ) -> None:
        elsewhere = tmp_path / "journal"
        elsewhere.touch()
        stderr_file = tmp_path / "stderr"
        stderr_file.touch()
        prefixes = by_event(run_emitter(stderr_file, journal_env(elsewhere)))
        assert set(prefixes.values()) == {""}
        assert "at_error" in prefixes

    async def test_the_daemon_prefixes_its_lines_so_journalctl_p_err_shows_the_errors(
        self, tmp_path: Path
    ) -> None:
        config = daemon_process.write_config(tmp_path)
        first, second = tmp_path / "first.stderr", tmp_path / "second.stderr"
        for f in (first, second):
            f.touch()
        holder = await start_run(config, first, journal_env(first))
        try:
            await wait_ready(config, holder)
            duplicate = await start_run(config, second, journal_env(second))
            assert await asyncio.wait_for(duplicate.wait(), 30) == 3
        finally:
            await stop(holder)
        held = by_event(first.read_text().splitlines())
        assert held["daemon_starting"] == held["daemon_ready"] == "<6>"
        assert held["daemon_stopped"] == "<6>"
        errors = [line for line in second.read_text().splitlines() if line.startswith("<3>")]
        assert [json.loads(line[3:])["event"] for line in errors] == ["duplicate_instance"]


class TestLogLevel:
    """`monitord run --log-level warning` writes no info lines; errors still come through."""

    async def test_warning_level_suppresses_info_lines(self, tmp_path: Path) -> None:
        config = daemon_process.write_config(tmp_path)
        quiet, duplicate_err = tmp_path / "quiet.stderr", tmp_path / "duplicate.stderr"
        for f in (quiet, duplicate_err):
            f.touch()
        holder = await start_run(config, quiet, dict(os.environ), "--log-level", "warning")
        try:
            await wait_ready(config, holder)
            duplicate = await start_run(config, duplicate_err, dict(os.environ),
                                        "--log-level", "warning")
            assert await asyncio.wait_for(duplicate.wait(), 30) == 3
        finally:
            assert await stop(holder) == 0
        levels = [json.loads(line)["level"] for line in quiet.read_text().splitlines()]
        assert "info" not in levels
        assert [json.loads(line)["event"] for line in duplicate_err.read_text().splitlines()] \
            == ["duplicate_instance"]

    async def test_the_default_level_is_info(self, tmp_path: Path) -> None:
        config = daemon_process.write_config(tmp_path)
        stderr_file = tmp_path / "stderr"
        holder = await start_run(config, stderr_file, dict(os.environ))
        try:
            await wait_ready(config, holder)
        finally:
            await stop(holder)
        events = [json.loads(line) for line in stderr_file.read_text().splitlines()]
        assert {"daemon_ready", "daemon_stopped"} <= {e["event"] for e in events}
        assert not any(e["level"] == "debug" for e in events)

    def test_an_unknown_level_is_bad_usage(self, tmp_path: Path) -> None:
        result = subprocess.run(
            [sys.executable, "-m", "monitord", "run", "--log-level", "chatty"],
            capture_output=True, text=True, timeout=60,
        )
        assert result.returncode == 2
        assert "invalid choice: 'chatty'" in result.stderr and "Traceback" not in result.stderr


async def start_run(
    config: Path, stderr_file: Path, env: dict[str, str], *args: str
) -> asyncio.subprocess.Process:
    with stderr_file.open("ab") as err:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "monitord", "run", "-c", str(config), *args,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=err,
            env=env,
        )


async def wait_ready(config: Path, proc: asyncio.subprocess.Process) -> None:
    import tomllib

    listen = tomllib.loads(config.read_text())["http"]["listen"]
    api = daemon_process.ApiClient(f"http://{listen}")
    async with asyncio.timeout(30):
        while await api.status_of("/readyz") != 200:
            assert proc.returncode is None, f"monitord exited {proc.returncode}"
            await asyncio.sleep(0.05)


async def stop(proc: asyncio.subprocess.Process) -> int:
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return await asyncio.wait_for(proc.wait(), 20)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise

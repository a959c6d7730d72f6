"""Under the journal, each log line is an entry of the native protocol with its own fields.

"The journal" is a Unix datagram socket the test binds (named by `MONITORD_JOURNAL_SOCKET`)
plus a stderr file named by `JOURNAL_STREAM`, as systemd sets it for a unit; the processes
that log are real ones (a script through monitord's set-up, `monitord run`, the VPS agent's
event log).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from monitord.base import journal_native
from tests.support import daemon_process
from tests.unit.test_journald_logs import start_run, stop, wait_ready

EMITTER = """
import logging
import structlog
from monitord.base import logs
logs.configure("json", level=logging.DEBUG)
log = logs.get_logger("emitter")
log.info("area_started", service="tg", area="1a2b3c4d-area", generation=3)
with structlog.contextvars.bound_contextvars(transaction_id="tx-42", service="tg", area="a-9"):
    log.error("phase_failed", error_code="PREFLIGHT_AUTH", detail="two\\nlines")
log.debug("plain")
logging.getLogger("asyncio").error("foreign_error")
"""

AGENT_EMITTER = """
from monitord.vps import event_log
event_log.configure("json")
log = event_log.get_logger("agent")
log.warning("lease_lapsed", area="a-7", generation=2, error_code="LEASE_EXPIRED")
"""


def parse_entry(data: bytes) -> dict[str, str]:
    """One datagram of the native protocol, both forms (KEY=VALUE and length-prefixed)."""
    fields: dict[str, str] = {}
    rest = data
    while rest:
        line_end = rest.index(b"\n")
        head = rest[:line_end]
        if b"=" in head:
            key, _, value = head.partition(b"=")
            fields[key.decode()] = value.decode()
            rest = rest[line_end + 1:]
        else:
            (length,) = struct.unpack("<Q", rest[line_end + 1:line_end + 9])
            start = line_end + 9
            fields[head.decode()] = rest[start:start + length].decode()
            assert rest[start + length:start + length + 1] == b"\n"
            rest = rest[start + length + 1:]
    return fields


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[tuple[socket.socket, Path]]:
    path = tmp_path / "journal.socket"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(0)
    try:
        yield sock, path
    finally:
        sock.close()


def received(sock: socket.socket) -> list[dict[str, str]]:
    entries = []
    while True:
        try:
            entries.append(parse_entry(sock.recv(1 << 20)))
        except BlockingIOError:
            return entries


def env_for(stderr_file: Path, socket_path: Path) -> dict[str, str]:
    st = os.stat(stderr_file)
    return {**os.environ, "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}",
            journal_native.SOCKET_ENV: str(socket_path)}


class TestNativeEntries:
    """When stderr is the journal and its socket answers, every line is a native entry."""

    def test_each_line_carries_priority_and_the_monitord_fields(
        self, tmp_path: Path, journal: tuple[socket.socket, Path]
    ) -> None:
        sock, path = journal
        stderr_file = tmp_path / "stderr"
        stderr_file.touch()
        with stderr_file.open("ab") as err:
            subprocess.run([sys.executable, "-c", EMITTER], stderr=err, check=True, timeout=60,
                           env=env_for(stderr_file, path))
        entries = {e["MONITORD_EVENT"]: e for e in received(sock)}
        assert stderr_file.read_text() == ""  # nothing went to stderr as well
        started = entries["area_started"]
        assert started["PRIORITY"] == "6" and started["SYSLOG_IDENTIFIER"] == "monitord"
        assert started["MONITORD_SERVICE"] == "tg"
        assert started["MONITORD_AREA"] == "1a2b3c4d-area"
        assert "MONITORD_CODE" not in started and "MONITORD_TXN" not in started
        assert json.loads(started["MESSAGE"])["generation"] == 3  # the JSON line, as on stderr
        failed = entries["phase_failed"]
        assert failed["PRIORITY"] == "3"
        assert (failed["MONITORD_CODE"], failed["MONITORD_TXN"]) == ("PREFLIGHT_AUTH", "tx-42")
        assert (failed["MONITORD_SERVICE"], failed["MONITORD_AREA"]) == ("tg", "a-9")
        assert json.loads(failed["MESSAGE"])["detail"] == "two\nlines"
        assert entries["plain"]["PRIORITY"] == "7"
        assert entries["foreign_error"]["PRIORITY"] == "3"
        assert json.loads(entries["foreign_error"]["MESSAGE"])["logger_name"] == "asyncio"

    def test_a_value_with_a_newline_uses_the_length_prefixed_form(self) -> None:
        data = journal_native.encode({"MESSAGE": "a\nb", "PRIORITY": "6"})
        assert data == b"MESSAGE\n" + struct.pack("<Q", 3) + b"a\nb\nPRIORITY=6\n"
        assert parse_entry(data) == {"MESSAGE": "a\nb", "PRIORITY": "6"}

    def test_the_vps_agents_event_log_sends_the_same_fields(
        self, tmp_path: Path, journal: tuple[socket.socket, Path]
    ) -> None:
        sock, path = journal
        stderr_file = tmp_path / "stderr"
        stderr_file.touch()
        with stderr_file.open("ab") as err:
            subprocess.run([sys.executable, "-I", "-c", AGENT_EMITTER], stderr=err, check=True,
                           timeout=60, env=env_for(stderr_file, path),
                           cwd=Path(__file__).resolve().parents[2])
        [entry] = received(sock)
        assert entry["PRIORITY"] == "4" and entry["SYSLOG_IDENTIFIER"] == "monitord-agent"
        assert (entry["MONITORD_AREA"], entry["MONITORD_CODE"]) == ("a-7", "LEASE_EXPIRED")
        assert json.loads(entry["MESSAGE"])["event"] == "lease_lapsed"
        assert stderr_file.read_text() == ""

    def test_without_the_socket_the_lines_go_to_stderr_with_their_prefix(
        self, tmp_path: Path
    ) -> None:
        stderr_file = tmp_path / "stderr"
        stderr_file.touch()
        with stderr_file.open("ab") as err:
            subprocess.run([sys.executable, "-c", EMITTER], stderr=err, check=True, timeout=60,
                           env=env_for(stderr_file, tmp_path / "absent.socket"))
        lines = stderr_file.read_text().splitlines()
        assert any(line.startswith("<3>") and "phase_failed" in line for line in lines)

    async def test_the_daemon_under_the_journal_sends_native_entries(
        self, tmp_path: Path, journal: tuple[socket.socket, Path]
    ) -> None:
        sock, path = journal
        config = daemon_process.write_config(tmp_path)
        first, second = tmp_path / "first.stderr", tmp_path / "second.stderr"
        for f in (first, second):
            f.touch()
        holder = await start_run(config, first, env_for(first, path))
        try:
            await wait_ready(config, holder)
            duplicate = await start_run(config, second, env_for(second, path))
            assert await asyncio.wait_for(duplicate.wait(), 30) == 3
        finally:
            await stop(holder)
        entries = received(sock)
        events = {e["MONITORD_EVENT"]: e for e in entries}
        assert {"daemon_starting", "daemon_ready", "daemon_stopped"} <= set(events)
        refused = events["duplicate_instance"]
        assert (refused["PRIORITY"], refused["MONITORD_CODE"]) == ("3", "DUPLICATE_INSTANCE")
        assert second.read_text() == ""

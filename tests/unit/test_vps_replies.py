"""Every VPS reply is typed and bounded before use: the tunnel-lease helper's answers, the
provisioning and preflight scripts' output, the self-check's report and `ss` output. A
malformed, oversized or deeply nested reply is a MonitordError (VPS_REPLY_INVALID where no
older code says more), never a ValueError, KeyError or RecursionError out of the caller,
and never a line buffered without a bound. (tests/fuzz/test_vps_replies_fuzz.py throws
generated replies at the same parsers.)"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import asyncssh
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from monitord.remote import agent_client, preflight, provisioning, remote_exec, ssh_errors
from monitord.remote.tunnel import lease_client, port_holder
from monitord.remote.tunnel.lease_client import LeaseSession
from monitord.store.state_db import Store
from orchestrator.errors import ErrorCode, MonitordError

DEEP = "[" * 100_000 + "]" * 100_000
SESSION = {"sshd_pid": 10, "sshd_start_ticks": 5, "ssh_connection": "1 2 3 4"}
RECORD = {"owner_id": "o", "owner_label": "pbx", "acquired_at": 1.0, "renewed_at": 2.0,
          "ttl": 30.0, "session": SESSION}


class FakeStream:
    """A helper's stdout: the given bytes in chunks, then (with `endless`) more for ever."""

    def __init__(self, data: bytes, *, endless: bool = False) -> None:
        self._data = data
        self._endless = endless
        self.read_bytes = 0

    async def read(self, n: int = -1) -> bytes:
        await asyncio.sleep(0)
        if not self._data and self._endless:
            self._data = b"x" * 65536
        n = len(self._data) if n < 0 else n
        chunk, self._data = self._data[:n], self._data[n:]
        self.read_bytes += len(chunk)
        return chunk

    async def readline(self) -> bytes:  # what asyncssh's does: until a newline, unbounded
        line = b""
        while not line.endswith(b"\n"):
            chunk = await self.read(1)
            if not chunk:
                break
            line += chunk
        return line


class FakeProcess:
    def __init__(self, stdout: FakeStream) -> None:
        self.stdout = stdout
        self.stderr = FakeStream(b"")
        self.stdin = SimpleNamespace(write=lambda data: None)

    async def wait(self, check: bool = False) -> Any:
        return SimpleNamespace(exit_status=0)

    def close(self) -> None:
        pass


def _session(stdout: FakeStream) -> LeaseSession:
    return LeaseSession(FakeProcess(stdout), owner_id="o", timeout_s=2.0)  # type: ignore[arg-type]


HOSTILE_LEASE_ANSWERS = {
    "now is a string": b'{"ok": true, "action": "take", "now": "x"}\n',
    "now is NaN": b'{"ok": true, "action": "take", "now": NaN}\n',
    "now has 5000 digits": b'{"ok": true, "action": "take", "now": ' + b"9" * 5000 + b"}\n",
    # Numbers no float holds, or that no clock reads: each raised OverflowError or got through.
    "now has 400 digits": b'{"ok": true, "action": "take", "now": ' + b"9" * 400 + b"}\n",
    "now is -400 digits": b'{"ok": true, "action": "take", "now": -' + b"9" * 400 + b"}\n",
    "now is 1e400": b'{"ok": true, "action": "take", "now": 1e400}\n',
    "now is true": b'{"ok": true, "action": "take", "now": true}\n',
    "ttl has 400 digits": b'{"ok": true, "action": "take", "now": 1, "lease": '
                          + json.dumps({**RECORD, "ttl": 0}).replace(
                              '"ttl": 0', '"ttl": ' + "9" * 400).encode() + b"}\n",
    "a lease that ends past any float": b'{"ok": true, "action": "take", "now": 1, "lease": '
                                        + json.dumps({**RECORD, "renewed_at": 1.7e308,
                                                      "ttl": 1.7e308}).encode() + b"}\n",
    "lease is a list": b'{"ok": true, "action": "take", "now": 1, "lease": [1]}\n',
    "lease lacks its session": b'{"ok": true, "action": "take", "now": 1, "lease": '
                               b'{"owner_id": "o", "owner_label": "l", "acquired_at": 1,'
                               b' "renewed_at": 1, "ttl": 3}}\n',
    "session pid is text": b'{"ok": true, "action": "take", "now": 1, "session":'
                           b' {"sshd_pid": "x", "sshd_start_ticks": 1, "ssh_connection": ""}}\n',
    "ok is a string": b'{"ok": "yes", "action": "take", "now": 1}\n',
    "deep JSON": b'{"ok": true, "now": 1, "lease": ' + DEEP.encode() + b"}\n",
    "fenced_pid negative": b'{"ok": true, "action": "take", "now": 1, "fenced_pid": -4}\n',
    "code not catalogued": b'{"ok": false, "action": "refuse_conflict", "now": 1,'
                           b' "code": "NOT_A_CODE"}\n',
}


class TestTheLeaseHelpersAnswers:
    """A lease answer of the wrong shape is VPS_REPLY_INVALID."""

    @pytest.mark.parametrize("name", sorted(HOSTILE_LEASE_ANSWERS))
    async def test_a_malformed_answer_is_vps_reply_invalid(self, name: str) -> None:
        session = _session(FakeStream(HOSTILE_LEASE_ANSWERS[name]))
        with pytest.raises(MonitordError) as refused:
            await session.acquire()
        assert refused.value.code == ErrorCode.VPS_REPLY_INVALID

    async def test_a_well_formed_answer_is_read(self) -> None:
        line = json.dumps({"ok": True, "action": "take", "reason": "free", "now": 5.0,
                           "lease": RECORD, "holder": None, "session": SESSION}).encode()
        answer = await _session(FakeStream(line + b"\n")).acquire()
        assert answer.ok and answer.lease is not None and answer.lease.session.sshd_pid == 10

    async def test_a_line_without_end_is_refused_after_the_bound(self) -> None:
        stream = FakeStream(b"{", endless=True)
        with pytest.raises(MonitordError) as refused:
            await _session(stream).acquire()
        assert refused.value.code == ErrorCode.VPS_REPLY_INVALID
        assert stream.read_bytes <= lease_client.MAX_REPLY_BYTES + 64 * 1024

    @pytest.mark.parametrize("reply", [
        b'{"ok": true, "source_port": "x"}\n', b'{"ok": true}\n',
        b'{"ok": true, "source_port": 70000}\n',
    ])
    async def test_a_probe_bind_answer_without_a_port_is_refused(self, reply: bytes) -> None:
        with pytest.raises(MonitordError) as refused:
            await _session(FakeStream(reply)).probe_bind(host="127.0.0.1")
        assert refused.value.code == ErrorCode.VPS_REPLY_INVALID

    @pytest.mark.parametrize("rtt", [b'"fast"', b"9" * 400, b"1e400", b"NaN", b"true"],
                             ids=["text", "400 digits", "1e400", "NaN", "true"])
    async def test_a_probe_answer_without_a_round_trip_time_is_refused(self, rtt: bytes) -> None:
        with pytest.raises(MonitordError) as refused:
            await _session(FakeStream(b'{"ok": true, "rtt_ms": ' + rtt + b"}\n")).probe_connect(
                source_port=1, host="h", port=2, nonce="n", timeout_s=1.0)
        assert refused.value.code == ErrorCode.VPS_REPLY_INVALID

    @pytest.mark.parametrize("now", ["9" * 400, "1e400", "NaN", "true", "1e300"],
                             ids=["400 digits", "1e400", "NaN", "true", "1e300"])
    def test_the_clock_of_an_answer_is_a_number_in_range(self, now: str) -> None:
        with pytest.raises(MonitordError) as refused:
            lease_client.parse_answer(
                lease_client.parse_answer_document('{"ok": true, "now": ' + now + "}"))
        assert refused.value.code == ErrorCode.VPS_REPLY_INVALID


def _output(monkeypatch: pytest.MonkeyPatch, module: Any, name: str, stdout: bytes) -> None:
    async def run(*args: Any, **kwargs: Any) -> remote_exec.CommandResult:
        return remote_exec.CommandResult(argv=("sh",), exit_status=0, stdout=stdout,
                                         stderr=b"")

    monkeypatch.setattr(module.remote_exec, name, run)


class TestProvisioningOutput:
    """The prepare step's report (`stale N`, `have MODE SHA NAME`) is parsed in bounds."""

    @pytest.mark.parametrize("stdout", [
        b"stale x\n", b"stale \xc2\xb2\n", b"stale " + b"9" * 5000 + b"\n",
        b"have 9 abc monitord.pyz\n", b"have \xd9\xa1 abc monitord.pyz\n",
    ])
    async def test_a_bad_report_is_vps_reply_invalid(
        self, monkeypatch: pytest.MonkeyPatch, stdout: bytes
    ) -> None:
        _output(monkeypatch, provisioning, "run_script", stdout)
        with pytest.raises(MonitordError) as refused:
            await provisioning._prepare(
                None, "/bin", [SimpleNamespace(name="monitord.pyz")],  # type: ignore[arg-type, list-item]
                timeout_s=1.0)
        assert refused.value.code == ErrorCode.VPS_REPLY_INVALID

    async def test_a_good_report_is_read(self, monkeypatch: pytest.MonkeyPatch) -> None:
        _output(monkeypatch, provisioning, "run_script",
                b"stale 2\nhave 755 " + b"a" * 64 + b" monitord.pyz\n")
        hashes, stale, modes = await provisioning._prepare(
            None, "/bin", [SimpleNamespace(name="monitord.pyz")],  # type: ignore[arg-type, list-item]
            timeout_s=1.0)
        assert (hashes, stale, modes) == ({"monitord.pyz": "a" * 64}, 2, {"monitord.pyz": 0o755})


class TestPreflightOutput:
    """The probe script's lines and the self-check's report are parsed in bounds."""

    @pytest.mark.parametrize("stdout", [
        b"arch x86_64\n\nuser me\n",  # an empty line
        b"bin_dir dir 9 me\n",  # not octal
        b"bin_dir dir \xc2\xb2 me\n",
        b"avail_kb \xc2\xb2\n",
        b"avail_kb " + b"9" * 5000 + b"\n",
        b"bin_dir\n",  # found by tests/fuzz/test_vps_replies_fuzz.py: an IndexError
    ])
    async def test_the_probe_never_raises_anything_but_a_monitord_error(
        self, monkeypatch: pytest.MonkeyPatch, stdout: bytes
    ) -> None:
        _output(monkeypatch, preflight, "run_script", stdout)
        try:
            facts = await preflight._probe(
                None, remote=SimpleNamespace(remote_bin_dir="/b"),  # type: ignore[arg-type]
                artifacts=[], data_root="/b/data", timeout_s=1.0)
        except MonitordError as e:
            assert e.code == ErrorCode.VPS_REPLY_INVALID
        else:
            assert facts.avail_bytes is None and facts.bin_dir_mode == 0

    async def test_a_deep_self_check_line_is_skipped(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        _output(monkeypatch, preflight, "run",
                DEEP.encode() + b'\n{"check": "python", "ok": true, "detail": "3.11"}\n')
        monkeypatch.setattr(preflight.artifact, "remote_command", lambda remote: ["monitord"])
        lines = await preflight._self_check(
            object(), remote=SimpleNamespace(remote_bin_dir="/b"),  # type: ignore[arg-type]
            timeout_s=1.0)
        assert not isinstance(lines, str) and [line.check for line in lines] == ["python"]


    def test_the_agent_line_ends_with_how_the_agent_fences_its_areas(self) -> None:
        line = preflight.SelfCheckLine
        fence = "areas on the VPS are fenced by process group only: why: what it leaves open"
        result = preflight._judge_agent(None, (line("python", True, "cpython 3.11", ""),
                                               line("fence", True, fence, "")))
        assert result.ok
        assert result.detail == ("answers over the SSH connection; self-check passed"
                                 f" (cpython 3.11); fence: {fence}")


class TestSsOutput:
    """Numbers in `ss` output are ASCII digits of bounded length."""

    @pytest.mark.parametrize("listen", [
        'LISTEN 0 128 127.0.0.1:8224 0.0.0.0:* users:(("sshd",pid=' + "9" * 5000 + ",fd=3))",
        'LISTEN 0 128 127.0.0.1:8224 0.0.0.0:* users:(("sshd",pid=\u0661\u0662,fd=3))',
    ])
    def test_an_absurd_pid_is_no_holder_at_all(self, listen: str) -> None:
        observed = port_holder.parse_probe(f"{listen}\n@@self\n1 2 3 22\n", port=8224)
        assert observed.holder.pid is None

    def test_an_absurd_lastrcv_reads_as_silent(self) -> None:
        text = (
            'LISTEN 0 128 127.0.0.1:8224 0.0.0.0:* users:(("sshd-session",pid=42,fd=3))\n'
            "@@stat\n42 (sshd-session) S 1 " + "0 " * 20 + "\n"
            "@@parent\n1 (sshd) S 0\n"
            "@@estab\nESTAB 0 0 10.0.0.1:22 10.0.0.2:5555 users:((\"sshd-session\",pid=42,fd=4))"
            " lastrcv:" + "9" * 5000 + "\n"
            "@@self\n1 2 3 22\n"
        )
        observed = port_holder.parse_probe(text, port=8224)
        assert observed.holder.pid == 42
        assert observed.holder.lastrcv_s == float("inf")


class TestTheSecretReadBack:
    """Provisioning compares agent.secret on the VPS with ours reading at most a bound."""

    async def test_at_most_the_bound_is_asked_for(self) -> None:
        asked: list[int] = []

        class File:
            async def __aenter__(self) -> File:
                return self

            async def __aexit__(self, *exc: object) -> None:
                return None

            async def read(self, size: int = -1) -> bytes:
                asked.append(size)
                return b"x" * (100_000_000 if size < 0 else min(size, 100_000_000))

        class Sftp:
            async def open(self, path: str, mode: str) -> File:
                return File()

        data = await provisioning._read_if_exists(Sftp(), "/b/agent.secret")  # type: ignore[arg-type]
        assert asked and all(0 <= size <= provisioning.MAX_SECRET_READ for size in asked)
        assert data is not None and len(data) <= provisioning.MAX_SECRET_READ


def _agent_answering(body: bytes) -> agent_client.AgentClient:
    """An AgentClient whose every request is answered 200 with `body`."""

    @contextlib.asynccontextmanager
    async def channel() -> AsyncIterator[tuple[Any, Any]]:
        head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body)

        async def drain() -> None:
            pass

        yield FakeStream(head + body), SimpleNamespace(write=lambda data: None, drain=drain,
                                                        close=lambda: None)

    return agent_client.AgentClient(channel=channel, secret=b"s")


# Numbers no float holds (a 400-digit integer: float() raises OverflowError), that are not
# JSON (NaN, 1e400 reads as infinite) or not numbers at all (true).
ODD_NUMBERS = {"400 digits": "9" * 400, "-400 digits": "-" + "9" * 400, "1e400": "1e400",
               "NaN": "NaN", "true": "true", "1e300": "1e300"}

# ... and what no count or duration is.
ODD_COUNTS = {**ODD_NUMBERS, "-1": "-1", "a string": '"1"'}


class TestTheAgentsNumbers:
    """A number in an agent's answer that no float holds, or no clock or size comes near, is
    a malformed answer (AGENT_UNREACHABLE), never an OverflowError out of the caller."""

    @pytest.mark.parametrize("name", sorted(ODD_NUMBERS))
    async def test_a_health_answer_with_an_odd_uptime_is_malformed(self, name: str) -> None:
        client = _agent_answering(b'{"area": "a1", "generation": 3, "healthy": true,'
                                  b' "uptime_s": ' + ODD_NUMBERS[name].encode() + b"}")
        with pytest.raises(MonitordError) as refused:
            await client.health(area="a1", generation=3, min_uptime_s=0.5, wait_s=0.1)
        assert refused.value.code == ErrorCode.AGENT_UNREACHABLE
        assert "malformed answer" in refused.value.detail

    @pytest.mark.parametrize("field", ["uptime_s", "started_at", "lease_expires_at",
                                       "created_at", "generation", "pid", "restarts"])
    @pytest.mark.parametrize("name", sorted(ODD_NUMBERS))
    def test_an_inventory_with_an_odd_number_is_malformed(self, field: str, name: str) -> None:
        process: dict[str, Any] = {"area": "a1", "generation": 3, "pid": 42,
                                   "started_at": 5.0, "uptime_s": 1.0, "restarts": 0}
        entry: dict[str, Any] = {"area": "a1", "service": "tg", "generation": 3,
                                 "lease_expires_at": 9.0, "created_at": 2.0}
        held = entry if field in ("lease_expires_at", "created_at") else process
        held[field] = None
        text = json.dumps({"entries": [entry], "processes": [process]}).replace(
            f'"{field}": null', f'"{field}": {ODD_NUMBERS[name]}')
        raw = agent_client._parse_json(text.encode())
        if raw is None:  # not JSON within bounds (NaN, 1e400): no answer at all
            return
        with pytest.raises(MonitordError) as refused:
            agent_client.check_inventory(raw, where="GET /v1/inventory")
        assert refused.value.code == ErrorCode.AGENT_UNREACHABLE

    @pytest.mark.parametrize("name", sorted(ODD_NUMBERS))
    async def test_a_renewal_for_an_odd_generation_is_malformed(self, name: str) -> None:
        client = _agent_answering(b'{"areas": {"a1": {"result": "renewed", "generation": '
                                  + ODD_NUMBERS[name].encode() + b"}}}")
        with pytest.raises(MonitordError) as refused:
            await client.renew(owner_id="o", ttl_s=30.0, areas={"a1": 3})
        assert refused.value.code == ErrorCode.AGENT_UNREACHABLE

    @pytest.mark.parametrize("name", sorted(ODD_NUMBERS))
    async def test_a_log_read_at_an_odd_offset_is_malformed(self, name: str) -> None:
        client = _agent_answering(b'{"data": "", "file": 0, "missing": false, "offset": '
                                  + ODD_NUMBERS[name].encode() + b"}")
        with pytest.raises(MonitordError) as refused:
            await client.area_log(area="a1", offset=0)
        assert refused.value.code == ErrorCode.AGENT_UNREACHABLE

    async def test_answers_in_range_are_read(self) -> None:
        client = _agent_answering(b'{"area": "a1", "generation": 3, "healthy": true,'
                                  b' "uptime_s": 7}')
        answer = await client.health(area="a1", generation=3, min_uptime_s=0.5, wait_s=0.1)
        assert answer == agent_client.AreaHealth(healthy=True, uptime_s=7.0)

    SNAPSHOT = {"area": "a1", "generation": 3, "dir": "/d/.monitord-copy/a1/warm",
                "taken_at": 1.7e9, "files": 2, "bytes": 4096, "databases": 1, "took_s": 0.2,
                "cpu_s": 0.1}

    @pytest.mark.parametrize("field", ["taken_at", "files", "bytes", "databases", "took_s",
                                       "cpu_s"])
    @pytest.mark.parametrize("name", sorted(ODD_COUNTS))
    async def test_a_snapshot_answer_with_an_odd_number_is_malformed(
        self, field: str, name: str
    ) -> None:
        text = json.dumps({**self.SNAPSHOT, field: None}).replace(
            f'"{field}": null', f'"{field}": {ODD_COUNTS[name]}')
        client = _agent_answering(text.encode())
        with pytest.raises(MonitordError) as refused:
            await client.snapshot(area="a1", data_dir="/d/a1", generation=3, sqlite=["*.db"])
        assert refused.value.code == ErrorCode.AGENT_UNREACHABLE

    @pytest.mark.parametrize("odd", [{"generation": 4}, {"dir": 7}, {"dir": ""},
                                     {"dir": "/" * 4097}, {"databases": 3}, {"files": 1.0}])
    async def test_a_snapshot_answer_for_another_generation_or_no_dir_is_malformed(
        self, odd: dict[str, Any]
    ) -> None:
        client = _agent_answering(json.dumps({**self.SNAPSHOT, **odd}).encode())
        with pytest.raises(MonitordError) as refused:
            await client.snapshot(area="a1", data_dir="/d/a1", generation=3, sqlite=[])
        assert refused.value.code == ErrorCode.AGENT_UNREACHABLE
        assert "malformed answer" in refused.value.detail

    async def test_a_snapshot_answer_in_range_is_read(self) -> None:
        client = _agent_answering(json.dumps(self.SNAPSHOT).encode())
        assert await client.snapshot(area="a1", data_dir="/d/a1", generation=3,
                                     sqlite=["*.db"]) == agent_client.WarmSnapshot(
            dir="/d/.monitord-copy/a1/warm", generation=3, taken_at=1.7e9, files=2,
            bytes=4096, databases=1, took_s=0.2, cpu_s=0.1)


class TestTheAgentsAnswers:
    """An agent answer within Python's recursion limit but past bounded_json's depth is no
    answer: it parsed before, and the bundle's redaction of the inventory then recursed."""

    def test_an_inventory_900_levels_deep_is_not_read(self) -> None:
        raw = b'{"entries": [], "processes": [], "x": ' + b"[" * 900 + b"]" * 900 + b"}"
        assert agent_client._parse_json(raw) is None

    def test_a_shallow_answer_is_read(self) -> None:
        assert agent_client._parse_json(b'{"entries": [], "processes": []}') == {
            "entries": [], "processes": []}


# What a broken or compromised VPS may put in a text it sends: a lone surrogate (valid as a
# JSON escape, not encodable as UTF-8) and a terminal control sequence (clears the screen).
HOSTILE_TEXTS = {"a lone surrogate": "\udc80", "an escape sequence": "\x1b[2J"}


def _safe(text: str) -> bool:
    """Text that encodes as UTF-8 and holds no control character but newline and tab."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return all(c in "\n\t" or not (c < " " or "\x7f" <= c <= "\x9f") for c in text)


class _Agent:
    """An agent double: `answer` is (status, JSON document) for every request."""

    def __init__(self) -> None:
        self.answer: tuple[int, Any] = (200, {})

    async def handle(self, request: web.Request) -> web.Response:
        status, document = self.answer
        return web.Response(status=status, body=json.dumps(document).encode(),
                            content_type="application/json")


@pytest.fixture
async def agent_double() -> AsyncIterator[tuple[_Agent, agent_client.AgentClient]]:
    agent = _Agent()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", agent.handle)
    server = TestServer(app)
    await server.start_server()
    try:
        yield agent, agent_client.AgentClient(
            channel=agent_client.tcp_channel(str(server.host), int(server.port or 0)),
            secret=b"s3cret", timeout_s=2.0)
    finally:
        await server.close()


class TestTextFromTheVps:
    """Text the VPS sends — an agent's error detail, a lease answer, a command's stderr, an
    SSH server's reason — enters monitord made safe: it encodes as UTF-8 (a lone surrogate
    is U+FFFD) and holds no control character but newline and tab, so no record, log line
    or operator's terminal ever gets it as sent."""

    @pytest.mark.parametrize("status", [400, 401, 409, 503])
    @pytest.mark.parametrize("name", sorted(HOSTILE_TEXTS))
    async def test_an_agents_error_detail_is_made_safe(
        self, agent_double: tuple[_Agent, agent_client.AgentClient], status: int, name: str
    ) -> None:
        agent, client = agent_double
        agent.answer = (status, {"error": {"code": "BAD_REQUEST",
                                           "detail": f"no {HOSTILE_TEXTS[name]} here"}})
        with pytest.raises(MonitordError) as refused:
            await client.stop(area="a1", generation=1)
        assert _safe(refused.value.detail) and _safe(str(refused.value))
        assert "no \ufffd" in refused.value.detail  # something was there, and it is shown

    async def test_an_agents_error_detail_with_a_lone_surrogate_is_recorded(
        self, agent_double: tuple[_Agent, agent_client.AgentClient], tmp_path: Path
    ) -> None:
        """The record of the step that failed is written: the move can roll back or park."""
        agent, client = agent_double
        agent.answer = (400, {"error": {"code": "BAD_REQUEST", "detail": "\udc80"}})
        with pytest.raises(MonitordError) as refused:
            await client.stop(area="a1", generation=1)
        record = {"transaction_id": "t-1", "service": "tg", "area": "a1", "source": "local",
                  "destination": "remote", "phase": "STOP_SOURCE", "attempt": 1,
                  "generation": 1, "started_at": 1.0, "updated_at": 2.0,
                  "last_error_code": refused.value.code.value,
                  "last_error_detail": refused.value.detail, "cleanup_required": False}
        async with await Store.open(tmp_path) as store:
            await store.put_transaction(record)
            assert await store.get_transaction("t-1") == record

    async def test_an_agents_result_is_made_safe(
        self, agent_double: tuple[_Agent, agent_client.AgentClient]
    ) -> None:
        agent, client = agent_double
        agent.answer = (200, {"result": "stopped\x1b[2J\udc80"})
        assert _safe(await client.stop(area="a1", generation=1))

    @pytest.mark.parametrize("name", sorted(HOSTILE_TEXTS))
    async def test_a_lease_helpers_usage_error_is_made_safe(self, name: str) -> None:
        line = json.dumps({"ok": False, "code": "BAD_REQUEST",
                           "detail": f"no {HOSTILE_TEXTS[name]} here"}).encode()
        with pytest.raises(MonitordError) as refused:
            await _session(FakeStream(line + b"\n")).acquire()
        assert refused.value.code == ErrorCode.BAD_REQUEST
        assert _safe(refused.value.detail)

    async def test_a_lease_answers_texts_are_made_safe(self) -> None:
        hostile = "".join(HOSTILE_TEXTS.values())
        holder = {**RECORD, "owner_id": f"o{hostile}", "owner_label": f"pbx{hostile}",
                  "session": {**SESSION, "ssh_connection": f"1 2 3 4{hostile}"}}
        line = json.dumps({"ok": False, "action": "refuse_conflict", "reason": hostile,
                           "now": 5.0, "holder": holder}).encode()
        answer = await _session(FakeStream(line + b"\n")).acquire()
        assert answer.holder is not None
        texts = [answer.action, answer.reason, answer.holder.owner_id,
                 answer.holder.owner_label, answer.holder.session.ssh_connection]
        assert all(_safe(text) for text in texts)

    def test_a_remote_commands_stderr_is_made_safe(self) -> None:
        result = remote_exec.CommandResult(argv=("sh",), exit_status=1, stdout=b"",
                                           stderr=b"\x1b[2Jboom \xed\xb2\x80 \x9b31m")
        assert _safe(result.stderr_tail())
        with pytest.raises(MonitordError) as refused:
            result.raise_for_status(ErrorCode.PROVISION_FAILED)
        assert _safe(refused.value.detail) and "boom" in refused.value.detail

    def test_an_ssh_servers_reason_is_made_safe(self) -> None:
        error = asyncssh.DisconnectError(11, "bye\x1b[2J\x1b]0;owned\x07")
        translated = ssh_errors.translate(error, code=ErrorCode.SSH_UNREACHABLE,
                                          during="connect")
        assert _safe(translated.detail) and "bye" in translated.detail

    def test_a_port_holders_name_is_made_safe(self) -> None:
        text = ('LISTEN 0 128 127.0.0.1:8224 0.0.0.0:* users:(("evil\x1b[2J",pid=42,fd=3))\n'
                "@@self\n1 2 3 22\n")
        observed = port_holder.parse_probe(text, port=8224)
        assert observed.holder.pid == 42 and _safe(observed.holder.command)


class TestTheAgentsConflicts:
    """An agent's 409 is DESTINATION_CONFLICT, but for a warm copy's snapshot refused or
    failed, which keep their own (retryable) codes."""

    @pytest.mark.parametrize(("said", "read"), [
        ("WARM_COPY_REFUSED", ErrorCode.WARM_COPY_REFUSED),
        ("WARM_COPY_FAILED", ErrorCode.WARM_COPY_FAILED),
        ("DESTINATION_CONFLICT", ErrorCode.DESTINATION_CONFLICT),
        ("INTERNAL", ErrorCode.DESTINATION_CONFLICT),
        (None, ErrorCode.DESTINATION_CONFLICT),
    ])
    async def test_a_409_keeps_a_warm_copys_code_only(
        self, agent_double: tuple[_Agent, agent_client.AgentClient], said: str | None,
        read: ErrorCode,
    ) -> None:
        agent, client = agent_double
        agent.answer = (409, {"error": {"code": said, "detail": "db/store.db kept changing"}})
        with pytest.raises(MonitordError) as refused:
            await client.snapshot(area="a1", data_dir="/d/a1", generation=3, sqlite=[])
        assert refused.value.code == read
        assert refused.value.detail.endswith("db/store.db kept changing")

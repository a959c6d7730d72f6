"""Every VPS reply is typed and bounded before use: the tunnel-lease helper's answers, the
provisioning and preflight scripts' output, the self-check's report and `ss` output. A
malformed, oversized or deeply nested reply is a MonitordError (VPS_REPLY_INVALID where no
older code says more), never a ValueError, KeyError or RecursionError out of the caller,
and never a line buffered without a bound. (tests/fuzz/test_vps_replies_fuzz.py throws
generated replies at the same parsers.)"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from monitord.remote import agent_client, preflight, provisioning, remote_exec
from monitord.remote.tunnel import lease_client, port_holder
from monitord.remote.tunnel.lease_client import LeaseSession
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
        import json

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

    async def test_a_probe_answer_with_a_text_round_trip_is_refused(self) -> None:
        with pytest.raises(MonitordError) as refused:
            await _session(FakeStream(b'{"ok": true, "rtt_ms": "fast"}\n')).probe_connect(
                source_port=1, host="h", port=2, nonce="n", timeout_s=1.0)
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


class TestTheAgentsAnswers:
    """An agent answer within Python's recursion limit but past bounded_json's depth is no
    answer: it parsed before, and the bundle's redaction of the inventory then recursed."""

    def test_an_inventory_900_levels_deep_is_not_read(self) -> None:
        raw = b'{"entries": [], "processes": [], "x": ' + b"[" * 900 + b"]" * 900 + b"}"
        assert agent_client._parse_json(raw) is None

    def test_a_shallow_answer_is_read(self) -> None:
        assert agent_client._parse_json(b'{"entries": [], "processes": []}') == {
            "entries": [], "processes": []}

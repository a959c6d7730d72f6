"""The agent's HTTP edge (monitord.vps.server) answers every hostile request with a coded
error document: a Content-Length or generation that only looks like digits (`²`, which
`str.isdigit` accepts and `int` refuses) and JSON nested too deep are 400 BAD_REQUEST, never
an exception that leaves the client without an answer."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from monitord.vps import server

SECRET = "s3cret-for-the-wire-test"
AREA = "5b1d0c2e-0000-4000-8000-000000000001"


class NoRuntime:
    """Reached only by a request that passed every check at the edge (a failure here)."""

    def __getattr__(self, name: str) -> Any:
        def reached(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError(f"the request reached the runtime ({name})")

        return reached


@pytest.fixture
async def socket_path(tmp_path: Path) -> AsyncIterator[Path]:
    secret = tmp_path / "agent.secret"
    secret.write_text(SECRET + "\n")
    path = tmp_path / "api" / "agent.sock"
    srv = await server.start_server(NoRuntime(), socket_path=path,  # type: ignore[arg-type]
                                    secret_path=secret)
    try:
        yield path
    finally:
        srv.close()
        await srv.wait_closed()


async def _exchange(path: Path, raw: bytes) -> tuple[int, dict[str, Any]]:
    reader, writer = await asyncio.open_unix_connection(str(path))
    try:
        writer.write(raw)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), timeout=10)
    finally:
        writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 "), f"no answer at all: {answer[:80]!r}"
    return int(head.split(b" ")[1]), json.loads(body)


def _request(method: str, target: str, *, body: bytes = b"", length: str | None = None,
             auth: bool = True) -> bytes:
    headers = f"{method} {target} HTTP/1.1\r\nHost: agent\r\n"
    if auth:
        headers += f"Authorization: Bearer {SECRET}\r\n"
    headers += f"Content-Length: {len(body) if length is None else length}\r\n\r\n"
    # The agent reads the head as latin-1: b"\xb2" is "²" there.
    return headers.encode("latin-1", "backslashreplace") + body


class TestLookalikeDigits:
    """Only ASCII digits are a number at the edge."""

    @pytest.mark.parametrize("length", ["²", "¹²", "+5", " 5x", "9" * 5000])
    async def test_a_content_length_of_lookalike_digits_is_400(
        self, socket_path: Path, length: str
    ) -> None:
        status, answer = await _exchange(
            socket_path, _request("POST", "/v1/leases/renew", length=length, auth=False)
        )
        assert (status, answer["error"]["code"]) == (400, "BAD_REQUEST")

    @pytest.mark.parametrize("generation", ["%C2%B2", "%D9%A1", "9" * 5000, "-1", "1.0"])
    async def test_a_generation_of_lookalike_digits_is_400(
        self, socket_path: Path, generation: str
    ) -> None:
        status, answer = await _exchange(
            socket_path, _request("POST", f"/v1/areas/{AREA}/stop?generation={generation}")
        )
        assert (status, answer["error"]["code"]) == (400, "BAD_REQUEST")


class TestDeepJson:
    """A body nested past the bound is 400 with a reason, not a RecursionError."""

    @pytest.mark.parametrize("body", [
        b'{"owner_id": "o", "ttl_s": 1, "areas": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b'{"owner_id": "o", "ttl_s": 1, "areas": {"a": ' + b"9" * 5000 + b"}}",
        b'{"owner_id": "o", "ttl_s": NaN, "areas": {}}',
    ], ids=["100000 deep", "5000 digits", "NaN"])
    async def test_a_renewal_body_out_of_bounds_is_400(
        self, socket_path: Path, body: bytes
    ) -> None:
        status, answer = await _exchange(
            socket_path, _request("POST", "/v1/leases/renew", body=body)
        )
        assert (status, answer["error"]["code"]) == (400, "BAD_REQUEST")


class _FaultyRuntime:
    """A runtime with a fault of its own: every call raises what no handler expects."""

    def __getattr__(self, name: str) -> Any:
        def broken(*args: Any, **kwargs: Any) -> Any:
            raise TypeError(f"{name}: an unexpected argument")

        return broken


class TestAFaultInsideTheAgent:
    """An exception of the agent's own is answered 500 INTERNAL naming it, so that the PBX
    reads the agent's failure, not a channel closed early (a lost link)."""

    async def test_it_is_answered_500_internal_with_its_name(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        secret = tmp_path / "agent.secret"
        secret.write_text(SECRET + "\n")
        path = tmp_path / "api" / "agent.sock"
        srv = await server.start_server(_FaultyRuntime(),  # type: ignore[arg-type]
                                        socket_path=path, secret_path=secret)
        try:
            status, answer = await _exchange(path, _request("GET", "/v1/inventory"))
        finally:
            srv.close()
            await srv.wait_closed()
        assert (status, answer["error"]["code"]) == (500, "INTERNAL")
        assert "TypeError: inventory: an unexpected argument" in answer["error"]["detail"]
        assert "agent_request_failed" in capsys.readouterr().err

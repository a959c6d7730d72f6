"""Local authority: every change through the HTTP API, and the bundle, needs the API token;
reads stay open on loopback; no answer of the API can be framed.

A whole installation (a real `monitord run`, the SSH VPS, the agent). Each refused request is
a 401 API_UNAUTHORIZED in the error shape with a `WWW-Authenticate: Bearer` challenge, and
changes nothing (the snapshot of test_api_bad_input.py: status, transactions, the store's
desired placements, custom_config.json, remote_state.json). With the token (as the CLI and
an authorised page send it) the same requests reach their handlers.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import re
import stat
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from monitord.surface import api_token, status_api
from monitord.testing.stack import Stack, StackOptions
from orchestrator import errors
from tests.integration.operator.conftest import run_cli
from tests.integration.operator.test_api_bad_input import snapshot
from tests.support import daemon_process

# One worker builds the module's stack once and runs every case on it (make test: --dist loadgroup).
pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.xdist_group("api-authority")]

JSON = {"Content-Type": "application/json"}

# The snapshots compare the areas' processes too: a lease that lapses because the machine is
# too busy to renew it within the test stack's 3 s restarts a remote daemon, which no request
# did. The stack's leases are therefore the default's 30 s.
QUIET_LEASE_TTL_S = 30.0


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    """tg local, chats on the VPS; no refused case may change anything in it."""
    async with Stack(tmp_path_factory.mktemp("authority"),
                     StackOptions(services={"tg": 1, "chats": 1},
                                  area_lease_ttl_s=QUIET_LEASE_TTL_S)) as stack:
        await stack.place("chats", "remote")
        await stack.wait_settled(expect={"tg": "local", "chats": "remote"}, timeout_s=60)
        await stack.wait_seen_up()  # what the snapshots compare, settled too
        yield stack
        assert stack.detector.overlaps() == []


def token_of(stack: Stack) -> str:
    token = stack.api_token()
    assert token is not None, "the daemon wrote no API token"
    return token


async def send(stack: Stack, method: str, path: str, body: bytes | None = None,
               headers: dict[str, str] | None = None) -> tuple[int, Any, Any]:
    """Exactly these headers (no token unless given); status, document, response headers."""
    timeout = aiohttp.ClientTimeout(total=20)
    async with aiohttp.ClientSession(timeout=timeout) as session, session.request(
        method, f"http://127.0.0.1:{stack.http_port}{path}", data=body, headers=headers or {}
    ) as resp:
        raw = await resp.read()
        try:
            document: Any = json.loads(raw)
        except ValueError:
            document = raw
        return resp.status, document, resp.headers


def changes(stack: Stack) -> list[tuple[str, str, bytes | None]]:
    """Every change route (and the reads that are not everyone's: the bundle, an area's log —
    mode 0600, one account's — and methods no route has), with a body that would be
    accepted: only the token decides."""
    (area,) = stack.areas["tg"]
    location = b'{"location": "remote"}'
    return [
        ("PUT", "/v1/services/tg/placement", location),
        ("PUT", f"/v1/areas/{area}/placement", location),
        ("POST", "/v1/services/tg/retry", None),
        ("POST", "/v1/services/chats/discard-remote-data", b"{}"),
        ("POST", "/v1/services/chats/give-up", b"{}"),
        ("GET", "/v1/diagnostics/bundle", None),
        ("HEAD", "/v1/diagnostics/bundle", None),
        ("GET", f"/v1/areas/{area}/logs", None),
        ("GET", f"/v1/areas/{area}/logs?side=remote&lines=5", None),
        ("HEAD", f"/v1/areas/{area}/logs", None),
        ("DELETE", "/v1/services/tg/placement", None),
        ("PATCH", "/v1/services/tg/placement", location),
        ("POST", "/v1/no-such-route", b"{}"),
        ("OPTIONS", "/v1/services/tg/placement", None),
    ]


def without_the_token(token: str) -> dict[str, dict[str, str]]:
    wrong = token[:-1] + ("A" if token[-1] != "A" else "B")
    return {
        "no header": {},
        "a wrong token": {"Authorization": f"Bearer {wrong}"},
        "the token cut short": {"Authorization": f"Bearer {token[:-1]}"},
        "the token and more": {"Authorization": f"Bearer {token}x"},
        "an empty bearer": {"Authorization": "Bearer "},
        "another scheme": {"Authorization": "Basic " + base64.b64encode(
            f"root:{token}".encode()).decode()},
        "the bare token": {"Authorization": token},
        "the token as a cookie": {"Cookie": f"token={token}"},
        "the token in another header": {"X-Api-Token": token},
    }


class TestChangesNeedTheToken:
    async def test_every_change_without_the_token_is_401_and_changes_nothing(
        self, stack: Stack
    ) -> None:
        token = token_of(stack)
        before = await snapshot(stack)
        for how, auth in without_the_token(token).items():
            for method, path, body in changes(stack):
                status, document, headers = await send(stack, method, path, body,
                                                       {**JSON, **auth})
                what = f"{method} {path} with {how}"
                assert status == 401, (what, document)
                assert headers["WWW-Authenticate"].startswith('Bearer realm="monitord"'), what
                if method != "HEAD":
                    assert document["error"]["code"] == "API_UNAUTHORIZED", what
                    assert set(document) == {"error"}, what
                    assert token not in document["error"]["detail"], what
        assert errors.lookup("API_UNAUTHORIZED").code == "API_UNAUTHORIZED"
        assert await snapshot(stack) == before

    async def test_no_token_is_refused_before_the_content_type_and_the_body_are_looked_at(
        self, stack: Stack
    ) -> None:
        before = await snapshot(stack)
        status, document, _ = await send(stack, "POST", "/v1/services/tg/retry", b"x=1",
                                         {"Content-Type": "text/plain"})
        assert (status, document["error"]["code"]) == (401, "API_UNAUTHORIZED")
        status, document, _ = await send(stack, "PUT", "/v1/services/tg/placement", b"[" * 10000,
                                         JSON)
        assert (status, document["error"]["code"]) == (401, "API_UNAUTHORIZED")
        assert await snapshot(stack) == before

    async def test_the_detail_says_where_the_token_is_and_a_wrong_one_is_named_invalid(
        self, stack: Stack
    ) -> None:
        status, document, headers = await send(stack, "POST", "/v1/services/tg/retry", None, JSON)
        detail = document["error"]["detail"]
        assert str(stack.root / "work" / "api-token") in detail and "Bearer" in detail
        status, _, headers = await send(stack, "POST", "/v1/services/tg/retry", None,
                                        {**JSON, "Authorization": "Bearer nope"})
        assert status == 401 and 'error="invalid_token"' in headers["WWW-Authenticate"]

    async def test_with_the_token_the_requests_reach_their_handlers(self, stack: Stack) -> None:
        auth = {**JSON, "Authorization": f"Bearer {token_of(stack)}"}
        status, document, _ = await send(stack, "POST", "/v1/services/tg/retry", None, auth)
        assert (status, document) == (202, {"service": "tg", "transaction_ids": []})
        # The scheme is case-insensitive (RFC 7235).
        lower = {**JSON, "Authorization": f"bearer {token_of(stack)}"}
        status, document, _ = await send(stack, "PUT", "/v1/services/tg/placement",
                                         b'{"location": "local"}', lower)
        assert status == 202 and document["transaction_ids"] == [], document
        # Past the gate: the handlers' own answers.
        status, document, _ = await send(stack, "POST", "/v1/services/tg/give-up", b"{}", auth)
        assert (status, document["error"]["code"]) == (409, "TRANSACTION_CONFLICT"), document
        status, document, _ = await send(stack, "POST", "/v1/services/tg/discard-remote-data",
                                         b"{}", auth)
        assert (status, document["error"]["code"]) == (409, "TRANSACTION_CONFLICT"), document
        status, document, _ = await send(stack, "POST", "/v1/no-such-route", b"{}", auth)
        assert (status, document["error"]["code"]) == (404, "NOT_FOUND")
        status, body, headers = await send(stack, "GET", "/v1/diagnostics/bundle", None, auth)
        assert status == 200 and headers["Content-Type"] == "application/gzip"
        with tarfile.open(fileobj=io.BytesIO(body), mode="r:gz") as bundle:
            members = [bundle.extractfile(m) for m in bundle.getmembers() if m.isfile()]
            contents = b"".join(m.read() for m in members if m is not None)
        assert len(contents) > 1000
        assert token_of(stack).encode() not in contents, "the token is in the bundle"
        (area,) = stack.areas["tg"]
        status, document, _ = await send(stack, "GET", f"/v1/areas/{area}/logs", None, auth)
        assert status == 200 and document["area"] == area, document


class TestReadsStayOpen:
    @pytest.mark.parametrize("path", ["/v1/status", "/v1/transactions", "/v1/cleanup",
                                      "/metrics", "/", "/livez", "/readyz"])
    async def test_a_read_needs_no_token(self, stack: Stack, path: str) -> None:
        for method in ("GET", "HEAD"):
            status, _, _ = await send(stack, method, path)
            assert status == 200, (method, path)


class TestNoFraming:
    @pytest.mark.parametrize(("method", "path"), [
        ("GET", "/"), ("GET", "/v1/status"), ("GET", "/metrics"), ("GET", "/v1/nothing"),
        ("POST", "/v1/services/tg/retry"), ("GET", "/livez"),
    ])
    async def test_every_answer_forbids_framing(
        self, stack: Stack, method: str, path: str
    ) -> None:
        _, _, headers = await send(stack, method, path, None, JSON)
        assert headers["X-Frame-Options"] == "DENY"
        policy = [p.strip() for p in headers["Content-Security-Policy"].split(";")]
        assert "frame-ancestors 'none'" in policy
        assert headers["X-Content-Type-Options"] == "nosniff"

    async def test_the_page_runs_only_its_own_script(self, stack: Stack) -> None:
        _, body, headers = await send(stack, "GET", "/")
        policy = dict(
            (p.strip().split(" ", 1) + [""])[:2] for p in headers["Content-Security-Policy"]
            .split(";")
        )
        [script] = re.findall(rb"<script>(.*?)</script>", body, re.DOTALL)
        digest = base64.b64encode(hashlib.sha256(script).digest()).decode()
        assert policy["script-src"] == f"'sha256-{digest}'"
        assert "'unsafe-inline'" not in headers["Content-Security-Policy"]
        assert policy["default-src"] == "'none'" and policy["connect-src"] == "'self'"
        assert policy["frame-ancestors"] == "'none'"
        assert headers["Referrer-Policy"] == "no-referrer"
        assert (body, headers["Content-Security-Policy"]) == status_api.page()


class TestTheTokenFile:
    async def test_written_at_start_0640_for_the_group_and_never_logged(
        self, stack: Stack
    ) -> None:
        token = token_of(stack)
        path = stack.root / "work" / api_token.FILE_NAME
        st = path.lstat()
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o640
        assert (st.st_uid, st.st_gid) == (os.geteuid(), os.getegid())
        [written] = stack.events("api_token_written")
        assert written["reason"] == "missing" and written["path"] == str(path)
        assert not any(token in line for line in stack.log_lines)
        assert token not in json.dumps(await stack.status())

    async def test_the_cli_sends_it_and_without_it_says_why(self, stack: Stack) -> None:
        result = await run_cli("retry", "-c", str(stack.config_path), "tg")
        assert result.code == 0 and result.stdout.startswith("tg: nothing was parked"), result
        # The same daemon, but a work_dir whose api-token this user cannot read.
        other = stack.root / "elsewhere"
        other.mkdir(exist_ok=True)
        text = stack.config_path.read_text()
        work = json.dumps(str(stack.root / "work"))
        assert f"work_dir = {work}" in text
        config = stack.root / "unauthorised.toml"
        config.write_text(text.replace(f"work_dir = {work}",
                                       f"work_dir = {json.dumps(str(other))}"))
        before = await snapshot(stack)
        result = await run_cli("place", "-c", str(config), "tg", "remote")
        assert result.code == 1, result
        assert result.stderr.startswith("monitord: API_UNAUTHORIZED: ")
        assert f"cannot read {other / 'api-token'}" in result.stderr
        assert token_of(stack) not in result.stderr + result.stdout
        assert await snapshot(stack) == before
        # Reads need no token: status works for anyone who reaches the API.
        result = await run_cli("status", "-c", str(config), "--json")
        assert result.code == 0 and json.loads(result.stdout)["services"]["tg"]


class TestAcrossRestarts:
    """The daemon keeps its token across restarts, replaces a file that may have leaked, and
    does not start when the token's group does not exist."""

    async def test_a_restart_keeps_the_token_and_a_widened_file_gets_a_new_one(
        self, tmp_path: Path
    ) -> None:
        work = tmp_path / "work"
        config = daemon_process.write_config(tmp_path)
        place = ("PUT", "/v1/services/tg/placement")
        async with daemon_process.running_daemon(tmp_path, config_path=config) as daemon:
            first, _ = api_token.read(work)
            assert first is not None
            status, _ = await daemon.request(*place, json_body={"location": "local"},
                                             authorised=False)
            assert status == 401
        async with daemon_process.running_daemon(tmp_path, config_path=config) as daemon:
            assert api_token.read(work) == (first, "")
            assert daemon.events("api_token_written") == []
            status, _ = await daemon.request(*place, json_body={"location": "local"})
            assert status == 202
        (work / api_token.FILE_NAME).chmod(0o644)
        async with daemon_process.running_daemon(tmp_path, config_path=config) as daemon:
            second, _ = api_token.read(work)
            assert second is not None and second != first
            [written] = daemon.events("api_token_written")
            assert "mode 0644" in written["reason"]
            assert not any(t in line for line in daemon.lines for t in (first, second))
            api = daemon_process.ApiClient(daemon.base_url)
            status, document = await api.request("POST", "/v1/services/tg/placement",
                                                 authorised=False)
            assert status == 401
            async with aiohttp.ClientSession() as session, session.put(
                daemon.base_url + "/v1/services/tg/placement", json={"location": "local"},
                headers={"Authorization": f"Bearer {first}"},
            ) as resp:
                assert resp.status == 401, "the old token still works"
            status, _ = await daemon.request(*place, json_body={"location": "local"})
            assert status == 202

    async def test_an_unknown_token_group_stops_the_start(self, tmp_path: Path) -> None:
        config = daemon_process.write_config(tmp_path)
        config.write_text(config.read_text().replace(
            "[http]\n", '[http]\ntoken_group = "monitord-no-such-group"\n', 1))
        daemon = await daemon_process.DaemonProcess.start(config)
        try:
            assert await daemon.wait_exit(timeout_s=30) == 1
        finally:
            await daemon.close()
        [failed] = daemon.events("daemon_start_failed")
        assert failed["error_code"] == "DAEMON_START_FAILED"
        assert "monitord-no-such-group" in failed["detail"]
        assert not (tmp_path / "work" / api_token.FILE_NAME).exists()

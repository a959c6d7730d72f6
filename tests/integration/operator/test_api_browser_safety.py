"""The HTTP API against a hostile browser and hostile bytes.

A web page the operator happens to have open must not be able to change anything (cross-site
form or `fetch` POSTs: refused by the Origin and Content-Type rules) or read anything through
DNS rebinding (refused by the Host rule); bodies that break a parser (deep nesting, a bogus
charset, bytes that are not UTF-8, too many bytes) get a 4xx in the one error shape, never a
500; and a non-loopback `http.listen` needs `http.allow_remote_api = true`.
"""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from monitord.base import config
from monitord.surface import http_api
from monitord.surface.admission import Admission
from monitord.testing.ports import free_port
from monitord.testing.stack import Stack, StackOptions
from tests.integration.operator.test_api_bad_input import snapshot
from tests.support import api_auth, daemon_process

MODULE_LOOP = pytest.mark.asyncio(loop_scope="module")
# One worker builds the module's stack once and runs every case on it (make test: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("api-browser-safety")

JSON = "application/json"
FORM = "application/x-www-form-urlencoded"
EVIL = "http://evil.example"
DEEP = b"[" * 100_000
MUTATING = [
    ("PUT", "/v1/services/tg/placement", b'{"location": "remote"}'),
    ("POST", "/v1/services/tg/retry", b""),
    ("POST", "/v1/services/tg/discard-remote-data", b"{}"),
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    """One settled installation; no case here may change anything in it."""
    async with Stack(tmp_path_factory.mktemp("browser-safety"),
                     StackOptions(services={"tg": 1})) as stack:
        await stack.wait_settled(expect={"tg": "local"}, timeout_s=60)
        await stack.wait_seen_up()  # what the snapshots compare, settled too
        yield stack
        assert stack.detector.overlaps() == []


async def send(port: int, method: str, path: str, body: bytes | None = None,
               headers: dict[str, str] | None = None, *,
               token: str | None = None) -> tuple[int, Any, str]:
    """Exactly these bytes and headers (aiohttp adds Host only when `headers` has none), and
    `Authorization: Bearer <token>` with a token: the checks after local authority are
    tested as an authorised operator meets them."""
    timeout = aiohttp.ClientTimeout(total=20)
    headers = dict(headers or {})
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    async with aiohttp.ClientSession(timeout=timeout) as session, session.request(
        method, f"http://127.0.0.1:{port}{path}",
        data=io.BytesIO(body) if body and len(body) > 65536 else body, headers=headers
    ) as resp:
        text = await resp.text()
        try:
            document: Any = json.loads(text)
        except ValueError:
            document = text
        return resp.status, document, resp.content_type


def assert_error(answer: tuple[int, Any, str], status: int, code: str = "BAD_REQUEST") -> str:
    got, document, content_type = answer
    assert (got, content_type) == (status, JSON), document
    assert set(document) == {"error"} and set(document["error"]) == {"code", "detail"}
    assert document["error"]["code"] == code and document["error"]["detail"]
    return str(document["error"]["detail"])


@MODULE_LOOP
class TestCrossSiteRequests:
    """What a page on another site can make the operator's browser send is refused."""

    @pytest.mark.parametrize(("method", "path", "_body"), MUTATING)
    async def test_a_cross_site_form_post_is_refused_and_changes_nothing(
        self, stack: Stack, method: str, path: str, _body: bytes
    ) -> None:
        before = await snapshot(stack)
        answer = await send(stack.http_port, method, path, b"location=remote",
                            {"Content-Type": FORM, "Origin": EVIL})
        assert "Origin" in assert_error(answer, 403)
        assert await snapshot(stack) == before

    @pytest.mark.parametrize(("method", "path", "body"), MUTATING)
    @pytest.mark.parametrize("content_type", [FORM, "text/plain", "multipart/form-data", None])
    async def test_a_mutating_request_without_json_content_type_is_refused(
        self, stack: Stack, method: str, path: str, body: bytes, content_type: str | None
    ) -> None:
        """Even with a valid JSON body and no Origin (an old browser, a no-cors fetch)."""
        before = await snapshot(stack)
        headers = {"Content-Type": content_type} if content_type else {}
        answer = await send(stack.http_port, method, path, body or None, headers,
                            token=stack.api_token())
        assert "Content-Type" in assert_error(answer, 400)
        assert await snapshot(stack) == before

    async def test_an_origin_of_another_port_or_scheme_is_refused(self, stack: Stack) -> None:
        port = stack.http_port
        for origin in (f"http://127.0.0.1:{port + 1}", f"https://127.0.0.1:{port}", "null",
                       f"http://127.0.0.1:{port}/", f"{EVIL}:{port}"):
            answer = await send(port, "POST", "/v1/services/tg/retry", None,
                                {"Content-Type": JSON, "Origin": origin})
            assert_error(answer, 403)

    async def test_the_status_page_origin_and_json_are_accepted(self, stack: Stack) -> None:
        port = stack.http_port
        for origin in (f"http://127.0.0.1:{port}", f"http://localhost:{port}"):
            status, document, _ = await send(port, "POST", "/v1/services/tg/retry", None,
                                             {"Content-Type": JSON, "Origin": origin},
                                             token=stack.api_token())
            assert status == 202, document
        status, document, _ = await send(
            port, "POST", "/v1/services/tg/retry", None,
            {"Content-Type": "application/json; charset=UTF-8"}, token=stack.api_token(),
        )
        assert status == 202, document


@MODULE_LOOP
class TestHostHeader:
    """DNS rebinding: a Host that does not name this API is refused before anything runs."""

    @pytest.mark.parametrize(
        ("method", "path", "body"),
        [("GET", "/v1/status", None), ("GET", "/v1/diagnostics/bundle", None),
         ("GET", "/", None), ("GET", "/livez", None), *MUTATING],
    )
    async def test_a_foreign_host_is_refused(
        self, stack: Stack, method: str, path: str, body: bytes | None
    ) -> None:
        before = await snapshot(stack)
        answer = await send(stack.http_port, method, path, body or None,
                            {"Host": f"evil.example:{stack.http_port}", "Content-Type": JSON})
        assert "Host" in assert_error(answer, 421)
        assert await snapshot(stack) == before

    async def test_a_wrong_port_or_a_garbled_host_is_refused(self, stack: Stack) -> None:
        port = stack.http_port
        for host in (f"127.0.0.1:{port + 1}", "127.0.0.1", f"localhost.:{port}",
                     f"127.0.0.1:{port}@evil.example", f"[::1:{port}", f"127.0.0.1:{port}x"):
            assert_error(await send(port, "GET", "/v1/status", None, {"Host": host}), 421)

    async def test_loopback_names_of_the_listen_port_are_accepted(self, stack: Stack) -> None:
        port = stack.http_port
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"LOCALHOST:{port}",
                     f"[::1]:{port}"):
            status, _, _ = await send(port, "GET", "/v1/status", None, {"Host": host})
            assert status == 200, host


@MODULE_LOOP
class TestHostileBodies:
    """Bodies that break a parser are a 400 in the error shape and change nothing."""

    @pytest.mark.parametrize(
        ("method", "path"),
        [("PUT", "/v1/services/tg/placement"), ("POST", "/v1/services/tg/discard-remote-data")],
    )
    @pytest.mark.parametrize(
        ("body", "content_type"),
        [
            (DEEP, JSON),
            (b'{"location": ' + b"[" * 5000 + b"]" * 5000 + b"}", JSON),
            (b'{"location": 1' + b"1" * 5000 + b"}", JSON),
            (b'{"location": "remote"}', "application/json; charset=bogus"),
            (b'{"location": "remote"}', "application/json; charset=latin-1"),
            (b'{"location": "remote"}', "application/json; charset="),
            ('{"location": "r\u00e9mote"}'.encode("latin-1"), JSON),
            (b"\xff\xfe{\x00}\x00", JSON),
            (b'\xef\xbb\xbf{"location": "remote"}', JSON),
        ],
        ids=["100000 [", "deep inside an object", "huge integer", "charset=bogus",
             "charset=latin-1", "empty charset", "latin-1 bytes", "utf-16", "utf-8 BOM"],
    )
    async def test_a_hostile_body_gets_400(
        self, stack: Stack, method: str, path: str, body: bytes, content_type: str
    ) -> None:
        before = await snapshot(stack)
        answer = await send(stack.http_port, method, path, body, {"Content-Type": content_type},
                            token=stack.api_token())
        assert_error(answer, 400)
        assert await snapshot(stack) == before

    async def test_a_body_over_the_limit_gets_413_in_the_error_shape(self, stack: Stack) -> None:
        before = await snapshot(stack)
        body = b'{"location": "' + b"x" * (http_api.MAX_BODY_BYTES + 1) + b'"}'
        answer = await send(stack.http_port, "PUT", "/v1/services/tg/placement", body,
                            {"Content-Type": JSON}, token=stack.api_token())
        assert_error(answer, 413)
        assert await snapshot(stack) == before


# -- the bare application (no engine behind it): aiohttp's own answers in the error shape ------

CONFIG = config.Config(
    services={"tg": config.ServiceSection(command=("tgd",), local_data_dir="/d/{area}",
                                          remote_data_dir="/r")}
)


class NoStore:
    async def set_desired_placement(self, **_: Any) -> None:
        raise AssertionError("nothing may be written")


@pytest_asyncio.fixture(loop_scope="module")
async def bare(tmp_path: Path) -> AsyncIterator[TestClient[web.Request, web.Application]]:
    custom = tmp_path / "custom_config.json"
    custom.write_text(json.dumps({"custom_daemons": []}))
    admission = Admission()
    admission.open_intake()
    ctx = http_api.ApiContext(config=CONFIG, admission=admission,
                              placement=http_api.StorePlacementIntake(NoStore()),
                              custom_config_path=custom, api_token=api_auth.TOKEN)
    client = TestClient(TestServer(http_api.build_app(ctx)), headers=api_auth.HEADERS)
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()


@MODULE_LOOP
class TestBareApplication:
    """Without the status routes (and their catch-all) aiohttp's 404/405 are in the shape too."""

    async def test_unknown_path_and_wrong_method_are_in_the_error_shape(
        self, bare: TestClient[web.Request, web.Application]
    ) -> None:
        missing = await bare.get("/nothing")
        assert missing.status == 404 and (await missing.json())["error"]["code"] == "NOT_FOUND"
        wrong = await bare.post("/livez", headers={"Content-Type": JSON})
        assert wrong.status == 405 and (await wrong.json())["error"]["code"] == "BAD_REQUEST"
        assert "GET" in wrong.headers["Allow"]

    async def test_the_host_rule_holds_without_the_status_routes(
        self, bare: TestClient[web.Request, web.Application]
    ) -> None:
        refused = await bare.get("/livez", headers={"Host": "evil.example"})
        assert refused.status == 421 and refused.content_type == JSON
        deep = await bare.put("/v1/services/tg/placement", data=DEEP,
                              headers={"Content-Type": JSON})
        assert deep.status == 400 and (await deep.json())["error"]["code"] == "BAD_REQUEST"


# -- [http] listen beyond loopback -------------------------------------------------------------


def http_config(tmp_path: Path, http: str) -> Path:
    path = tmp_path / "monitord.toml"
    path.write_text(f'[monitord]\nwork_dir = "{tmp_path / "w"}"\n[http]\n{http}\n')
    return path


class TestRemoteListen:
    """A non-loopback listen is a config error unless allow_remote_api says it is meant."""

    @pytest.mark.parametrize("listen", ["0.0.0.0:8224", "[::]:8224", "192.0.2.7:8224",
                                        "pbx-01.example.net:8224"])
    def test_a_non_loopback_listen_without_allow_remote_api_is_a_config_error(
        self, tmp_path: Path, listen: str
    ) -> None:
        path = http_config(tmp_path, f'listen = "{listen}"')
        with pytest.raises(config.ConfigError) as raised:
            config.load(path)
        line = str(raised.value)
        assert "http.allow_remote_api" in line and listen in line and "\n" not in line

    @pytest.mark.parametrize("listen", ["0.0.0.0:8224", "[::]:8224", "192.0.2.7:8224"])
    def test_allow_remote_api_lets_it_load(self, tmp_path: Path, listen: str) -> None:
        path = http_config(tmp_path, f'listen = "{listen}"\nallow_remote_api = true')
        loaded = config.load(path)
        assert loaded.http.listen == listen and loaded.http.allow_remote_api

    @pytest.mark.parametrize("listen", ["127.0.0.1:8224", "127.0.0.2:8224", "localhost:8224",
                                        "[::1]:8224", "::1:8224"])
    def test_loopback_listens_need_nothing(self, tmp_path: Path, listen: str) -> None:
        loaded = config.load(http_config(tmp_path, f'listen = "{listen}"'))
        assert loaded.http.listen == listen and not loaded.http.allow_remote_api

    def test_the_default_is_loopback_only(self) -> None:
        assert config.Config().http.allow_remote_api is False

    async def test_an_allowed_remote_listen_warns_at_start_and_keeps_the_host_rule(
        self, tmp_path: Path
    ) -> None:
        port = free_port()
        path = daemon_process.write_config(tmp_path, port=port)
        text = path.read_text().replace(f'listen = "127.0.0.1:{port}"',
                                        f'listen = "0.0.0.0:{port}"\nallow_remote_api = true')
        path.write_text(text)
        daemon = await daemon_process.DaemonProcess.start(path)
        try:
            await daemon.wait_ready()
            warnings = daemon.events("http_api_not_loopback")
            assert len(warnings) == 1 and warnings[0]["listen"] == f"0.0.0.0:{port}"
            assert warnings[0]["level"] == "warning"
            status, _, _ = await send(port, "GET", "/v1/status", None,
                                      {"Host": f"127.0.0.1:{port}"})
            assert status == 200
            answer = await send(port, "GET", "/v1/status", None,
                                {"Host": f"evil.example:{port}"})
            assert_error(answer, 421)
        finally:
            assert await daemon.stop() == 0

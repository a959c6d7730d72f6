"""Fuzz: HTTP requests against the real API app (monitord.surface.http_api) over a real Store.

Promise: every response is a 2xx JSON document or a 4xx in the error shape
`{"error": {"code": str, "detail": str}}` with a catalogued code (or NOT_FOUND); no 5xx for
a client's mistake (the store works and intake is open, so any 5xx fails); after every
refused request the store's desired placements and custom_config.json are unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import given
from hypothesis import strategies as st
from yarl import URL

from monitord.base.config import Config, ServiceSection
from monitord.store.state_db import Store
from monitord.surface import http_api
from monitord.surface.admission import Admission
from orchestrator.errors import ErrorCode
from tests.support import api_auth

from .profiles import demo, profile

AREA = "5b1d0000-0000-4000-8000-000000000001"
CONFIG = Config(
    services={
        "tg": ServiceSection(command=("tgd",), local_data_dir="/d/{area}", remote_data_dir="/r"),
    }
)
CODES = {code.value for code in ErrorCode} | {"NOT_FOUND"}
CUSTOM = {"custom_daemons": [{"uuid": AREA, "service": "tg"}, {"uuid": "../x", "service": 1}]}


@dataclass
class Api:
    runner: asyncio.Runner
    store: Store
    client: TestClient[web.Request, web.Application]
    custom: Path

    @property
    def port(self) -> int:
        port = self.client.server.port
        assert port is not None
        return port


async def _start(root: Path) -> tuple[Store, TestClient[web.Request, web.Application], Path]:
    root.mkdir(parents=True, exist_ok=True)
    store = await Store.open(root / "work")
    custom = root / "custom_config.json"
    custom.write_text(json.dumps(CUSTOM))
    admission = Admission()
    admission.open_intake()
    ctx = http_api.ApiContext(
        config=CONFIG,
        admission=admission,
        placement=http_api.StorePlacementIntake(store),
        custom_config_path=custom,
        api_token=api_auth.TOKEN,
    )
    client = TestClient(TestServer(http_api.build_app(ctx)), headers=api_auth.HEADERS)
    await client.start_server()
    return store, client, custom


def _serve(root: Path) -> Iterator[Api]:
    with asyncio.Runner(loop_factory=asyncio.new_event_loop) as runner:
        store, client, custom = runner.run(_start(root))
        try:
            yield Api(runner, store, client, custom)
        finally:
            runner.run(client.close())
            runner.run(store.close())


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    yield from _serve(tmp_path_factory.mktemp("api"))


# -- strategies ---------------------------------------------------------------------------------

_SAFE = "abcXYZ019-._~!$&'()*+,;=:@"
segments = st.one_of(
    st.sampled_from(["tg", AREA, "whatsapp", "no-such-area", "..", ".", "", "-x", "a" * 129]),
    st.text(alphabet=_SAFE, max_size=30),
    st.binary(max_size=20).map(lambda b: "".join(f"%{x:02X}" for x in b)),
    st.sampled_from(["%", "%zz", "%2", "%2F", "%00", "%2e%2e", "%C0%AE", "%FF%FE", "%E2%80%AE"]),
    st.integers(1000, 4000).map(lambda n: "a" * n),
)


@st.composite
def paths(draw: st.DrawFn) -> str:
    shape = draw(st.sampled_from([
        "/v1/services/{}/placement", "/v1/areas/{}/placement", "/v1/services/{}/placement",
        "/v1/areas/{}/placement", "/livez", "/readyz", "/{}", "/v1/{}/{}", "/v1/areas/{}",
        "/livez/{}", "/{}/../livez",
    ]))
    path = shape.format(*(draw(segments) for _ in range(shape.count("{}"))))
    if draw(st.integers(0, 4)) == 0:
        path += "?" + draw(st.text(alphabet=_SAFE + "%=&", max_size=30))
    return path


_HEADER_TEXT = st.text(
    alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40
)


def hosts(port: int) -> st.SearchStrategy[str | None]:
    good = [f"127.0.0.1:{port}", f"localhost:{port}", "127.0.0.1:8224", f"LocalHost:{port}"]
    return st.one_of(
        st.sampled_from(good * 3),
        st.sampled_from([
            None, "", "evil.example", "127.0.0.1", "127.0.0.1:0", "127.0.0.1:99999",
            f"[::1]:{port}", f"user@127.0.0.1:{port}", f"127.0.0.1:{port}/x", f"127.0.0.1:+{port}",
            f"127.0.0.1:{port}:1", f"[127.0.0.1:{port}", f"evil.example:{port}", " ",
            f"127.0.0.1: {port}", f"127.0.0.1:٣{port}",
        ]),
        _HEADER_TEXT,
    )


def origins(port: int) -> st.SearchStrategy[str | None]:
    return st.one_of(
        st.sampled_from([None, None, None, f"http://127.0.0.1:{port}", f"http://localhost:{port}"]),
        st.sampled_from([
            "null", "", f"https://127.0.0.1:{port}", "http://evil.example",
            f"http://127.0.0.1:{port}/", f"HTTP://localhost:{port}", "http://", "://",
        ]),
        _HEADER_TEXT,
    )


content_types = st.one_of(
    st.sampled_from([
        "application/json", "application/json", "application/json; charset=utf-8",
        "application/json; charset=UTF8", 'application/json; charset="utf-8"',
    ]),
    st.sampled_from([
        None, "application/json; charset=latin-1", "application/json; charset=",
        "application/json; charset=utf-8; charset=utf-16", "application/json; charset=bogus",
        "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
        "application/JSON", "application/json;;", "application/json; charset=\u00e9".encode(
            "latin-1").decode("latin-1"), "*/*",
    ]),
    _HEADER_TEXT,
)

json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=20)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)


def _dumps(value: Any) -> bytes:
    return json.dumps(value).encode()


def _big_body(kind: str) -> bytes:
    """Large bodies made from a name, so hypothesis never has to print them."""
    if kind == "digits":
        return b"1" * 5000
    if kind == "deep-list":
        return b"[" * 100_000 + b"]" * 100_000
    if kind == "deep-object":
        return b'{"a":' * 50_000 + b"1" + b"}" * 50_000
    return b" " * (http_api.MAX_BODY_BYTES + 1)


bodies = st.one_of(
    st.sampled_from([
        b'{"location": "remote"}', b'{"location": "local"}', b'{"location": "remote"}', None,
        b"", b'{"location": "mars"}', b'{"location": "remote", "x": 1}', b"\xff\xfe{",
        '{"location": "remote"}'.encode("utf-16"), b'{"location": "remote"',
        b'{"location": "remote", "location": "local"}', b'{"location": NaN}',
    ]),
    st.sampled_from(["digits", "deep-list", "deep-object", "over-limit"]).map(_big_body),
    json_values.map(_dumps),
    st.dictionaries(st.just("location"), json_values, max_size=1).map(_dumps),
    st.binary(max_size=200),
)
methods = st.sampled_from(
    ["GET", "PUT", "PUT", "PUT", "POST", "DELETE", "PATCH", "HEAD", "OPTIONS", "PROPFIND", "put"]
)


@dataclass(frozen=True)
class Req:
    method: str
    path: str
    host: str | None
    origin: str | None
    content_type: str | None
    body: bytes | None

    def __repr__(self) -> str:  # bodies can be 1 MiB: keep failure reports readable
        body = None if self.body is None else f"{self.body[:80]!r}... ({len(self.body)} bytes)"
        return (f"Req({self.method} {self.path[:200]!r} host={self.host!r} origin={self.origin!r}"
                f" content_type={self.content_type!r} body={body})")


@st.composite
def requests(draw: st.DrawFn, port: int) -> Req:
    if draw(st.booleans()):  # half the time a request that passes the guard: fuzz the handlers
        shape = draw(st.sampled_from(["/v1/services/{}/placement", "/v1/areas/{}/placement"]))
        name = draw(st.sampled_from(["tg", AREA, "whatsapp", "no-such-area", "x"]))
        return Req(
            method="PUT", path=shape.format(name), host=f"127.0.0.1:{port}", origin=None,
            content_type="application/json", body=draw(bodies),
        )
    return Req(
        method=draw(methods), path=draw(paths()), host=draw(hosts(port)),
        origin=draw(origins(port)), content_type=draw(content_types), body=draw(bodies),
    )


# -- the property -------------------------------------------------------------------------------

STATS = {"requests": 0, "accepted": 0, "refused": 0}


async def check_request(api: Api, req: Req) -> None:
    before_rows = await api.store.desired_placements()
    before_custom = api.custom.read_bytes()
    headers: dict[str, str] = {}
    skip: list[str] = []
    for name, value in (("Host", req.host), ("Origin", req.origin),
                        ("Content-Type", req.content_type)):
        if value is None:
            skip.append(name)
        else:
            headers[name] = value
    url = URL(f"http://127.0.0.1:{api.port}{req.path}", encoded=True)
    async with api.client.session.request(
        req.method, url, headers=headers, skip_auto_headers=skip,
        data=None if req.body is None else io.BytesIO(req.body),
        allow_redirects=False,
    ) as response:
        status = response.status
        raw = await response.read()
        content_type = response.content_type
    STATS["requests"] += 1
    assert status < 500, f"{status} for {req!r:.300}: {raw[:300]!r}"
    assert 200 <= status < 300 or 400 <= status < 500, f"{status}: {raw[:300]!r}"
    assert content_type == "application/json", (status, content_type, raw[:200])
    if req.method.upper() != "HEAD":
        document = json.loads(raw)
        if status >= 400:
            assert isinstance(document, dict) and set(document) == {"error"}, document
            error = document["error"]
            assert isinstance(error, dict) and set(error) == {"code", "detail"}, error
            assert isinstance(error["code"], str) and isinstance(error["detail"], str)
            assert error["code"] in CODES, error
    assert api.custom.read_bytes() == before_custom, "custom_config.json changed"
    if status >= 300:
        STATS["refused"] += 1
        assert await api.store.desired_placements() == before_rows, f"{status} changed the store"
    else:
        STATS["accepted"] += 1


def test_every_request_gets_a_shaped_answer_and_refusals_change_nothing(api: Api) -> None:
    @profile("api")
    @given(req=requests(api.port))
    def fuzz(req: Req) -> None:
        api.runner.run(check_request(api, req))

    fuzz()
    print(f"api fuzz: {STATS}")
    assert STATS["accepted"] > 0 and STATS["refused"] > 0  # both sides were exercised


# -- the property can fail ----------------------------------------------------------------------


async def _naive_read_json(request: web.Request) -> Any:
    """Broken on purpose: lets a non-UTF-8 or too-deep body escape as a 500."""
    return json.loads(await request.read())


def test_the_property_catches_a_500(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(http_api, "read_json", _naive_read_json)
    with contextlib.contextmanager(_serve)(tmp_path) as api:
        @demo(300)
        @given(req=requests(api.port))
        def search(req: Req) -> None:
            api.runner.run(check_request(api, req))

        with pytest.raises(AssertionError, match="^500"):
            search()


def test_the_property_catches_a_refused_request_that_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = http_api._read_location

    async def write_then_validate(request: web.Request) -> str:
        store = request.app[http_api.CONTEXT].placement
        await store.record_placement(service="tg", area=None, location="remote")
        return await original(request)

    monkeypatch.setattr(http_api, "_read_location", write_then_validate)
    with contextlib.contextmanager(_serve)(tmp_path) as api:
        @demo(300)
        @given(req=requests(api.port))
        def search(req: Req) -> None:
            api.runner.run(check_request(api, req))

        with pytest.raises(AssertionError, match="changed the store"):
            search()

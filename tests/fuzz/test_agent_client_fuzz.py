"""Fuzz: a malicious agent double behind monitord.remote.agent_client.AgentClient.

Promise: every method returns a well-typed value or raises a MonitordError (never another
exception, never hangs past its timeout, whatever number an answer holds); a body over the
size limit is refused.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from hypothesis import given
from hypothesis import strategies as st

from monitord.remote import agent_client
from monitord.remote.agent_client import AgentClient, AreaHealth, RenewResult, tcp_channel
from orchestrator.errors import ErrorCode, MonitordError
from orchestrator.models import RemoteInventory

from .profiles import demo, profile

TIMEOUT_S = 2.0
VALID = {
    "inventory": {"entries": [{"area": "a1", "service": "tg", "generation": 3, "owner_id": "o",
                               "lease_expires_at": 1.0, "created_at": 2.0}],
                  "processes": [{"area": "a1", "generation": 3, "pid": 42, "started_at": 5.0}]},
    "create": {"result": "created", "entry": {"area": "a1"}},
    "stop": {"result": "stopped"},
    "delete": {"result": "deleted"},
    "renew": {"areas": {"a1": {"result": "renewed", "generation": 3}}},
    "livez": {"status": "alive"},
    "health": {"area": "a1", "generation": 3, "running": True, "pid": 42, "uptime_s": 0.6,
               "healthy": True},
    "routes": {"routes": ["GET /livez", "POST /v1/areas/{area}/promote"]},
}
METHODS = list(VALID) + ["inventory_raw"]
# The limits as shipped, fixed here: the demo below switches the client's off.
LIMITS = (agent_client.MAX_INVENTORY_BYTES, agent_client.MAX_RESPONSE_BYTES)


@dataclass
class Plan:
    status: int
    content_type: str | None
    body: str  # a kind; the bytes are made in the double (never printed by hypothesis)
    payload: Any = None


@dataclass
class Double:
    runner: asyncio.Runner
    server: TestServer
    client: AgentClient
    plan: Plan | None = None


def _body(plan: Plan, method: str) -> bytes:
    if plan.body == "valid":
        return json.dumps(VALID[method.removesuffix("_raw")]).encode()
    if plan.body == "json":
        return json.dumps(plan.payload).encode()
    if plan.body == "bytes":
        ok = isinstance(plan.payload, list) and all(
            type(x) is int and 0 <= x < 256 for x in plan.payload)
        return bytes(plan.payload) if ok else b"\xff\xfe{"
    if plan.body == "deep":
        return b"[" * 100_000 + b"]" * 100_000
    if plan.body == "huge":  # valid JSON padded over the limit: only the limit refuses it
        limit = LIMITS[0] if method.startswith("inventory") else LIMITS[1]
        return json.dumps(VALID[method.removesuffix("_raw")]).encode() + b" " * limit
    return b""


def _serve() -> Iterator[Double]:
    holder: dict[str, Double] = {}

    async def handler(request: web.Request) -> web.StreamResponse:
        double = holder["d"]
        assert double.plan is not None
        plan = double.plan
        body = _body(plan, holder["method"])
        if plan.status in (204, 304):
            body = b""
        headers = {} if plan.content_type is None else {"Content-Type": plan.content_type}
        return web.Response(status=plan.status, body=body, headers=headers)

    async def start() -> Double:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handler)
        server = TestServer(app)
        await server.start_server()
        client = AgentClient(
            channel=tcp_channel(str(server.host), int(server.port or 0)),
            secret=b"s3cret", timeout_s=TIMEOUT_S,
        )
        return Double(runner=runner, server=server, client=client)

    with asyncio.Runner(loop_factory=asyncio.new_event_loop) as runner:
        holder["d"] = double = runner.run(start())
        holder["method"] = ""
        double.holder = holder  # type: ignore[attr-defined]
        try:
            yield double
        finally:
            runner.run(double.client.close())
            runner.run(double.server.close())


@pytest.fixture(scope="module")
def double() -> Iterator[Double]:
    yield from _serve()


# Integers no float holds (float() raises OverflowError) and floats no clock reads.
odd_numbers = st.one_of(
    st.integers(min_value=2**1024, max_value=10**400),
    st.integers(min_value=-(10**400), max_value=-(2**1024)),
    st.floats(min_value=1e300, allow_infinity=False), st.sampled_from([2**63, -(2**63) - 1]),
)
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), odd_numbers, st.floats(),
              st.text(max_size=10)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=10,
)


@st.composite
def mutated_valid(draw: st.DrawFn) -> Any:
    """A valid document of some method with one value replaced by anything."""
    document = json.loads(json.dumps(VALID[draw(st.sampled_from(list(VALID)))]))
    node = document
    while isinstance(node, dict | list) and node and draw(st.booleans()):
        key = draw(st.sampled_from(list(node) if isinstance(node, dict) else range(len(node))))
        if not isinstance(node[key], dict | list) or draw(st.booleans()):
            node[key] = draw(json_values)
            break
        node = node[key]
    return document


@st.composite
def odd_numbered_valid(draw: st.DrawFn, method: str | None = None) -> Any:
    """A valid document of `method` (else of some method) with one of its numbers replaced
    by an odd one."""
    name = draw(st.sampled_from(list(VALID))) if method is None else method
    document = json.loads(json.dumps(VALID[name.removesuffix("_raw")]))
    leaves: list[tuple[Any, Any]] = []
    stack = [document]
    while stack:
        node = stack.pop()
        for key in list(node) if isinstance(node, dict) else range(len(node)):
            if isinstance(node[key], dict | list):
                stack.append(node[key])
            elif type(node[key]) in (int, float):
                leaves.append((node, key))
    if leaves:
        node, key = draw(st.sampled_from(leaves))
        node[key] = draw(odd_numbers)
    return document


plans = st.builds(
    Plan,
    status=st.one_of(st.sampled_from([200, 200, 201, 204, 299, 301, 302, 304, 400, 401, 404, 409,
                                      418, 422, 500, 502, 503]), st.integers(200, 599)),
    content_type=st.sampled_from([None, "application/json", "text/html",
                                  "application/json; charset=latin-1",
                                  "application/json; charset=bogus"]),
    body=st.sampled_from(["valid", "valid", "json", "json", "bytes", "deep", "huge", "empty"]),
    payload=st.one_of(json_values, mutated_valid(), odd_numbered_valid(),
                      st.fixed_dictionaries({"error": json_values}),
                      st.fixed_dictionaries({"error": st.fixed_dictionaries(
                          {"code": st.one_of(st.sampled_from([c.value for c in ErrorCode]),
                                             json_values),
                           "detail": json_values})}),
                      st.binary(max_size=50).map(list)),
)

STATS = {"calls": 0, "returned": 0, "raised": 0}


async def call(client: AgentClient, method: str) -> Any:
    if method == "inventory":
        return await client.inventory()
    if method == "inventory_raw":
        return await client.inventory_raw()
    if method == "create":
        return await client.create(area="a1", service="tg", generation=3, owner_id="o",
                                   lease_ttl_s=30, command=("tgd",), data_dir="/r", env={})
    if method == "stop":
        return await client.stop(area="a1", generation=3)
    if method == "delete":
        return await client.delete(area="a1", generation=3)
    if method == "renew":
        return await client.renew(owner_id="o", ttl_s=30, areas={"a1": 3})
    if method == "health":
        return await client.health(area="a1", generation=3, min_uptime_s=0.5, wait_s=0.1)
    if method == "routes":
        client.forget_routes()  # (kept between calls: each example asks this answer)
        return await client.routes()
    return await client.livez()


def _says_no_such_route(plan: Plan) -> bool:
    """An error answer whose code says the path is not served: the routes question's 'none'
    (an agent older than that route)."""
    error = plan.payload.get("error") if isinstance(plan.payload, dict) else None
    return (plan.body == "json" and 400 <= plan.status < 500 and plan.status not in (401, 409)
            and isinstance(error, dict)
            and error.get("code") in ("AGENT_ROUTE_MISSING", "UNKNOWN_AREA"))


def _well_typed(method: str, value: Any) -> bool:
    if method == "inventory":
        return isinstance(value, RemoteInventory)
    if method in ("inventory_raw", "create"):
        return isinstance(value, dict)
    if method in ("stop", "delete"):
        return isinstance(value, str)
    if method == "health":
        return isinstance(value, AreaHealth) and isinstance(value.healthy, bool) and (
            value.uptime_s is None or isinstance(value.uptime_s, float)) and (
            not value.healthy or (value.uptime_s is not None and value.uptime_s >= 0.499))
    if method == "routes":
        return isinstance(value, frozenset) and all(isinstance(r, str) for r in value)
    if method == "renew":
        return isinstance(value, dict) and all(
            isinstance(k, str) and isinstance(v, RenewResult) and isinstance(v.result, str)
            and (v.generation is None or type(v.generation) is int) for k, v in value.items())
    return isinstance(value, bool)


async def check_call(double: Double, method: str, plan: Plan) -> None:
    double.plan = plan
    double.holder["method"] = method  # type: ignore[attr-defined]
    STATS["calls"] += 1
    try:
        value = await asyncio.wait_for(call(double.client, method), timeout=TIMEOUT_S + 3)
    except MonitordError as e:
        STATS["raised"] += 1
        if plan.body == "huge":
            assert e.code == ErrorCode.AGENT_UNREACHABLE
        assert not (plan.body == "valid" and 200 <= plan.status < 300 and plan.status != 204), (
            f"a valid answer was refused: {e}")
        return
    STATS["returned"] += 1
    assert _well_typed(method, value), (method, value)
    if method == "livez":
        assert value is (200 <= plan.status < 300 and plan.body != "huge"), (plan, value)
        return
    if method == "routes" and _says_no_such_route(plan):
        assert value == frozenset(), (plan, value)
        return
    assert plan.body != "huge", f"{method}: an answer over the limit was accepted"
    assert 200 <= plan.status < 300, f"{method}: HTTP {plan.status} accepted"


@given(method=st.sampled_from(METHODS), plan=plans)
def _property(double: Double, method: str, plan: Plan) -> None:
    double.runner.run(check_call(double, method, plan))


def test_every_method_returns_a_typed_value_or_a_monitord_error(double: Double) -> None:
    @profile("agent")
    @given(method=st.sampled_from(METHODS), plan=plans)
    def fuzz(method: str, plan: Plan) -> None:
        double.runner.run(check_call(double, method, plan))

    fuzz()
    print(f"agent fuzz: {STATS}")


def test_an_answer_with_a_number_out_of_range_is_typed_or_a_monitord_error(
    double: Double,
) -> None:
    """The method's own answer, 200, with one number no float holds or no clock reads."""

    @profile("agent")
    @given(data=st.data(), method=st.sampled_from(METHODS))
    def fuzz(data: st.DataObject, method: str) -> None:
        payload = data.draw(odd_numbered_valid(method))
        plan = Plan(status=200, content_type="application/json", body="json", payload=payload)
        double.runner.run(check_call(double, method, plan))

    fuzz()


@pytest.mark.parametrize("broken", ["no size limit", "no shape checks"])
def test_the_property_catches_a_broken_client(
    double: Double, monkeypatch: pytest.MonkeyPatch, broken: str
) -> None:
    if broken == "no size limit":
        monkeypatch.setattr(agent_client, "MAX_INVENTORY_BYTES", 1 << 40)
        monkeypatch.setattr(agent_client, "MAX_RESPONSE_BYTES", 1 << 40)
    else:
        monkeypatch.setattr(agent_client, "check_inventory", lambda raw, *, where: None)
        monkeypatch.setattr(agent_client, "_result_of",
                            lambda payload, *, where: str(payload.get("result", "")))

    @demo()
    @given(method=st.sampled_from(METHODS), plan=plans)
    def search(method: str, plan: Plan) -> None:
        double.runner.run(check_call(double, method, plan))

    with pytest.raises((AssertionError, AttributeError, KeyError, TypeError, ValueError)):
        search()

"""What the agent says it serves decides, once, how a copy reaches the VPS: an agent that
lists the copy routes is used for them; an older one — whose answer to the question is a
404, with or without the AGENT_ROUTE_MISSING code — is not, and is never tried."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from monitord.remote.agent_client import AgentClient, tcp_channel
from monitord.remote.copy import AreaCopy, vps_tree
from orchestrator.errors import ErrorCode, MonitordError


class _Agent:
    """An agent double: `answer` is (status, JSON document) for every request."""

    def __init__(self) -> None:
        self.answer: tuple[int, Any] = (200, {"routes": []})
        self.paths: list[str] = []

    async def handle(self, request: web.Request) -> web.Response:
        self.paths.append(f"{request.method} {request.path}")
        status, document = self.answer
        return web.Response(status=status, body=json.dumps(document).encode(),
                            content_type="application/json")


@pytest.fixture
async def double() -> AsyncIterator[tuple[_Agent, AgentClient]]:
    agent = _Agent()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", agent.handle)
    server = TestServer(app)
    await server.start_server()
    try:
        yield agent, AgentClient(channel=tcp_channel(str(server.host), int(server.port or 0)),
                                 secret=b"s3cret", timeout_s=2.0)
    finally:
        await server.close()


def _missing(code: str) -> tuple[int, Any]:
    return 404, {"error": {"code": code, "detail": "no route /v1/routes"}}


class TestWhatTheAgentServes:
    async def test_an_agent_listing_the_copy_routes_serves_copies(
        self, double: tuple[_Agent, AgentClient]
    ) -> None:
        agent, client = double
        agent.answer = (200, {"routes": ["GET /livez", *sorted(vps_tree.COPY_ROUTES)]})
        assert await AreaCopy(client, "a1", "/opt/offload/data/a1").serves_copies()
        assert agent.paths == ["GET /v1/routes"]

    async def test_an_agent_lacking_one_copy_route_does_not(
        self, double: tuple[_Agent, AgentClient]
    ) -> None:
        agent, client = double
        agent.answer = (200, {"routes": sorted(vps_tree.COPY_ROUTES)[1:]})
        assert not await AreaCopy(client, "a1", "/d").serves_copies()

    @pytest.mark.parametrize("code", ["UNKNOWN_AREA", "AGENT_ROUTE_MISSING"])
    async def test_an_agent_older_than_the_question_serves_none(
        self, double: tuple[_Agent, AgentClient], code: str
    ) -> None:
        agent, client = double
        agent.answer = _missing(code)
        assert await client.routes() == frozenset()
        assert not await AreaCopy(client, "a1", "/d").serves_copies()

    @pytest.mark.parametrize("answer", [
        (200, {"routes": "POST /v1/areas/{area}/promote"}),
        (200, {"routes": [1, 2]}),
        (200, ["GET /livez"]),
        (503, {"error": {"code": "AGENT_UNREACHABLE", "detail": "busy"}}),
    ])
    async def test_any_other_answer_fails_the_question(
        self, double: tuple[_Agent, AgentClient], answer: tuple[int, Any]
    ) -> None:
        agent, client = double
        agent.answer = answer
        with pytest.raises(MonitordError) as err:
            await client.routes()
        assert err.value.code == ErrorCode.AGENT_UNREACHABLE

    async def test_a_route_missing_is_its_own_code(
        self, double: tuple[_Agent, AgentClient]
    ) -> None:
        agent, client = double
        agent.answer = 404, {"error": {"code": "AGENT_ROUTE_MISSING", "detail": "no route"}}
        with pytest.raises(MonitordError) as err:
            await client.promote(area="a1", data_dir="/d", expect="0" * 64)
        assert err.value.code == ErrorCode.AGENT_ROUTE_MISSING


class TestAskedOnce:
    """The answer is kept: a copy after the stop never waits for the question. It is asked
    again after `forget_routes` (a new connection, a new agent launched) and after any
    route is answered missing (an older agent took the place of the one that answered)."""

    async def test_the_routes_are_asked_once_until_forgotten(
        self, double: tuple[_Agent, AgentClient]
    ) -> None:
        agent, client = double
        agent.answer = (200, {"routes": sorted(vps_tree.COPY_ROUTES)})
        for _ in range(3):
            assert await AreaCopy(client, "a1", "/d").serves_copies()
        assert agent.paths == ["GET /v1/routes"]
        client.forget_routes()
        agent.answer = (200, {"routes": []})
        assert not await AreaCopy(client, "a1", "/d").serves_copies()
        assert agent.paths == ["GET /v1/routes"] * 2

    async def test_a_route_answered_missing_forgets_them(
        self, double: tuple[_Agent, AgentClient]
    ) -> None:
        agent, client = double
        agent.answer = (200, {"routes": sorted(vps_tree.COPY_ROUTES)})
        assert await AreaCopy(client, "a1", "/d").serves_copies()
        agent.answer = 404, {"error": {"code": "AGENT_ROUTE_MISSING", "detail": "no route"}}
        with pytest.raises(MonitordError):
            await client.promote(area="a1", data_dir="/d", expect="0" * 64)
        assert not await AreaCopy(client, "a1", "/d").serves_copies()
        assert agent.paths.count("GET /v1/routes") == 2

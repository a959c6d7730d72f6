"""`GET /v1/status` is served from a pre-serialised document rebuilt only when what it shows
changed (monitord/surface/status_api.py, `StatusDocument`): a change is in the very next
answer after it, and while nothing changes every answer is the same bytes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp

import monitord
from monitord.testing.stack import Stack
from tests.support.stacks import StackFactory

# Nothing periodic that the document shows: no reconcile or cleanup pass, no lease renewal.
QUIET = {"reconcile_interval_s": 600.0, "cleanup_interval_s": 600.0,
         "tunnel_lease_ttl_s": 600.0}


@asynccontextmanager
async def status_reader(stack: Stack) -> AsyncIterator[aiohttp.ClientSession]:
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        yield session


async def raw_status(session: aiohttp.ClientSession, stack: Stack) -> bytes:
    async with session.get(f"http://127.0.0.1:{stack.http_port}/v1/status") as resp:
        assert resp.status == 200
        assert resp.content_type == "application/json"
        return await resp.read()


class TestNoStaleDocument:
    """A state change is visible in the very next request after it."""

    async def test_a_placement_is_in_the_next_answer(self, stack_factory: StackFactory) -> None:
        stack = await stack_factory(services={"tg": 2}, **QUIET)
        await stack.wait_settled(expect={"tg": "local"})
        async with status_reader(stack) as session:
            # served from the cache: equal bytes (its `at` too) while nothing changed — a
            # daemon's start or a reconcile pass in between is a change, so look again
            before, again = b"", await raw_status(session, stack)
            for _ in range(5):
                before, again = again, await raw_status(session, stack)
                if again == before:
                    break
            assert again == before
            ids = await stack.place("tg", "remote")
            after = json.loads(await raw_status(session, stack))
        assert after["services"]["tg"]["desired"] == "remote"
        assert set(ids) <= {t["transaction_id"] for t in after["transactions"]}
        assert after["at"] > json.loads(before)["at"]

    async def test_a_corrupt_custom_config_is_in_the_next_answer(
        self, stack_factory: StackFactory
    ) -> None:
        # `config_error` changes without a placement notification: the cache must see it too.
        stack = await stack_factory(services={"tg": 1}, **QUIET)
        await stack.wait_settled(expect={"tg": "local"})
        path = stack.root / "spool" / "custom_config.json"
        good = path.read_bytes()
        async with status_reader(stack) as session:
            assert json.loads(await raw_status(session, stack))["config_error"] is None
            path.write_bytes(b'{"custom_daemons": [')
            code, body = await stack.request(
                "PUT", "/v1/services/tg/placement", {"location": "remote"}
            )
            assert (code, body["error"]["code"]) == (409, "CONFIG_CORRUPT")
            error = json.loads(await raw_status(session, stack))["config_error"]
            assert error["code"] == "CONFIG_CORRUPT"

            path.write_bytes(good)
            await stack.place("tg", "local")  # re-reads the file: usable again
            assert json.loads(await raw_status(session, stack))["config_error"] is None


class TestIdenticalBytes:
    """While nothing changes, concurrent requests get the very same bytes."""

    async def test_concurrent_requests_get_identical_bytes(
        self, stack_factory: StackFactory
    ) -> None:
        stack = await stack_factory(services={"tg": 2, "chats": 1}, **QUIET)
        await stack.wait_settled(expect={"tg": "local", "chats": "local"})
        async with status_reader(stack) as session:
            for _ in range(10):
                # A first reconcile or cleanup pass may still land after settling: a burst
                # counts only when the same document is read just before and just after it.
                before = await raw_status(session, stack)
                bodies = await asyncio.gather(
                    *(raw_status(session, stack) for _ in range(32))
                )
                if await raw_status(session, stack) == before:
                    break
            else:
                raise AssertionError("the status kept changing on a quiet installation")
        assert set(bodies) == {before}
        document = json.loads(before)
        assert document["version"] == monitord.__version__
        assert set(document["services"]) == {"tg", "chats"}

"""Bad input on every endpoint of the HTTP API: a 4xx in the one error shape with a
stable code, and no state change anywhere (status, transactions, the store's desired placement,
custom_config.json, remote_state.json)."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from monitord.testing.stack import Stack, StackOptions

# One worker builds the module's stack once and runs every case on it (make test: --dist loadgroup).
pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.xdist_group("api-bad-input")]

VALID = b'{"location": "remote"}'

# The snapshots compare the areas' processes too: a lease that lapses because the machine is
# too busy to renew it within the test stack's 3 s restarts a remote daemon, which no request
# did. The stack's leases are therefore the default's 30 s.
QUIET_LEASE_TTL_S = 30.0


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    """One settled installation shared by the cases: none of them may change anything."""
    async with Stack(tmp_path_factory.mktemp("bad-input"),
                     StackOptions(services={"tg": 2, "chats": 1},
                                  area_lease_ttl_s=QUIET_LEASE_TTL_S)) as stack:
        await stack.place("chats", "remote")
        await stack.wait_settled(expect={"tg": "local", "chats": "remote"}, timeout_s=60)
        await stack.wait_seen_up()  # what the snapshots compare, settled too
        yield stack
        assert stack.detector.overlaps() == []


async def raw(stack: Stack, method: str, path: str, body: bytes | None,
              ) -> tuple[int, dict[str, Any], str]:
    """Send exactly these bytes (no client-side JSON encoding); status, document, content type.

    Changes (PUT, POST) always say Content-Type: application/json, as the API requires, and
    every request carries the API token, so that these cases test the body and the path
    (test_api_browser_safety.py tests the header, test_api_authority.py the token)."""
    url = f"http://127.0.0.1:{stack.http_port}{path}"
    timeout = aiohttp.ClientTimeout(total=10)
    json_header = body or method in ("PUT", "POST")
    headers = {"Content-Type": "application/json"} if json_header else {}
    headers["Authorization"] = f"Bearer {stack.api_token()}"
    async with aiohttp.ClientSession(timeout=timeout) as session, session.request(
        method, url, data=body, headers=headers
    ) as resp:
        text = await resp.text()
        return resp.status, json.loads(text), resp.content_type


async def snapshot(stack: Stack) -> dict[str, Any]:
    """Everything a request could have changed, minus clocks."""
    status = await stack.status()
    code, transactions = await stack.request("GET", "/v1/transactions")
    assert code == 200
    work = stack.root / "work" / "state.db"
    with sqlite3.connect(f"file:{work}?mode=ro", uri=True) as db:
        desired = db.execute(
            "SELECT service, area, location, updated_at FROM desired_placement"
            " ORDER BY service, area"
        ).fetchall()
    spool = stack.root / "spool"
    for service in status["services"].values():
        for area in service["areas"]:  # clocks: when the agent was asked, its answer's uptime
            area["process"].pop("as_of", None)
            area["process"].pop("started_at", None)
    return {
        "services": status["services"],
        "counts": status["counts"],
        "active": status["transactions"],
        "cleanup": status["cleanup"],
        "transactions": transactions,
        "desired_placement": desired,
        "custom_config.json": (spool / "custom_config.json").read_bytes(),
        "remote_state.json": (spool / "remote_state.json").read_bytes(),
    }


@dataclass(frozen=True)
class Case:
    method: str
    path: str
    body: bytes | None
    status: int
    code: str

    def __str__(self) -> str:
        return f"{self.method} {self.path} {self.body!r} -> {self.status} {self.code}"


AREA = "{tg_area}"  # replaced by a real tg area of the stack
# A well-formed area id no stack has (a constant: parallel workers must collect the same ids).
NO_SUCH_AREA = "0badc0de-0000-4000-8000-000000000000"
PLACEMENT_BODIES = [
    (b"{not json", "malformed"),
    (b"", "empty"),
    (b"\xff\xfe\x00", "not utf-8"),
    (b'["remote"]', "array"),
    (b'"remote"', "string"),
    (b"null", "null"),
    (b'{"location": "remote", "force": true}', "unknown field"),
    (b'{"where": "remote"}', "only an unknown field"),
    (b'{"location": "elsewhere"}', "wrong location"),
    (b'{"location": "REMOTE"}', "wrong case"),
    (b'{"location": 1}', "location not a string"),
    (b"{}", "location missing"),
]
CASES = [
    *(Case("PUT", "/v1/services/tg/placement", body, 400, "BAD_REQUEST")
      for body, _ in PLACEMENT_BODIES),
    *(Case("PUT", f"/v1/areas/{AREA}/placement", body, 400, "BAD_REQUEST")
      for body, _ in PLACEMENT_BODIES),
    Case("PUT", "/v1/services/nope/placement", VALID, 404, "UNKNOWN_SERVICE"),
    Case("PUT", f"/v1/areas/{NO_SUCH_AREA}/placement", VALID, 404, "UNKNOWN_AREA"),
    Case("PUT", "/v1/areas/not-a-uuid/placement", VALID, 404, "UNKNOWN_AREA"),
    Case("POST", "/v1/services/nope/retry", None, 404, "UNKNOWN_SERVICE"),
    # Path parameters that are not names (orchestrator.names) never reach a handler.
    *(Case("PUT", f"/v1/areas/{bad}/placement", VALID, 400, "BAD_REQUEST")
      for bad in ("%205b1d", "a%00b", "a" * 300, "-rf", "victim%23", "a%0A",
                  "..%2Fchats%2Fx")),
    # ... and those no route can match ("{", "}") end at the catch-all.
    Case("PUT", "/v1/areas/%7B5b1d%7D/placement", VALID, 404, "NOT_FOUND"),
    *(Case("POST", f"/v1/services/{bad}/retry", None, 400, "BAD_REQUEST")
      for bad in ("t%20g", ".hidden", "tg%0A")),
    *(Case("GET", f"/v1/{what}?limit={limit}", None, 400, "BAD_REQUEST")
      for what in ("transactions", "cleanup")
      for limit in ("abc", "0", "-1", "100001", "", "1.5", "1e3", "%C2%B2", "9" * 5000)),
    Case("GET", "/v1/nothing-here", None, 404, "NOT_FOUND"),
    Case("DELETE", "/v1/services/tg/placement", None, 405, "BAD_REQUEST"),
    Case("POST", "/v1/status", VALID, 405, "BAD_REQUEST"),
    Case("PUT", "/v1/services/tg", VALID, 404, "NOT_FOUND"),
]


class TestBadInput:
    """Every bad request gets a 4xx JSON error with a stable code and changes nothing."""

    @pytest.mark.parametrize("case", CASES, ids=str)
    async def test_bad_request_is_refused_with_a_stable_code_and_changes_nothing(
        self, stack: Stack, case: Case
    ) -> None:
        path = case.path.replace(AREA, stack.areas["tg"][0])
        before = await snapshot(stack)
        status, document, content_type = await raw(stack, case.method, path, case.body)
        assert (status, content_type) == (case.status, "application/json"), document
        assert set(document) == {"error"} and set(document["error"]) == {"code", "detail"}
        assert document["error"]["code"] == case.code
        assert document["error"]["detail"]
        assert await snapshot(stack) == before


class TestGoodInputChangesState:
    """The snapshot sees a change when there is one (so the cases above could fail)."""

    async def test_a_valid_placement_changes_the_snapshot(self, stack: Stack) -> None:
        before = await snapshot(stack)
        status, document, _ = await raw(stack, "PUT", "/v1/services/chats/placement",
                                        b'{"location": "local"}')
        assert status == 202, document
        assert await snapshot(stack) != before
        await stack.wait_settled(expect={"tg": "local", "chats": "local"}, timeout_s=60)

"""Admission to the HTTP API: one decision point, 202 after the write.

Ordering between an admitted request and stop-intake cannot be forced from outside, so the
drain tests use a test double of the placement store *interface* whose write waits on an
asyncio.Event; every other test writes to the real SQLite store.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from monitord.base.config import Config, ServiceSection
from monitord.store.state_db import Store, StoreError
from monitord.surface import http_api
from monitord.surface.admission import Admission, IntakeState
from tests.support import api_auth

AREA = "5b1d0000-0000-4000-8000-000000000001"
CONFIG = Config(
    services={
        "tg": ServiceSection(command=("tgd",), local_data_dir="/d/{area}", remote_data_dir="/r"),
    }
)


class GatedStore:
    """Store double: each write signals `entered`, then waits for `release` before finishing."""

    def __init__(self, *, fail: bool = False) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.fail = fail
        self.rows: list[dict[str, Any]] = []

    async def set_desired_placement(
        self, *, service: str, area: str | None, location: str, now: float
    ) -> None:
        self.entered.set()
        await asyncio.wait_for(self.release.wait(), timeout=10)
        if self.fail:
            raise StoreError("disk full")
        self.rows.append({"service": service, "area": area, "location": location})


async def api_client(
    tmp_path: Path, store: Any, admission: Admission
) -> TestClient[web.Request, web.Application]:
    custom = tmp_path / "custom_config.json"
    if not custom.exists():
        custom.write_text(json.dumps({"custom_daemons": [{"uuid": AREA, "service": "tg"}]}))
    ctx = http_api.ApiContext(
        config=CONFIG,
        admission=admission,
        placement=http_api.StorePlacementIntake(store),
        custom_config_path=custom,
        api_token=api_auth.TOKEN,
    )
    client = TestClient(TestServer(http_api.build_app(ctx)), headers=api_auth.HEADERS)
    await client.start_server()
    return client


@pytest.fixture
async def real_store(tmp_path: Path) -> AsyncIterator[Store]:
    store = await Store.open(tmp_path / "work")
    try:
        yield store
    finally:
        await store.close()


@pytest.fixture
def admission() -> Admission:
    gate = Admission()
    gate.open_intake()
    return gate


@pytest.fixture
async def client(
    tmp_path: Path, real_store: Store, admission: Admission
) -> AsyncIterator[TestClient[web.Request, web.Application]]:
    test_client = await api_client(tmp_path, real_store, admission)
    try:
        yield test_client
    finally:
        await test_client.close()


async def error_code(response: Any) -> str:
    return str((await response.json())["error"]["code"])


class TestAdmissionPoint:
    """The admission point admits only while accepting and counts admitted work until it ends."""

    def test_nothing_is_admitted_before_start_up_completes(self) -> None:
        gate = Admission()
        assert gate.state is IntakeState.STARTING and gate.enter() is None

    def test_after_stop_intake_nothing_is_admitted_and_it_never_reopens(self) -> None:
        gate = Admission()
        gate.open_intake()
        gate.stop_intake()
        gate.open_intake()
        assert gate.enter() is None and not gate.accepting

    def test_admitted_work_is_counted_until_its_ticket_closes(self) -> None:
        gate = Admission()
        gate.open_intake()
        with gate.enter() as ticket:  # type: ignore[union-attr]
            assert gate.active == 1
            gate.stop_intake()
            assert gate.active == 1
        assert ticket is not None and gate.active == 0

    async def test_wait_drained_returns_when_the_last_admitted_work_ends(self) -> None:
        gate = Admission()
        gate.open_intake()
        ticket = gate.enter()
        gate.stop_intake()
        assert not await gate.wait_drained(grace_s=0.01)
        waiter = asyncio.create_task(gate.wait_drained(grace_s=5))
        await asyncio.sleep(0)
        assert ticket is not None
        ticket.close()
        assert await waiter


class TestReadiness:
    """/readyz is 503 while starting and once draining; /livez does not follow readiness."""

    async def test_readyz_follows_the_admission_state(
        self, tmp_path: Path, real_store: Store
    ) -> None:
        gate = Admission()
        client = await api_client(tmp_path, real_store, gate)
        try:
            assert (await client.get("/readyz")).status == 503
            gate.open_intake()
            assert (await client.get("/readyz")).status == 200
            gate.stop_intake()
            ready = await client.get("/readyz")
            assert ready.status == 503 and (await ready.json())["status"] == "draining"
            assert (await client.get("/livez")).status == 200
        finally:
            await client.close()


class TestRefusedRequestsChangeNothing:
    """A request refused by admission or by validation leaves the store untouched."""

    async def test_put_after_stop_intake_gets_503_and_writes_nothing(
        self, client: TestClient[web.Request, web.Application], admission: Admission,
        real_store: Store,
    ) -> None:
        admission.stop_intake()
        response = await client.put("/v1/services/tg/placement", json={"location": "remote"})
        assert response.status == 503 and await error_code(response) == "DRAINING"
        area = await client.put(f"/v1/areas/{AREA}/placement", json={"location": "remote"})
        assert area.status == 503
        assert await real_store.desired_placements() == []

    async def test_put_before_start_up_completes_gets_503(
        self, tmp_path: Path, real_store: Store
    ) -> None:
        client = await api_client(tmp_path, real_store, Admission())
        try:
            response = await client.put("/v1/services/tg/placement", json={"location": "remote"})
            assert response.status == 503
        finally:
            await client.close()
        assert await real_store.desired_placements() == []

    @pytest.mark.parametrize(
        "body",
        [
            b"{not json",
            b'"remote"',
            b'{"location": "mars"}',
            b"{}",
            b'{"location": "remote", "x": 1}',
        ],
    )
    async def test_bad_body_gets_400_and_writes_nothing(
        self, client: TestClient[web.Request, web.Application], real_store: Store, body: bytes
    ) -> None:
        for path in ("/v1/services/tg/placement", f"/v1/areas/{AREA}/placement"):
            response = await client.put(path, data=body)
            assert response.status == 400 and await error_code(response) == "BAD_REQUEST"
        assert await real_store.desired_placements() == []

    async def test_unknown_service_and_unknown_area_get_404(
        self, client: TestClient[web.Request, web.Application], real_store: Store
    ) -> None:
        service = await client.put("/v1/services/whatsapp/placement", json={"location": "remote"})
        assert service.status == 404 and await error_code(service) == "UNKNOWN_SERVICE"
        area = await client.put("/v1/areas/no-such-area/placement", json={"location": "remote"})
        assert area.status == 404 and await error_code(area) == "UNKNOWN_AREA"
        assert await real_store.desired_placements() == []

    async def test_corrupt_custom_config_gets_409_and_is_left_as_found(
        self, tmp_path: Path, real_store: Store, admission: Admission
    ) -> None:
        custom = tmp_path / "custom_config.json"
        custom.write_text('{"custom_daemons": [')
        client = await api_client(tmp_path, real_store, admission)
        try:
            response = await client.put(f"/v1/areas/{AREA}/placement", json={"location": "remote"})
            assert response.status == 409 and await error_code(response) == "CONFIG_CORRUPT"
        finally:
            await client.close()
        assert custom.read_text() == '{"custom_daemons": ['


class TestAcceptedRequests:
    """A 202 is sent only after the placement is durably recorded."""

    async def test_service_placement_is_recorded_then_202(
        self, client: TestClient[web.Request, web.Application], real_store: Store
    ) -> None:
        response = await client.put("/v1/services/tg/placement", json={"location": "remote"})
        assert response.status == 202
        assert (await response.json())["transaction_ids"] == []
        [row] = await real_store.desired_placements()
        assert (row["service"], row["area"], row["location"]) == ("tg", None, "remote")

    async def test_area_placement_is_recorded_under_its_service(
        self, client: TestClient[web.Request, web.Application], real_store: Store
    ) -> None:
        response = await client.put(f"/v1/areas/{AREA}/placement", json={"location": "remote"})
        assert response.status == 202
        [row] = await real_store.desired_placements()
        assert (row["service"], row["area"], row["location"]) == ("tg", AREA, "remote")

    async def test_a_failing_durable_write_gets_500_never_202(
        self, tmp_path: Path, admission: Admission
    ) -> None:
        closed = await Store.open(tmp_path / "closed")
        await closed.close()
        client = await api_client(tmp_path, closed, admission)
        try:
            response = await client.put("/v1/services/tg/placement", json={"location": "remote"})
            assert response.status == 500 and await error_code(response) == "STORE_WRITE_FAILED"
        finally:
            await client.close()

    async def test_no_response_is_sent_while_the_write_is_unconfirmed(
        self, tmp_path: Path, admission: Admission
    ) -> None:
        gated = GatedStore(fail=True)
        client = await api_client(tmp_path, gated, admission)
        try:
            request = asyncio.create_task(
                client.put("/v1/services/tg/placement", json={"location": "remote"})
            )
            await asyncio.wait_for(gated.entered.wait(), timeout=5)
            assert not request.done()
            gated.release.set()
            response = await asyncio.wait_for(request, timeout=5)
            assert response.status == 500
        finally:
            await client.close()
        assert gated.rows == []


class TestDrain:
    """Work admitted before stop-intake finishes with 202 during the drain; later work gets 503."""

    async def test_admitted_request_completes_with_202_after_stop_intake(
        self, tmp_path: Path, admission: Admission
    ) -> None:
        gated = GatedStore()
        client = await api_client(tmp_path, gated, admission)
        try:
            first = asyncio.create_task(
                client.put("/v1/services/tg/placement", json={"location": "remote"})
            )
            await asyncio.wait_for(gated.entered.wait(), timeout=5)
            admission.stop_intake()

            late = await client.put("/v1/services/tg/placement", json={"location": "local"})
            assert late.status == 503
            assert (await client.get("/readyz")).status == 503
            assert not await admission.wait_drained(grace_s=0)
            assert not first.done()

            gated.release.set()
            response = await asyncio.wait_for(first, timeout=5)
            assert response.status == 202
            assert await admission.wait_drained(grace_s=5)
        finally:
            await client.close()
        assert gated.rows == [{"service": "tg", "area": None, "location": "remote"}]

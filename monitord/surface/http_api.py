"""monitord's HTTP API application: health, readiness and the placement intake.

`build_app(ctx, extra_routes=...)` returns the aiohttp application; other modules add their
routes (status, transactions, cleanup, metrics, bundle, the status page) through
`extra_routes` and reach the shared context with `request.app[http_api.CONTEXT]`. A handler
that changes state wraps itself with `@http_api.mutating`, which passes the request through the
one admission point (monitord.surface.admission) first: after stop-intake it answers 503 DRAINING
before reading the body or touching any state.

Placement requests follow the order of docs/design.md, "Daemon lifecycle" (Admission): admit
-> parse (400 changes nothing) -> validate (404) -> durable write through the `PlacementIntake`
-> 202. A failing write is a 500, never a 202. Errors are
`{"error": {"code": ..., "detail": ...}}` with the stable codes of orchestrator/errors.py.

Callers: monitord.surface.daemon builds and serves the app; tests build it around test doubles.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from aiohttp import web

from monitord.base.config import Config
from monitord.store import spool_files
from monitord.surface.admission import Admission
from orchestrator.errors import ErrorCode, MonitordError, PermanentError

if TYPE_CHECKING:
    from monitord.engine.operator_facade import OperatorFacade

LOCATIONS = ("local", "remote")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# The status an intake's refusal is answered with; any other MonitordError is a 500.
_REFUSAL_STATUS = {
    ErrorCode.TRANSACTION_CONFLICT: 409,
    ErrorCode.CONFIG_CORRUPT: 409,
}


class PlacementIntake(Protocol):
    """Durably records an operator's placement request; returns the transaction ids it created.

    Must return only after the request is on disk. Raises a MonitordError: TRANSACTION_CONFLICT
    or CONFIG_CORRUPT for a 409, STORE_WRITE_FAILED (or any other code) when the write failed.
    """

    async def record_placement(
        self, *, service: str, area: str | None, location: str
    ) -> list[str]: ...


class DesiredPlacementStore(Protocol):
    async def set_desired_placement(
        self, *, service: str, area: str | None, location: str, now: float
    ) -> None: ...


class StorePlacementIntake:
    """The default intake: writes the wish to the store's desired_placement table.

    The migration engine, once running, plans transactions from those rows; it may replace this
    intake with one that also opens transactions and returns their ids.
    """

    def __init__(
        self, store: DesiredPlacementStore, *, clock: Callable[[], float] = time.time
    ) -> None:
        self._store = store
        self._clock = clock

    async def record_placement(
        self, *, service: str, area: str | None, location: str
    ) -> list[str]:
        await self._store.set_desired_placement(
            service=service, area=area, location=location, now=self._clock()
        )
        return []


class Liveness:
    """What /livez reports: healthy until something fatal is recorded (e.g. a root task died)."""

    def __init__(self) -> None:
        self._fault: str | None = None

    @property
    def healthy(self) -> bool:
        return self._fault is None

    @property
    def fault(self) -> str | None:
        return self._fault

    def mark_failed(self, reason: str) -> None:
        if self._fault is None:
            self._fault = reason


@dataclass(frozen=True)
class ApiContext:
    """Everything handlers need; reach it with `request.app[CONTEXT]`."""

    config: Config
    admission: Admission
    placement: PlacementIntake
    custom_config_path: Path
    liveness: Liveness = field(default_factory=Liveness)
    operator: OperatorFacade | None = None  # the engine's facade; None: no engine behind us


CONTEXT = web.AppKey("monitord_api_context", ApiContext)


def error_response(status: int, *, code: str, detail: str) -> web.Response:
    """The API's one error shape."""
    return web.json_response({"error": {"code": code, "detail": detail}}, status=status)


def mutating(handler: Handler) -> Handler:
    """Run `handler` only if the admission point admits the request; 503 DRAINING otherwise."""

    @functools.wraps(handler)
    async def admitted(request: web.Request) -> web.StreamResponse:
        ticket = request.app[CONTEXT].admission.enter()
        if ticket is None:
            return error_response(
                503, code="DRAINING", detail="not accepting changes (starting up or stopping)"
            )
        with ticket:
            return await handler(request)

    return admitted


class _BadRequest(PermanentError):
    """A request body the API cannot take (400 BAD_REQUEST); nothing was changed."""

    def __init__(self, detail: str) -> None:
        super().__init__(ErrorCode.BAD_REQUEST, detail)


async def _read_location(request: web.Request) -> str:
    try:
        body = await request.json(loads=json.loads)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _BadRequest(f"body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise _BadRequest('body must be a JSON object like {"location": "remote"}')
    unknown = sorted(set(body) - {"location"})
    if unknown:
        raise _BadRequest(f"unknown field(s): {', '.join(unknown)}")
    location = body.get("location")
    if location not in LOCATIONS:
        raise _BadRequest(f"location must be 'local' or 'remote', got {location!r}")
    return str(location)


async def _record(
    ctx: ApiContext, *, service: str, area: str | None, location: str
) -> web.Response:
    try:
        transaction_ids = await ctx.placement.record_placement(
            service=service, area=area, location=location
        )
    except MonitordError as e:
        status = _REFUSAL_STATUS.get(e.code, 500)
        detail = e.detail if status != 500 else f"not recorded: {e.detail}"
        return error_response(status, code=e.code, detail=detail)
    accepted = {"service": service, "area": area, "location": location}
    return web.json_response({**accepted, "transaction_ids": transaction_ids}, status=202)


@mutating
async def put_service_placement(request: web.Request) -> web.StreamResponse:
    ctx = request.app[CONTEXT]
    service = request.match_info["service"]
    try:
        location = await _read_location(request)
    except _BadRequest as e:
        return error_response(400, code=e.code, detail=e.detail)
    if service not in ctx.config.services:
        return error_response(
            404, code="UNKNOWN_SERVICE", detail=f"service {service!r} is not configured"
        )
    return await _record(ctx, service=service, area=None, location=location)


@mutating
async def put_area_placement(request: web.Request) -> web.StreamResponse:
    ctx = request.app[CONTEXT]
    uuid = request.match_info["uuid"]
    try:
        location = await _read_location(request)
    except _BadRequest as e:
        return error_response(400, code=e.code, detail=e.detail)
    try:
        placement = await asyncio.to_thread(spool_files.read_custom_config, ctx.custom_config_path)
    except spool_files.ConfigCorrupt as e:
        # The authoritative file is unreadable: nothing may move until it is fixed.
        return error_response(409, code=e.code, detail=e.detail)
    entry = placement.entry(uuid)
    if entry is None:
        return error_response(
            404, code="UNKNOWN_AREA", detail=f"area {uuid} is not in {ctx.custom_config_path.name}"
        )
    return await _record(ctx, service=entry.service, area=uuid, location=location)


async def livez(request: web.Request) -> web.StreamResponse:
    liveness = request.app[CONTEXT].liveness
    if liveness.healthy:
        return web.json_response({"status": "alive"})
    return web.json_response({"status": "failing", "detail": liveness.fault}, status=503)


async def readyz(request: web.Request) -> web.StreamResponse:
    admission = request.app[CONTEXT].admission
    state = admission.state.value
    if admission.accepting:
        return web.json_response({"status": "ready"})
    return web.json_response({"status": state}, status=503)


def build_app(
    ctx: ApiContext, *, extra_routes: Iterable[web.AbstractRouteDef] = ()
) -> web.Application:
    """The aiohttp application: the routes above plus `extra_routes` from other modules."""
    app = web.Application()
    app[CONTEXT] = ctx
    app.add_routes(
        [
            web.get("/livez", livez),
            web.get("/readyz", readyz),
            web.put("/v1/services/{service}/placement", put_service_placement),
            web.put("/v1/areas/{uuid}/placement", put_area_placement),
            *extra_routes,
        ]
    )
    return app

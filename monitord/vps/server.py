"""The agent's manager API (aiohttp), reached by the local owner through the SSH local forward.

Every route except `GET /livez` needs `Authorization: Bearer <secret>`, the secret being the
content of `{dir}/agent.secret` (re-read on each request, so re-provisioning takes effect at
once; compared in constant time). Errors are JSON: `{"error": {"code", "detail"}}` with the
project's stable codes. Request bodies are validated here, at the edge, into frozen values
and handed to `AgentRuntime`. The routes are documented in docs/agent.md.
Called by monitord.vps.cli (`monitord agent`).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from monitord.vps.lease_table import AreaSpec
from monitord.vps.runtime import AgentError, AgentRuntime, bad_request, check_name

SECRET_NAME = "agent.secret"
RUNTIME_KEY = web.AppKey("runtime", AgentRuntime)
SECRET_KEY = web.AppKey("secret_path", Path)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class CreateBody(_Body):
    service: str = Field(min_length=1)
    generation: int = Field(ge=0)
    owner_id: str = Field(min_length=1)
    lease_ttl_s: float = Field(gt=0, le=3600)
    command: tuple[str, ...] = Field(min_length=1)
    data_dir: str = Field(min_length=1)
    env: dict[str, str] = Field(default_factory=dict)


class RenewBody(_Body):
    owner_id: str = Field(min_length=1)
    ttl_s: float = Field(gt=0, le=3600)
    areas: dict[str, int]


def error_response(*, status: int, code: str, detail: str) -> web.Response:
    return web.json_response({"error": {"code": code, "detail": detail}}, status=status)


def _authorized(request: web.Request) -> bool:
    try:
        secret = request.app[SECRET_KEY].read_bytes().strip()
    except OSError:
        return False
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not secret:
        return False
    return hmac.compare_digest(token.strip().encode(), secret)


@web.middleware
async def _errors_and_auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.path != "/livez" and not _authorized(request):
        return error_response(
            status=401, code="AGENT_UNAUTHORIZED", detail="missing or wrong bearer secret"
        )
    try:
        return await handler(request)
    except AgentError as e:
        return error_response(status=e.status, code=e.code, detail=e.detail)
    except OSError as e:  # a cache, lease or record write failed: nothing was acknowledged
        return error_response(
            status=500, code="STORE_WRITE_FAILED", detail=f"{e.strerror or e}: {e.filename}"
        )
    except web.HTTPException as e:
        if e.status < 400:
            raise
        code = "UNKNOWN_AREA" if e.status == 404 else "BAD_REQUEST"
        return error_response(status=e.status, code=code, detail=e.reason)


async def _json_body(request: web.Request, model: type[_Body]) -> Any:
    try:
        raw = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"body is not JSON: {e}") from e
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(body)"
        raise bad_request(f"{where}: {first['msg']}") from e


def _generation_param(request: web.Request) -> int:
    raw = request.query.get("generation", "")
    if not raw.isdigit():
        raise bad_request("query parameter generation=N (a non-negative integer) is required")
    return int(raw)


def _runtime(request: web.Request) -> AgentRuntime:
    return request.app[RUNTIME_KEY]


async def livez(request: web.Request) -> web.Response:
    return web.json_response({"status": "alive"})


async def readyz(request: web.Request) -> web.Response:
    if _runtime(request).ready:
        return web.json_response({"status": "ready"})
    return error_response(status=503, code="DRAINING", detail="agent is not ready")


async def inventory(request: web.Request) -> web.Response:
    return web.json_response(_runtime(request).inventory())


async def get_area(request: web.Request) -> web.Response:
    area = check_name("area", request.match_info["area"])
    view = _runtime(request).entry(area)
    if view is None:
        return error_response(status=404, code="UNKNOWN_AREA", detail=f"no entry for {area}")
    return web.json_response(view)


async def put_area(request: web.Request) -> web.Response:
    runtime = _runtime(request)
    area = check_name("area", request.match_info["area"])
    body: CreateBody = await _json_body(request, CreateBody)
    spec = AreaSpec(
        area=area,
        service=check_name("service", body.service),
        generation=body.generation,
        owner_id=body.owner_id,
        command=body.command,
        data_dir=runtime.validate_data_dir(body.data_dir),
        env=dict(body.env),
    )
    result, view = await runtime.create(spec, ttl_s=body.lease_ttl_s)
    return web.json_response(
        {"result": result, "entry": view}, status=201 if result == "created" else 200
    )


async def stop_area(request: web.Request) -> web.Response:
    area = check_name("area", request.match_info["area"])
    result = await _runtime(request).stop(area, generation=_generation_param(request))
    return web.json_response(result)


async def delete_area(request: web.Request) -> web.Response:
    area = check_name("area", request.match_info["area"])
    result = await _runtime(request).delete(area, generation=_generation_param(request))
    return web.json_response(result)


async def renew_leases(request: web.Request) -> web.Response:
    body: RenewBody = await _json_body(request, RenewBody)
    # One bad name never fails the batch (every other area would lose its lease): the
    # runtime answers it `invalid` on its own.
    result = await _runtime(request).renew(
        owner_id=body.owner_id, ttl_s=body.ttl_s, areas=body.areas
    )
    return web.json_response(result)


def build_app(runtime: AgentRuntime, *, secret_path: Path) -> web.Application:
    app = web.Application(middlewares=[_errors_and_auth])
    app[RUNTIME_KEY] = runtime
    app[SECRET_KEY] = secret_path
    app.router.add_get("/livez", livez)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/v1/inventory", inventory)
    app.router.add_get("/v1/areas/{area}", get_area)
    app.router.add_put("/v1/areas/{area}", put_area)
    app.router.add_post("/v1/areas/{area}/stop", stop_area)
    app.router.add_delete("/v1/areas/{area}", delete_area)
    app.router.add_post("/v1/leases/renew", renew_leases)
    return app

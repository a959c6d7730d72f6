"""Read-side HTTP routes of the daemon and the documents behind them (SPEC §8, §9).

`GET /v1/status`, `GET /v1/transactions`, `GET /v1/cleanup`, `POST /v1/services/{s}/retry`
(admitted like every mutating request), `GET /metrics`, `GET /v1/diagnostics/bundle` and the
status page at `/`. The status document is assembled from the orchestration component's
live objects; per-service states, counts and the remote_state.json projection come from the
pure `orchestrator.status`, so the page, the CLI, the PHP UI and the metrics agree.
Called by `monitord.surface.wiring` (its `routes()`).
"""

from __future__ import annotations

import json
import time
from importlib import resources
from typing import TYPE_CHECKING, Any

from aiohttp import web

from monitord.base.metrics import CONTENT_TYPE
from monitord.store import spool_files
from monitord.surface import bundle, http_api
from orchestrator import status as status_rules

if TYPE_CHECKING:
    from monitord.engine.placement_state import PlacementState
    from monitord.surface.wiring import Orchestration


def _orchestration(request: web.Request) -> Orchestration:
    orchestration: Orchestration = request.app[http_api.CONTEXT].extras["orchestration"]
    return orchestration


def side_counts(state: PlacementState) -> dict[str, int]:
    counts = {"local": 0, "remote": 0}
    for area in state.committed.values():
        counts[area.location.value] += 1
    return counts


def _service_view(orch: Orchestration, service: str) -> dict[str, Any]:
    state = orch.state
    areas = state.areas_of(service)
    txns = [t for t in state.active() if t.service == service]
    tunnel = orch.link.keeper.status() if orch.link else None
    view = status_rules.service_view(
        service=service,
        areas=areas,
        transactions=txns,
        desired=state.service_desired(service),
        area_desired={a.uuid: state.desired_location(a) for a in areas},
        orphans=_orphans_of(orch, service),
        tunnel_conflict=bool(tunnel and tunnel.state.value in ("lease_conflict", "port_occupied")),
        cleanup_pending=orch.cleanup.backlog_by_service.get(service, 0) > 0,
    )
    by_area = {t.area: t for t in txns}
    return {
        "desired": view.desired,
        "state": str(view.state),
        "counts": dict(view.counts),
        "areas": [
            {
                "uuid": a.uuid,
                "location": a.location.value,
                "generation": a.generation,
                "desired": state.desired_location(a).value,
                "phase": by_area[a.uuid].phase.value if a.uuid in by_area else None,
            }
            for a in areas
        ],
        "last_error": orch.engine.last_errors.get(service) or view.last_error,
    }


def _orphans_of(orch: Orchestration, service: str) -> int:
    return orch.reconciler.orphans_by_service.get(service, 0)


def build_status(orch: Orchestration) -> dict[str, Any]:
    """The SPEC §8 status document."""
    state = orch.state
    services = {name: _service_view(orch, name) for name in sorted(orch.config.services)}
    counts = {"local": 0, "remote": 0, "migrating": 0, "orphan": 0}
    for svc in services.values():
        for key in counts:
            counts[key] += svc["counts"].get(key, 0)
    tunnel: dict[str, Any]
    if orch.link is None:
        tunnel = {"state": "not_configured", "connected": False, "last_error": "",
                  "attempts": 0, "lease": None}
    else:
        tunnel = orch.link.keeper.status().to_dict()
        err = tunnel.get("last_error")
        tunnel["last_error_code"] = err["code"] if err else ""
        tunnel["last_error"] = f"{err['code']}: {err['detail']}" if err else ""
    drift = orch.reconciler.last.to_dict() if orch.reconciler.last else {"before": 0, "after": 0}
    return {
        "owner_id": orch.owner_id,
        "owner_label": orch.config.monitord.owner_label,
        "at": time.time(),
        "accepting": orch.ctx.admission.accepting,
        "config_error": str(state.corrupt) if state.corrupt else None,
        "tunnel": tunnel,
        "counts": counts,
        "services": services,
        "transactions": [t.to_storage() for t in state.active()],
        "cleanup": {"backlog": orch.cleanup.backlog, "stuck": orch.cleanup.stuck},
        "drift": drift,
    }


def remote_state_projection(orch: Orchestration) -> dict[str, spool_files.ServiceCompatState]:
    """remote_state.json rows, one per configured service (never a source of truth)."""
    rows = {}
    for name in sorted(orch.config.services):
        txns = [t for t in orch.state.active() if t.service == name]
        error = orch.engine.last_errors.get(name)
        row = status_rules.remote_state_row(
            transactions=txns,
            fail_count=orch.engine.failures(name),
            last_error=f"{error['code']}: {error['detail']}" if error else "",
        )
        rows[name] = spool_files.ServiceCompatState(**row)
    return rows


# -- handlers ----------------------------------------------------------------------------------


async def get_status(request: web.Request) -> web.Response:
    return web.json_response(build_status(_orchestration(request)))


async def get_transactions(request: web.Request) -> web.Response:
    orch = _orchestration(request)
    limit = _limit(request)
    records = await orch.ctx.store.list_transactions(limit=limit)
    return web.json_response({"transactions": records})


async def get_cleanup(request: web.Request) -> web.Response:
    orch = _orchestration(request)
    items = await orch.ctx.store.list_cleanup(limit=_limit(request))
    return web.json_response(
        {"items": items, "backlog": await orch.ctx.store.cleanup_backlog()}
    )


def _limit(request: web.Request) -> int:
    raw = request.query.get("limit", "1000")
    if not raw.isdigit() or not 0 < int(raw) <= 100_000:
        raise web.HTTPBadRequest(
            text=json.dumps({"error": {"code": "BAD_REQUEST",
                                       "detail": "limit must be an integer in 1..100000"}}),
            content_type="application/json",
        )
    return int(raw)


@http_api.mutating
async def post_retry(request: web.Request) -> web.StreamResponse:
    orch = _orchestration(request)
    service = request.match_info["service"]
    if service not in orch.config.services:
        return http_api.error_response(
            404, code="UNKNOWN_SERVICE", detail=f"service {service!r} is not configured"
        )
    ids = await orch.engine.retry(service)
    return web.json_response({"service": service, "transaction_ids": ids}, status=202)


async def get_metrics(request: web.Request) -> web.Response:
    orch = _orchestration(request)
    return web.Response(body=orch.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


async def get_bundle(request: web.Request) -> web.Response:
    orch = _orchestration(request)
    store = orch.ctx.store
    sections: dict[str, Any] = {
        "status.json": build_status(orch),
        "transactions.json": await store.list_transactions(limit=5000),
        "cleanup.json": await store.list_cleanup(limit=100_000),
        "events.json": await store.recent_events(limit=1000),
        "local_inventory.json": [v.to_json() for v in orch.supervisor.inventory()],
        "remote_inventory.json": orch.reconciler.remote_inventory,
        "tunnel.json": orch.link.keeper.status().to_dict() if orch.link else None,
        "config.json": orch.config.model_dump(mode="json"),
    }
    for name, path in (
        ("custom_config.json", orch.ctx.custom_config_path),
        ("remote_state.json", orch.ctx.remote_state_path),
    ):
        try:
            sections[name] = path.read_bytes()
        except OSError as e:
            sections[name] = f"unreadable: {e}\n"
    body = bundle.build(sections)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    return web.Response(
        body=body,
        headers={
            "Content-Type": "application/gzip",
            "Content-Disposition": f'attachment; filename="monitord-bundle-{stamp}.tar.gz"',
        },
    )


async def not_found(request: web.Request) -> web.Response:
    """The last route: unknown paths get the API's error shape instead of aiohttp's text.

    A path that exists under another method is a 405 with an Allow header, as aiohttp would
    answer, but in the same JSON shape.
    """
    allowed: set[str] = set()
    for resource in request.app.router.resources():
        if resource is request.match_info.route.resource:
            continue
        _, methods = await resource.resolve(request)
        allowed |= methods
    if allowed:
        response = http_api.error_response(
            405, code="BAD_REQUEST",
            detail=f"{request.method} is not allowed on {request.path};"
                   f" allowed: {', '.join(sorted(allowed))}",
        )
        response.headers["Allow"] = ", ".join(sorted(allowed))
        return response
    return http_api.error_response(
        404, code="NOT_FOUND", detail=f"no such endpoint: {request.method} {request.path}"
    )


async def get_page(request: web.Request) -> web.Response:
    page = resources.files("monitord.surface").joinpath("static/index.html").read_bytes()
    return web.Response(body=page, content_type="text/html", charset="utf-8")


def routes(orch: Orchestration) -> list[web.RouteDef]:
    return [
        web.get("/", get_page),
        web.get("/v1/status", get_status),
        web.get("/v1/transactions", get_transactions),
        web.get("/v1/cleanup", get_cleanup),
        web.post("/v1/services/{service}/retry", post_retry),
        web.get("/metrics", get_metrics),
        web.get("/v1/diagnostics/bundle", get_bundle),
        web.route("*", "/{tail:.*}", not_found),  # must stay last
    ]


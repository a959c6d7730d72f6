"""Read-side HTTP routes of the daemon and the documents behind them.

`GET /v1/status`, `GET /v1/transactions`, `GET /v1/cleanup`, `GET /v1/moves`, `GET /metrics`,
`GET /v1/diagnostics/bundle`, the status page at `/`, and the operator actions
`POST /v1/services/{s}/retry`, `POST /v1/services/{s}/discard-remote-data` and
`POST /v1/services/{s}/give-up` and `POST /v1/abandoned/{area}/fetch` (admitted like every
mutating request), and `GET /v1/areas/{uuid}/logs` (an area's log, read-only). Every handler asks
the operator facade (monitord.engine.operator_facade) for its answer; nothing here reaches
into the engine.
Host, Origin, local authority (the API token for every change and for the bundle) and
Content-Type were checked by `http_api.guard` before any handler runs; bodies are read with
`http_api.read_json` (deep nesting, non-UTF-8: 400, never a 500). The page is served with a
Content-Security-Policy that admits only its own inline script and style (by hash), requests
to its own origin, and no framing (`PAGE_CSP`).
Called by `monitord.surface.daemon`, which serves these routes whenever an engine is behind
the API.

`GET /v1/status` is served from one pre-serialised document (`StatusDocument`), rebuilt at the
first request after anything it is built from changed (`OperatorFacade.status_key()`), so a
poll costs a key comparison, not a rebuild, and requests while nothing changed get identical
bytes; `at` is then when the document was built.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import re
import time
from importlib import resources
from typing import TYPE_CHECKING, Any

from aiohttp import web

from monitord.base import bounded_json, log_tail
from monitord.base.metrics import CONTENT_TYPE
from monitord.surface import bundle, http_api
from orchestrator.errors import ErrorCode, MonitordError
from orchestrator.give_up import VpsNotFenced

if TYPE_CHECKING:
    from monitord.engine.operator_facade import OperatorFacade


def _operator(request: web.Request) -> OperatorFacade:
    operator = request.app[http_api.CONTEXT].operator
    assert operator is not None, "status routes are only served with an engine behind them"
    return operator


# -- handlers ----------------------------------------------------------------------------------


class StatusDocument:
    """The status document as bytes, rebuilt only when its key changed (one per app).

    The key is read before the document is built, and both happen without an await in
    between, so the bytes served always belong to the key stored with them: a change made
    before a request is in the answer to that request."""

    def __init__(self) -> None:
        self._key: tuple[Any, ...] | None = None
        self._body = b""

    def body(self, operator: OperatorFacade) -> bytes:
        key = operator.status_key()
        if self._key is None or key != self._key:
            self._body = json.dumps(operator.snapshot()).encode()
            self._key = key
        return self._body

    async def get(self, request: web.Request) -> web.Response:
        return web.Response(body=self.body(_operator(request)),
                            content_type="application/json", charset="utf-8")


async def get_transactions(request: web.Request) -> web.Response:
    records = await _operator(request).transactions(limit=_limit(request))
    return web.json_response({"transactions": records})


async def get_cleanup(request: web.Request) -> web.Response:
    return web.json_response(await _operator(request).cleanup(limit=_limit(request)))


async def get_moves(request: web.Request) -> web.Response:
    """The moves whose transactions ended in the last `hours` (default 24, at most 720),
    newest first, each as the status's `last_move` shows one."""
    hours = _bounded_int(request, "hours", default=24, maximum=720)
    since = time.time() - hours * 3600.0
    return web.json_response({"since": since,
                              "moves": await _operator(request).moves_since(since)})


def _limit(request: web.Request) -> int:
    return _bounded_int(request, "limit", default=1000, maximum=100_000)


def _bounded_int(request: web.Request, key: str, *, default: int, maximum: int) -> int:
    value = bounded_json.count(request.query.get(key, str(default)), maximum=maximum)
    if not value:
        raise web.HTTPBadRequest(
            text=json.dumps({"error": {"code": "BAD_REQUEST",
                                       "detail": f"{key} must be an integer in 1..{maximum}"}}),
            content_type="application/json",
        )
    return value


@http_api.mutating
async def post_retry(request: web.Request) -> web.StreamResponse:
    operator = _operator(request)
    service = request.match_info["service"]
    if not operator.knows_service(service):
        return http_api.error_response(
            404, code="UNKNOWN_SERVICE", detail=f"service {service!r} is not configured"
        )
    ids = await operator.retry(service)
    return web.json_response({"service": service, "transaction_ids": ids}, status=202)


async def _service_and_area(
    request: web.Request,
) -> tuple[str, str | None] | web.StreamResponse:
    """The service of the path (404 unless configured) and the body's optional area: `{}` for
    every area of the service, `{"area": UUID}` for one; an error response otherwise."""
    service = request.match_info["service"]
    if not _operator(request).knows_service(service):
        return http_api.error_response(
            404, code="UNKNOWN_SERVICE", detail=f"service {service!r} is not configured"
        )
    try:
        body = await http_api.read_json(request) if request.can_read_body else {}
    except http_api.BadRequest as e:
        return http_api.error_response(400, code=e.code, detail=e.detail)
    if not isinstance(body, dict) or set(body) - {"area"} or not isinstance(
        body.get("area", ""), str
    ):
        return http_api.error_response(
            400, code="BAD_REQUEST", detail='body must be {} or {"area": "<uuid>"}'
        )
    return service, body.get("area") or None


@http_api.mutating
async def post_discard_remote_data(request: web.Request) -> web.StreamResponse:
    """The operator's override for rollbacks waiting on the destination's newer data."""
    target = await _service_and_area(request)
    if isinstance(target, web.StreamResponse):
        return target
    service, area = target
    try:
        ids = await _operator(request).discard_remote_data(service, area=area)
    except MonitordError as e:
        status = 409 if e.code is ErrorCode.TRANSACTION_CONFLICT else 500
        return http_api.error_response(status, code=e.code, detail=e.detail)
    return web.json_response({"service": service, "transaction_ids": ids}, status=202)


@http_api.mutating
async def post_give_up(request: web.Request) -> web.StreamResponse:
    """The VPS is given up for a service (or one area): 202 with the transactions taking its
    areas home on the PBX's own copy; 409 VPS_NOT_FENCED with `retry_after_s` while a copy
    there may still run, 409 TRANSACTION_CONFLICT when there is nothing to give up."""
    target = await _service_and_area(request)
    if isinstance(target, web.StreamResponse):
        return target
    service, area = target
    operator = _operator(request)
    if area is not None and not operator.knows_area(service, area):
        return http_api.error_response(
            404, code="UNKNOWN_AREA",
            detail=f"area {area!r} of {service} is not in custom_config.json",
        )
    try:
        given_up = await operator.give_up_remote(service, area=area)
    except VpsNotFenced as e:
        return web.json_response(
            {"error": {"code": e.code, "detail": e.detail}, "retry_after_s": e.retry_after_s,
             "allowed_at": e.allowed_at},
            status=409, headers={"Retry-After": str(e.retry_after_s)},
        )
    except MonitordError as e:
        status = 409 if e.code is ErrorCode.TRANSACTION_CONFLICT else 500
        return http_api.error_response(status, code=e.code, detail=e.detail)
    return web.json_response({"service": service, "area": area,
                              "transaction_ids": given_up.transaction_ids,
                              "kept": given_up.kept}, status=202)


@http_api.mutating
async def post_fetch_abandoned(request: web.Request) -> web.StreamResponse:
    """Fetch a given-up copy set aside on the VPS to the PBX for forensics: 202 with where it
    goes (the status row of that copy shows the fetch); 404 NOT_FOUND without such a copy,
    409 TRANSACTION_CONFLICT while it is being fetched, 503 SSH_UNREACHABLE without the VPS.
    Body: `{}` for the area's newest given-up generation, or `{"generation": N}`."""
    area = request.match_info["area"]  # a name (http_api.guard checked it)
    try:
        body = await http_api.read_json(request) if request.can_read_body else {}
    except http_api.BadRequest as e:
        return http_api.error_response(400, code=e.code, detail=e.detail)
    generation = body.get("generation") if isinstance(body, dict) else None
    if not isinstance(body, dict) or set(body) - {"generation"} or not (
        generation is None
        or (type(generation) is int and 0 <= generation < 2**63)
    ):
        return http_api.error_response(
            400, code="BAD_REQUEST", detail='body must be {} or {"generation": N}'
        )
    try:
        started = _operator(request).fetch_abandoned(area, generation=generation)
    except MonitordError as e:
        status = {ErrorCode.NOT_FOUND: 404, ErrorCode.TRANSACTION_CONFLICT: 409,
                  ErrorCode.SSH_UNREACHABLE: 503}.get(e.code, 500)
        return http_api.error_response(status, code=e.code, detail=e.detail)
    return web.json_response(started, status=202)


_LOG_STATUS = {ErrorCode.UNKNOWN_AREA: 404, ErrorCode.NOT_FOUND: 404,
               ErrorCode.BAD_REQUEST: 400, ErrorCode.PREFLIGHT_REMOTE_CONFIG: 409}


def _log_query(request: web.Request) -> tuple[str | None, int, tuple[int | None, int] | None]:
    """(side, lines, position) of `GET /v1/areas/{uuid}/logs`; BadRequest for anything else."""
    query = request.query
    unknown = set(query) - {"side", "lines", "offset", "file"}
    side = query.get("side")
    if unknown or side not in (None, "local", "remote"):
        raise http_api.BadRequest("query: side=local|remote, lines=N, or offset=N and file=I")
    numbers: dict[str, int] = {}
    for key in ("lines", "offset", "file"):
        raw = query.get(key)
        if raw is not None:
            number = bounded_json.count(raw)
            if number is None:
                raise http_api.BadRequest(f"{key} must be a non-negative integer")
            numbers[key] = number
    lines = numbers.get("lines", log_tail.DEFAULT_LINES)
    if not 0 < lines <= log_tail.MAX_LINES:
        raise http_api.BadRequest(f"lines must be in 1..{log_tail.MAX_LINES}")
    if "file" in numbers and "offset" not in numbers:
        raise http_api.BadRequest("file goes with offset")
    position = (numbers.get("file"), numbers["offset"]) if "offset" in numbers else None
    return side, lines, position


@http_api.privileged  # (an area's log is one account's, mode 0600: not every local user's)
async def get_area_log(request: web.Request) -> web.Response:
    """An area's log, read-only and bounded (at most 1 MiB an answer): `?lines=N` (default
    100) its last lines, `?offset=N&file=I` what was appended since (`monitord logs -f`),
    `?side=` another side than where it is placed. A remote log is asked of the agent."""
    try:
        side, lines, position = _log_query(request)
    except http_api.BadRequest as e:
        return http_api.error_response(400, code=e.code, detail=e.detail)
    try:
        found = await _operator(request).area_log(
            request.match_info["uuid"], side=side, lines=lines, position=position)
    except MonitordError as e:
        return http_api.error_response(_LOG_STATUS.get(e.code, 503), code=e.code,
                                       detail=e.detail)
    return web.json_response(found)


async def get_metrics(request: web.Request) -> web.Response:
    return web.Response(
        body=_operator(request).metrics_text(), headers={"Content-Type": CONTENT_TYPE}
    )


@http_api.privileged
async def get_bundle(request: web.Request) -> web.Response:
    sections = await _operator(request).bundle_sections()
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


def _inline_hashes(page: bytes, tag: str) -> str:
    """`'sha256-…'` sources for every inline <tag>…</tag> block of the page, as CSP wants."""
    blocks = re.findall(rb"<%s>(.*?)</%s>" % (tag.encode(), tag.encode()), page, re.DOTALL)
    return " ".join(
        f"'sha256-{base64.b64encode(hashlib.sha256(block).digest()).decode()}'"
        for block in blocks
    )


@functools.cache
def page() -> tuple[bytes, str]:
    """The page's bytes and its Content-Security-Policy: its own inline script and style only
    (no other script can run in it, so nothing else can read the token it keeps), requests
    only to its own origin, no framing, no <base>, no form that navigates."""
    body = resources.files("monitord.surface").joinpath("static/index.html").read_bytes()
    csp = (
        "default-src 'none'; "
        f"script-src {_inline_hashes(body, 'script')}; "
        f"style-src {_inline_hashes(body, 'style')}; "
        "connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    )
    return body, csp


async def get_page(request: web.Request) -> web.Response:
    body, csp = page()
    return web.Response(
        body=body, content_type="text/html", charset="utf-8",
        headers={"Content-Security-Policy": csp, "Referrer-Policy": "no-referrer",
                 "Cache-Control": "no-store"},
    )


def routes() -> list[web.RouteDef]:
    status = StatusDocument()
    return [
        web.get("/", get_page),
        web.get("/v1/status", status.get),
        web.get("/v1/transactions", get_transactions),
        web.get("/v1/cleanup", get_cleanup),
        web.get("/v1/moves", get_moves),
        web.post("/v1/services/{service}/retry", post_retry),
        web.post("/v1/services/{service}/discard-remote-data", post_discard_remote_data),
        web.post("/v1/services/{service}/give-up", post_give_up),
        web.post("/v1/abandoned/{area}/fetch", post_fetch_abandoned),
        web.get("/v1/areas/{uuid}/logs", get_area_log),
        web.get("/metrics", get_metrics),
        web.get("/v1/diagnostics/bundle", get_bundle),
        web.route("*", "/{tail:.*}", not_found),  # must stay last
    ]


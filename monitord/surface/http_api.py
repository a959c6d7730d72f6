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
The handlers never read custom_config.json while an engine runs: its operator facade checks
the file once per request and finds an area's service (docs/architecture.md, "The route of a
placement request"); only the bare application (no engine behind it) reads the file itself.

Every request first passes `guard` (one middleware, applied by `build_app`; docs/operator.md,
"Browser safety"): a Host that does not name this API is 421, a present Origin that is not
`http://<an allowed host>` is 403 (both BAD_REQUEST); then local authority (docs/design.md,
"Local authorization"): any method but GET and HEAD, and a GET of a `privileged` handler (the
bundle), needs `Authorization: Bearer <the API token>` (monitord.surface.api_token), else 401
API_UNAUTHORIZED, before anything else is looked at; a mutating request without
`Content-Type: application/json` (charset, if given, utf-8) is 400 BAD_REQUEST; aiohttp's own
refusals (404, 405, 413 body over `MAX_BODY_BYTES`) are put into the error shape. Every answer
carries `X-Frame-Options: DENY`, a Content-Security-Policy with `frame-ancestors 'none'` and
`X-Content-Type-Options: nosniff` (`_security_headers`); the page sets its own, stricter CSP.
Bodies are read with `read_json`, which turns deep nesting, non-UTF-8 bytes and other parser
failures into `BadRequest` (400).

Callers: monitord.surface.daemon builds and serves the app; tests build it around test doubles.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import json
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web

from monitord.base.config import Config
from monitord.base.hostport import split_hostport
from monitord.store import spool_files
from monitord.surface import api_token
from monitord.surface.admission import Admission
from orchestrator import names
from orchestrator.errors import ErrorCode, MonitordError, PermanentError, error_for

if TYPE_CHECKING:
    from monitord.engine.operator_facade import OperatorFacade

LOCATIONS = ("local", "remote")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# The largest request body read (aiohttp's client_max_size); a larger one is 413. Above 100 000
# bytes on purpose: a body of deep nesting is refused by the parser check (400), not by size.
MAX_BODY_BYTES = 1024 * 1024
# Host names that always name this API (with the listen port), besides the configured host.
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


# The status an intake's refusal is answered with; any other MonitordError is a 500.
_REFUSAL_STATUS = {
    ErrorCode.UNKNOWN_AREA: 404,
    ErrorCode.TRANSACTION_CONFLICT: 409,
    ErrorCode.CONFIG_CORRUPT: 409,
    ErrorCode.PREFLIGHT_REMOTE_CONFIG: 409,  # a move to a VPS that is not configured
    ErrorCode.AREA_ENTRY_INVALID: 409,  # an area at the last generation cannot move
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
    # The local authority for changes; None: no token is set up, and every change is refused.
    api_token: api_token.ApiToken | None = None


CONTEXT = web.AppKey("monitord_api_context", ApiContext)


def error_response(status: int, *, code: str, detail: str) -> web.Response:
    """The API's one error shape."""
    return web.json_response({"error": {"code": code, "detail": detail}}, status=status)


# The handlers wrapped by `mutating`: `guard` requires a JSON Content-Type for these.
_MUTATING: set[Handler] = set()
# Handlers a GET (or HEAD) of which also needs the API token (`privileged`): the bundle.
_PRIVILEGED: set[Handler] = set()
# The only methods that may pass without the API token, and only to a handler not privileged.
OPEN_METHODS = frozenset({"GET", "HEAD"})


def privileged(handler: Handler) -> Handler:
    """Mark a read-only handler whose answer needs local authority all the same (the bundle:
    it describes the whole installation); `guard` asks for the API token before it runs."""
    _PRIVILEGED.add(handler)
    return handler


def mutating(handler: Handler) -> Handler:
    """Run `handler` only if the admission point admits the request; 503 DRAINING otherwise.

    `guard` has already refused it unless its Content-Type is application/json."""

    @functools.wraps(handler)
    async def admitted(request: web.Request) -> web.StreamResponse:
        ticket = request.app[CONTEXT].admission.enter()
        if ticket is None:
            return error_response(
                503, code=ErrorCode.DRAINING,
                detail="not accepting changes (starting up or stopping)",
            )
        with ticket:
            return await handler(request)

    _MUTATING.add(admitted)
    return admitted


class BadRequest(PermanentError):
    """A request the API cannot take (400 BAD_REQUEST); nothing was changed."""

    def __init__(self, detail: str) -> None:
        super().__init__(ErrorCode.BAD_REQUEST, detail)


async def read_json(request: web.Request) -> Any:
    """The request body as JSON; BadRequest (400) for anything a parser could choke on.

    The body is at most MAX_BODY_BYTES (aiohttp raises 413 beyond); it must be UTF-8 (a charset
    other than utf-8 was refused by `guard`); nesting beyond the interpreter's recursion limit,
    numbers with too many digits and every other JSON error are a 400, never a 500.
    """
    raw = await request.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(f"body is not UTF-8 text (byte {e.start})") from e
    try:
        return json.loads(text)
    except RecursionError as e:
        raise BadRequest("body is not valid JSON: nested too deeply") from e
    except ValueError as e:  # JSONDecodeError, and int() refusing too many digits
        raise BadRequest(f"body is not valid JSON: {e}") from e


async def _read_location(request: web.Request) -> str:
    body = await read_json(request)
    if not isinstance(body, dict):
        raise BadRequest('body must be a JSON object like {"location": "remote"}')
    unknown = sorted(set(body) - {"location"})
    if unknown:
        raise BadRequest(f"unknown field(s): {', '.join(unknown)}")
    location = body.get("location")
    if location not in LOCATIONS:
        raise BadRequest(f"location must be 'local' or 'remote', got {location!r}")
    return str(location)


def _refused(error: MonitordError) -> web.Response:
    """An intake's refusal (404, 409) or a write that failed (500: nothing was recorded)."""
    status = _REFUSAL_STATUS.get(error.code, 500)
    detail = error.detail if status != 500 else f"not recorded: {error.detail}"
    return error_response(status, code=error.code, detail=detail)


def _accepted(
    *, service: str, area: str | None, location: str, transaction_ids: list[str]
) -> web.Response:
    accepted = {"service": service, "area": area, "location": location}
    return web.json_response({**accepted, "transaction_ids": transaction_ids}, status=202)


async def _area_placement(ctx: ApiContext, uuid: str, *, location: str) -> tuple[str, list[str]]:
    """(the area's service, the transaction ids) of a recorded area placement; a MonitordError
    refuses it (CONFIG_CORRUPT, UNKNOWN_AREA, TRANSACTION_CONFLICT, or a failed write)."""
    if ctx.operator is not None:  # the engine's facade: one check of the file finds the area
        return await ctx.operator.record_area_placement(uuid, location=location)
    # No engine behind the API (health and placement only): the file names the area's service.
    placement = await asyncio.to_thread(spool_files.read_custom_config, ctx.custom_config_path)
    entry = placement.entry(uuid)
    if entry is None:
        raise error_for(
            ErrorCode.UNKNOWN_AREA, f"area {uuid} is not in {ctx.custom_config_path.name}"
        )
    ids = await ctx.placement.record_placement(service=entry.service, area=uuid,
                                               location=location)
    return entry.service, ids


@mutating
async def put_service_placement(request: web.Request) -> web.StreamResponse:
    ctx = request.app[CONTEXT]
    service = request.match_info["service"]
    try:
        location = await _read_location(request)
    except BadRequest as e:
        return error_response(400, code=e.code, detail=e.detail)
    if service not in ctx.config.services:
        return error_response(
            404, code=ErrorCode.UNKNOWN_SERVICE, detail=f"service {service!r} is not configured"
        )
    try:
        transaction_ids = await ctx.placement.record_placement(
            service=service, area=None, location=location
        )
    except MonitordError as e:
        return _refused(e)
    return _accepted(service=service, area=None, location=location,
                     transaction_ids=transaction_ids)


@mutating
async def put_area_placement(request: web.Request) -> web.StreamResponse:
    ctx = request.app[CONTEXT]
    uuid = request.match_info["uuid"]
    try:
        location = await _read_location(request)
    except BadRequest as e:
        return error_response(400, code=e.code, detail=e.detail)
    try:
        # An unreadable custom_config.json is 409 CONFIG_CORRUPT: nothing may move until it
        # is fixed; an area it does not list is 404 UNKNOWN_AREA.
        service, transaction_ids = await _area_placement(ctx, uuid, location=location)
    except MonitordError as e:
        return _refused(e)
    return _accepted(service=service, area=uuid, location=location,
                     transaction_ids=transaction_ids)


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


# -- browser safety: one middleware in front of every handler -----------------------------------


def _authority(value: str) -> tuple[str, int] | None:
    """'Host:port' (Host header or the part of an Origin after 'http://') -> (host, port).

    The host is lower-cased, IPv6 brackets dropped; no port means 80. None when it is not a
    plain authority (user info, a path, an unbracketed IPv6 address, a non-numeric port ...).
    """
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        host, rest = value[1:end], value[end + 1:]
        if end < 0 or (rest and not rest.startswith(":")):
            return None
        port = rest[1:] if rest else "80"
    else:
        host, sep, port = value.partition(":")
        port = port if sep else "80"
        if ":" in port:
            return None
    if not host or any(c in host for c in "/@?#\\ ") or not (
        port.isascii() and port.isdigit() and 0 < int(port) < 65536
    ):
        return None
    return host, int(port)


def _allowed(request: web.Request) -> tuple[frozenset[str], frozenset[int]]:
    """The hosts and ports a Host header (and an Origin) may name for this request.

    Hosts: the configured listen host, the loopback names, and the address the connection
    actually arrived on (an IP literal cannot be rebound). Ports: the configured one and the one
    the socket listens on (the same in the daemon; tests serve the app on a random port).
    """
    host, port = split_hostport(request.app[CONTEXT].config.http.listen)
    hosts, ports = {host.lower(), *LOOPBACK_HOSTS}, {port}
    sockname = request.transport.get_extra_info("sockname") if request.transport else None
    if isinstance(sockname, tuple) and len(sockname) >= 2:
        local = str(sockname[0]).split("%")[0]
        hosts.add(local.lower())
        try:
            mapped = ipaddress.ip_address(local)
        except ValueError:
            mapped = None
        if isinstance(mapped, ipaddress.IPv6Address) and mapped.ipv4_mapped is not None:
            hosts.add(str(mapped.ipv4_mapped))
        ports.add(int(sockname[1]))
    return frozenset(hosts), frozenset(ports)


def needs_authority(request: web.Request) -> bool:
    """Every method but GET and HEAD (whatever the route, also one that will be a 404/405),
    and a privileged handler under any method."""
    return request.method not in OPEN_METHODS or request.match_info.handler in _PRIVILEGED


def _unauthorized(request: web.Request) -> web.Response | None:
    """401 API_UNAUTHORIZED unless the request carries the API token; None when it does.

    The detail says where the token is, never what it is; the header offered is never
    echoed or logged."""
    token = request.app[CONTEXT].api_token
    header = request.headers.get("Authorization")
    if token is not None and api_token.permits(token, header):
        return None
    what = f"{request.method} {request.path}"
    if token is None:
        detail = f"{what} needs local authority and no API token is set up"
        challenge = 'Bearer realm="monitord"'
    elif api_token.presented(header) is None:
        detail = (f"{what} needs local authority: send 'Authorization: Bearer <token>' with the"
                  f" token from {token.path} (readable by root and group {token.group})")
        challenge = 'Bearer realm="monitord"'
    else:
        detail = f"{what}: the bearer token is not this daemon's API token ({token.path})"
        challenge = 'Bearer realm="monitord", error="invalid_token"'
    response = error_response(401, code=ErrorCode.API_UNAUTHORIZED, detail=detail)
    response.headers["WWW-Authenticate"] = challenge
    return response


def _refusal(request: web.Request) -> web.Response | None:
    """Host, Origin, local authority and (for mutating handlers) Content-Type; None when the
    request may pass."""
    hosts, ports = _allowed(request)
    listen = request.app[CONTEXT].config.http.listen
    host = _authority(request.headers.get("Host", ""))
    if host is None or host[0] not in hosts or host[1] not in ports:
        return error_response(
            421, code=ErrorCode.BAD_REQUEST,
            detail=f"Host {request.headers.get('Host', '(none)')!r} does not name this API;"
                   f" use http://{listen} or http://localhost:{split_hostport(listen)[1]}",
        )
    origin = request.headers.get("Origin")
    if origin is not None:
        scheme, _, rest = origin.partition("://")
        named = _authority(rest) if scheme.lower() == "http" else None
        if named is None or named[0] not in hosts or named[1] not in ports:
            return error_response(
                403, code=ErrorCode.BAD_REQUEST,
                detail=f"Origin {origin!r} is not this API's own page; cross-site requests are"
                       " refused",
            )
    if needs_authority(request):
        unauthorized = _unauthorized(request)
        if unauthorized is not None:
            return unauthorized
    if request.match_info.handler in _MUTATING:
        if request.content_type != "application/json":
            return error_response(
                400, code=ErrorCode.BAD_REQUEST,
                detail=f"Content-Type must be application/json, got"
                       f" {request.headers.get('Content-Type', '(none)')!r}",
            )
        # Every charset parameter, read from the raw header: aiohttp's parser drops an empty
        # one ("charset=") and keeps only the first of several.
        for param in request.headers.get("Content-Type", "").split(";")[1:]:
            name, _, value = param.partition("=")
            charset = value.strip().strip('"')
            if name.strip().lower() == "charset" and charset.lower() not in ("utf-8", "utf8"):
                return error_response(
                    400, code=ErrorCode.BAD_REQUEST,
                    detail=f"charset must be utf-8, got {charset!r}",
                )
    return None


def _shaped(request: web.Request, e: web.HTTPException) -> web.Response:
    """aiohttp's own refusal (404, 405, 413, ...) in the API's error shape."""
    if e.status == 404:
        code, detail = ErrorCode.NOT_FOUND, f"no such endpoint: {request.method} {request.path}"
    elif e.status == 405:
        code = ErrorCode.BAD_REQUEST
        detail = f"{request.method} is not allowed on {request.path}"
    else:
        code = ErrorCode.BAD_REQUEST
        text = e.text or ""
        detail = text if text and text != f"{e.status}: {e.reason}" else e.reason
    allow = e.headers.get("Allow")
    if allow is not None:
        detail = f"{detail}; allowed: {allow}"
    response = error_response(e.status, code=code, detail=detail or f"HTTP {e.status}")
    if allow is not None:
        response.headers["Allow"] = allow
    return response


# Path parameters that become file names, URLs and agent requests (orchestrator.names).
_NAME_PARAMETERS = ("service", "uuid", "area")


@web.middleware
async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuse what a foreign page or a rebound DNS name could send, before any handler runs,
    and answer every 4xx in the error shape."""
    refused = _refusal(request)
    if refused is not None:
        return refused
    for key in _NAME_PARAMETERS:
        value = request.match_info.get(key)
        reason = None if value is None else names.why_invalid(value)
        if reason is not None:  # before any handler: a bad name never reaches a path or URL
            return error_response(400, code=ErrorCode.BAD_REQUEST, detail=f"{key}: {reason}")
    try:
        return await handler(request)
    except BadRequest as e:
        return error_response(400, code=e.code, detail=e.detail)
    except web.HTTPException as e:
        if e.status < 400 or e.status >= 500 or e.content_type == "application/json":
            raise
        return _shaped(request, e)


# On every answer (errors and aiohttp's own included): no page of this API may be framed
# (clickjacking the buttons), and nothing is sniffed into another content type. The page
# replaces the CSP with its own, which also forbids framing (status_api.PAGE_CSP).
SECURITY_HEADERS = {
    "X-Frame-Options": "DENY",
    "Content-Security-Policy": "default-src 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
}


async def _security_headers(request: web.Request, response: web.StreamResponse) -> None:
    for name, value in SECURITY_HEADERS.items():
        response.headers.setdefault(name, value)


def build_app(
    ctx: ApiContext, *, extra_routes: Iterable[web.AbstractRouteDef] = ()
) -> web.Application:
    """The aiohttp application: the routes above plus `extra_routes` from other modules."""
    app = web.Application(middlewares=[guard], client_max_size=MAX_BODY_BYTES)
    app[CONTEXT] = ctx
    app.on_response_prepare.append(_security_headers)
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

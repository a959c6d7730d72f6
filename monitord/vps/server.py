"""The agent's manager API: HTTP/1.1 on a Unix socket, standard library only.

The socket is `{dir}/api/agent.sock`, in a directory only the agent's user may enter (0700),
and nothing listens on a TCP port: the local owner reaches it through its SSH connection
(a `direct-streamlocal` channel per request, docs/agent.md), so no socket on the PBX ever
carries the secret. Every route except `GET /livez` still needs
`Authorization: Bearer <secret>`, the content of `{dir}/agent.secret` (re-read on each
request, so re-provisioning takes effect at once; compared in constant time).

One request per connection (`Connection: close`); requests are bounded (head 16 KiB, body
1 MiB, 30 s to arrive) so a stuck or hostile client holds nothing for long. Numbers on the
wire (Content-Length, `generation=`) are ASCII digits only, integers in [0, 2^63), and
bodies are JSON within monitord.base.bounded_json's bounds (nesting, digits, no NaN): all
else is 400 BAD_REQUEST, never an exception that leaves the client without an answer.
Errors are JSON:
`{"error": {"code", "detail"}}` with the project's stable codes. Bodies are validated here,
at the edge, into frozen values and handed to `AgentRuntime`. Routes: docs/agent.md.
Called by monitord.vps.cli (`monitord agent`).
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import re
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import Any, Callable, Optional
from urllib.parse import parse_qs, unquote, urlsplit

from monitord.base import bounded_json, log_tail, tree_digest
from monitord.vps import event_log, host_memory, warm_snapshot
from monitord.vps.lease_table import AreaSpec
from monitord.vps.runtime import (
    MAX_HEALTH_WAIT_S,
    AgentError,
    AgentRuntime,
    bad_request,
    check_name,
)
from orchestrator import names

log = event_log.get_logger(__name__)

SECRET_NAME = "agent.secret"
SOCKET_DIR = "api"  # 0700: only the agent's user may reach the socket at all
SOCKET_NAME = "agent.sock"
MAX_HEAD_BYTES = 16 * 1024
MAX_BODY_BYTES = 1024 * 1024
REQUEST_TIMEOUT_S = 30.0
# Generations and counts are SQLite INTEGERs on the owner's side: [0, 2^63).
MAX_INTEGER = 2**63 - 1
# A number on the wire is ASCII digits only: `str.isdigit` also takes "²" (which int()
# refuses) and "١" (which int() reads as 1).


@dataclass(frozen=True)
class Request:
    method: str
    path: str  # as sent (percent-encoded)
    query: Mapping[str, str]
    headers: Mapping[str, str]  # lower-case names
    body: bytes


@dataclass(frozen=True)
class Response:
    status: int
    document: Any

    def encode(self) -> bytes:
        body = json.dumps(self.document).encode()
        reason = HTTPStatus(self.status).phrase
        head = (
            f"HTTP/1.1 {self.status} {reason}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
        return head.encode("ascii") + body


def error_response(*, status: int, code: str, detail: str) -> Response:
    return Response(status, {"error": {"code": code, "detail": detail}})


# -- request bodies ----------------------------------------------------------------------


@dataclass(frozen=True)
class CreateBody:
    service: str
    generation: int
    owner_id: str
    lease_ttl_s: float
    command: tuple[str, ...]
    data_dir: str
    env: Mapping[str, str]
    user: str | None
    group: str | None
    log_max_bytes: int
    log_keep: int


@dataclass(frozen=True)
class RenewBody:
    owner_id: str
    ttl_s: float
    areas: Mapping[str, int]


def _document(raw: bytes) -> dict[str, Any]:
    try:
        value = bounded_json.loads(raw)  # nesting, integer digits and NaN bounded
    except bounded_json.JsonRefused as e:
        raise bad_request(f"body is not JSON within bounds: {e}") from e
    if not isinstance(value, dict):
        raise bad_request("(body): must be a JSON object")
    return value


def _text(doc: Mapping[str, Any], key: str) -> str:
    value = doc.get(key)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{key}: must be a non-empty string")
    return value


def _count(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_INTEGER:
        raise bad_request(f"{where}: must be an integer in [0, 2^63)")
    return value


def _seconds(doc: Mapping[str, Any], key: str) -> float:
    value = doc.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 3600:
        raise bad_request(f"{key}: must be a number of seconds in (0, 3600]")
    return float(value)


def _strings(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise bad_request(f"{where}: must be a non-empty list of strings")
    return tuple(value)


def _string_map(value: Any, where: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise bad_request(f"{where}: must be an object of strings")
    return dict(value)


def _optional_name(doc: Mapping[str, Any], key: str) -> str | None:
    value = doc.get(key)
    return None if value is None else check_name(key, value if isinstance(value, str) else "")


def parse_create(raw: bytes) -> CreateBody:
    doc = _document(raw)
    return CreateBody(
        service=_text(doc, "service"),
        generation=_count(doc.get("generation"), "generation"),
        owner_id=_text(doc, "owner_id"),
        lease_ttl_s=_seconds(doc, "lease_ttl_s"),
        command=_strings(doc.get("command"), "command"),
        data_dir=_text(doc, "data_dir"),
        env=_string_map(doc.get("env", {}), "env"),
        user=_optional_name(doc, "user"),
        group=_optional_name(doc, "group"),
        log_max_bytes=_count(doc.get("log_max_bytes", 0), "log_max_bytes"),
        log_keep=_count(doc.get("log_keep", -1), "log_keep") if "log_keep" in doc else -1,
    )


def parse_renew(raw: bytes) -> RenewBody:
    doc = _document(raw)
    areas = doc.get("areas")
    if not isinstance(areas, dict) or not all(isinstance(k, str) for k in areas):
        raise bad_request("areas: must be an object of area -> generation")
    return RenewBody(
        owner_id=_text(doc, "owner_id"),
        ttl_s=_seconds(doc, "ttl_s"),
        areas={area: _count(gen, f"areas.{area}") for area, gen in areas.items()},
    )


# -- routes ------------------------------------------------------------------------------

Handler = Callable[[AgentRuntime, Request, Optional[str]], Awaitable[Response]]


def _generation_param(request: Request) -> int:
    generation = bounded_json.count(request.query.get("generation", ""), maximum=MAX_INTEGER)
    if generation is None:
        raise bad_request("query parameter generation=N (ASCII digits, below 2^63) is required")
    return generation


def _area(value: str | None) -> str:
    return check_name("area", value or "")


async def livez(runtime: AgentRuntime, request: Request, _: str | None) -> Response:
    return Response(200, {"status": "alive"})


async def readyz(runtime: AgentRuntime, request: Request, _: str | None) -> Response:
    if runtime.ready:
        return Response(200, {"status": "ready"})
    return error_response(status=503, code="DRAINING", detail="agent is not ready")


async def inventory(runtime: AgentRuntime, request: Request, _: str | None) -> Response:
    return Response(200, runtime.inventory())


async def host(runtime: AgentRuntime, request: Request, _: str | None) -> Response:
    """The VPS's memory (monitord/vps/host_memory.py): a move's preflight asks it."""
    return Response(200, host_memory.read())


async def get_area(runtime: AgentRuntime, request: Request, name: str | None) -> Response:
    area = _area(name)
    view = runtime.entry(area)
    if view is None:
        return error_response(status=404, code="UNKNOWN_AREA", detail=f"no entry for {area}")
    return Response(200, view)


def _seconds_param(request: Request, key: str, *, maximum: float) -> float:
    raw = request.query.get(key, "")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= maximum:  # (also refuses nan and inf)
        raise bad_request(f"query parameter {key}=S (seconds, 0 to {maximum:g}) is required")
    return value


async def area_health(runtime: AgentRuntime, request: Request, name: str | None) -> Response:
    area = _area(name)
    return Response(200, await runtime.health(
        area,
        generation=_generation_param(request),
        min_uptime_s=_seconds_param(request, "min_uptime_s", maximum=86400.0),
        wait_s=_seconds_param(request, "wait_s", maximum=MAX_HEALTH_WAIT_S),
    ))


def _count_param(request: Request, key: str, *, default: int | None, maximum: int) -> int | None:
    raw = request.query.get(key)
    if raw is None:
        return default
    value = bounded_json.count(raw, maximum=maximum)
    if value is None:
        raise bad_request(f"query parameter {key}=N (an integer, 0 to {maximum}) is wanted")
    return value


async def area_log(runtime: AgentRuntime, request: Request, name: str | None) -> Response:
    """The area's log `{dir}/logs/{area}.log`, read-only and bounded (monitord.base.log_tail):
    `?lines=N` its last N lines, `?offset=N&file=I` what was appended since that position
    (a follower's next read); at most `max_bytes` (1 MiB) either way. It answers for an area
    the agent no longer holds too (its log stays until the area is deleted from the VPS)."""
    area = _area(name)
    path = str(runtime.runner.logs_dir / f"{area}.log")
    max_bytes = _count_param(request, "max_bytes", default=log_tail.MAX_BYTES,
                             maximum=log_tail.MAX_BYTES)
    offset = _count_param(request, "offset", default=None, maximum=2**63 - 1)
    assert max_bytes is not None
    if offset is not None:
        file = _count_param(request, "file", default=None, maximum=2**64 - 1)
        doc = await asyncio.to_thread(log_tail.read_from, path, file=file, offset=offset,
                                      max_bytes=max_bytes)
    else:
        lines = _count_param(request, "lines", default=log_tail.DEFAULT_LINES,
                             maximum=log_tail.MAX_LINES)
        assert lines is not None
        doc = await asyncio.to_thread(log_tail.tail, path, lines=lines, max_bytes=max_bytes)
    return Response(200, {"area": area, **doc})


async def put_area(runtime: AgentRuntime, request: Request, name: str | None) -> Response:
    area = _area(name)
    body = parse_create(request.body)
    spec = AreaSpec(
        area=area,
        service=check_name("service", body.service),
        generation=body.generation,
        owner_id=body.owner_id,
        command=body.command,
        data_dir=runtime.validate_data_dir(body.data_dir),
        env=dict(body.env),
        user=body.user,
        group=body.group,
        log_max_bytes=body.log_max_bytes,
        log_keep=body.log_keep,
    )
    result, view = await runtime.create(spec, ttl_s=body.lease_ttl_s)
    return Response(201 if result == "created" else 200, {"result": result, "entry": view})


async def stop_area(runtime: AgentRuntime, request: Request, name: str | None) -> Response:
    area = _area(name)
    return Response(200, await runtime.stop(area, generation=_generation_param(request)))


async def delete_area(runtime: AgentRuntime, request: Request, name: str | None) -> Response:
    area = _area(name)
    aside = request.query.get("aside", "0") == "1"  # a copy the operator gave up
    return Response(200, await runtime.delete(area, generation=_generation_param(request),
                                              aside=aside))


async def promote_area_data(
    runtime: AgentRuntime, request: Request, name: str | None
) -> Response:
    area = _area(name)
    doc = _document(request.body)
    expect = _text(doc, "expect")
    if len(expect) != 64 or any(c not in "0123456789abcdef" for c in expect):
        raise bad_request("expect must be a SHA-256 in 64 lowercase hex digits")
    data_dir = runtime.validate_data_dir(_text(doc, "data_dir"))
    return Response(200, await runtime.promote(area, data_dir=data_dir, expect=expect))


STAGING_ACTIONS = ("reset", "digest", "blocks")


async def area_staging(runtime: AgentRuntime, request: Request, name: str | None) -> Response:
    area = _area(name)
    doc = _document(request.body)
    action = _text(doc, "action")
    if action not in STAGING_ACTIONS:
        raise bad_request(f"action must be one of {', '.join(STAGING_ACTIONS)}")
    data_dir = runtime.validate_data_dir(_text(doc, "data_dir"))
    return Response(200, await runtime.staging(area, data_dir=data_dir, action=action))


async def area_blocks(runtime: AgentRuntime, request: Request, name: str | None) -> Response:
    area = _area(name)
    doc = _document(request.body)
    data_dir = runtime.validate_data_dir(_text(doc, "data_dir"))
    paths = _strings(doc.get("paths"), "paths")
    most = tree_digest.MAX_BLOCK_PATHS
    if len(paths) > most:
        raise bad_request(f"paths: at most {most} names in one question")
    known = _known_groups(doc.get("known"), paths)
    return Response(200, await runtime.blocks(area, data_dir=data_dir, paths=paths,
                                              limit=tree_digest.BLOCK_DIGEST_BYTES,
                                              known=known))


def _known_groups(value: Any, paths: tuple[str, ...]) -> dict[str, bytes]:
    """`known` of a blocks question: {name asked for: the asker's group summaries of its
    copy (orchestrator/block_delta.group_digests), base64} — absent: none."""
    if value is None:
        return {}
    found = _string_map(value, "known")
    if not set(found) <= set(paths):
        raise bad_request("known: only names asked for in paths")
    decoded: dict[str, bytes] = {}
    for rel, encoded in found.items():
        try:
            decoded[rel] = base64.b64decode(encoded, validate=True)
        except ValueError as e:
            raise bad_request(f"known: {rel!r}: not base64 ({e})") from e
    return decoded


async def area_listing(runtime: AgentRuntime, request: Request, name: str | None) -> Response:
    area = _area(name)
    data_dir = runtime.validate_data_dir(_text(_document(request.body), "data_dir"))
    return Response(200, await runtime.listing(area, data_dir=data_dir))


async def area_snapshot(runtime: AgentRuntime, request: Request, name: str | None) -> Response:
    """A consistent snapshot of the area's live data dir beside it, for a warm copy
    (monitord.vps.warm_snapshot): `{"data_dir", "generation", "sqlite": [glob, …]}`, or
    `"command": [argv…]` with `"timeout_s"` instead of `sqlite` (the service's own way)."""
    area = _area(name)
    doc = _document(request.body)
    data_dir = runtime.validate_data_dir(_text(doc, "data_dir"))
    generation = _count(doc.get("generation"), "generation")
    if "command" in doc:
        if "sqlite" in doc:
            raise bad_request("either sqlite or command, not both")
        command = _strings(doc.get("command"), "command")
        return Response(200, await runtime.snapshot(
            area, data_dir=data_dir, generation=generation, command=command,
            timeout_s=_seconds(doc, "timeout_s")))
    sqlite = _globs(doc.get("sqlite"), "sqlite")
    return Response(200, await runtime.snapshot(area, data_dir=data_dir, generation=generation,
                                                sqlite=sqlite))


async def discard_area_snapshot(runtime: AgentRuntime, request: Request, name: str | None
                                ) -> Response:
    """The snapshot a warm copy has fetched, removed (`{"data_dir"}`): kept, it would double
    the area's room on the VPS until the next one, and serve nothing — the PBX diffs the
    next one against its own copy."""
    area = _area(name)
    data_dir = runtime.validate_data_dir(_text(_document(request.body), "data_dir"))
    return Response(200, await runtime.discard_snapshot(area, data_dir=data_dir))


def _globs(value: Any, where: str) -> tuple[str, ...]:
    """An area's database globs (an empty list: it has none). Required: a snapshot that took
    a store for a plain file would copy it and its WAL at two moments."""
    most = warm_snapshot.MAX_GLOBS
    if not isinstance(value, list) or len(value) > most:
        raise bad_request(f"{where}: must be a list of at most {most} globs")
    for i, glob in enumerate(value):
        problem = warm_snapshot.glob_problem(glob)
        if problem is not None:
            raise bad_request(f"{where}[{i}]: {problem}")
    return tuple(value)


# A copy `DELETE /v1/areas/{area}?aside=1` set aside: `{area}-g{generation}-{time}`.


async def delete_set_aside(runtime: AgentRuntime, request: Request, name: str | None) -> Response:
    if name is None or not names.is_set_aside_name(name):
        raise bad_request("the name of a set-aside copy ({area}-g{generation}-{time}) is required")
    return Response(200, await runtime.remove_set_aside(name))


async def renew_leases(runtime: AgentRuntime, request: Request, _: str | None) -> Response:
    body = parse_renew(request.body)
    # One bad name never fails the batch (every other area would lose its lease): the
    # runtime answers it `invalid` on its own.
    result = await runtime.renew(owner_id=body.owner_id, ttl_s=body.ttl_s, areas=body.areas)
    return Response(200, result)


async def routes(runtime: AgentRuntime, request: Request, _: str | None) -> Response:
    """What this agent serves, one `METHOD /path/{area}` a route, so that the PBX can choose
    its way once (a copy through these routes, or a shell where one is missing) instead of
    trying each route in turn."""
    return Response(200, {"routes": [f"{method} {template}" for method, template, _ in ROUTES]})


ROUTES: tuple[tuple[str, str, Handler], ...] = (
    ("GET", "/livez", livez),
    ("GET", "/readyz", readyz),
    ("GET", "/v1/routes", routes),
    ("GET", "/v1/inventory", inventory),
    ("GET", "/v1/host", host),
    ("GET", "/v1/areas/{area}", get_area),
    ("GET", "/v1/areas/{area}/health", area_health),
    ("GET", "/v1/areas/{area}/log", area_log),
    ("PUT", "/v1/areas/{area}", put_area),
    ("POST", "/v1/areas/{area}/stop", stop_area),
    ("POST", "/v1/areas/{area}/copy/promote", promote_area_data),
    ("POST", "/v1/areas/{area}/copy/staging", area_staging),
    ("POST", "/v1/areas/{area}/listing", area_listing),
    ("POST", "/v1/areas/{area}/copy/blocks", area_blocks),
    ("POST", "/v1/areas/{area}/copy/snapshot", area_snapshot),
    ("POST", "/v1/areas/{area}/copy/snapshot/discard", discard_area_snapshot),
    ("DELETE", "/v1/areas/{area}", delete_area),
    ("DELETE", "/v1/abandoned/{area}", delete_set_aside),
    ("POST", "/v1/leases/renew", renew_leases),
)
# Each template as the pattern a raw path must match whole: `{area}` is one path segment.
_PATTERNS = tuple(
    (method, re.compile(re.escape(template).replace(re.escape("{area}"), "(?P<name>[^/]*)")),
     handler)
    for method, template, handler in ROUTES
)


def _route(request: Request) -> tuple[Handler, str | None] | Response:
    allowed = False
    for method, pattern, handler in _PATTERNS:
        match = pattern.fullmatch(request.path)
        if match is None:
            continue
        if method == request.method:
            name = match.groupdict().get("name")
            # Routed on the raw path, named after decoding: `..%2Fetc` is a bad area name
            # (400), never a different route.
            return handler, None if name is None else unquote(name)
        allowed = True
    if allowed:
        return error_response(status=405, code="BAD_REQUEST", detail="method not allowed")
    # Its own code: an UNKNOWN_AREA here made "no such route" look like "no such area".
    return error_response(status=404, code="AGENT_ROUTE_MISSING",
                          detail=f"no route {request.path}")


def _authorized(request: Request, secret_path: Path) -> bool:
    try:
        secret = secret_path.read_bytes().strip()
    except OSError:
        return False
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secret:
        return False
    return hmac.compare_digest(token.strip().encode(), secret)


async def handle(runtime: AgentRuntime, request: Request, *, secret_path: Path) -> Response:
    """The answer to one parsed request (auth, routing, the agent's errors as documents)."""
    if request.path != "/livez" and not _authorized(request, secret_path):
        return error_response(
            status=401, code="AGENT_UNAUTHORIZED", detail="missing or wrong bearer secret"
        )
    routed = _route(request)
    if isinstance(routed, Response):
        return routed
    handler, name = routed
    try:
        return await handler(runtime, request, name)
    except AgentError as e:
        return error_response(status=e.status, code=e.code, detail=e.detail)
    except OSError as e:  # a cache, lease or record write failed: nothing was acknowledged
        return error_response(
            status=500, code="STORE_WRITE_FAILED", detail=f"{e.strerror or e}: {e.filename}"
        )
    except Exception as e:  # a fault of the agent's own: named, not a channel closed early
        log.error("agent_request_failed", method=request.method, path=request.path,
                  error_code="INTERNAL", exc_info=e)
        return error_response(status=500, code="INTERNAL",
                              detail=f"the agent failed: {type(e).__name__}: {e}"[:300])


# -- the wire ----------------------------------------------------------------------------


class _Malformed(Exception):
    pass


async def read_request(reader: asyncio.StreamReader) -> Request:
    """One request off the stream; `_Malformed` for anything that is not a bounded HTTP/1.x
    request with a Content-Length body (no chunked bodies: the owner never sends them)."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError as e:
        raise _Malformed("request head too large") from e
    except asyncio.IncompleteReadError as e:
        raise _Malformed("connection closed inside the request head") from e
    try:
        lines = head.decode("latin-1").split("\r\n")
        method, target, version = lines[0].split(" ")
    except ValueError as e:
        raise _Malformed("bad request line") from e
    if not version.startswith("HTTP/1."):
        raise _Malformed("not HTTP/1.x")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, sep, value = line.partition(":")
            if not sep:
                raise _Malformed("bad header line")
            headers[name.strip().lower()] = value.strip()
    if "chunked" in headers.get("transfer-encoding", "").lower():
        raise _Malformed("chunked bodies are not accepted")
    length = bounded_json.count(headers.get("content-length", "0"), maximum=MAX_BODY_BYTES)
    if length is None:
        raise _Malformed("missing, bad or too large Content-Length")
    try:
        body = await reader.readexactly(length)
    except asyncio.IncompleteReadError as e:
        raise _Malformed("connection closed inside the body") from e
    parts = urlsplit(target)
    query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
    return Request(method=method.upper(), path=parts.path, query=query,
                   headers=headers, body=body)


async def serve_connection(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    *,
    runtime: AgentRuntime,
    secret_path: Path,
) -> None:
    """Read one request, answer it, close. Never raises: a broken client only loses its
    own answer."""
    try:
        try:
            request = await asyncio.wait_for(read_request(reader), REQUEST_TIMEOUT_S)
        except _Malformed as e:
            response = error_response(status=400, code="BAD_REQUEST", detail=str(e))
        except asyncio.TimeoutError:
            response = error_response(status=408, code="BAD_REQUEST", detail="request too slow")
        else:
            response = await handle(runtime, request, secret_path=secret_path)
        writer.write(response.encode())
        await asyncio.wait_for(writer.drain(), REQUEST_TIMEOUT_S)
    except (OSError, asyncio.TimeoutError):
        pass  # the client went away; the answer is lost, nothing else is
    finally:
        writer.close()
        try:
            await asyncio.wait_for(writer.wait_closed(), 1.0)
        except (OSError, asyncio.TimeoutError):
            pass


async def start_server(
    runtime: AgentRuntime, *, socket_path: Path, secret_path: Path
) -> asyncio.AbstractServer:
    """Listen on `socket_path` (its directory made 0700, a stale socket replaced)."""
    _prepare_socket_dir(socket_path)

    async def connected(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await serve_connection(reader, writer, runtime=runtime, secret_path=secret_path)

    return await asyncio.start_unix_server(
        connected, path=str(socket_path), limit=MAX_HEAD_BYTES
    )


def _prepare_socket_dir(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.parent.chmod(0o700)  # an existing directory is tightened too
    if path.is_socket():
        path.unlink()  # left by an agent that died; we hold the agent lock


def socket_path(base_dir: Path) -> Path:
    """Where the agent of `base_dir` listens (the owner derives the same path from
    `remote_bin_dir`: monitord.base.config.RemoteSection.agent_socket)."""
    return base_dir / SOCKET_DIR / SOCKET_NAME


def probe(path: Path, route: str, *, secret: str, timeout_s: float = 1.0) -> int:
    """The HTTP status of `GET route` on the agent's socket (blocking; for the launcher and
    the self-check, which run before or beside the agent's loop). OSError when nothing
    answers."""
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect(str(path))
        sock.sendall(
            f"GET {route} HTTP/1.1\r\nHost: agent\r\nAuthorization: Bearer {secret}\r\n"
            "Content-Length: 0\r\n\r\n".encode()
        )
        head = sock.recv(64)
    parts = head.split(b" ", 2)
    status = bounded_json.count(parts[1].decode("latin-1")) if len(parts) >= 2 else None
    if status is None:
        raise OSError(f"not an HTTP answer from {path}")
    return status

"""The local owner's client of the agent's manager API (docs/agent.md), over the SSH connection.

Each request opens its own channel (`channel()`, an async context manager yielding a reader
and a writer): in production a `direct-streamlocal` channel of the tunnel's SSH connection
to the agent's Unix socket on the VPS (monitord.remote.agent_channel), so nothing on the PBX
listens for, or could intercept, the bearer secret. Tests and tools use a local Unix or
TCP socket (`unix_channel`, `tcp_channel`). One HTTP/1.1 request per channel, answered and
closed by the agent; with `open_ahead` (the daemon's client) each request's channel was
opened before it was needed, so a request costs one round trip, not two
(monitord/remote/agent_channels.py). Every request carries the bearer secret and a timeout;
failures are translated here, once, into typed errors with stable codes:

- no channel (tunnel down, channel refused)     -> AGENT_UNREACHABLE, provably not delivered
- lost channel / timeout / 5xx                  -> AGENT_UNREACHABLE (maybe delivered)
- 401                                           -> AGENT_UNAUTHORIZED
- 409 (another owner, other generation)         -> DESTINATION_CONFLICT (a warm copy's
                                                   snapshot refused or failed: its own code)
- the agent's own error document                -> its code (AGENT_ROUTE_MISSING: the
                                                   agent has no such route)
- a body over the size limit, a 2xx that is not the JSON document the caller relies on,
  or any other status                          -> AGENT_UNREACHABLE (maybe delivered)

What the agent says as text (an error's detail, a `result`) is made safe here, before any
error or caller holds it (monitord.base.outside_text): it ends in transaction records, logs
and an operator's terminal.

Each answer is one debug line, `agent_call` (`call`, `status`, `bytes`); made during a step of
a transaction it carries that transaction's id (monitord/engine/txn_log.py, `step`).

`RemoteInventory` conversion lives here too, so the planner sees the agent's table as the
orchestrator's frozen values.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import json
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import quote, urlencode

from monitord.base import bounded_json, log_tail, logs, outside_text, round_trips, tree_digest
from monitord.remote import agent_channels
from orchestrator import area_health, block_delta, memory_room, names
from orchestrator.block_delta import Blocks, ChangedGroups
from orchestrator.errors import ErrorCode, MonitordError, TransientError, error_for
from orchestrator.models import ProcessInfo, RemoteEntry, RemoteInventory

log = logs.get_logger(__name__)

DEFAULT_TIMEOUT_S = 10.0
# A promote digests (and fsyncs) the whole staging dir: as long as the exec it replaces had.
PROMOTE_TIMEOUT_S = 60.0
# A snapshot copies the whole live data dir on the VPS, every file fsynced, and copies again a
# file that changed meanwhile: a store of a few hundred MiB at a small VPS's disk speed.
SNAPSHOT_TIMEOUT_S = 120.0
_PATH_CHARS = 4096  # (PATH_MAX: a dir the agent names longer than that is no dir of its)
# The most response body read; a longer one is refused (AGENT_UNREACHABLE), never buffered
# whole. The inventory is the one answer that grows: an entry plus a process is ~0.5 KiB of
# JSON, so 8 MiB holds ~16 000 areas, two orders of magnitude beyond any PBX, while keeping a
# broken or hostile agent from filling the owner's memory. Every other answer is one small
# object (one area, or one line per renewed area): 1 MiB is the same margin.
MAX_INVENTORY_BYTES = 8 * 1024 * 1024
MAX_RESPONSE_BYTES = 1024 * 1024
# A tree's listing, base64 in JSON: a copy refuses a longer listing anyway.
MAX_LISTING_ANSWER_BYTES = tree_digest.MAX_LISTING_BYTES * 4 // 3 + 4096
# A staging dir's block digests (base64) and each file's name, JSON-escaped (at most
# tree_digest.MAX_BLOCK_PATHS names of at most PATH_MAX bytes, six bytes a byte).
MAX_STAGED_BLOCKS_ANSWER_BYTES = (tree_digest.BLOCK_DIGEST_BYTES * 4 // 3
                                  + tree_digest.MAX_BLOCK_PATHS * (6 * 4096 + 64) + 4096)
MAX_HEAD_BYTES = 16 * 1024
# An area's log read (at most log_tail.MAX_BYTES of text), JSON-escaped: up to six bytes a byte.
MAX_LOG_ANSWER_BYTES = 6 * log_tail.MAX_BYTES + 4096
_CHUNK_BYTES = 64 * 1024
_DETAIL_CHARS = 200  # of an agent-supplied error detail (or result) kept in ours


class AgentUnreachable(TransientError):
    """AGENT_UNREACHABLE, knowing whether the request may have reached the agent anyway."""

    def __init__(self, detail: str, *, maybe_delivered: bool) -> None:
        super().__init__(ErrorCode.AGENT_UNREACHABLE, detail)
        self.maybe_delivered = maybe_delivered


def maybe_delivered(error: MonitordError) -> bool:
    """False only when the request provably never left (no channel could be opened)."""
    return getattr(error, "maybe_delivered", True)


class ChannelReader(Protocol):
    async def read(self, n: int = -1) -> bytes: ...


class ChannelWriter(Protocol):
    def write(self, data: bytes) -> None: ...

    async def drain(self) -> None: ...

    def close(self) -> None: ...


# Opens one channel to the agent: raise AgentUnreachable(maybe_delivered=False) when none
# can be opened, and translate a failure inside the block (maybe_delivered=True).
Channel = Callable[[], contextlib.AbstractAsyncContextManager[tuple[ChannelReader, ChannelWriter]]]


def unix_channel(path: str) -> Channel:
    """A channel to an agent socket on this machine (tests, and an agent on the same host)."""
    return _stream_channel(lambda: asyncio.open_unix_connection(path), where=path)


def tcp_channel(host: str, port: int) -> Channel:
    """A channel to a TCP address (tests: a fake agent on loopback)."""
    return _stream_channel(lambda: asyncio.open_connection(host, port), where=f"{host}:{port}")


def _stream_channel(connect: Callable[[], Any], *, where: str) -> Channel:
    @contextlib.asynccontextmanager
    async def channel() -> AsyncIterator[tuple[ChannelReader, ChannelWriter]]:
        try:
            reader, writer = await connect()
        except OSError as e:
            raise AgentUnreachable(f"connect {where}: {e.strerror or e}",
                                   maybe_delivered=False) from e
        try:
            yield reader, writer
        except OSError as e:
            raise AgentUnreachable(f"{where}: {e.strerror or e}", maybe_delivered=True) from e
        finally:
            writer.close()

    return channel


@dataclass(frozen=True, slots=True)
class RenewResult:
    """The agent's answer for one area of a batch renewal."""

    area: str
    renewed: bool
    result: str
    generation: int | None


@dataclass(frozen=True, slots=True)
class AreaHealth:
    """The agent's answer to "has this area's daemon run for min_uptime_s?"."""

    healthy: bool
    uptime_s: float | None  # None: no daemon of that generation runs


@dataclass(frozen=True, slots=True)
class WarmSnapshot:
    """The agent's answer to "take a snapshot of this live data dir" (a warm copy's source):
    where it is on the VPS (`dir`, read with the copy routes as a data dir) and what it holds."""

    dir: str
    generation: int
    taken_at: float  # the VPS's wall clock when its walk began
    files: int
    bytes: int
    databases: int  # of the files, SQLite stores copied by the backup API
    took_s: float
    cpu_s: float


# The agent's 409s that are not a conflict over the area (another owner, a newer generation):
# a warm copy's snapshot refused or failed is retried at the next interval, not an error.
_OWN_CONFLICT_CODES = frozenset({ErrorCode.WARM_COPY_REFUSED, ErrorCode.WARM_COPY_FAILED})

# What an agent older than a route answers it: 404 with AGENT_ROUTE_MISSING, or UNKNOWN_AREA
# from one before that code existed (a route without an area names none).
_OLDER_AGENT_CODES = frozenset({ErrorCode.AGENT_ROUTE_MISSING, ErrorCode.UNKNOWN_AREA})


class AgentClient:
    """The manager API, one channel per request."""

    def __init__(self, *, channel: Channel, secret: bytes, timeout_s: float = DEFAULT_TIMEOUT_S,
                 open_ahead: bool = False):
        self._ahead = agent_channels.ChannelsAhead(channel) if open_ahead else None
        self._channel: Channel = self._ahead.channel if self._ahead is not None \
            else functools.partial(agent_channels.fresh, channel)
        self._authorization = f"Bearer {secret.decode().strip()}"
        self._timeout_s = timeout_s
        self._routes: frozenset[str] | None = None  # `routes()`, as last answered

    async def close(self) -> None:
        """The channel opened ahead (`open_ahead`), if any, is closed; requests after this
        open their own."""
        if self._ahead is not None:
            await self._ahead.close()

    async def _call(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: Mapping[str, str] | None = None,
        limit: int | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        """The parsed JSON body of a 2xx answer (None when it is not JSON); raises otherwise.

        The agent never redirects: a redirect, like any status that is neither 2xx nor
        4xx/5xx, is AGENT_UNREACHABLE."""
        where = f"{method} {path}"
        timeout_s = self._timeout_s if timeout_s is None else timeout_s
        target = quote(path) + (f"?{urlencode(params)}" if params else "")
        payload_bytes = b"" if body is None else json.dumps(body).encode()
        limit = MAX_RESPONSE_BYTES if limit is None else limit
        try:
            # (the channel's open is a round trip of its own unless it was opened ahead)
            async with asyncio.timeout(timeout_s), self._channel() as (reader, writer):
                with round_trips.exchange():
                    status, raw = await _exchange(
                        reader, writer, method=method, target=target,
                        authorization=self._authorization, body=payload_bytes,
                        limit=limit, where=where,
                    )
        except MonitordError:
            raise
        except TimeoutError as e:
            raise AgentUnreachable(
                f"{where}: no answer within {timeout_s:g} s", maybe_delivered=True
            ) from e
        log.debug("agent_call", call=where, status=status, bytes=len(raw))
        payload = _parse_json(raw)
        if 200 <= status < 300:
            return payload
        if status < 400:
            raise AgentUnreachable(f"{where}: unexpected HTTP {status}", maybe_delivered=True)
        error = _http_error(status, payload, where=where)
        if error.code == ErrorCode.AGENT_ROUTE_MISSING:
            self.forget_routes()  # an older agent than the one whose routes were kept
        raise error

    # -- the manager API ---------------------------------------------------------------

    async def inventory_raw(self) -> dict[str, Any]:
        """The inventory document, checked to have the shape `to_remote_inventory` (and the
        engine's readers of the raw document) rely on; AGENT_UNREACHABLE when it has not."""
        raw = await self._call("GET", "/v1/inventory", limit=MAX_INVENTORY_BYTES)
        check_inventory(raw, where="GET /v1/inventory")
        result: dict[str, Any] = raw
        return result

    async def inventory(self) -> RemoteInventory:
        return to_remote_inventory(await self.inventory_raw())

    async def create(
        self,
        *,
        area: str,
        service: str,
        generation: int,
        owner_id: str,
        lease_ttl_s: float,
        command: tuple[str, ...],
        data_dir: str,
        env: Mapping[str, str],
        user: str | None = None,
        group: str | None = None,
        log_max_bytes: int = 0,
        log_keep: int | None = None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "service": service,
            "generation": generation,
            "owner_id": owner_id,
            "lease_ttl_s": lease_ttl_s,
            "command": list(command),
            "data_dir": data_dir,
            "env": dict(env),
            "user": user,
            "group": group,
            "log_max_bytes": log_max_bytes,
        }
        if log_keep is not None:
            body["log_keep"] = log_keep
        where = f"PUT /v1/areas/{area}"
        answer = await self._call("PUT", f"/v1/areas/{area}", body=body)
        result: dict[str, Any] = _object(answer, where=where)
        return result

    async def health(
        self, *, area: str, generation: int, min_uptime_s: float, wait_s: float
    ) -> AreaHealth:
        """Whether the area's daemon at `generation` has run for `min_uptime_s`; the agent
        holds the question up to `wait_s` for that moment. An agent without this route
        (an older one) answers UNKNOWN_AREA."""
        where = f"GET /v1/areas/{area}/health"
        doc = _object(await self._call(
            "GET", f"/v1/areas/{area}/health",
            params={"generation": str(generation), "min_uptime_s": repr(float(min_uptime_s)),
                    "wait_s": f"{wait_s:.3f}"},
            timeout_s=wait_s + self._timeout_s,
        ), where=where)
        healthy, raw_uptime = doc.get("healthy"), doc.get("uptime_s")
        if not isinstance(healthy, bool):
            raise _malformed(where, f"healthy is {type(healthy).__name__}, not a boolean")
        uptime = None if raw_uptime is None else _number(raw_uptime, where=where,
                                                         what="uptime_s", minimum=0.0)
        if doc.get("generation") != generation:
            raise _malformed(where, f"it answers for generation {doc.get('generation')!r:.20}")
        if healthy and (uptime is None or uptime + 0.001 < min_uptime_s):  # (rounded to ms)
            raise _malformed(where, f"healthy with an uptime of {uptime!r:.20} s")
        return AreaHealth(healthy=healthy, uptime_s=uptime)

    async def area_log(
        self, *, area: str, lines: int | None = None, file: int | None = None,
        offset: int | None = None,
    ) -> dict[str, Any]:
        """The area's log on the VPS (`GET /v1/areas/{area}/log`, read-only, at most 1 MiB):
        its last `lines` lines, or with `offset` (and `file`) what was appended since that
        position. `{"data", "file", "offset", "missing"}` (monitord.base.log_tail). An agent
        older than the route answers AGENT_ROUTE_MISSING."""
        where = f"GET /v1/areas/{area}/log"
        params = {"lines": str(log_tail.DEFAULT_LINES if lines is None else lines)}
        if offset is not None:
            params = {"offset": str(offset)}
            if file is not None:
                params["file"] = str(file)
        doc = _object(await self._call("GET", f"/v1/areas/{area}/log", params=params,
                                       limit=MAX_LOG_ANSWER_BYTES), where=where)
        data, found_file, found_offset = doc.get("data"), doc.get("file"), doc.get("offset")
        if not isinstance(data, str) or not isinstance(doc.get("missing"), bool):
            raise _malformed(where, "data is not text or missing not a boolean")
        if not (found_file is None or bounded_json.integer(found_file) is not None) \
                or bounded_json.integer(found_offset) is None:
            raise _malformed(where, "file or offset is not an integer in [0, 2^63)")
        return {"data": data, "file": found_file, "offset": found_offset,
                "missing": doc["missing"]}

    async def routes(self) -> frozenset[str]:
        """What the agent serves, one `METHOD /path/{area}` a route (`GET /v1/routes`), so
        that a caller chooses its way once. An agent older than that route answers it 404
        (`_OLDER_AGENT_CODES`): it serves none of the routes a caller would look for, the
        empty set. Asked once and kept until `forget_routes` (a new connection, a new
        agent launched) or until a route is answered missing: no copy asks it again while
        its area is down."""
        if self._routes is None:
            self._routes = await self._asked_routes()
        return self._routes

    def forget_routes(self) -> None:
        """The agent may be another one now: ask its routes again."""
        self._routes = None

    async def _asked_routes(self) -> frozenset[str]:
        where = "GET /v1/routes"
        try:
            doc = _object(await self._call("GET", "/v1/routes"), where=where)
        except MonitordError as e:
            if e.code in _OLDER_AGENT_CODES:
                return frozenset()
            raise
        listed = doc.get("routes")
        if not isinstance(listed, list) or not all(isinstance(r, str) for r in listed):
            raise _malformed(where, "routes is not a list of strings")
        return frozenset(listed)

    async def host(self) -> memory_room.Host | None:
        """The VPS's memory (`GET /v1/host`); None from an agent older than that route,
        which answers it 404 (having accepted our secret: 401 comes before routing). A
        field that is not a whole number of bytes in [0, 2^63) is AGENT_UNREACHABLE."""
        where = "GET /v1/host"
        try:
            doc = _object(await self._call("GET", "/v1/host"), where=where)
        except MonitordError as e:
            if e.code in _OLDER_AGENT_CODES:
                return None
            raise
        return to_host(doc, where=where)

    async def promote(self, *, area: str, data_dir: str, expect: str,
                      timeout_s: float = PROMOTE_TIMEOUT_S) -> bool:
        """An upload's last step, answered by the agent (no new process inside the area's
        downtime): True once the staging dir of `data_dir`, whose listing's SHA-256 is
        `expect`, has replaced it; False when the listing differs (nothing changed). An
        agent without this route answers 404 (`routes` tells beforehand)."""
        where = f"POST /v1/areas/{area}/copy/promote"
        doc = _object(await self._call(
            "POST", f"/v1/areas/{area}/copy/promote",
            body={"data_dir": data_dir, "expect": expect}, timeout_s=timeout_s,
        ), where=where)
        promoted = doc.get("promoted")
        if not isinstance(promoted, bool):
            raise _malformed(where, f"promoted is {type(promoted).__name__}, not a boolean")
        return promoted

    async def reset_staging(self, *, area: str, data_dir: str,
                            timeout_s: float = PROMOTE_TIMEOUT_S) -> None:
        """The staging dir of `data_dir` made empty (where a copy to it starts). An agent
        without this route answers 404 (`routes` tells beforehand)."""
        where = f"POST /v1/areas/{area}/copy/staging"
        doc = _object(await self._call(
            "POST", f"/v1/areas/{area}/copy/staging",
            body={"data_dir": data_dir, "action": "reset"}, timeout_s=timeout_s,
        ), where=where)
        if doc.get("action") != "reset":
            raise _malformed(where, f"it answers for action {doc.get('action')!r:.20}")

    async def staged_blocks(self, *, area: str, data_dir: str,
                            timeout_s: float = PROMOTE_TIMEOUT_S,
                            ) -> dict[str, Blocks | None] | None:
        """The block digests of every file in the staging dir of `data_dir` (what a copy cut
        by the link left there; None for a file too large to answer for), or None when the
        VPS does not answer for them (too many files). An agent without the action answers
        BAD_REQUEST (the caller starts over instead)."""
        where = f"POST /v1/areas/{area}/copy/staging"
        doc = _object(await self._call(
            "POST", f"/v1/areas/{area}/copy/staging",
            body={"data_dir": data_dir, "action": "blocks"}, timeout_s=timeout_s,
            limit=MAX_STAGED_BLOCKS_ANSWER_BYTES,
        ), where=where)
        if doc.get("action") != "blocks":
            raise _malformed(where, f"it answers for action {doc.get('action')!r:.20}")
        answered = doc.get("blocks")
        if answered is None:
            return None
        if not isinstance(answered, dict) or len(answered) > tree_digest.MAX_BLOCK_PATHS:
            raise _malformed(where, "blocks is not one entry per staged file")
        return {rel: _blocks(value, where=f"{where}: {rel!r:.80}")
                for rel, value in answered.items()}

    async def staging_listing(self, *, area: str, data_dir: str,
                              timeout_s: float = PROMOTE_TIMEOUT_S) -> bytes:
        """The listing (`sha256sum` format, as the tree-digest verb prints it) of the staging
        dir of `data_dir`, every file fsynced there. 404 from an agent without it."""
        return await self._listing("copy/staging", area=area, timeout_s=timeout_s,
                                   body={"data_dir": data_dir, "action": "digest"})

    async def data_listing(self, *, area: str, data_dir: str,
                           timeout_s: float = PROMOTE_TIMEOUT_S) -> bytes:
        """The listing of `data_dir` itself (its digest cache kept there): where a copy from
        the VPS starts. 404 from an agent without it."""
        return await self._listing("listing", area=area, timeout_s=timeout_s,
                                   body={"data_dir": data_dir})

    async def _listing(self, route: str, *, area: str, body: dict[str, str],
                       timeout_s: float) -> bytes:
        where = f"POST /v1/areas/{area}/{route}"
        doc = _object(await self._call(
            "POST", f"/v1/areas/{area}/{route}", body=body, timeout_s=timeout_s,
            limit=MAX_LISTING_ANSWER_BYTES,
        ), where=where)
        encoded = doc.get("listing")
        if not isinstance(encoded, str):
            raise _malformed(where, f"listing is {type(encoded).__name__}, not a string")
        try:
            return base64.b64decode(encoded, validate=True)
        except ValueError as e:
            raise _malformed(where, f"listing is not base64: {e}") from e

    async def blocks(self, *, area: str, data_dir: str, paths: list[str],
                     known: dict[str, bytes] | None = None,
                     timeout_s: float = PROMOTE_TIMEOUT_S,
                     ) -> dict[str, Blocks | ChangedGroups | None]:
        """The block digests (orchestrator/block_delta.py) of each of `paths` in `data_dir`
        on the VPS (`POST /v1/areas/{area}/copy/blocks`; at most tree_digest.MAX_BLOCK_PATHS
        names): None for a name that is not a regular file there or did not fit the answer;
        for a name in `known` (the PBX's group summaries of its own copy), the digests of
        the groups that differ only, as the agent sends them (an agent before `known` sends
        every digest). An answer that is not exactly that (a name not asked for, digests
        that do not fit the size) is AGENT_UNREACHABLE; 404 from an agent without the route."""
        where = f"POST /v1/areas/{area}/copy/blocks"
        known = known or {}
        # The answer: the digests (base64), each name asked for, JSON-escaped, and the
        # indices of the groups sent (at most one per group of digests the answer holds).
        groups = (tree_digest.BLOCK_DIGEST_BYTES
                  // (block_delta.GROUP_BLOCKS * block_delta.DIGEST_BYTES) if known else 0)
        limit = (tree_digest.BLOCK_DIGEST_BYTES * 4 // 3
                 + sum(6 * len(p.encode(errors="surrogateescape")) + 64 for p in paths)
                 + 12 * groups + 4096)
        body: dict[str, Any] = {"data_dir": data_dir, "paths": paths}
        if known:
            body["known"] = {rel: base64.b64encode(g).decode("ascii") for rel, g in known.items()}
        doc = _object(await self._call(
            "POST", f"/v1/areas/{area}/copy/blocks", body=body, timeout_s=timeout_s, limit=limit,
        ), where=where)
        answered = doc.get("blocks")
        if not isinstance(answered, dict) or set(answered) != set(paths):
            raise _malformed(where, "blocks does not answer the names asked for")
        return {rel: _blocks_or_groups(value, where=f"{where}: {rel!r}", known=rel in known)
                for rel, value in answered.items()}

    async def snapshot(self, *, area: str, data_dir: str, generation: int,
                       sqlite: Sequence[str] = (), command: Sequence[str] | None = None,
                       command_timeout_s: float = 60.0, timeout_s: float = SNAPSHOT_TIMEOUT_S,
                       ) -> WarmSnapshot:
        """A consistent snapshot of the area's live `data_dir` on the VPS, taken by the agent
        (`POST /v1/areas/{area}/copy/snapshot`; `sqlite`: the globs of its SQLite stores,
        relative to the data dir): only for an area it holds at exactly `generation` with
        that data dir (WARM_COPY_REFUSED otherwise; UNKNOWN_AREA without an entry there);
        WARM_COPY_FAILED when no whole snapshot could be taken (the agent's detail names the
        file). An answer for another generation, or whose numbers are not counts and
        durations, is AGENT_UNREACHABLE; 404 from an agent without the route. `command`:
        the service's own snapshot command instead of `sqlite`, with `command_timeout_s`."""
        where = f"POST /v1/areas/{area}/copy/snapshot"
        body: dict[str, Any] = {"data_dir": data_dir, "generation": generation}
        if command is None:
            body["sqlite"] = list(sqlite)
        else:  # (the service's own command: the answer waits for it, then for the fsyncs)
            body.update(command=list(command), timeout_s=command_timeout_s)
            timeout_s = max(timeout_s, command_timeout_s + SNAPSHOT_TIMEOUT_S)
        doc = _object(await self._call(
            "POST", f"/v1/areas/{area}/copy/snapshot", timeout_s=timeout_s, body=body,
        ), where=where)
        if doc.get("generation") != generation:
            raise _malformed(where, f"it answers for generation {doc.get('generation')!r:.20}")
        found = doc.get("dir")
        if not isinstance(found, str) or not 0 < len(found) <= _PATH_CHARS:
            raise _malformed(where, "dir is not a path")
        counts = {key: _count(doc.get(key), where=where, what=key)
                  for key in ("files", "bytes", "databases")}
        seconds = {key: _number(doc.get(key), where=where, what=key, minimum=0.0)
                   for key in ("taken_at", "took_s", "cpu_s")}
        if counts["databases"] > counts["files"]:
            raise _malformed(where, "more databases than files")
        return WarmSnapshot(dir=found, generation=generation, taken_at=seconds["taken_at"],
                            files=counts["files"], bytes=counts["bytes"],
                            databases=counts["databases"], took_s=seconds["took_s"],
                            cpu_s=seconds["cpu_s"])

    async def discard_snapshot(self, *, area: str, data_dir: str,
                               timeout_s: float = PROMOTE_TIMEOUT_S) -> None:
        """The snapshots of `data_dir` on the VPS removed, once a warm copy fetched one
        (`POST /v1/areas/{area}/copy/snapshot/discard`); 404 from an agent without it."""
        where = f"POST /v1/areas/{area}/copy/snapshot/discard"
        doc = _object(await self._call("POST", f"/v1/areas/{area}/copy/snapshot/discard",
                                       body={"data_dir": data_dir}, timeout_s=timeout_s),
                      where=where)
        if doc.get("discarded") is not True:
            raise _malformed(where, "it does not say the snapshot is gone")

    async def stop(self, *, area: str, generation: int) -> str:
        """Stop the process at `generation`, keep the entry: 'stopped' or 'absent'."""
        result = await self._call(
            "POST", f"/v1/areas/{area}/stop", params={"generation": str(generation)}
        )
        return _result_of(result, where=f"POST /v1/areas/{area}/stop")

    async def delete(self, *, area: str, generation: int) -> str:
        """Stop + remove entry and data at `generation`: 'deleted' or 'absent'."""
        result = await self._call(
            "DELETE", f"/v1/areas/{area}", params={"generation": str(generation)}
        )
        return _result_of(result, where=f"DELETE /v1/areas/{area}")

    async def set_aside(self, *, area: str, generation: int) -> str | None:
        """Stop + remove the entry at `generation`, its data dir moved aside on the VPS
        (a copy an operator gave up): where it went, or None when there was none."""
        where = f"DELETE /v1/areas/{area}?aside=1"
        result = _object(await self._call(
            "DELETE", f"/v1/areas/{area}", params={"generation": str(generation), "aside": "1"}
        ), where=where)
        path = result.get("set_aside")
        if path is not None and not isinstance(path, str):
            raise error_for(ErrorCode.AGENT_UNREACHABLE, f"{where}: set_aside is not a path")
        return path

    async def remove_set_aside(self, *, name: str) -> str:
        """Remove a copy `set_aside` moved into the VPS's `abandoned` dir (`name` is the
        last part of the path it returned): 'deleted' or 'absent'. An agent older than this
        route answers 404 (AGENT_ROUTE_MISSING); `routes` tells beforehand."""
        result = await self._call("DELETE", f"/v1/abandoned/{name}")
        return _result_of(result, where=f"DELETE /v1/abandoned/{name}")

    async def renew(
        self, *, owner_id: str, ttl_s: float, areas: Mapping[str, int]
    ) -> dict[str, RenewResult]:
        body = {"owner_id": owner_id, "ttl_s": ttl_s, "areas": dict(areas)}
        where = "POST /v1/leases/renew"
        result = _object(await self._call("POST", "/v1/leases/renew", body=body), where=where)
        views = result.get("areas") or {}
        if not isinstance(views, dict):
            raise _malformed(where, f"areas is {type(views).__name__}, not an object")
        answers: dict[str, RenewResult] = {}
        for area, view in views.items():
            if not isinstance(view, dict):
                raise _malformed(where, f"areas[{area!r:.60}] is {type(view).__name__}")
            outcome = _result_of(view, where=f"{where} areas[{area!r:.60}]")
            generation = view.get("generation")
            if generation is not None and bounded_json.integer(generation) is None:
                raise _malformed(where, f"areas[{area!r:.60}].generation is {generation!r:.40}")
            answers[area] = RenewResult(
                area=area,
                renewed=outcome == "renewed",
                result=outcome,
                generation=generation,
            )
        return answers

    async def call_livez(self) -> None:
        """GET /livez (no secret needed); raises like every other call."""
        await self._call("GET", "/livez")

    async def livez(self) -> bool:
        try:
            await self.call_livez()
        except MonitordError:
            return False
        return True


async def _exchange(
    reader: ChannelReader,
    writer: ChannelWriter,
    *,
    method: str,
    target: str,
    authorization: str,
    body: bytes,
    limit: int,
    where: str,
) -> tuple[int, bytes]:
    """Send one request, read the whole answer (the agent closes after it): (status, body).
    At most `limit` body bytes are read; AGENT_UNREACHABLE (maybe delivered) beyond."""
    head = (
        f"{method} {target} HTTP/1.1\r\nHost: agent\r\nAuthorization: {authorization}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    writer.write(head.encode("ascii") + body)
    await writer.drain()
    received = bytearray()
    while True:
        chunk = await reader.read(_CHUNK_BYTES)
        if not chunk:
            break
        received += chunk
        if len(received) > MAX_HEAD_BYTES + limit:
            raise AgentUnreachable(
                f"{where}: answer over {limit} bytes refused", maybe_delivered=True
            )
    head_bytes, sep, payload = bytes(received).partition(b"\r\n\r\n")
    status_line = head_bytes.split(b"\r\n", 1)[0].split(b" ")
    if not sep or len(status_line) < 2 or not status_line[1].isdigit():
        raise _malformed(where, "not an HTTP answer (the channel closed early?)")
    if len(payload) > limit:
        raise AgentUnreachable(f"{where}: answer over {limit} bytes refused", maybe_delivered=True)
    return int(status_line[1]), payload


def _parse_json(raw: bytes) -> Any:
    """The body as JSON (UTF-8, RFC 8259) within monitord.base.bounded_json's bounds, None
    when it is empty or not such JSON. The bounds matter beyond the parse: what is read here
    is walked again later (the bundle redacts the inventory), and a document 900 levels
    deep parses but breaks the walk."""
    if not raw.strip():
        return None
    try:
        return bounded_json.loads(raw)
    except bounded_json.JsonRefused:  # bad UTF-8 or JSON, too many digits, too deep, NaN
        return None


def _blocks(value: Any, *, where: str) -> Blocks | None:
    if value is None:
        return None
    size, digests = _size_and_digests(value, where=where)
    try:
        return Blocks(size=size, digests=digests)
    except ValueError as e:  # (not one digest per block of `size`)
        raise _malformed(where, str(e)) from e


def _blocks_or_groups(value: Any, *, where: str, known: bool) -> Blocks | ChangedGroups | None:
    """One name's answer to a blocks question: its digests, or (`known`: the question
    summarised the PBX's copy) those of the groups that differ, named by ascending index."""
    groups = value.get("groups") if isinstance(value, dict) else None
    if groups is None:
        return _blocks(value, where=where)
    if not known or not isinstance(groups, list) or not all(
            bounded_json.integer(g) is not None for g in groups):
        raise _malformed(where, "groups is not a list of indices of a file summarised")
    size, digests = _size_and_digests(value, where=where)
    return ChangedGroups(size=size, groups=tuple(groups), digests=digests)


def _size_and_digests(value: Any, *, where: str) -> tuple[int, bytes]:
    size = bounded_json.integer(value.get("size")) if isinstance(value, dict) else None
    encoded = value.get("digests") if isinstance(value, dict) else None
    if size is None or not isinstance(encoded, str):
        raise _malformed(where, "not a size and its digests")
    try:
        return size, base64.b64decode(encoded, validate=True)
    except ValueError as e:
        raise _malformed(where, str(e)) from e


def _malformed(where: str, what: str) -> AgentUnreachable:
    return AgentUnreachable(f"{where}: malformed answer: {what}", maybe_delivered=True)


def _number(value: Any, *, where: str, what: str,
            minimum: float = -bounded_json.MAX_NUMBER) -> float:
    """A number of an answer (monitord.base.bounded_json.number: never a bool, NaN or an
    integer float() cannot hold); a malformed answer otherwise."""
    found = bounded_json.number(value, minimum=minimum)
    if found is None:
        raise _malformed(where, f"{what} is {value!r:.40}, not a number in [{minimum:g},"
                                f" {bounded_json.MAX_NUMBER:g}]")
    return found


def _count(value: Any, *, where: str, what: str) -> int:
    """A count of an answer (monitord.base.bounded_json.integer: [0, 2^63), never a bool or
    a float); a malformed answer otherwise."""
    found = bounded_json.integer(value)
    if found is None:
        raise _malformed(where, f"{what} is {value!r:.40}, not a count")
    return found


def _object(payload: Any, *, where: str) -> dict[str, Any]:
    if not isinstance(payload, dict):
        raise _malformed(where, f"expected a JSON object, got {type(payload).__name__}")
    return payload


def _result_of(payload: Any, *, where: str) -> str:
    """The `result` string of an answer object ('' when absent), as outside text."""
    result = _object(payload, where=where).get("result", "")
    if not isinstance(result, str):
        raise _malformed(where, f"result is {type(result).__name__}, not a string")
    return outside_text.clean(result, limit=_DETAIL_CHARS)


def _http_error(status: int, payload: Any, *, where: str) -> MonitordError:
    err = payload.get("error", {}) if isinstance(payload, dict) else {}
    if not isinstance(err, dict):
        err = {}
    # The agent's words, made safe here: the detail goes into the transaction's record.
    said = outside_text.clean(str(err.get("detail") or f"HTTP {status}"), limit=_DETAIL_CHARS)
    detail = f"{where}: {said}"
    if status == 401:
        return error_for(ErrorCode.AGENT_UNAUTHORIZED, detail)
    if status == 409:
        code = err.get("code")  # (outside text: any JSON value, hashable or not)
        if isinstance(code, str) and code in _OWN_CONFLICT_CODES:
            return error_for(code, detail)
        return error_for(ErrorCode.DESTINATION_CONFLICT, detail)
    if status >= 500:
        return AgentUnreachable(detail, maybe_delivered=True)
    code = err.get("code") or ErrorCode.BAD_REQUEST
    try:
        return error_for(code if isinstance(code, str) else ErrorCode.BAD_REQUEST, detail)
    except KeyError:
        return error_for(ErrorCode.BAD_REQUEST, detail)


def to_host(raw: Any, *, where: str) -> memory_room.Host:
    """The VPS's memory as the agent says it (`GET /v1/host`, an inventory's `host`):
    AGENT_UNREACHABLE unless an object whose two fields are byte counts in [0, 2^63) or
    null (what the VPS's kernel does not say)."""
    doc = _object(raw, where=where)
    found: dict[str, int | None] = {}
    for key in ("mem_total_bytes", "mem_available_bytes"):
        value = doc.get(key)
        if value is not None and bounded_json.integer(value) is None:
            raise _malformed(where, f"{key} is not a byte count")
        found[key] = value
    return memory_room.Host(total_bytes=found["mem_total_bytes"],
                            available_bytes=found["mem_available_bytes"])


def check_inventory(raw: Any, *, where: str) -> None:
    """AGENT_UNREACHABLE unless `raw` is an inventory document `to_remote_inventory` takes:
    an object whose `entries` and `processes` are lists of objects, each with a valid `area`
    name and fields of the types read. One bad entry refuses the whole document: an
    inventory with a hole could hide a running process from the reconciler."""
    document = _object(raw, where=where)
    for key in ("entries", "processes"):
        items = document.get(key, [])
        if not isinstance(items, list):
            raise _malformed(where, f"{key} is {type(items).__name__}, not a list")
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                raise _malformed(where, f"{key}[{i}] is {type(item).__name__}, not an object")
            if not names.is_valid(item.get("area")):
                raise _malformed(where, f"{key}[{i}].area is {item.get('area')!r:.60}")
            for field in ("generation", "pid", "restarts"):
                value = item.get(field, 0)
                if field in item and bounded_json.integer(value) is None:
                    raise _malformed(where, f"{key}[{i}].{field} is {value!r:.40}")
            if not isinstance(item.get("alive", True), bool):
                raise _malformed(where, f"{key}[{i}].alive is {item.get('alive')!r:.40}")
            for field in ("service", "owner_id"):
                value = item.get(field)
                if value is not None and not isinstance(value, str):
                    raise _malformed(where, f"{key}[{i}].{field} is {type(value).__name__}")
            for field in ("created_at", "started_at", "lease_expires_at", "uptime_s"):
                value = item.get(field)
                if value is not None:
                    _number(value, where=where, what=f"{key}[{i}].{field}")
    try:
        to_remote_inventory(document, now=0.0)
    except (ValueError, TypeError, OverflowError) as e:  # pydantic's ValidationError included
        raise _malformed(where, f"{type(e).__name__}: {outside_text.clean(str(e), limit=200)}"
                         ) from e


def to_remote_inventory(raw: Mapping[str, Any], *, now: float | None = None) -> RemoteInventory:
    """The agent's inventory document as the planner's frozen RemoteInventory."""
    wall = time.time() if now is None else now
    services = {}
    entries = []
    for e in raw.get("entries", []):
        services[e["area"]] = e.get("service", "?")
        entries.append(
            RemoteEntry(
                area=e["area"],
                service=e.get("service", "?"),
                generation=int(e.get("generation", 0)),
                owner_id=e.get("owner_id") or "",
                lease_expires_at=e.get("lease_expires_at"),
                created_at=float(e.get("created_at") or wall),
            )
        )
    processes = tuple(
        ProcessInfo(
            area=p["area"],
            service=p.get("service") or services.get(p["area"], "?"),
            generation=int(p.get("generation", 0)),
            pid=int(p["pid"]),
            started_at=float(p.get("started_at") or wall),
        )
        for p in raw.get("processes", [])
        if area_health.is_live(p)
    )
    return RemoteInventory(entries=tuple(entries), processes=processes)

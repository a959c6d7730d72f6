"""The local owner's client of the agent's manager API (docs/agent.md), over the local forward.

Called by the migration engine, the lease renewer, the reconciler and the cleanup worker.
Every request carries the bearer secret and a timeout; aiohttp failures are translated here,
once, into typed errors with stable codes:

- no connection / timeout / 5xx          -> AGENT_UNREACHABLE (transient)
- 401                                    -> AGENT_UNAUTHORIZED
- 409 (another owner, other generation)  -> DESTINATION_CONFLICT
- the agent's own error document         -> its code

`RemoteInventory` conversion lives here too, so the planner sees the agent's table as the
orchestrator's frozen values.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from orchestrator.errors import ErrorCode, MonitordError, TransientError, error_for
from orchestrator.models import ProcessInfo, RemoteEntry, RemoteInventory

DEFAULT_TIMEOUT_S = 10.0


class AgentUnreachable(TransientError):
    """AGENT_UNREACHABLE, knowing whether the request may have reached the agent anyway."""

    def __init__(self, detail: str, *, maybe_delivered: bool) -> None:
        super().__init__(ErrorCode.AGENT_UNREACHABLE, detail)
        self.maybe_delivered = maybe_delivered


def maybe_delivered(error: MonitordError) -> bool:
    """False only when the request provably never left (the connection was refused)."""
    return getattr(error, "maybe_delivered", True)


@dataclass(frozen=True, slots=True)
class RenewResult:
    """The agent's answer for one area of a batch renewal."""

    area: str
    renewed: bool
    result: str
    generation: int | None


class AgentClient:
    """One aiohttp session to `base_url` (the local end of the manager forward)."""

    def __init__(self, *, base_url: str, secret: bytes, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {secret.decode().strip()}"}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # force_close: a forward that was re-established must not reuse a dead socket.
            connector = aiohttp.TCPConnector(force_close=True)
            self._session = aiohttp.ClientSession(
                headers=self._headers, timeout=self._timeout, connector=connector
            )
        return self._session

    async def _call(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: Mapping[str, str] | None = None,
    ) -> Any:
        url = self.base_url + path
        try:
            async with self._client().request(method, url, json=body, params=params) as resp:
                try:
                    payload = await resp.json(content_type=None)
                except ValueError:
                    payload = None
                if resp.status < 400:
                    return payload
                raise _http_error(resp.status, payload, where=f"{method} {path}")
        except MonitordError:
            raise
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            # A refused connect sent nothing; anything later may have delivered the request.
            refused = isinstance(e, aiohttp.ClientConnectorError)
            raise AgentUnreachable(
                f"{method} {path}: {type(e).__name__}: {e}", maybe_delivered=not refused
            ) from e

    # -- the manager API ---------------------------------------------------------------

    async def inventory_raw(self) -> dict[str, Any]:
        result: dict[str, Any] = await self._call("GET", "/v1/inventory")
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
    ) -> dict[str, Any]:
        body = {
            "service": service,
            "generation": generation,
            "owner_id": owner_id,
            "lease_ttl_s": lease_ttl_s,
            "command": list(command),
            "data_dir": data_dir,
            "env": dict(env),
        }
        result: dict[str, Any] = await self._call("PUT", f"/v1/areas/{area}", body=body)
        return result

    async def stop(self, *, area: str, generation: int) -> str:
        """Stop the process at `generation`, keep the entry: 'stopped' or 'absent'."""
        result = await self._call(
            "POST", f"/v1/areas/{area}/stop", params={"generation": str(generation)}
        )
        return str(result.get("result", ""))

    async def delete(self, *, area: str, generation: int) -> str:
        """Stop + remove entry and data at `generation`: 'deleted' or 'absent'."""
        result = await self._call(
            "DELETE", f"/v1/areas/{area}", params={"generation": str(generation)}
        )
        return str(result.get("result", ""))

    async def renew(
        self, *, owner_id: str, ttl_s: float, areas: Mapping[str, int]
    ) -> dict[str, RenewResult]:
        body = {"owner_id": owner_id, "ttl_s": ttl_s, "areas": dict(areas)}
        result = await self._call("POST", "/v1/leases/renew", body=body)
        answers: dict[str, RenewResult] = {}
        for area, view in (result.get("areas") or {}).items():
            outcome = str(view.get("result", ""))
            answers[area] = RenewResult(
                area=area,
                renewed=outcome == "renewed",
                result=outcome,
                generation=view.get("generation"),
            )
        return answers

    async def livez(self) -> bool:
        try:
            await self._call("GET", "/livez")
        except MonitordError:
            return False
        return True


def _http_error(status: int, payload: Any, *, where: str) -> MonitordError:
    err = payload.get("error", {}) if isinstance(payload, dict) else {}
    detail = f"{where}: {err.get('detail') or f'HTTP {status}'}"
    if status == 401:
        return error_for(ErrorCode.AGENT_UNAUTHORIZED, detail)
    if status == 409:
        return error_for(ErrorCode.DESTINATION_CONFLICT, detail)
    if status >= 500:
        return AgentUnreachable(detail, maybe_delivered=True)
    code = str(err.get("code") or ErrorCode.BAD_REQUEST)
    try:
        return error_for(code, detail)
    except KeyError:
        return error_for(ErrorCode.BAD_REQUEST, detail)


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
        if p.get("pid") and p.get("alive", True)
    )
    return RemoteInventory(entries=tuple(entries), processes=processes)

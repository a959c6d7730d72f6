"""What the operator sees per service, derived from records: state, area counts, the
remote_state.json projection, and the normalisation of a legacy remote_state.json.

* `service_state()` picks exactly one of the contract states (ServiceState) for a service, by
  a fixed priority: what needs a human first, then the least advanced migration phase
  (the one holding the service back), then background cleanup, then idle.
* `area_counts()` counts a service's areas as local / remote / migrating / orphan.
* `service_view()` bundles state, counts, desired and `last_error_view()` for the API.
* `remote_state()` / `remote_state_row()` is the compatibility projection the PHP UI
  reads (docs/design.md, "Files"); it is written from transactions, never read back as truth.
* `normalise_legacy()` cleans a remote_state.json found on first start: unknown services
  and areas dropped, `migrating`/`resuming` without a transaction cleared, `parked` with
  no parked transaction cleared, malformed values reset; each change is noted.

Called by monitord/engine/operator_facade.py (the status document, the metrics and the
remote_state rows) and monitord/surface/wiring.py (the legacy remote_state.json).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Any

from orchestrator import errors
from orchestrator.models import Area, CleanupItem, Phase, Side, Transaction
from orchestrator.planner import CreateRemoteEntry, PlanAction


class ServiceState(StrEnum):
    """Service-level states of the status API (contract)."""

    IDLE = "idle"
    PREFLIGHT = "preflight"
    SUPPRESSING_SOURCE = "suppressing_source"
    COPYING = "copying"
    STARTING_DESTINATION = "starting_destination"
    AWAITING_HEALTHCHECK = "awaiting_healthcheck"
    COMMITTING = "committing"
    ROLLING_BACK = "rolling_back"
    AWAITING_DATA = "awaiting_data"  # a rollback keeps an area stopped until its data is back
    CLEANING_ORPHANS = "cleaning_orphans"
    TUNNEL_CONFLICT = "tunnel_conflict"
    PARKED = "parked"


PHASE_STATES: Mapping[Phase, ServiceState] = MappingProxyType({
    Phase.PREFLIGHT: ServiceState.PREFLIGHT,
    Phase.SUPPRESS_SOURCE: ServiceState.SUPPRESSING_SOURCE,
    Phase.COPY: ServiceState.COPYING,
    Phase.CREATE_DESTINATION: ServiceState.STARTING_DESTINATION,
    Phase.HEALTHCHECK_DESTINATION: ServiceState.AWAITING_HEALTHCHECK,
    Phase.COMMIT_LOCATION: ServiceState.COMMITTING,
    Phase.CLEANUP_SOURCE: ServiceState.CLEANING_ORPHANS,
    Phase.ROLLBACK: ServiceState.ROLLING_BACK,
    Phase.PARKED: ServiceState.PARKED,
})

# Most urgent first. A service with areas in several phases shows the first that applies.
PRIORITY: tuple[ServiceState, ...] = (
    ServiceState.PARKED,
    ServiceState.TUNNEL_CONFLICT,
    ServiceState.AWAITING_DATA,
    ServiceState.ROLLING_BACK,
    ServiceState.PREFLIGHT,
    ServiceState.SUPPRESSING_SOURCE,
    ServiceState.COPYING,
    ServiceState.STARTING_DESTINATION,
    ServiceState.AWAITING_HEALTHCHECK,
    ServiceState.COMMITTING,
    ServiceState.CLEANING_ORPHANS,
    ServiceState.IDLE,
)


def _own(service: str, transactions: Iterable[Transaction]) -> list[Transaction]:
    return [t for t in transactions if t.service == service and t.is_active]


def service_state(
    *,
    service: str,
    authoritative: Iterable[Area],
    transactions: Iterable[Transaction],
    tunnel_conflict: bool,
    orphans: int,
) -> ServiceState:
    """The one contract state of `service`.

    `tunnel_conflict`: the tunnel is held by another owner or its port by another process;
    it matters only to a service that has something remote or in flight. `orphans`: the
    service's orphan entries/processes and pending cleanup items (see orphan_count).
    """
    own = _own(service, transactions)
    present = {PHASE_STATES[t.phase] for t in own if t.phase in PHASE_STATES}
    if any(t.phase is Phase.ROLLBACK and t.data_wait_since is not None for t in own):
        present.add(ServiceState.AWAITING_DATA)
    uses_tunnel = bool(own) or any(
        a.service == service and a.location is Side.REMOTE for a in authoritative
    )
    if tunnel_conflict and uses_tunnel:
        present.add(ServiceState.TUNNEL_CONFLICT)
    if orphans:
        present.add(ServiceState.CLEANING_ORPHANS)
    return next((state for state in PRIORITY if state in present), ServiceState.IDLE)


@dataclass(frozen=True, slots=True)
class AreaCounts:
    local: int = 0
    remote: int = 0
    migrating: int = 0
    orphan: int = 0


def orphan_count(
    *, service: str, plan_actions: Iterable[PlanAction], cleanup_items: Iterable[CleanupItem]
) -> int:
    """Orphans of a service: the planner's removals and stops plus its pending cleanup items."""
    planned = sum(
        1 for a in plan_actions if a.service == service and not isinstance(a, CreateRemoteEntry)
    )
    return planned + sum(1 for item in cleanup_items if item.service == service)


def area_counts(
    *,
    service: str,
    authoritative: Iterable[Area],
    transactions: Iterable[Transaction],
    orphans: int,
) -> AreaCounts:
    """Committed areas by side, areas in a running migration, and the orphan count.

    A parked area is not migrating: it sits on its source side and counts there.
    """
    moving = {t.area for t in _own(service, transactions) if t.phase is not Phase.PARKED}
    local = remote = 0
    for area in authoritative:
        if area.service != service or area.uuid in moving:
            continue
        if area.location is Side.REMOTE:
            remote += 1
        else:
            local += 1
    return AreaCounts(local=local, remote=remote, migrating=len(moving), orphan=orphans)


def _latest_error(own: list[Transaction]) -> str:
    errors = [t for t in own if t.last_error_code]
    if not errors:
        return ""
    return max(errors, key=lambda t: t.updated_at).last_error_code or ""


def remote_state_row(
    *, transactions: Iterable[Transaction], fail_count: int, last_error: str
) -> dict[str, Any]:
    """One service's remote_state.json entry from its transactions (the contract keys).

    migrating: a migration is moving an area forward; resuming: a rollback is bringing an
    area's source back; parked: the service waits for an operator's retry.
    """
    active = [t for t in transactions if t.is_active]
    return {
        "migrating": any(t.phase not in (Phase.ROLLBACK, Phase.PARKED) for t in active),
        "resuming": any(t.phase is Phase.ROLLBACK for t in active),
        "parked": any(t.phase is Phase.PARKED for t in active),
        "fail_count": int(fail_count),
        "last_error": last_error,
    }


def remote_state(
    *,
    services: Iterable[str],
    transactions: Iterable[Transaction],
    fail_counts: Mapping[str, int],
) -> dict[str, dict[str, Any]]:
    """The remote_state.json projection, one entry per configured service."""
    every = list(transactions)
    result: dict[str, dict[str, Any]] = {}
    for service in services:
        own = _own(service, every)
        result[service] = remote_state_row(
            transactions=own,
            fail_count=fail_counts.get(service, 0),
            last_error=_latest_error(own),
        )
    return result


def last_error_view(transactions: Iterable[Transaction]) -> dict[str, Any] | None:
    """`last_error{code, detail, phase, area, at, action}` of the latest failing transaction."""
    failing = [t for t in transactions if t.last_error_code]
    if not failing:
        return None
    latest = max(failing, key=lambda t: t.updated_at)
    code = latest.last_error_code or ""
    try:
        action = errors.lookup(code).action
    except errors.UnknownErrorCode:
        action = ""
    return {
        "code": code,
        "detail": latest.last_error_detail or "",
        "phase": latest.phase.value,
        "area": latest.area,
        "at": latest.updated_at,
        "action": action,
    }


@dataclass(frozen=True, slots=True)
class ServiceView:
    """Everything the status API shows for one service, derived in one place."""

    desired: str  # "local" | "remote" | "mixed"
    state: ServiceState
    counts: Mapping[str, int]
    last_error: dict[str, Any] | None


def service_view(
    *,
    service: str,
    areas: Iterable[Area],
    transactions: Iterable[Transaction],
    desired: Side | None,
    area_desired: Mapping[str, Side],
    orphans: int,
    tunnel_conflict: bool,
    cleanup_pending: bool = False,
) -> ServiceView:
    """state + counts + desired + last error of one service (see service_state/area_counts)."""
    own_areas = [a for a in areas if a.service == service]
    txns = _own(service, transactions)
    wanted = {area_desired.get(a.uuid, desired or a.location) for a in own_areas}
    if len(wanted) > 1:
        desired_text = "mixed"
    elif wanted:
        desired_text = next(iter(wanted)).value
    else:
        desired_text = (desired or Side.LOCAL).value
    state = service_state(
        service=service,
        authoritative=own_areas,
        transactions=txns,
        tunnel_conflict=tunnel_conflict,
        orphans=orphans + (1 if cleanup_pending else 0),
    )
    counts = area_counts(
        service=service, authoritative=own_areas, transactions=txns, orphans=orphans
    )
    return ServiceView(
        desired=desired_text,
        state=state,
        counts=MappingProxyType(
            {
                "local": counts.local,
                "remote": counts.remote,
                "migrating": counts.migrating,
                "orphan": counts.orphan,
            }
        ),
        last_error=last_error_view(txns),
    )


@dataclass(frozen=True, slots=True)
class LegacyNormalisation:
    """A cleaned legacy remote_state.json and one note per change made."""

    state: dict[str, dict[str, Any]]
    notes: tuple[str, ...]

    def __bool__(self) -> bool:
        """True when something had to be changed."""
        return bool(self.notes)


def normalise_legacy(
    raw: Mapping[str, Any],
    *,
    services: Iterable[str],
    transactions: Iterable[Transaction],
    known_areas: Iterable[str] | None = None,
) -> LegacyNormalisation:
    """Bring a legacy remote_state.json in line with monitord's records (which are the truth).

    `known_areas` None keeps per-area sub-entries as found; otherwise unknown ones are dropped.
    """
    every = list(transactions)
    areas = None if known_areas is None else set(known_areas)
    configured = list(services)
    notes = [f"dropped unknown service {name!r}" for name in raw if name not in configured]
    state: dict[str, dict[str, Any]] = {}
    for service in configured:
        old = raw.get(service)
        entry = dict(old) if isinstance(old, Mapping) else {}
        if old is not None and not isinstance(old, Mapping):
            notes.append(f"{service}: replaced a malformed entry")
        own = _own(service, every)
        has_forward = any(t.phase not in (Phase.ROLLBACK, Phase.PARKED) for t in own)
        has_rollback = any(t.phase is Phase.ROLLBACK for t in own)
        has_parked = any(t.phase is Phase.PARKED for t in own)
        clean: dict[str, Any] = {}
        for key, truth, what in (
            ("migrating", has_forward, "stuck migrating"),
            ("resuming", has_rollback, "stuck resuming"),
            ("parked", has_parked, "stale parked"),
        ):
            value = entry.get(key) is True
            if value and not truth:
                notes.append(f"{service}: cleared {what} (no such transaction)")
            clean[key] = truth
        fail_count = entry.get("fail_count", 0)
        if not isinstance(fail_count, int) or isinstance(fail_count, bool) or fail_count < 0:
            notes.append(f"{service}: reset malformed fail_count {fail_count!r}")
            fail_count = 0
        if clean["parked"] is False and entry.get("parked") is True:
            fail_count = 0
        clean["fail_count"] = fail_count
        last_error = entry.get("last_error", "")
        clean["last_error"] = last_error if isinstance(last_error, str) else ""
        old_areas = entry.get("areas")
        if isinstance(old_areas, Mapping):
            known = set(old_areas) if areas is None else areas
            kept = {uuid: info for uuid, info in old_areas.items() if uuid in known}
            unknown = [uuid for uuid in old_areas if uuid not in known]
            notes.extend(f"{service}: dropped unknown area {uuid!r}" for uuid in unknown)
            clean["areas"] = kept
        state[service] = clean
    return LegacyNormalisation(state=state, notes=tuple(notes))

"""`monitord status --check`: one status document in, one monitoring verdict out.

The verdict follows the Nagios/Icinga plugin convention, so the exit code is the check's
state: 0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN. What is which is decided by the tables below,
read top to bottom by `classify()`:

    CRITICAL  a human must act: a service parked or blocked by a tunnel conflict, the
              authoritative custom_config.json unreadable (config_error), the tunnel held by
              another owner or refused for good (lease_conflict, port_occupied,
              auth_failed, host_key_mismatch)
    WARNING   monitord is working on it, but it is not fine yet: quarantined entries, the
              tunnel down or reconnecting, a rollback running or waiting for data, cleanup
              items stuck, the API not accepting changes (starting or draining), a root
              loop whose iteration fails now or failed within LOOP_ERROR_WARN_S
    UNKNOWN   the check could not tell: the daemon did not answer (decided by the caller),
              or the document holds a state these tables do not know
    OK        everything else: idle services, migrations in progress, background cleanup

The line is `MONITORD <STATE> - <findings, worst first> | <perfdata>`. Pure: called by
`monitord.surface.client_commands` with the JSON document of `GET /v1/status`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from orchestrator import area_health
from orchestrator.status import ServiceState


class CheckState(enum.IntEnum):
    """A check's state; the value is the plugin's exit code."""

    OK = 0
    WARNING = 1
    CRITICAL = 2
    UNKNOWN = 3


_OK, _WARN, _CRIT = CheckState.OK, CheckState.WARNING, CheckState.CRITICAL

# Which state wins when findings disagree: a known problem outranks "could not tell".
_RANK: Mapping[CheckState, int] = MappingProxyType(
    {CheckState.OK: 0, CheckState.UNKNOWN: 1, CheckState.WARNING: 2, CheckState.CRITICAL: 3}
)

# Every contract service state (orchestrator.status.ServiceState).
SERVICE_STATES: Mapping[ServiceState, CheckState] = MappingProxyType({
    ServiceState.IDLE: _OK,
    ServiceState.PREFLIGHT: _OK,
    ServiceState.SUPPRESSING_SOURCE: _OK,
    ServiceState.COPYING: _OK,
    ServiceState.STARTING_DESTINATION: _OK,
    ServiceState.AWAITING_HEALTHCHECK: _OK,
    ServiceState.COMMITTING: _OK,
    ServiceState.CLEANING_ORPHANS: _OK,
    ServiceState.ROLLING_BACK: _WARN,
    ServiceState.AWAITING_DATA: _WARN,
    ServiceState.TUNNEL_CONFLICT: _CRIT,
    ServiceState.PARKED: _CRIT,
})

# Every tunnel state the keeper reports, plus "not_configured" (no [remote] section).
TUNNEL_STATES: Mapping[str, CheckState] = MappingProxyType({
    "not_configured": _OK,
    "connected": _OK,
    "connecting": _WARN,
    "backoff": _WARN,
    "stopped": _WARN,
    "lease_conflict": _CRIT,
    "port_occupied": _CRIT,
    "auth_failed": _CRIT,
    "host_key_mismatch": _CRIT,
})

# Forward states (tunnel.forwards[].state) that deserve a word while the tunnel is up.
FORWARD_STATES: Mapping[str, CheckState] = MappingProxyType({
    "pending": _OK,
    "proven": _OK,
    "target_down": _WARN,
})


# How long after a root loop's last failed iteration the check still warns (the loop went on,
# but someone should read the log line with its traceback).
LOOP_ERROR_WARN_S = 900.0


@dataclass(frozen=True, slots=True)
class Finding:
    """One thing the check noticed, with the state it deserves."""

    state: CheckState
    text: str


@dataclass(frozen=True, slots=True)
class Verdict:
    """The check's state, what led to it (worst first) and the figures it reports."""

    state: CheckState
    findings: tuple[Finding, ...]
    perfdata: tuple[tuple[str, int], ...] = ()
    summary: str = ""  # shown when nothing is wrong

    @property
    def exit_code(self) -> int:
        return int(self.state)

    def line(self) -> str:
        """The plugin's one output line: `MONITORD STATE - text | label=value ...`."""
        problems = [f.text for f in self.findings if f.state is not CheckState.OK]
        text = "; ".join(problems) if problems else self.summary
        perf = " ".join(f"{label}={value}" for label, value in self.perfdata)
        return f"MONITORD {self.state.name} - {text}" + (f" | {perf}" if perf else "")


def unreachable(detail: str) -> Verdict:
    """The verdict when the daemon did not answer (DAEMON_UNREACHABLE): UNKNOWN."""
    return Verdict(
        state=CheckState.UNKNOWN,
        findings=(Finding(CheckState.UNKNOWN, f"DAEMON_UNREACHABLE: {detail}"),),
    )


def unusable(text: str) -> Verdict:
    """The verdict when the check could not run (bad config, an API error): UNKNOWN."""
    return Verdict(state=CheckState.UNKNOWN, findings=(Finding(CheckState.UNKNOWN, text),))


def classify(status: Mapping[str, Any], *, now: float | None = None) -> Verdict:
    """The verdict for one `GET /v1/status` document (fields: docs/design.md); `now` (wall
    clock) dates the root loops' last errors (default: the document's `at`, which is when it
    was built — possibly long ago, the status API rebuilds it only on a change)."""
    services = status.get("services")
    if not isinstance(services, Mapping):
        return unusable("the status document has no services")
    findings = [
        *_config_findings(status),
        *_tunnel_findings(status.get("tunnel")),
        *_service_findings(services),
        *_background_findings(status, now=now),
        *_warm_copy_findings(services, now=now if now is not None else _float(status.get("at"))),
    ]
    findings.sort(key=lambda f: -_RANK[f.state])
    worst = findings[0].state if findings else CheckState.OK
    return Verdict(
        state=worst,
        findings=tuple(findings),
        perfdata=_perfdata(status),
        summary=_summary(status, services),
    )


# -- the parts of the document ----------------------------------------------------------------


def _config_findings(status: Mapping[str, Any]) -> list[Finding]:
    found = []
    error = status.get("config_error")
    if error:
        found.append(Finding(_CRIT, f"config_error {_code_and_detail(error)}"))
    quarantined = status.get("quarantined") or []
    if quarantined:
        codes = sorted({str(q.get("code", "")) for q in quarantined if isinstance(q, Mapping)})
        found.append(Finding(
            _WARN, f"{len(quarantined)} quarantined custom_config.json entr"
                   f"{'y' if len(quarantined) == 1 else 'ies'} ({', '.join(codes)})"
        ))
    held = [h for h in status.get("held") or [] if isinstance(h, Mapping)]
    if held:
        found.append(Finding(
            _CRIT, f"{len(held)} area{'' if len(held) == 1 else 's'} held on both sides"
                   f" after state.db was lost: {str(held[0].get('area'))[:64]}:"
                   f" {str(held[0].get('detail'))[:300]}"))
    if status.get("accepting") is False:
        found.append(Finding(_WARN, "not accepting changes (starting or draining)"))
    return found


def _tunnel_findings(tunnel: Any) -> list[Finding]:
    if not isinstance(tunnel, Mapping):
        return [Finding(CheckState.UNKNOWN, "the status document has no tunnel")]
    state = str(tunnel.get("state", ""))
    level = TUNNEL_STATES.get(state, CheckState.UNKNOWN)
    found = []
    if level is not CheckState.OK:
        error = tunnel.get("last_error") or ""
        holder = tunnel.get("lease_holder")
        held_by = (
            f" held by {holder.get('owner_label') or holder.get('owner_id')}"
            if isinstance(holder, Mapping) and (holder.get("owner_label") or
                                                holder.get("owner_id"))
            else ""
        )
        found.append(Finding(
            level, f"tunnel {state or '?'}{held_by}" + (f" ({error})" if error else "")
        ))
    if tunnel.get("connected"):
        for forward in tunnel.get("forwards") or []:
            if not isinstance(forward, Mapping):
                continue
            forward_state = str(forward.get("state", ""))
            forward_level = FORWARD_STATES.get(forward_state, CheckState.UNKNOWN)
            if forward_level is not CheckState.OK:
                found.append(Finding(
                    forward_level, f"forward {forward.get('name', '?')} {forward_state}"
                ))
    return found


def _service_findings(services: Mapping[str, Any]) -> list[Finding]:
    found = []
    for name in sorted(services):
        view = services[name]
        state = str(view.get("state", "")) if isinstance(view, Mapping) else ""
        try:
            level = SERVICE_STATES[ServiceState(state)]
        except ValueError:
            level = CheckState.UNKNOWN
        if level is CheckState.OK:
            continue
        error = view.get("last_error") if isinstance(view, Mapping) else None
        code = error.get("code") if isinstance(error, Mapping) else None
        found.append(Finding(level, f"{name} {state or '?'}" + (f" ({code})" if code else "")))
    for name in sorted(services):
        view = services[name]
        areas = view.get("areas") if isinstance(view, Mapping) else None
        if isinstance(areas, list):
            sick = area_health.service_findings(
                str(name), [a for a in areas if isinstance(a, Mapping)])
            found.extend(Finding(_CRIT if level == "critical" else _WARN, text)
                         for level, text in sick)
    return found


def _background_findings(status: Mapping[str, Any], *, now: float | None) -> list[Finding]:
    found = []
    cleanup = status.get("cleanup") or {}
    stuck = int(cleanup.get("stuck", 0) or 0) if isinstance(cleanup, Mapping) else 0
    if stuck:
        found.append(Finding(_WARN, f"{stuck} cleanup item{'s' if stuck != 1 else ''} stuck"
                                    " (CLEANUP_STUCK)"))
    loops = status.get("loops") or {}
    if isinstance(loops, Mapping):
        now = now if now is not None else _float(status.get("at"))
        for name in sorted(loops):
            finding = _loop_finding(str(name), loops[name], now=now)
            if finding is not None:
                found.append(finding)
    return found


def _warm_copy_findings(services: Mapping[str, Any], *, now: float | None) -> list[Finding]:
    """Remote areas whose warm copy is past `overdue_at` (orchestrator/warm_copy.py: three
    intervals old): what a give-up would lose has grown past the bound the service chose."""
    late: list[tuple[str, Mapping[str, Any]]] = []
    for name, service in sorted(services.items()):
        areas = service.get("areas") if isinstance(service, Mapping) else None
        for area in areas if isinstance(areas, list) else []:
            warm = area.get("warm_copy") if isinstance(area, Mapping) else None
            due = _float(warm.get("overdue_at")) if isinstance(warm, Mapping) else None
            if now is not None and due is not None and now > due:
                late.append((str(name), warm))  # type: ignore[arg-type]
    if not late:
        return []
    name, warm = late[0]
    taken = _float(warm.get("taken_at"))
    age = "none yet" if taken is None or now is None else f"{now - taken:.0f} s old"
    error = warm.get("error")
    why = f", last {error.get('code', '?')}" if isinstance(error, Mapping) else ""
    return [Finding(_WARN, f"{len(late)} warm cop{'y' if len(late) == 1 else 'ies'} overdue"
                           f" ({name}: {age}{why})")]


def _loop_finding(name: str, loop: Any, *, now: float | None) -> Finding | None:
    """A root loop that fails now, or failed lately (monitord/base/periodic.py)."""
    if not isinstance(loop, Mapping):
        return None
    last = loop.get("last_error")
    if not isinstance(last, Mapping):
        return None
    at = _float(last.get("at"))
    recent = now is None or at is None or now - at < LOOP_ERROR_WARN_S
    if not (_int(loop.get("failing", 0)) or recent):
        return None
    errors = _int(loop.get("errors", 0))
    return Finding(_WARN, f"{name} loop: {errors} failed iteration{'s' if errors != 1 else ''}"
                          f" (last {last.get('code', '?')})")


def _perfdata(status: Mapping[str, Any]) -> tuple[tuple[str, int], ...]:
    counts = status.get("counts") or {}
    cleanup = status.get("cleanup") or {}
    figures = [
        *((f"areas_{side}", counts.get(side, 0)) for side in ("local", "remote", "migrating")),
        ("orphans", counts.get("orphan", 0)),
        ("cleanup_backlog", cleanup.get("backlog", 0)),
        ("cleanup_stuck", cleanup.get("stuck", 0)),
        ("quarantined", len(status.get("quarantined") or [])),
    ]
    return tuple((label, _int(value)) for label, value in figures)


def _summary(status: Mapping[str, Any], services: Mapping[str, Any]) -> str:
    counts = status.get("counts") or {}
    tunnel = status.get("tunnel") or {}
    return (
        f"{len(services)} service{'s' if len(services) != 1 else ''},"
        f" areas local {_int(counts.get('local', 0))} remote {_int(counts.get('remote', 0))}"
        f" migrating {_int(counts.get('migrating', 0))}; tunnel {tunnel.get('state', '?')}"
    )


def _code_and_detail(error: Any) -> str:
    if isinstance(error, Mapping):
        return f"{error.get('code', '?')}: {error.get('detail', '')}".rstrip(": ")
    return str(error)


def _float(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0

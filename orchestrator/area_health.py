"""How each area's daemon is doing where it is placed: the per-area view of the status
document (`services.*.areas[].process`) and what `status --check` and the metrics make of it.

A sick area must not look healthy: a daemon in a crash loop, or not running where its
placement says it runs, is named — per area in the status, as a WARNING in the check
(CRITICAL when every area of a service is down), and in `monitord_area_up`. Pure: the
facts come from the local supervisor and from the agent's last inventory
(monitord/engine/operator_facade.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from enum import StrEnum
from typing import Any

# Consecutive runs shorter than the service's min_uptime_s (the supervisor's or the agent's
# back-off count) from which an area is "crash-looping" rather than restarting once.
CRASH_LOOP_FAILURES = 3


class Health(StrEnum):
    UP = "up"  # running where it is placed
    CRASH_LOOP = "crash_loop"  # restarting again and again
    DOWN = "down"  # not running where it is placed (and not moving)
    MOVING = "moving"  # a transaction owns it: its phases say how it does
    UNKNOWN = "unknown"  # its side cannot be looked at now (the VPS does not answer)


@dataclass(frozen=True, slots=True)
class AreaProcess:
    """One area's daemon on the side it is placed on."""

    side: str
    state: str  # running | backoff | stopped | missing | unknown
    pid: int | None = None
    # wall clock of this machine (for the VPS: when the agent answered, less the uptime it
    # gave); a time, not an uptime, so that a status document built once stays true
    started_at: float | None = None
    restarts: int = 0  # since this monitord (local) or the agent's entry (remote) began
    restarts_1h: int | None = None  # local only: the agent does not keep restart times
    failures: int = 0  # consecutive runs shorter than min_uptime_s
    last_exit_status: int | None = None  # local only
    as_of: float | None = None  # remote: when the agent's inventory was read (wall clock)

    def health(self) -> Health:
        if self.state == "unknown":
            return Health.UNKNOWN
        if self.failures >= CRASH_LOOP_FAILURES:
            return Health.CRASH_LOOP
        return Health.UP if self.state == "running" else Health.DOWN

    def to_dict(self) -> dict[str, Any]:
        # Field by field: every value is a scalar, and dataclasses.asdict's deep copy was
        # about half of what a remote area's view cost the status document.
        return {**{name: getattr(self, name) for name in _PROCESS_FIELDS},
                "health": str(self.health())}


_PROCESS_FIELDS = tuple(f.name for f in fields(AreaProcess))


def recent_failures(*, failures: int, running: bool, uptime_s: float | None,
                    min_uptime_s: float) -> int:
    """The back-off count of a side, as it stands now: a daemon that has been up for its
    service's min_uptime_s has broken the loop, though the count resets only at its next
    exit."""
    if running and uptime_s is not None and uptime_s >= min_uptime_s:
        return 0
    return failures


@dataclass(frozen=True, slots=True)
class RemoteInventoryIndex:
    """The agent's inventory document by (area, generation), built once per status document:
    looking each area up in the lists cost every document O(areas²) (76 ms at 1000 areas)."""

    entries: Mapping[tuple[Any, Any], Mapping[str, Any]]
    live: Mapping[tuple[Any, Any], Mapping[str, Any]]  # processes alive, with a pid


def index_inventory(inventory: Mapping[str, Any] | None) -> RemoteInventoryIndex | None:
    """`inventory` (checked by monitord.remote.agent_client.check_inventory) indexed; the
    first item of a key wins, as a scan of the list would find it. None stays None."""
    if inventory is None:
        return None
    entries: dict[tuple[Any, Any], Mapping[str, Any]] = {}
    live: dict[tuple[Any, Any], Mapping[str, Any]] = {}
    for entry in inventory.get("entries", []):
        _keep_first(entries, entry)
    for proc in inventory.get("processes", []):
        if is_live(proc):
            _keep_first(live, proc)
    return RemoteInventoryIndex(entries=entries, live=live)


def is_live(proc: Mapping[str, Any]) -> bool:
    """A process of the agent's inventory that runs: not said dead, and with a pid."""
    return bool(proc.get("alive", True) and proc.get("pid"))


def _keep_first(index: dict[tuple[Any, Any], Mapping[str, Any]],
                item: Mapping[str, Any]) -> None:
    try:
        index.setdefault((item.get("area"), item.get("generation")), item)
    except TypeError:  # an unhashable name or generation matches no area anyway
        pass


def remote_process(
    inventory: RemoteInventoryIndex | None, *, area: str, generation: int,
    as_of: float | None, min_uptime_s: float,
) -> AreaProcess:
    """The area at `generation` in the agent's inventory (`index_inventory`); `unknown`
    without one."""
    if inventory is None:
        return AreaProcess(side="remote", state="unknown")
    entry = inventory.entries.get((area, generation))
    proc = inventory.live.get((area, generation))
    restarts = int(entry.get("restarts", 0) or 0) if entry else 0
    if proc is not None:
        uptime_s = float(proc.get("uptime_s") or 0.0)
        return AreaProcess(side="remote", state="running", pid=int(proc["pid"]),
                           started_at=None if as_of is None else round(as_of - uptime_s, 3),
                           restarts=restarts, as_of=as_of,
                           failures=recent_failures(failures=restarts, running=True,
                                                    uptime_s=uptime_s,
                                                    min_uptime_s=min_uptime_s))
    # An entry without a live daemon is between restarts: its count is the agent's back-off.
    return AreaProcess(side="remote", state="backoff" if entry else "missing",
                       restarts=restarts, failures=restarts if entry else 0, as_of=as_of)


def service_findings(service: str, areas: list[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """(level, text) for `status --check` from one service's area views: `critical` when
    every area of it that is not moving is down, `warning` for each sick area otherwise."""
    judged = [a for a in areas if isinstance(a.get("process"), Mapping)]
    health = {str(a.get("uuid", "?")): str(a["process"].get("health")) for a in judged}
    settled = [h for h in health.values() if h not in (Health.MOVING, Health.UNKNOWN)]
    sick = {uuid: h for uuid, h in health.items() if h in (Health.DOWN, Health.CRASH_LOOP)}
    if not sick:
        return []
    if len(sick) == len(settled):
        return [("critical", f"{service} down: {_areas(len(sick))} not running")]
    found = []
    for uuid, h in sorted(sick.items()):
        what = "crash-looping" if h == Health.CRASH_LOOP else "down"
        found.append(("warning", f"{service} area {uuid[:8]} {what}"))
    return found


def _areas(n: int) -> str:
    return f"all {n} areas" if n != 1 else "its area"

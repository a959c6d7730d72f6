"""Whether an area's daemon fits in the VPS's memory: the memory arithmetic of a move there.

A VPS that runs out of memory does not refuse a start: the kernel's OOM killer ends some
process later — an area's daemon (its guard restarts it, into the same shortage), the agent,
or sshd. So a move to the VPS is refused in preflight, before anything stops, when what the
area will take there does not fit in what the VPS has available:

- the daemon: what it holds resident on the PBX now (the same program with the same data;
  unknown when it does not run there, and then only the rest is judged);
- its lease guard: `GUARD_BYTES` (a guard forked on the VPS: 3.65 to 3.84 MiB of its own
  on Debian 11 to 13, docs/benchmarks.md);
- what the moves still under way to the VPS claim (`claimed_bytes`, `Claims`: their daemons
  may not show in the VPS's figure yet);
- and `reserve_bytes` kept free for everything else (`remote.memory_reserve_mib`).

"Available" is the kernel's own estimate of what can be allocated without swapping
(/proc/meminfo's MemAvailable), read by the agent at each preflight. A VPS that does not
tell (an agent older than `GET /v1/host`, a kernel without the field) is not judged.

Pure: called by monitord/remote/preflight.py and monitord/engine/phase_actions.py (the claims).
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.disk_space import MIB, mib_text

GUARD_BYTES = 4 * MIB


@dataclass(frozen=True, slots=True)
class Host:
    """The VPS's memory as its agent read it; None where it could not tell."""

    total_bytes: int | None
    available_bytes: int | None


@dataclass(frozen=True, slots=True)
class Need:
    """What a move to the VPS asks of its memory (module doc)."""

    daemon_bytes: int | None  # None: the daemon does not run where the area is now
    claimed_bytes: int = 0
    reserve_bytes: int = 0  # remote.memory_reserve_mib: the preflight sets it

    @property
    def area_bytes(self) -> int:
        """The area's own share: its daemon (when known) and its lease guard."""
        return (self.daemon_bytes or 0) + GUARD_BYTES

    @property
    def total_bytes(self) -> int:
        return self.area_bytes + self.claimed_bytes + self.reserve_bytes


@dataclass(frozen=True, slots=True)
class Shortage:
    """The area does not fit: `need.total_bytes` wanted, `available` there."""

    available: int
    need: Need

    @property
    def missing(self) -> int:
        return self.need.total_bytes - self.available

    def detail(self) -> str:
        """The sentence the status and the CLI show: each part, and what is missing."""
        need = self.need
        daemon = ("its daemon's size unknown (not running on the PBX)"
                  if need.daemon_bytes is None
                  else f"its daemon {mib_text(need.daemon_bytes)} as resident on the PBX")
        claimed = (f", moves under way {mib_text(need.claimed_bytes)}"
                   if need.claimed_bytes else "")
        return (f"VPS: {mib_text(self.available)} of memory available, {mib_text(need.total_bytes)}"
                f" needed ({daemon}, its lease guard {mib_text(GUARD_BYTES)}{claimed},"
                f" {mib_text(need.reserve_bytes)} kept free): {mib_text(self.missing)} missing")

    def facts(self) -> dict[str, object]:
        """The numbers as fields of the service's last error (status API)."""
        return {"side": "VPS", "unit": "memory_bytes", "needed_bytes": self.need.total_bytes,
                "available_bytes": self.available, "daemon_bytes": self.need.daemon_bytes,
                "claimed_bytes": self.need.claimed_bytes,
                "reserve_bytes": self.need.reserve_bytes}


class Claims:
    """What the moves under way to the VPS claim of its memory, by transaction id, from their
    preflight until they end: a daemon just started there may not show in the VPS's figure
    yet, so the moves count it for each other. (A claim is taken with its need, in one step:
    two preflights at once each count the other.)"""

    def __init__(self) -> None:
        self._needs: dict[str, Need] = {}

    def claim(self, key: str, *, daemon_bytes: int | None) -> Need:
        """The need of `key`'s move with every other claim counted, claimed from now on. A
        daemon not running (a preflight checked again once the source stopped) keeps the
        size measured before."""
        earlier = self._needs.get(key)
        if daemon_bytes is None and earlier is not None:
            daemon_bytes = earlier.daemon_bytes
        claimed = sum(need.area_bytes for other, need in self._needs.items() if other != key)
        need = Need(daemon_bytes=daemon_bytes, claimed_bytes=claimed)
        self._needs[key] = need
        return need

    def release(self, key: str) -> None:
        self._needs.pop(key, None)


def shortage(host: Host, need: Need) -> Shortage | None:
    """None when the area fits (or the VPS does not tell); else what is short."""
    if host.available_bytes is None or host.available_bytes >= need.total_bytes:
        return None
    return Shortage(available=host.available_bytes, need=need)


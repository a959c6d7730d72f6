"""The per-area lease file: the one fact a lease guard trusts (docs/agent.md, "Self-fencing").

The agent rewrites it atomically on every grant (create or renewal). It holds the expiry
twice: on the wall clock and on CLOCK_BOOTTIME (which never jumps and counts suspend). A
guard treats the lease as lapsed as soon as EITHER clock passes its expiry, so a wall-clock
step can only shorten a lease, never stretch it. A missing or unreadable file is a lapsed
lease. Written by `monitord.vps.runtime`, read by `monitord.vps.lease_guard`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from monitord.base import atomic_file


def boottime() -> float:
    """Seconds since boot on a clock that never steps and keeps counting in suspend."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


@dataclass(frozen=True)
class LeaseRecord:
    """One area's current grant as the guard sees it."""

    area: str
    generation: int
    owner_id: str
    expires_at_wall: float
    expires_at_boottime: float

    def is_current(self, *, wall: float, boot: float) -> bool:
        return wall < self.expires_at_wall and boot < self.expires_at_boottime


def write(path: Path, *, area: str, generation: int, owner_id: str, ttl_s: float) -> LeaseRecord:
    """Grant `ttl_s` seconds from now and persist it atomically; returns what was written."""
    record = LeaseRecord(
        area=area,
        generation=generation,
        owner_id=owner_id,
        expires_at_wall=time.time() + ttl_s,
        expires_at_boottime=boottime() + ttl_s,
    )
    document: dict[str, object] = {
        "area": record.area,
        "generation": record.generation,
        "owner_id": record.owner_id,
        "expires_at_wall": record.expires_at_wall,
        "expires_at_boottime": record.expires_at_boottime,
    }
    # Not fsynced: every renewal rewrites every area's file (a hundred fsyncs per renewal
    # held up the agent's loop), and no reader can use a file a crash took back — the
    # guards die with the machine, and after a boot nothing starts without a new grant,
    # which writes a new file. The rename still keeps a running guard from a torn read.
    atomic_file.atomic_write_bytes(path, json.dumps(document).encode(), mode=0o600,
                                   durable=False)
    return record


def revoke(path: Path) -> None:
    """Remove the lease: a guard reading the directory afterwards fences its daemon."""
    path.unlink(missing_ok=True)


def read(path: Path) -> LeaseRecord | None:
    """The lease on disk, or None when it is missing or unreadable (both mean lapsed)."""
    try:
        data = json.loads(path.read_text())
        return LeaseRecord(
            area=str(data["area"]),
            generation=int(data["generation"]),
            owner_id=str(data["owner_id"]),
            expires_at_wall=float(data["expires_at_wall"]),
            expires_at_boottime=float(data["expires_at_boottime"]),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None

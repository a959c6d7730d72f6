"""The VPS's memory as the kernel tells it: `GET /v1/host` (monitord/vps/server.py).

A move's preflight asks it (orchestrator/memory_room.py judges it): /proc/meminfo's MemTotal
and MemAvailable, the kernel's estimate of what can be allocated without swapping. Read at
each question (a few microseconds): moves change it. Standard library only, Python >= 3.9.
"""

from __future__ import annotations

from pathlib import Path

MEMINFO = Path("/proc/meminfo")
_FIELDS = {"MemTotal:": "mem_total_bytes", "MemAvailable:": "mem_available_bytes"}


def read(path: Path = MEMINFO) -> dict[str, int | None]:
    """{"mem_total_bytes": N, "mem_available_bytes": N}; None for what it does not say (a
    kernel before 3.14 has no MemAvailable; a /proc that cannot be read says nothing)."""
    found: dict[str, int | None] = {name: None for name in _FIELDS.values()}
    try:
        text = path.read_text()
    except OSError:
        return found
    for line in text.splitlines():
        parts = line.split()
        name = _FIELDS.get(parts[0]) if parts else None
        if name is not None and len(parts) == 3 and parts[2] == "kB" \
                and parts[1].isascii() and parts[1].isdigit():  # (isdigit alone takes "²")
            found[name] = int(parts[1]) * 1024
    return found

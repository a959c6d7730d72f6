"""The agent's `{dir}/spool/custom_config.json`: a cache of its entries, never a permission.

Written atomically (temp, fsync, rename, fsync dir) after every change of the entry set.
Read once at agent start to know which areas exist (so inventory, stop and delete work
after a restart); every loaded entry starts in `awaiting_grant` and runs nothing until the
owner grants it again. Leases are deliberately not cached. A cache that cannot be parsed is
moved aside (`custom_config.json.corrupt-<time>`) and the agent starts with an empty table:
losing a cache can only make the agent run less, never more. Called by monitord.vps.runtime.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from monitord.base import atomic_file
from monitord.vps.lease_table import AreaEntry, AreaSpec
from orchestrator.errors import ErrorCode, PermanentError

CACHE_NAME = "custom_config.json"


class CacheUnreadable(PermanentError):
    """The cache file exists but is not a valid cache; it was moved to `moved_to`."""

    def __init__(self, *, moved_to: Path, detail: str) -> None:
        super().__init__(ErrorCode.CONFIG_CORRUPT, f"agent cache moved to {moved_to}: {detail}")
        self.moved_to = moved_to


def _entry_to_json(entry: AreaEntry) -> dict[str, Any]:
    spec = entry.spec
    return {
        "uuid": spec.area,
        "service": spec.service,
        "location": "remote",
        "generation": spec.generation,
        "owner_id": spec.owner_id,
        "command": list(spec.command),
        "data_dir": spec.data_dir,
        "env": dict(spec.env),
        "user": spec.user,
        "group": spec.group,
        "log_max_bytes": spec.log_max_bytes,
        "log_keep": spec.log_keep,
        "run_wanted": entry.run_wanted,
        "created_at": entry.created_at,
    }


def _entry_from_json(raw: dict[str, Any]) -> AreaEntry:
    spec = AreaSpec(
        area=str(raw["uuid"]),
        service=str(raw["service"]),
        generation=int(raw["generation"]),
        owner_id=str(raw["owner_id"]),
        command=tuple(str(part) for part in raw["command"]),
        data_dir=str(raw["data_dir"]),
        env={str(k): str(v) for k, v in dict(raw.get("env") or {}).items()},
        user=None if raw.get("user") is None else str(raw["user"]),
        group=None if raw.get("group") is None else str(raw["group"]),
        log_max_bytes=int(raw.get("log_max_bytes") or 0),
        log_keep=int(raw.get("log_keep", -1)),
    )
    return AreaEntry(
        spec=spec,
        created_at=float(raw.get("created_at") or 0.0),
        run_wanted=bool(raw.get("run_wanted", True)),
        lease_expires=None,
    )


def save(path: Path, entries: Iterable[AreaEntry]) -> None:
    document = {"custom_daemons": [_entry_to_json(entry) for entry in entries]}
    data = (json.dumps(document, indent=2) + "\n").encode()
    atomic_file.atomic_write_bytes(path, data, mode=0o600)


def load(path: Path) -> dict[str, AreaEntry]:
    """Entries from the cache, all without a lease; {} if there is no cache yet."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return {}
    try:
        document = json.loads(raw)
        entries = [_entry_from_json(item) for item in document["custom_daemons"]]
    except (ValueError, KeyError, TypeError) as e:
        moved_to = path.with_name(f"{path.name}.corrupt-{int(time.time())}")
        path.rename(moved_to)
        raise CacheUnreadable(moved_to=moved_to, detail=f"{type(e).__name__}: {e}") from e
    return {entry.spec.area: entry for entry in entries}

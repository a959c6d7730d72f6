"""`{work_dir}/abandoned_copies.json`: the VPS copies an operator gave up.

One row per (area, generation) given up (orchestrator/give_up.py): when, and — once the VPS
answered again and the agent moved the data dir aside instead of deleting it — where it went
on the VPS. Written atomically and durably (monitord.base.atomic_file), read at start-up.

A file beside state.db rather than a state.db table: an older monitord started on the same
work_dir (a rollback of an upgrade) must still open state.db, and it refuses a schema newer
than its own. Written before the lineage that gives the copy up, so a crash between the two
leaves at worst a copy set aside that was not given up — never one deleted that was.
Called by monitord.engine.placement_state.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from monitord.base import atomic_file

FILE_NAME = "abandoned_copies.json"

Row = dict[str, Any]  # area, generation, abandoned_at, set_aside_path, set_aside_at


def load(path: Path) -> dict[tuple[str, int], Row]:
    """The rows by (area, generation); none when the file does not exist. A file that does
    not parse is kept as it is and read as empty (the copies are then deleted, not set
    aside, as before this record existed): it is never overwritten unread."""
    try:
        document = json.loads(path.read_bytes())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        return {}
    rows: dict[tuple[str, int], Row] = {}
    for row in document.get("copies", []) if isinstance(document, dict) else []:
        if isinstance(row, dict) and isinstance(row.get("area"), str) \
                and isinstance(row.get("generation"), int):
            rows[(row["area"], row["generation"])] = row
    return rows


def save(path: Path, rows: dict[tuple[str, int], Row]) -> None:
    document = {"copies": [rows[key] for key in sorted(rows)]}
    atomic_file.atomic_write_bytes(path, json.dumps(document, indent=1).encode(), mode=0o600)

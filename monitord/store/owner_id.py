"""The stable owner id of this installation + work_dir, kept in `{work_dir}/owner_id`.

Created once (a random UUID, written atomically and fsynced) and read on every start, so a
restarted monitord recognises its own tunnel lease and its own stale sessions on the VPS,
while two installations (or two work_dirs on one machine) never share an id.
Called by monitord.surface.wiring (NodeFiles.load, before any part is built) and
monitord.surface.check_command.
"""

from __future__ import annotations

import uuid
from pathlib import Path

from monitord.base.atomic_file import atomic_write_bytes
from orchestrator.errors import ErrorCode, PermanentError

OWNER_ID_FILE = "owner_id"


def load_or_create(work_dir: Path) -> str:
    """Return the owner id stored in work_dir, creating it on first use."""
    path = work_dir / OWNER_ID_FILE
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        text = ""
    except OSError as e:
        raise PermanentError(ErrorCode.STORE_WRITE_FAILED, f"cannot read {path}: {e}") from e
    if text:
        try:
            return str(uuid.UUID(text))
        except ValueError as e:
            raise PermanentError(
                ErrorCode.CONFIG_CORRUPT, f"{path} does not hold an owner id: {text[:40]!r}"
            ) from e
    owner_id = str(uuid.uuid4())
    try:
        work_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, (owner_id + "\n").encode(), mode=0o644)
    except OSError as e:
        raise PermanentError(ErrorCode.STORE_WRITE_FAILED, f"cannot write {path}: {e}") from e
    return owner_id

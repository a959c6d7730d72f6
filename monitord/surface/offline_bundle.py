"""`monitord bundle --offline`: the diagnostic bundle from the files alone, with no daemon.

When monitord does not answer — crashed, not starting, its unit failed — is when a bundle is
needed most. This collects what can be read without it, touching nothing: `state.db` opened
read-only (`mode=ro`, monitord.store.state_db.read_only_sections: transactions, cleanup queue,
recent events, lineage), the configuration, `custom_config.json` and `remote_state.json`, and
the tails of the logs on this machine: `monitord.log`, each local area's log, and the journal's
last lines of the unit when `journalctl` is there. The sections go through the same
allow-list redaction and key-material check as the daemon's bundle (monitord.surface.bundle);
the log tails are text, as the daemons and monitord wrote them, at most `LOG_TAIL_BYTES` each.
There is no status, inventory or tunnel section (only a running daemon knows them);
`README.txt` says so and why the bundle is offline.

Called by `monitord bundle --offline` (monitord.surface.client_commands).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from monitord.base import area_paths, log_tail
from monitord.base.config import Config
from monitord.store import spool_files, state_db
from monitord.surface.launcher import LOG_NAME

LOG_TAIL_BYTES = 256 * 1024
LOG_TAIL_LINES = 2000
JOURNAL_LINES = 2000
JOURNAL_TIMEOUT_S = 15.0
MAX_AREA_LOGS = 500


def sections(config: Config, *, reason: str) -> dict[str, Any]:
    """Every section of an offline bundle, by member name (see the module doc)."""
    work_dir = config.monitord.work_dir
    found: dict[str, Any] = {
        "README.txt": (
            "monitord bundle --offline, written "
            f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())} without the daemon"
            f" ({reason}).\nstate.db was read read-only; there is no status.json,"
            " inventory or tunnel section: only a running daemon knows them.\n"
            "logs/ holds the last lines of monitord's and each local area's log, as written.\n"
        ),
    }
    try:
        found.update(state_db.read_only_sections(work_dir / state_db.DB_NAME))
    except state_db.StoreError as e:
        found["state_db.txt"] = f"unreadable: {e.detail}\n"
    found["config.json"] = config.model_dump(mode="json")
    for name in (spool_files.CUSTOM_CONFIG_NAME, spool_files.REMOTE_STATE_NAME):
        path = config.monitord.spool_dir / name
        try:
            found[name] = path.read_bytes()
        except OSError as e:
            found[name] = f"unreadable: {e}\n"
    found.update(_log_tails(work_dir))
    journal = _journal_tail()
    if journal:
        found["logs/journal-monitord.txt"] = journal
    return found


def _tail(path: Path) -> str:
    return str(log_tail.tail(str(path), lines=LOG_TAIL_LINES, max_bytes=LOG_TAIL_BYTES)["data"])


def _log_tails(work_dir: Path) -> dict[str, str]:
    tails = {}
    own = work_dir / LOG_NAME
    if own.exists():
        tails[f"logs/{LOG_NAME}"] = _tail(own)
    logs_dir = area_paths.local_log_path(work_dir, "_").parent
    try:
        area_logs = sorted(logs_dir.glob("*.log"))[:MAX_AREA_LOGS]
    except OSError:
        area_logs = []
    for path in area_logs:
        tails[f"logs/areas/{path.name}"] = _tail(path)
    return tails


def _journal_tail() -> str:
    """The unit's last journal lines (`-o cat`: the JSON lines), '' without a journal."""
    journalctl = shutil.which("journalctl")
    if journalctl is None:
        return ""
    try:
        result = subprocess.run(
            [journalctl, "-u", "monitord", "-n", str(JOURNAL_LINES), "-o", "cat", "--no-pager"],
            capture_output=True, timeout=JOURNAL_TIMEOUT_S, check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return result.stdout.decode("utf-8", "replace")[-LOG_TAIL_BYTES:] if result.returncode == 0 \
        else ""

"""The remote_state.json projection: the per-service rows the PHP UI reads, kept in step.

Never a source of truth (monitord decides from state.db and custom_config.json); this module
only writes the rows it is given when they changed, and reads a legacy file once at start-up
so that its old shapes can be normalised. Called by monitord.surface.wiring.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from monitord.base import logs
from monitord.store import spool_files

log = logs.get_logger(__name__)


class RemoteStateFile:
    """remote_state.json at `path`, rewritten (atomically) only when its rows change."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._written: dict[str, spool_files.ServiceCompatState] | None = None

    def publish(self, rows: Mapping[str, spool_files.ServiceCompatState]) -> None:
        """Write `rows` unless they are what the file already holds; a failure is logged and
        retried at the next publish (the file is a projection, nothing depends on it)."""
        rows = dict(rows)
        if rows == self._written:
            return
        try:
            spool_files.write_remote_state(self.path, rows)
        except OSError as e:
            log.warning("remote_state_write_failed", detail=str(e))
            return
        self._written = rows

    def read_legacy(self) -> dict[str, spool_files.ServiceCompatState] | None:
        """The rows a previous version left, or None when there is no readable file."""
        if not self.path.exists():
            return None
        try:
            return spool_files.read_remote_state(self.path)
        except spool_files.ConfigCorrupt as e:
            log.warning("legacy_remote_state_unreadable", detail=e.detail)
            return None

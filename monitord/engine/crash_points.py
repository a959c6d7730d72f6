"""Named crash and hold points at every phase boundary — for fault tests only.

Off unless the environment names a point (nothing in monitord.toml can turn them on):

    MONITORD_CRASH_AT=<point>      the daemon SIGKILLs itself when it reaches <point>
    MONITORD_HOLD_AT=<point>       it waits at <point> until the file named by
    MONITORD_HOLD_RELEASE=<path>   exists (so a test can cut the link exactly there)

Points (called by monitord.engine.migration_engine and monitord.engine.phase_actions):
    <PHASE>          right after a record entering PHASE was persisted, before its action
                     (PREFLIGHT, SUPPRESS_SOURCE, COPY, CREATE_DESTINATION,
                     HEALTHCHECK_DESTINATION, COMMIT_LOCATION, CLEANUP_SOURCE, DONE,
                     ROLLBACK, ROLLED_BACK)
    COMMIT_WRITTEN   custom_config.json was written, the record saying so was not yet
A point may be qualified by direction: `local_to_remote:COPY`.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

from monitord.base import logs

CRASH_ENV = "MONITORD_CRASH_AT"
HOLD_ENV = "MONITORD_HOLD_AT"
RELEASE_ENV = "MONITORD_HOLD_RELEASE"
HOLD_LIMIT_S = 300.0

log = logs.get_logger(__name__)


def _matches(wanted: str | None, point: str, direction: str) -> bool:
    return bool(wanted) and wanted in (point, f"{direction}:{point}")


async def reached(point: str, *, direction: str, **fields: object) -> None:
    """Crash or hold here if the environment asks for this point; otherwise nothing."""
    if _matches(os.environ.get(CRASH_ENV), point, direction):
        log.warning("crash_point", point=point, direction=direction, **fields)
        os.kill(os.getpid(), signal.SIGKILL)
    if _matches(os.environ.get(HOLD_ENV), point, direction):
        release = os.environ.get(RELEASE_ENV, "/nonexistent")
        log.warning("hold_point", point=point, direction=direction, **fields)
        deadline = time.monotonic() + HOLD_LIMIT_S
        # The release comes from another process (the test), as a file: poll for it.
        while not os.path.exists(release) and time.monotonic() < deadline:  # noqa: ASYNC110, ASYNC240
            await asyncio.sleep(0.05)

"""structlog set-up, done once at start-up by the CLI (docs/design.md, "Observability").

JSON lines when stderr is not a terminal (systemd, pipes), a console renderer on a TTY.
Event fields used across the project: event, transaction_id, service, area, phase,
source, destination, generation, error_code.

The one convention: every module takes `log = logs.get_logger(__name__)` (its lines carry
`logger_name`), and a unit of work binds its identity once (`log.bind(...)`, for a transaction
`monitord.engine.txn_log.bound(txn)`) instead of retyping it at every call.

`RepeatLimiter` keeps a repeating error to one line per interval: the first occurrence is logged
at once, repeats inside the interval are only counted, and the next line carries
`repeated=N` (how many were held back since the previous line).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Hashable
from typing import Any

import structlog


def configure(fmt: str = "auto", *, level: int = logging.INFO) -> None:
    """Configure structlog for the process. `fmt` is auto, json or console."""
    use_console = fmt == "console" or (fmt == "auto" and sys.stderr.isatty())
    renderer: Any = (
        structlog.dev.ConsoleRenderer() if use_console else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def get_logger(name: str) -> Any:
    """A lazy structlog logger whose lines carry `logger_name` (safe to create at import time)."""
    return structlog.get_logger(logger_name=name)


class RepeatLimiter:
    """Logs an event at most once per `interval_s` per key, counting what it held back.

    The key defaults to (event, error_code), so different errors never hide each other.
    Not thread-safe: use one limiter per task or loop.
    """

    MAX_KEYS = 1024

    def __init__(
        self, interval_s: float, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        self.interval_s = interval_s
        self._clock = clock
        self._seen: dict[Hashable, tuple[float, int]] = {}  # key -> (last emitted at, held back)

    def log(
        self,
        logger: Any,
        level: str,
        event: str,
        *,
        key: Hashable | None = None,
        **fields: Any,
    ) -> bool:
        """Emit `event` through `logger.<level>` unless it was emitted within the interval.

        Returns True when a line was written.
        """
        now = self._clock()
        key = (event, fields.get("error_code")) if key is None else key
        last = self._seen.get(key)
        if last is not None and now - last[0] < self.interval_s:
            self._seen[key] = (last[0], last[1] + 1)
            return False
        if len(self._seen) >= self.MAX_KEYS:
            self._forget_older_than(now - self.interval_s)
        self._seen[key] = (now, 0)
        if last is not None and last[1]:
            fields["repeated"] = last[1]
        getattr(logger, level)(event, **fields)
        return True

    def _forget_older_than(self, cutoff: float) -> None:
        self._seen = {k: v for k, v in self._seen.items() if v[0] >= cutoff}

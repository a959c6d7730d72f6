"""structlog set-up, done once at start-up by the CLI (docs/design.md, "Observability").

JSON lines when stderr is not a terminal (systemd, pipes), a console renderer on a TTY.
Event fields used across the project: event, transaction_id, service, area, phase,
source, destination, generation, error_code.

`level` (`--log-level` of `monitord run`: debug, info, warning, error; default info) drops
lines below it. When stderr is the journal — `JOURNAL_STREAM` names stderr's device:inode, as
systemd sets it for a unit's stdout/stderr — each line starts with its syslog priority, the
sd-daemon(3) prefixes `<3>` error, `<4>` warning, `<6>` info, `<7>` debug (`<2>` critical), so
that `journalctl -p err -u monitord` shows exactly the error lines. Lines of other libraries
(asyncio, aiohttp, asyncssh: the standard `logging` module) go through the same renderer and
prefixes, from WARNING up whatever `level` says (their info chatter is not ours to show).

The one convention: every module takes `log = logs.get_logger(__name__)` (its lines carry
`logger_name`), and a unit of work binds its identity once instead of retyping it at every
call: `log.bind(...)` for the lines of one logger, and — for every line logged while the unit
runs, by whichever module (the agent client, the copy, preflight) and by the tasks it starts —
structlog's contextvars, merged into each line by `CONTEXT_PROCESSORS`. One step of a
transaction is such a unit: `monitord.engine.txn_log.step(txn)` binds `transaction_id`,
`service` and `area` around it (only with a context manager, so the binding ends with the
step); `txn_log.bound(txn)` is the engine's own logger for one transaction.

`RepeatLimiter` keeps a repeating error to one line per interval: the first occurrence is logged
at once, repeats inside the interval are only counted, and the next line carries
`repeated=N` (how many were held back since the previous line).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Hashable, Mapping
from typing import IO, Any

import structlog

# `--log-level` names -> logging levels.
LEVELS: Mapping[str, int] = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}
DEFAULT_LEVEL = "info"
# Log method (structlog) or level name (logging) -> syslog priority prefix (sd-daemon(3)).
JOURNAL_PRIORITIES: Mapping[str, str] = {
    "debug": "<7>",
    "info": "<6>",
    "warning": "<4>",
    "warn": "<4>",
    "error": "<3>",
    "exception": "<3>",
    "critical": "<2>",
    "fatal": "<2>",
}
# Other libraries' loggers never speak below this, whatever `level` says.
FOREIGN_MIN_LEVEL = logging.WARNING

# The processors that add context bound through structlog.contextvars to every line (first in
# the chain; tests capture with `structlog.testing.capture_logs(processors=CONTEXT_PROCESSORS)`).
CONTEXT_PROCESSORS: tuple[Any, ...] = (structlog.contextvars.merge_contextvars,)

_foreign_handler: logging.Handler | None = None


def stderr_is_journal(
    environ: Mapping[str, str] = os.environ, stream: IO[str] | None = None
) -> bool:
    """True when `stream` (stderr) is the journal: `JOURNAL_STREAM` is its `st_dev:st_ino`.

    Comparing device and inode (not just the variable's presence) matters: a child whose
    stderr was redirected inherits the variable, and must not prefix lines going to a file.
    """
    dev, _, ino = environ.get("JOURNAL_STREAM", "").partition(":")
    try:
        st = os.fstat((stream or sys.stderr).fileno())
        return (st.st_dev, st.st_ino) == (int(dev), int(ino))
    except (ValueError, OSError):  # unset, malformed, or a stream without a descriptor
        return False


def journal_priority(logger: Any, method_name: str, line: str) -> str:
    """Renderer epilogue: the syslog priority prefix on every line of a rendered entry."""
    prefix = JOURNAL_PRIORITIES.get(method_name, "<6>")
    return "\n".join(prefix + part for part in line.split("\n"))


def _foreign_logger_name(logger: Any, method_name: str, event_dict: Any) -> Any:
    record = event_dict.get("_record")
    if record is not None:
        event_dict.setdefault("logger_name", record.name)
    return event_dict


def configure(fmt: str = "auto", *, level: int = logging.INFO) -> None:
    """Configure logging for the process. `fmt` is auto, json or console; `level` a logging
    level (see LEVELS). Safe to call again: the previous configuration is replaced."""
    global _foreign_handler
    use_console = fmt == "console" or (fmt == "auto" and sys.stderr.isatty())
    renderer: Any = (
        structlog.dev.ConsoleRenderer() if use_console else structlog.processors.JSONRenderer()
    )
    epilogue: list[Any] = [journal_priority] if stderr_is_journal() else []
    structlog.configure(
        processors=[
            *CONTEXT_PROCESSORS,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
            *epilogue,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    # The standard library's loggers (asyncio, aiohttp, asyncssh) through the same renderer.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[
            _foreign_logger_name,
            structlog.stdlib.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
        ],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            renderer,
            *epilogue,
        ],
    ))
    root = logging.getLogger()
    if _foreign_handler is not None:
        root.removeHandler(_foreign_handler)
    root.addHandler(handler)
    root.setLevel(max(level, FOREIGN_MIN_LEVEL))
    _foreign_handler = handler


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

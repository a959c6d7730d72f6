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

When stderr is the journal and its socket answers, each line goes through the journal's native
protocol instead (monitord.base.journal_native): `MESSAGE` is the same JSON line, with
`PRIORITY`, `SYSLOG_IDENTIFIER=monitord` and the line's own `MONITORD_SERVICE`,
`MONITORD_AREA`, `MONITORD_CODE` (error_code), `MONITORD_TXN` (transaction_id) and
`MONITORD_EVENT` as fields of the entry, so `journalctl -u monitord MONITORD_AREA=…` finds one
area's lines. A line the socket does not take is written to stderr with its prefix, as before.

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
from typing import IO, TYPE_CHECKING, Any

from monitord.base import journal_native


def _import_structlog() -> Any:
    """structlog, imported without rich. When rich is installed (the CLI's tables need it),
    structlog's `dev` and `tracebacks` modules import rich's traceback and pretty-printer at
    import time: about a tenth of a second of `monitord run`'s start-up, for formatters these
    lines never use (tracebacks are rendered to text by `format_exc_info` before any
    renderer, so the console renderer's exception formatter is never called). rich stays
    importable for everything else once structlog is loaded."""
    if "structlog" in sys.modules or "rich" in sys.modules:
        import structlog
    else:
        sys.modules["rich"] = None  # type: ignore[assignment]  # `import rich` -> ImportError
        try:
            import structlog
        finally:
            del sys.modules["rich"]
    return structlog


if TYPE_CHECKING:
    import structlog
else:
    structlog = _import_structlog()

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
bound_contextvars = structlog.contextvars.bound_contextvars

_foreign_handler: logging.Handler | None = None
_journal: journal_native.JournalSocket | None = None
JOURNAL_IDENTIFIER = "monitord"


def stderr_is_journal(
    environ: Mapping[str, str] = os.environ, stream: IO[str] | None = None
) -> bool:
    """True when stderr is the journal (monitord.base.journal_native.stderr_is_journal)."""
    return journal_native.stderr_is_journal(environ, stream or sys.stderr)


def journal_priority(logger: Any, method_name: str, line: str) -> str:
    """Renderer epilogue: the syslog priority prefix on every line of a rendered entry."""
    prefix = JOURNAL_PRIORITIES.get(method_name, "<6>")
    return "\n".join(prefix + part for part in line.split("\n"))


class JournalLogger:
    """The structlog logger when stderr is the journal: each entry through the native
    protocol (the last processor hands over the line and its fields), stderr with the
    priority prefix when the socket does not take it."""

    def __init__(self, journal: journal_native.JournalSocket, file: IO[str]) -> None:
        self._journal = journal
        self._file = file

    def msg(self, message: str, journal_fields: Mapping[str, str] | None = None) -> None:
        if journal_fields is not None and self._journal.send(journal_fields):
            return
        level = next((name for name, number in journal_native.PRIORITIES.items()
                      if journal_fields and str(number) == journal_fields.get("PRIORITY")),
                     "info")
        try:
            self._file.write(journal_priority(None, level, message) + "\n")
            self._file.flush()
        except (OSError, ValueError):
            pass  # nowhere left to write it

    debug = info = warning = warn = error = err = critical = fatal = exception = msg
    failure = log = msg


class JournalLoggerFactory:
    def __init__(self, journal: journal_native.JournalSocket, file: IO[str]) -> None:
        self._logger = JournalLogger(journal, file)

    def __call__(self, *args: Any) -> JournalLogger:
        return self._logger


def to_journal(renderer: Any) -> Any:
    """The last processor when stderr is the journal: the rendered line plus the entry's
    native fields, for `JournalLogger.msg`."""

    def render(logger: Any, method_name: str, event_dict: Any) -> Any:
        fields = {k: event_dict.get(k) for k in journal_native.FIELDS}
        line = renderer(logger, method_name, event_dict)
        return (line,), {"journal_fields": journal_native.entry_fields(
            message=line, level=method_name, identifier=JOURNAL_IDENTIFIER, event=fields)}

    return render


class JournalHandler(logging.Handler):
    """The standard library's lines (asyncio, aiohttp, asyncssh) into the journal the same
    way: the formatted JSON line as MESSAGE, the record's level as PRIORITY."""

    def __init__(self, journal: journal_native.JournalSocket, file: IO[str]) -> None:
        super().__init__()
        self._journal = journal
        self._file = file

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
            level = record.levelname.lower()
            fields = journal_native.entry_fields(
                message=line, level=level, identifier=JOURNAL_IDENTIFIER,
                event={"event": record.getMessage()})
            if not self._journal.send(fields):
                self._file.write(journal_priority(None, level, line) + "\n")
                self._file.flush()
        except Exception:  # logging's own convention: handleError reports, never raises
            self.handleError(record)


def _foreign_logger_name(logger: Any, method_name: str, event_dict: Any) -> Any:
    record = event_dict.get("_record")
    if record is not None:
        event_dict.setdefault("logger_name", record.name)
    return event_dict


def configure(fmt: str = "auto", *, level: int = logging.INFO) -> None:
    """Configure logging for the process. `fmt` is auto, json or console; `level` a logging
    level (see LEVELS). Safe to call again: the previous configuration is replaced."""
    global _foreign_handler, _journal
    use_console = fmt == "console" or (fmt == "auto" and sys.stderr.isatty())
    renderer: Any = (
        structlog.dev.ConsoleRenderer() if use_console else structlog.processors.JSONRenderer()
    )
    if _journal is not None:
        _journal.close()
        _journal = None
    on_journal = stderr_is_journal()
    if on_journal:
        _journal = journal_native.JournalSocket.open()
    epilogue: list[Any] = [journal_priority] if on_journal and _journal is None else []
    last: list[Any] = [to_journal(renderer)] if _journal is not None else [renderer, *epilogue]
    logger_factory: Any = (
        JournalLoggerFactory(_journal, sys.stderr) if _journal is not None
        else structlog.PrintLoggerFactory(file=sys.stderr)
    )
    structlog.configure(
        processors=[
            *CONTEXT_PROCESSORS,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            *last,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=logger_factory,
        cache_logger_on_first_use=False,
    )
    # The standard library's loggers (asyncio, aiohttp, asyncssh) through the same renderer.
    handler: logging.Handler = (
        JournalHandler(_journal, sys.stderr) if _journal is not None
        else logging.StreamHandler(sys.stderr)
    )
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

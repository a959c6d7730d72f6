"""The VPS side's log: one JSON object per line on stderr, standard library only.

The same shape as the PBX side's lines (monitord.base.logs, which needs structlog and so
cannot run on a bare VPS Python): `event`, `level`, `timestamp` (ISO 8601, UTC),
`logger_name`, then the call's own fields (`area`, `generation`, `error_code`, ...). The agent's
stderr is `{dir}/logs/agent.log` (through a log sink that caps and rotates it) or, under its
unit, the journal: then each line is sent as a native journal entry with the MONITORD_* fields
(monitord.base.journal_native, `SYSLOG_IDENTIFIER=monitord-agent`), stderr taking any line the
socket does not. A bundle or `journalctl` reader parses both sides alike.

    log = event_log.get_logger(__name__)
    log.info("area_created", area=area, generation=7)
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from typing import Any

from monitord.base import journal_native

_LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}
_threshold = _LEVELS["info"]
_console = False
_journal: journal_native.JournalSocket | None = None
JOURNAL_IDENTIFIER = "monitord-agent"


def configure(fmt: str = "auto", *, level: str = "info") -> None:
    """`fmt` json, console (`event key=value`, for a person at a terminal) or auto (console
    on a terminal); lines below `level` are dropped."""
    global _threshold, _console, _journal
    _threshold = _LEVELS[level]
    _console = fmt == "console" or (fmt == "auto" and sys.stderr.isatty())
    if _journal is not None:
        _journal.close()
    _journal = (journal_native.JournalSocket.open()
                if journal_native.stderr_is_journal() else None)


class EventLogger:
    """A named logger: `log.<level>(event, **fields)`; `exc_info=` adds the traceback."""

    def __init__(self, name: str) -> None:
        self.name = name

    def _emit(self, level: str, event: str, fields: dict[str, Any]) -> None:
        if _LEVELS[level] < _threshold:
            return
        error = fields.pop("exc_info", None)
        if isinstance(error, BaseException):
            fields["exception"] = "".join(
                traceback.format_exception(type(error), error, error.__traceback__)
            )
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
        if _console:
            extra = " ".join(f"{k}={v}" for k, v in fields.items())
            line = f"{stamp} [{level}] {event} {extra}".rstrip()
        else:
            record = {"event": event, "level": level, "timestamp": stamp + "Z",
                      "logger_name": self.name, **fields}
            line = json.dumps(record, default=str)
        if _journal is not None and _journal.send(journal_native.entry_fields(
                message=line, level=level, identifier=JOURNAL_IDENTIFIER,
                event={"event": event, **fields})):
            return
        try:
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
        except (OSError, ValueError):
            pass  # a log that cannot be written never stops the agent

    def debug(self, event: str, **fields: Any) -> None:
        self._emit("debug", event, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._emit("info", event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._emit("warning", event, fields)

    def error(self, event: str, **fields: Any) -> None:
        self._emit("error", event, fields)

    def critical(self, event: str, **fields: Any) -> None:
        self._emit("critical", event, fields)


def get_logger(name: str) -> EventLogger:
    return EventLogger(name)

"""structlog set-up, done once at start-up by the CLI (SPEC §9 "Events").

JSON lines when stderr is not a terminal (systemd, pipes), a console renderer on a TTY.
Event fields used across the project: event, transaction_id, service, area, phase,
source, destination, generation, error_code.
"""

from __future__ import annotations

import logging
import sys
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
    return structlog.get_logger(logger=name)

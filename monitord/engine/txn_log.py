"""The log of one transaction: its identity bound once, so every line about it carries the
same fields without retyping them. Used by the migration engine and its phase actions.

- `step(txn)`: the unit of work of one step (the engine wraps each `perform` in it). Through
  structlog's contextvars (monitord.base.logs) every line logged inside — by the agent client,
  the copy, preflight, any module, and by tasks started inside — carries `transaction_id`,
  `service` and `area`; the binding ends with the step.
- `bound(txn)`: the engine's logger for a transaction, with its whole identity (also source,
  destination and generation).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from monitord.base import logs
from orchestrator.models import Transaction

_log = logs.get_logger("monitord.engine")


def identity(txn: Transaction) -> dict[str, Any]:
    """The fields that name a transaction, in logs and in stored events alike."""
    return {
        "transaction_id": txn.transaction_id,
        "service": txn.service,
        "area": txn.area,
        "source": txn.source.value,
        "destination": txn.destination.value,
        "generation": txn.generation,
    }


@contextlib.contextmanager
def step(txn: Transaction) -> Iterator[None]:
    """Every line logged inside carries the transaction's id, service and area (see above)."""
    with logs.bound_contextvars(
        transaction_id=txn.transaction_id, service=txn.service, area=txn.area
    ):
        yield


def bound(txn: Transaction) -> Any:
    """A logger for `txn`; add only what the line itself is about (phase, outcome, code)."""
    return _log.bind(**identity(txn))

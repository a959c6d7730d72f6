"""The log of one transaction: its identity bound once, so every line about it carries the
same fields (transaction_id, service, area, source, destination, generation) without
retyping them. Used by the migration engine and its phase actions."""

from __future__ import annotations

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


def bound(txn: Transaction) -> Any:
    """A logger for `txn`; add only what the line itself is about (phase, outcome, code)."""
    return _log.bind(**identity(txn))

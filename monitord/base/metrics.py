"""Prometheus metrics of one monitord process, served at `GET /metrics`.

One `Metrics` object per daemon, with its own registry so that tests and several daemons in
one process never share counters. Components receive it and update it; nothing reads it back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

CONTENT_TYPE = CONTENT_TYPE_LATEST


class _RefusedStarts(Collector):
    """monitord_duplicate_instances_total: starts the instance lock refused, read at scrape
    time from the file the refused processes append to (they cannot reach our memory)."""

    def __init__(self, count: Callable[[], int]) -> None:
        self._count = count

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(
            "monitord_duplicate_instances",
            "Second instances refused by the singleton lock of this work_dir",
            value=self._count(),
        )


class Metrics:
    def __init__(self, *, work_dir: Path | None = None) -> None:
        from monitord.base import singleton

        self.registry = CollectorRegistry()
        r = self.registry
        where = work_dir
        r.register(_RefusedStarts(lambda: singleton.refused_starts(where) if where else 0))
        self.tunnel_lease_conflicts = Counter(
            "monitord_tunnel_lease_conflicts", "Tunnel lease held by another owner", registry=r
        )
        self.tunnel_reconnects = Counter(
            "monitord_tunnel_reconnects", "SSH (re)connections established", registry=r
        )
        self.tunnel_up = Gauge("monitord_tunnel_up", "1 while the tunnel is connected", registry=r)
        self.migration_duration = Histogram(
            "monitord_migration_duration_seconds",
            "Wall time of finished area migrations",
            ["service", "destination", "outcome"],
            buckets=(0.5, 1, 2, 5, 10, 30, 60, 120, 300, 900),
            registry=r,
        )
        self.rollbacks = Counter(
            "monitord_rollbacks", "Area migrations rolled back", ["service"], registry=r
        )
        self.cleanup_backlog = Gauge(
            "monitord_cleanup_backlog", "Cleanup items not yet done", registry=r
        )
        self.cleanup_stuck = Gauge(
            "monitord_cleanup_stuck", "Cleanup items flagged for manual action", registry=r
        )
        self.drift = Gauge("monitord_drift", "Differences found by the last reconcile", registry=r)
        self.areas = Gauge("monitord_areas", "Areas by committed side", ["side"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)

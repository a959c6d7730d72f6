"""Prometheus metrics of one monitord process, served at `GET /metrics`.

One `Metrics` object per daemon, with its own registry so that tests and several daemons in
one process never share counters. Components receive it and update it; nothing reads it back.
Besides monitord's own families the registry carries `monitord_build_info{version, python} 1`
and the standard process metrics (`process_cpu_seconds_total`, `process_resident_memory_bytes`,
`process_open_fds`, `process_start_time_seconds`, ...), which prometheus_client's
`ProcessCollector` reads from /proc at scrape time.
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterator
from pathlib import Path

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from monitord import __version__

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


class _ByServiceAndSide(Collector):
    """A counter family read at scrape time from counts kept elsewhere (the supervisor's and
    the reconciler's restart counts), per (service, side)."""

    def __init__(self, name: str, documentation: str,
                 counts: Callable[[], dict[tuple[str, str], int]]) -> None:
        self._name, self._documentation, self._counts = name, documentation, counts

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self._name, self._documentation, labels=["service", "side"])
        for (service, side), value in sorted(self._counts().items()):
            family.add_metric([service, side], value)
        yield family


class Metrics:
    def __init__(self, *, work_dir: Path | None = None) -> None:
        from monitord.base import singleton

        # `_created` series double every counter and histogram for nothing an alert uses
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry()
        r = self.registry
        where = work_dir
        r.register(_RefusedStarts(lambda: singleton.refused_starts(where) if where else 0))
        ProcessCollector(registry=r)
        self.build_info = Gauge(
            "monitord_build_info", "Always 1; the labels say what runs",
            ["version", "python"], registry=r,
        )
        self.build_info.labels(version=__version__, python=platform.python_version()).set(1)
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
        # Source stopped -> destination healthy (or the source again, after a rollback).
        self.area_downtime = Histogram(
            "monitord_area_downtime_seconds",
            "Per-area downtime of a move: from the source's stop to the first healthy moment",
            ["service", "direction"],
            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
            registry=r,
        )

        # Warm copies (monitord/engine/warm_copier.py): the oldest remote area's copy per
        # service (what a give-up would lose at most), and the copies that failed.
        self.warm_copy_age = Gauge(
            "monitord_area_warm_copy_age_seconds",
            "Age of the oldest warm copy among the service's remote areas (data a give-up"
            " loses at most)", ["service"], registry=r,
        )
        self.warm_copy_bound = Gauge(
            "monitord_warm_copy_overdue_after_seconds",
            "The age past which a warm copy is overdue: three of the service's intervals",
            ["service"], registry=r,
        )
        self.warm_copy_failures = Counter(
            "monitord_warm_copy_failures", "Warm copies that could not be taken or received",
            ["service", "code"], registry=r,
        )

        # Iterations of a root loop that raised (monitord/base/periodic.py): the loop went on.
        self.loop_errors = Counter(
            "monitord_loop_errors", "Iterations of a root loop that raised; the loop went on",
            ["loop", "code"], registry=r,
        )

        # Per area, where it is placed (orchestrator/area_health.py): set at scrape time.
        self.area_up = Gauge(
            "monitord_area_up", "Areas whose daemon runs where they are placed",
            ["service", "side"], registry=r,
        )
        self.area_expected_up = Gauge(
            "monitord_area_expected_up",
            "Areas that should run where they are placed now (not moving, side observable)",
            ["service", "side"], registry=r,
        )
        self.config_corrupt = Gauge(
            "monitord_config_corrupt", "1 while custom_config.json cannot be used", registry=r
        )
        self.quarantined = Gauge(
            "monitord_quarantined_entries", "custom_config.json entries left out", registry=r
        )
        self.service_state = Gauge(
            "monitord_service_state", "1 for the state each service is in, 0 for the others",
            ["service", "state"], registry=r,
        )
        self._restart_counts: Callable[[], dict[tuple[str, str], int]] = dict
        r.register(_ByServiceAndSide(
            "monitord_area_restarts", "Restarts of area daemons after they exited",
            lambda: self._restart_counts(),
        ))

    def count_restarts_with(self, counts: Callable[[], dict[tuple[str, str], int]]) -> None:
        """Where monitord_area_restarts_total reads its counts, per (service, side)."""
        self._restart_counts = counts

    def render(self) -> bytes:
        return generate_latest(self.registry)

"""`GET /metrics` after one migration: every metric family, in Prometheus text format."""

from __future__ import annotations

import platform
import time
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from monitord import __version__
from tests.integration.operator.conftest import StackFactory
from tests.support import daemon_process

# The families of docs/design.md ("Observability"): duplicate instances, tunnel lease
# conflicts, migration duration (histogram), rollbacks, cleanup backlog, drift, areas by
# side, tunnel state, reconnects.
FAMILIES = {
    "monitord_duplicate_instances": "counter",
    "monitord_tunnel_lease_conflicts": "counter",
    "monitord_migration_duration_seconds": "histogram",
    "monitord_rollbacks": "counter",
    "monitord_cleanup_backlog": "gauge",
    "monitord_drift": "gauge",
    "monitord_areas": "gauge",
    "monitord_tunnel_up": "gauge",
    "monitord_tunnel_reconnects": "counter",
    "monitord_area_up": "gauge",
    "monitord_area_restarts": "counter",
    "monitord_service_state": "gauge",
}


class TestMetrics:
    """The metrics endpoint exposes every documented family and counts what happened."""

    async def test_metrics_after_one_migration(self, stack_factory: StackFactory) -> None:
        stack = await stack_factory(services={"tg": 1, "chats": 1})
        await stack.wait_settled(expect={"tg": "local", "chats": "local"}, timeout_s=60)
        await stack.place("tg", "remote")
        await stack.wait_settled(expect={"tg": "remote", "chats": "local"}, timeout_s=60)
        # The gauges below read the status: a remote area's process is the agent's next
        # inventory after the move (the reconciler's pass, at most a second after the last).
        await stack.wait_seen_up()

        url = f"http://127.0.0.1:{stack.http_port}/metrics"
        scraped: list[str] = []

        async def move_ended() -> bool:
            # The area runs on the VPS a moment before its transaction ends and is observed.
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session, \
                    session.get(url) as resp:
                assert resp.status == 200
                assert resp.content_type == "text/plain"
                scraped.append(await resp.text())
            return any(s.name == "monitord_migration_duration_seconds_count"
                       and s.labels.get("service") == "tg" and s.value >= 1
                       for f in text_string_to_metric_families(scraped[-1])
                       for s in f.samples)

        await stack.wait_until(move_ended, timeout_s=30, what="the move's duration observed")
        text = scraped[-1]
        families = {f.name: f for f in text_string_to_metric_families(text)}
        assert {name: families[name].type for name in FAMILIES if name in families} == FAMILIES

        def value(sample_name: str, **labels: str) -> float:
            found = [s.value for f in families.values() for s in f.samples
                     if s.name == sample_name and all(s.labels.get(k) == v
                                                      for k, v in labels.items())]
            assert len(found) == 1, f"{sample_name}{labels}: {found}"
            return found[0]

        assert value("monitord_migration_duration_seconds_count", service="tg",
                     destination="remote", outcome="done") == 1
        assert value("monitord_migration_duration_seconds_sum", service="tg",
                     destination="remote", outcome="done") > 0
        assert value("monitord_areas", side="remote") == 1
        assert value("monitord_areas", side="local") == 1
        assert value("monitord_tunnel_up") == 1
        assert value("monitord_tunnel_reconnects_total") >= 1
        assert value("monitord_cleanup_backlog") == 0
        assert value("monitord_drift") == 0
        assert value("monitord_duplicate_instances_total") == 0
        # each area up where it is placed; each service in exactly one state
        assert value("monitord_area_up", service="tg", side="remote") == 1
        assert value("monitord_area_up", service="tg", side="local") == 0
        assert value("monitord_area_up", service="chats", side="local") == 1
        assert value("monitord_service_state", service="tg", state="idle") == 1
        assert sum(s.value for s in families["monitord_service_state"].samples
                   if s.labels["service"] == "tg") == 1
        assert not [s.name for f in families.values() for s in f.samples
                    if s.name.endswith("_created")], "no _created series"


class TestBuildAndProcessMetrics:
    """/metrics says which monitord runs and carries the standard process metrics."""

    async def test_build_info_and_process_metrics_describe_the_daemon(
        self, tmp_path: Path
    ) -> None:
        async with daemon_process.running_daemon(tmp_path) as daemon:
            status, text = await daemon.request("GET", "/metrics")
            assert status == 200
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples
        }
        build = ("monitord_build_info",
                 (("python", platform.python_version()), ("version", __version__)))
        assert samples[build] == 1
        assert samples[("process_resident_memory_bytes", ())] > 1_000_000
        assert samples[("process_open_fds", ())] >= 3
        assert samples[("process_cpu_seconds_total", ())] > 0
        assert 0 < samples[("process_start_time_seconds", ())] <= time.time()

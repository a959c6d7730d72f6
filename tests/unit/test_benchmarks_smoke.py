"""Smoke runs of the benchmark suite (benchmarks/bench_*.py) at their smallest sizes, so the
benchmark code cannot rot unnoticed. Only that figures come out is checked: benchmarks are
never pass/fail on their values (docs/benchmarks.md)."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import pytest

from benchmarks import (
    bench_autossh,
    bench_cleanup_queue,
    bench_idle_rss,
    bench_log_rss,
    bench_migration,
    bench_reconcile,
    bench_rollback,
    bench_startup,
    bench_status_api,
    bench_status_views,
    bench_supervisor_passes,
)
from tests.support.sshd import can_run_sshd


def assert_figures(figures: list[dict[str, Any]], *, names: set[str], count: int) -> None:
    assert len(figures) == count, figures
    for figure in figures:
        assert figure["benchmark"] in names, figure
        assert isinstance(figure["ratio"], float | int) and figure["ratio"] > 0, figure
        assert figure.get("reference"), figure


class TestInProcessBenchmarks:
    """The store and planner benchmarks produce a figure with a ratio for each size."""

    async def test_cleanup_queue_reports_each_operation_against_the_small_backlog(
        self, tmp_path: Path
    ) -> None:
        figures = await bench_cleanup_queue.measure(
            tmp_path, backlogs=(10, 100), rounds=2, ops_per_round=5
        )
        assert_figures(figures, count=3, names={"cleanup_queue_enqueue",
                                                "cleanup_queue_take_due",
                                                "cleanup_queue_complete"})

    def test_reconcile_reports_per_area_time_for_every_size(self) -> None:
        figures = bench_reconcile.measure(sizes=(100, 300), repeats=1)
        assert_figures(figures, count=2, names={"reconcile_pass"})
        assert [f["areas"] for f in figures] == [100, 300]

    async def test_supervisor_passes_report_per_area_cpu_for_every_size(
        self, tmp_path: Path
    ) -> None:
        figures = await bench_supervisor_passes.measure(tmp_path, sizes=(2, 4))
        assert_figures(figures, count=2, names={"supervisor_move_away_cpu"})
        assert [f["areas"] for f in figures] == [2, 4]

    def test_status_views_report_per_area_time_for_every_size(self) -> None:
        figures = bench_status_views.measure(sizes=(10, 30), repeats=1)
        assert_figures(figures, count=2, names={"status_remote_area_views"})
        assert [f["areas"] for f in figures] == [10, 30]


class TestWholeInstallationBenchmarks:
    """The benchmarks that start real monitord processes produce their figures."""

    async def test_idle_rss_of_a_few_areas_against_none(self, tmp_path: Path) -> None:
        figures = await bench_idle_rss.measure(tmp_path, areas=10)
        assert_figures(figures, count=1, names={"idle_rss"})

    def test_startup_to_readyz_against_a_bare_interpreter(self, tmp_path: Path) -> None:
        figures = bench_startup.measure(tmp_path, runs=1)
        assert_figures(figures, count=1, names={"startup_readyz"})

    async def test_log_rss_of_one_area_on_each_side_against_the_daemon_alone(
        self, tmp_path: Path
    ) -> None:
        figures = await bench_log_rss.measure(tmp_path, sizes=(1,))
        assert_figures(figures, count=2, names={"log_rss_pbx", "log_rss_vps"})

    async def test_migration_and_status_latency_on_tiny_stacks(self, tmp_path: Path) -> None:
        # Two independent stacks side by side: the smoke run stays short.
        migration, status = await asyncio.gather(
            # The smallest downtime case: one area of 256 KiB.
            bench_migration.measure(tmp_path / "migration", cases=((1, 256 * 1024),)),
            bench_status_api.measure(tmp_path / "status", areas=2, clients=2,
                                     requests_per_client=5, open_rate=20.0,
                                     open_idle_s=0.5),
        )
        assert_figures(migration, count=2, names={"migration_local_to_remote",
                                                  "area_downtime_local_to_remote"})
        assert_figures(status, count=2, names={"status_api_latency_during_migration",
                                               "status_api_open_loop_during_migration"})

    async def test_rollback_copy_back_of_one_area_under_both_policies(
        self, tmp_path: Path
    ) -> None:
        # The smallest case; measure() itself raises on any overlap or data regression.
        figures = await bench_rollback.measure(tmp_path, cases=((1, 256 * 1024),))
        assert_figures(figures, count=2, names={"rollback_copy_back"})
        assert [f["rollback_data"] for f in figures] == ["preserve", "discard"]


@pytest.mark.root
@pytest.mark.skipif(not can_run_sshd(), reason="needs root and /usr/sbin/sshd")
@pytest.mark.skipif(shutil.which("autossh") is None,
                    reason="autossh is not installed (apt-get install -y autossh)")
class TestAutosshComparison:
    """monitord's tunnel keeper and autossh give side-by-side figures on one real sshd."""

    async def test_one_kill_one_stale_session_and_a_short_storm_window(
        self, tmp_path: Path
    ) -> None:
        figures = await bench_autossh.measure(tmp_path, runs=1, stale_runs=1, window_s=6.0,
                                              pacings=("bench",), polls=(30,))
        assert_figures(figures, count=3, names={
            "autossh_vs_monitord_session_kill",
            "autossh_vs_monitord_stale_session_monitord",
            "autossh_vs_monitord_stale_session_autossh",
        })

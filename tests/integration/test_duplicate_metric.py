"""A start refused by the instance lock shows in the running instance's metrics."""

from __future__ import annotations

from pathlib import Path

from tests.support import daemon_process


def _value(metrics: str, name: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


class TestDuplicateInstancesMetric:
    """monitord_duplicate_instances_total counts refused second starts for this work_dir."""

    async def test_refused_starts_are_counted_by_the_holder(self, tmp_path: Path) -> None:
        config = daemon_process.write_config(tmp_path)
        async with daemon_process.running_daemon(tmp_path, config_path=config) as holder:
            _, metrics = await holder.request("GET", "/metrics")
            assert _value(metrics, "monitord_duplicate_instances_total") == 0
            for _ in range(2):
                second = await daemon_process.DaemonProcess.start(config)
                assert await second.wait_exit(timeout_s=20) == 3
                await second.close()
            _, metrics = await holder.request("GET", "/metrics")
            assert _value(metrics, "monitord_duplicate_instances_total") == 2

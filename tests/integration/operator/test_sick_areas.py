"""A sick area does not look healthy: a daemon in a crash loop is named per area in the
status document and in `monitord status`, makes `status --check` critical when it is all the
service has, and shows in monitord_area_up and monitord_area_restarts_total."""

from __future__ import annotations

import json

from prometheus_client.parser import text_string_to_metric_families

from tests.integration.operator.conftest import StackFactory, run_cli


class TestSickAreas:
    async def test_a_healthy_area_shows_its_daemon(self, stack_factory: StackFactory) -> None:
        stack = await stack_factory(services={"tg": 1})
        await stack.wait_settled(expect={"tg": "local"}, timeout_s=60)
        (area,) = stack.areas["tg"]
        [view] = (await stack.status())["services"]["tg"]["areas"]
        process = view["process"]
        assert (process["side"], process["state"], process["health"]) == (
            "local", "running", "up")
        [alive] = stack.detector.alive(area)
        assert process["pid"] == alive.pid and process["started_at"] > 0
        result = await run_cli("status", "-c", str(stack.config_path))
        assert result.code == 0 and area[:8] in result.stdout and " up " in result.stdout

    async def test_a_crash_looping_area_is_critical_when_it_is_all_the_service_has(
        self, stack_factory: StackFactory
    ) -> None:
        # each run far shorter than min_uptime_s, however slowly the daemon's Python starts
        stack = await stack_factory(services={"tg": 1}, min_uptime_s=5.0,
                                    local_daemon_args=("--crash-after", "0.2"))
        (area,) = stack.areas["tg"]

        async def looping() -> bool:
            [view] = (await stack.status())["services"]["tg"]["areas"]
            return view["process"]["health"] == "crash_loop"
        await stack.wait_until(looping, timeout_s=60, what="tg's area seen crash-looping")
        [view] = (await stack.status())["services"]["tg"]["areas"]
        assert view["process"]["restarts_1h"] >= 2 and view["process"]["failures"] >= 3
        assert view["process"]["last_exit_status"] == 70

        check = await run_cli("status", "--check", "-c", str(stack.config_path))
        assert check.code == 2, check.stdout
        assert "tg down: its area not running" in check.stdout
        shown = await run_cli("status", "-c", str(stack.config_path))
        assert "crash_loop" in shown.stdout and area[:8] in shown.stdout

        code, text = await stack.request("GET", "/metrics")
        assert code == 200
        samples = {(s.name, s.labels.get("service"), s.labels.get("side")): s.value
                   for f in text_string_to_metric_families(text) for s in f.samples}
        assert samples[("monitord_area_up", "tg", "local")] == 0
        assert samples[("monitord_area_restarts_total", "tg", "local")] >= 2
        status = await stack.status()
        assert json.dumps(status)  # the document stays plain JSON with the new fields

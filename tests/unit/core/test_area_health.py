"""The per-area view and what the check makes of it (orchestrator/area_health.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

from orchestrator import health_check
from orchestrator.area_health import (
    AreaProcess,
    Health,
    RemoteInventoryIndex,
    index_inventory,
    remote_process,
    service_findings,
)

A, B = "aaaaaaaa-0000-4000-8000-000000000001", "bbbbbbbb-0000-4000-8000-000000000002"


def _inventory(*, alive: bool, restarts: int, uptime_s: float = 50.0
               ) -> RemoteInventoryIndex | None:
    return index_inventory(
        {"entries": [{"area": A, "generation": 3, "restarts": restarts}],
         "processes": [{"area": A, "generation": 3, "pid": 41, "alive": alive,
                        "uptime_s": uptime_s}]})


class TestTheVpsSide:
    def test_a_running_daemon_is_up_with_its_start_on_the_pbxs_clock(self) -> None:
        seen = remote_process(_inventory(alive=True, restarts=0), area=A, generation=3,
                              as_of=1000.0, min_uptime_s=3.0)
        assert (seen.state, seen.pid, seen.started_at, seen.health()) == (
            "running", 41, 950.0, Health.UP)

    def test_restarts_in_a_row_are_a_crash_loop_until_it_has_run_long_enough(self) -> None:
        between = remote_process(_inventory(alive=False, restarts=4), area=A, generation=3,
                                 as_of=1.0, min_uptime_s=3.0)
        assert (between.state, between.health()) == ("backoff", Health.CRASH_LOOP)
        just_up = remote_process(_inventory(alive=True, restarts=4, uptime_s=1.0), area=A,
                                 generation=3, as_of=1.0, min_uptime_s=3.0)
        assert just_up.health() is Health.CRASH_LOOP
        settled = remote_process(_inventory(alive=True, restarts=4, uptime_s=9.0), area=A,
                                 generation=3, as_of=1.0, min_uptime_s=3.0)
        assert (settled.health(), settled.restarts) == (Health.UP, 4)

    def test_another_generation_or_no_entry_is_down_and_no_inventory_is_unknown(self) -> None:
        other = remote_process(_inventory(alive=True, restarts=0), area=A, generation=4,
                               as_of=1.0, min_uptime_s=3.0)
        assert (other.state, other.health()) == ("missing", Health.DOWN)
        assert remote_process(None, area=A, generation=3, as_of=None,
                              min_uptime_s=3.0).health() is Health.UNKNOWN

    def test_the_first_item_of_an_area_and_generation_counts_as_a_scan_would_find_it(
        self
    ) -> None:
        index = index_inventory({
            "entries": [{"area": A, "generation": 3, "restarts": 1},
                        {"area": A, "generation": 3, "restarts": 7}],
            "processes": [{"area": A, "generation": 3, "pid": 40, "alive": False},
                          {"area": A, "generation": 3, "pid": 0},
                          {"area": A, "generation": 3, "pid": 41, "uptime_s": 9.0},
                          {"area": A, "generation": 3, "pid": 42, "uptime_s": 9.0}],
        })
        seen = remote_process(index, area=A, generation=3, as_of=10.0, min_uptime_s=3.0)
        # the first entry's count, the first process alive with a pid
        assert (seen.state, seen.pid, seen.restarts) == ("running", 41, 1)

    def test_an_item_whose_name_cannot_be_looked_up_is_passed_over(self) -> None:
        index = index_inventory({
            "entries": [{"area": [A], "generation": 3}, {"area": B, "generation": {}},
                        {"area": A, "generation": 3, "restarts": 2}],
            "processes": [{"area": {"x": 1}, "generation": 3, "pid": 5}],
        })
        seen = remote_process(index, area=A, generation=3, as_of=1.0, min_uptime_s=3.0)
        assert (seen.state, seen.restarts) == ("backoff", 2)
        assert index_inventory(None) is None

    def test_the_view_as_a_document_has_every_field_and_the_health(self) -> None:
        seen = remote_process(_inventory(alive=True, restarts=0), area=A, generation=3,
                              as_of=1000.0, min_uptime_s=3.0)
        assert seen.to_dict() == {**dataclasses.asdict(seen), "health": "up"}
        local = AreaProcess(side="local", state="stopped", last_exit_status=1, restarts_1h=2)
        assert local.to_dict() == {**dataclasses.asdict(local), "health": "down"}


def _area(uuid: str, health: Health) -> dict[str, Any]:
    return {"uuid": uuid, "process": {"health": str(health)}}


class TestFindings:
    def test_one_sick_area_of_two_is_a_warning_all_of_them_critical(self) -> None:
        assert service_findings("tg", [_area(A, Health.UP), _area(B, Health.CRASH_LOOP)]) == [
            ("warning", "tg area bbbbbbbb crash-looping")]
        assert service_findings("tg", [_area(A, Health.DOWN), _area(B, Health.CRASH_LOOP)]) == [
            ("critical", "tg down: all 2 areas not running")]

    def test_moving_unknown_and_healthy_areas_raise_nothing(self) -> None:
        assert service_findings("tg", [_area(A, Health.MOVING), _area(B, Health.UNKNOWN)]) == []
        assert service_findings("tg", [_area(A, Health.UP)]) == []
        # the areas not moving are all the service has now: one down is all of it
        assert service_findings("tg", [_area(A, Health.MOVING), _area(B, Health.DOWN)]) == [
            ("critical", "tg down: its area not running")]

    def test_the_check_reports_them(self) -> None:
        status = {"services": {"tg": {"state": "idle", "areas": [
            _area(A, Health.UP), {"uuid": B, "process": AreaProcess(
                side="local", state="backoff").to_dict()}]}},
            "tunnel": {"state": "not_configured"}, "counts": {}, "at": 0}
        verdict = health_check.classify(status)
        assert verdict.state is health_check.CheckState.WARNING
        assert [f.text for f in verdict.findings] == ["tg area bbbbbbbb down"]

"""`status --check` classification: one status document, one Nagios-style state and line."""

from __future__ import annotations

import io
from typing import Any

import pytest
from rich.console import Console

from monitord.remote.tunnel.keeper import TunnelState
from orchestrator import health_check
from orchestrator.health_check import CheckState
from orchestrator.status import ServiceState


def document(**changes: Any) -> dict[str, Any]:
    """A healthy status document (the shape of GET /v1/status), with `changes` applied."""
    status: dict[str, Any] = {
        "owner_id": "o1",
        "accepting": True,
        "config_error": None,
        "quarantined": [],
        "tunnel": {"state": "connected", "connected": True, "last_error": "", "attempts": 1,
                   "lease": None, "lease_holder": None, "forwards": []},
        "counts": {"local": 3, "remote": 2, "migrating": 0, "orphan": 0},
        "services": {
            "tg": {"state": "idle", "last_error": None, "areas": []},
            "chats": {"state": "idle", "last_error": None, "areas": []},
        },
        "transactions": [],
        "cleanup": {"backlog": 0, "stuck": 0},
        "drift": {"before": 0, "after": 0},
    }
    status.update(changes)
    return status


def with_service(state: str, *, code: str | None = None) -> dict[str, Any]:
    status = document()
    status["services"]["chats"] = {
        "state": state, "areas": [],
        "last_error": {"code": code, "detail": "d"} if code else None,
    }
    return status


def with_tunnel(state: str, **fields: Any) -> dict[str, Any]:
    tunnel = {**document()["tunnel"], "state": state, "connected": state == "connected",
              **fields}
    return document(tunnel=tunnel)


class TestTables:
    """Every service state and every tunnel state has a check state."""

    def test_every_contract_service_state_is_classified(self) -> None:
        assert set(health_check.SERVICE_STATES) == set(ServiceState)

    def test_every_tunnel_state_of_the_keeper_is_classified(self) -> None:
        assert {s.value for s in TunnelState} | {"not_configured"} == set(
            health_check.TUNNEL_STATES
        )

    def test_the_exit_codes_are_the_plugin_convention(self) -> None:
        assert [s.value for s in CheckState] == [0, 1, 2, 3]
        assert [s.name for s in CheckState] == ["OK", "WARNING", "CRITICAL", "UNKNOWN"]


class TestOk:
    """A healthy installation is OK, and migrations in progress are too."""

    def test_idle_services_and_a_connected_tunnel_are_ok(self) -> None:
        verdict = health_check.classify(document())
        assert verdict.state is CheckState.OK and verdict.exit_code == 0
        assert verdict.line() == (
            "MONITORD OK - 2 services, areas local 3 remote 2 migrating 0; tunnel connected"
            " | areas_local=3 areas_remote=2 areas_migrating=0 orphans=0 cleanup_backlog=0"
            " cleanup_stuck=0 quarantined=0"
        )

    @pytest.mark.parametrize("state", ["copying", "preflight", "cleaning_orphans"])
    def test_work_in_progress_is_ok(self, state: str) -> None:
        assert health_check.classify(with_service(state)).state is CheckState.OK

    def test_no_remote_configured_is_ok(self) -> None:
        assert health_check.classify(with_tunnel("not_configured")).state is CheckState.OK


class TestCritical:
    """What needs a human is CRITICAL, and the line names it first."""

    def test_a_parked_service_is_critical_with_its_code(self) -> None:
        verdict = health_check.classify(with_service("parked", code="PREFLIGHT_DISK_SPACE"))
        assert verdict.exit_code == 2
        assert verdict.line().startswith("MONITORD CRITICAL - chats parked (PREFLIGHT_DISK_SPACE)")

    def test_a_tunnel_lease_held_by_another_owner_is_critical_and_names_the_holder(
        self
    ) -> None:
        status = with_tunnel(
            "lease_conflict", last_error="TUNNEL_LEASE_CONFLICT: held by pbx-2",
            lease_holder={"owner_id": "o2", "owner_label": "pbx-2"},
        )
        status["services"]["chats"]["state"] = "tunnel_conflict"
        verdict = health_check.classify(status)
        assert verdict.state is CheckState.CRITICAL
        assert "tunnel lease_conflict held by pbx-2 (TUNNEL_LEASE_CONFLICT" in verdict.line()
        assert "chats tunnel_conflict" in verdict.line()

    def test_a_corrupt_authoritative_file_is_critical(self) -> None:
        status = document(config_error={"code": "CONFIG_CORRUPT", "detail": "line 3"})
        verdict = health_check.classify(status)
        assert verdict.state is CheckState.CRITICAL
        assert "config_error CONFIG_CORRUPT: line 3" in verdict.line()

    @pytest.mark.parametrize("state", ["port_occupied", "auth_failed", "host_key_mismatch"])
    def test_a_tunnel_refused_for_good_is_critical(self, state: str) -> None:
        assert health_check.classify(with_tunnel(state)).state is CheckState.CRITICAL

    def test_critical_outranks_warnings_and_comes_first_in_the_line(self) -> None:
        status = with_service("parked", code="HEALTHCHECK_TIMEOUT")
        status["cleanup"] = {"backlog": 2, "stuck": 1}
        status["tunnel"] = with_tunnel("backoff")["tunnel"]
        verdict = health_check.classify(status)
        assert verdict.state is CheckState.CRITICAL
        text = verdict.line().split(" | ")[0]
        assert text.index("chats parked") < text.index("tunnel backoff")
        assert "1 cleanup item stuck" in text


class TestWarning:
    """What monitord is still working on is a WARNING."""

    @pytest.mark.parametrize("state", ["rolling_back", "awaiting_data"])
    def test_a_rollback_in_progress_or_waiting_for_data_warns(self, state: str) -> None:
        assert health_check.classify(with_service(state)).exit_code == 1

    @pytest.mark.parametrize("state", ["connecting", "backoff", "stopped"])
    def test_a_tunnel_down_or_reconnecting_warns(self, state: str) -> None:
        verdict = health_check.classify(with_tunnel(state, last_error="SSH_UNREACHABLE: x"))
        assert verdict.state is CheckState.WARNING
        assert f"tunnel {state} (SSH_UNREACHABLE: x)" in verdict.line()

    def test_quarantined_entries_warn_with_their_codes(self) -> None:
        status = document(quarantined=[
            {"position": 2, "code": "AREA_ID_INVALID", "detail": "x"},
            {"position": 3, "code": "AREA_ENTRY_INVALID", "detail": "y"},
        ])
        verdict = health_check.classify(status)
        assert verdict.state is CheckState.WARNING
        assert "2 quarantined custom_config.json entries (AREA_ENTRY_INVALID, AREA_ID_INVALID)" \
            in verdict.line()
        assert verdict.line().endswith("quarantined=2")

    def test_stuck_cleanup_warns(self) -> None:
        verdict = health_check.classify(document(cleanup={"backlog": 3, "stuck": 2}))
        assert verdict.state is CheckState.WARNING
        assert "2 cleanup items stuck (CLEANUP_STUCK)" in verdict.line()

    def test_a_draining_daemon_warns(self) -> None:
        assert health_check.classify(document(accepting=False)).state is CheckState.WARNING

    def test_a_forward_whose_target_is_down_warns_while_connected(self) -> None:
        forwards = [{"name": "nats", "state": "target_down"}]
        verdict = health_check.classify(with_tunnel("connected", forwards=forwards))
        assert verdict.state is CheckState.WARNING and "forward nats target_down" in verdict.line()


class TestRootLoops:
    """A root loop whose iteration failed lately (or still fails) warns, with its code."""

    @staticmethod
    def with_loop(*, failing: int, at: float, now: float = 10_000.0) -> dict[str, Any]:
        loop = {"errors": 3, "failing": failing,
                "last_error": {"code": "INTERNAL", "detail": "KeyError: 'x'", "at": at}}
        return document(at=now, loops={"lease renewer": loop,
                                       "reconciler": {"errors": 0, "failing": 0,
                                                      "last_error": None}})

    def test_a_loop_failing_now_warns_with_its_code_and_count(self) -> None:
        verdict = health_check.classify(self.with_loop(failing=2, at=1.0))
        assert verdict.state is CheckState.WARNING
        assert "lease renewer" in verdict.line() and "INTERNAL" in verdict.line()
        assert "3 failed iterations" in verdict.line()

    def test_a_loop_that_failed_minutes_ago_still_warns(self) -> None:
        now = 10_000.0
        recent = now - health_check.LOOP_ERROR_WARN_S / 2
        verdict = health_check.classify(self.with_loop(failing=0, at=recent, now=now))
        assert verdict.state is CheckState.WARNING

    def test_monitord_status_names_the_loop_its_count_and_its_last_error(self) -> None:
        from monitord.surface import status_view

        status = self.with_loop(failing=2, at=1.0)
        status["loops"]["lease renewer"]["last_error"]["detail"] = "KeyError: '[/x]'"
        [line] = status_view.loop_lines(status)
        assert line.startswith("loop lease renewer: 3 failed iterations, failing now (2 in a")
        assert "last INTERNAL: KeyError: '[/x]' at 1970-01-01" in line
        console = Console(file=io.StringIO(), width=200)
        status_view.print_status(status, console=console)  # the markup-like text is no markup
        assert "KeyError: '[/x]'" in console.file.getvalue()  # type: ignore[attr-defined]

    def test_a_loop_that_recovered_long_ago_is_ok(self) -> None:
        now = 10_000.0
        old = now - health_check.LOOP_ERROR_WARN_S - 1
        verdict = health_check.classify(self.with_loop(failing=0, at=old, now=now))
        assert verdict.state is CheckState.OK


class TestUnknown:
    """What the check cannot tell is UNKNOWN, exit 3."""

    def test_an_unreachable_daemon_is_unknown_with_its_code(self) -> None:
        verdict = health_check.unreachable("monitord is not answering at http://127.0.0.1:1")
        assert verdict.exit_code == 3
        assert verdict.line() == (
            "MONITORD UNKNOWN - DAEMON_UNREACHABLE: monitord is not answering at"
            " http://127.0.0.1:1"
        )

    def test_a_document_without_services_is_unknown(self) -> None:
        assert health_check.classify({"tunnel": {}}).state is CheckState.UNKNOWN

    def test_a_state_the_tables_do_not_know_is_unknown_unless_something_is_worse(
        self
    ) -> None:
        assert health_check.classify(with_service("teleporting")).state is CheckState.UNKNOWN
        status = with_service("teleporting")
        status["cleanup"] = {"backlog": 1, "stuck": 1}
        assert health_check.classify(status).state is CheckState.WARNING


class TestWarmCopies:
    """A remote area whose warm copy is past `overdue_at` (three intervals) warns: what a
    give-up would lose has outgrown the bound the service chose."""

    def _with(self, *warm: dict[str, Any] | None) -> dict[str, Any]:
        status = document()
        status["services"]["tg"]["areas"] = [
            {"uuid": f"a{n}", "warm_copy": w} for n, w in enumerate(warm)]
        return status

    def test_a_copy_within_its_bound_or_no_copies_at_all_is_ok(self) -> None:
        fresh = {"taken_at": 990.0, "overdue_at": 1080.0, "error": None}
        verdict = health_check.classify(self._with(fresh, None), now=1000.0)
        assert verdict.state is CheckState.OK, verdict.line()

    def test_an_overdue_copy_warns_with_its_age_and_last_failure(self) -> None:
        late = {"taken_at": 900.0, "overdue_at": 990.0,
                "error": {"code": "WARM_COPY_FAILED", "detail": "kept changing"}}
        never = {"taken_at": None, "overdue_at": 995.0, "error": None}
        verdict = health_check.classify(self._with(late, never), now=1000.0)
        assert verdict.state is CheckState.WARNING
        assert "2 warm copies overdue (tg: 100 s old, last WARM_COPY_FAILED)" in verdict.line()

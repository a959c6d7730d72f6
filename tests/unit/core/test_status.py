"""Service status: one contract state, area counts, and the remote_state.json projection."""

from __future__ import annotations

import pytest

from orchestrator import planner, status
from orchestrator.models import Area, CleanupItem, Phase, Side, Transaction
from orchestrator.status import ServiceState

from .records import transaction

CONTRACT_STATES = {
    "idle", "preflight", "suppressing_source", "copying", "starting_destination",
    "awaiting_healthcheck", "committing", "rolling_back", "cleaning_orphans",
    "tunnel_conflict", "parked",
    # added with data lineage: a rollback keeps an area stopped until its data is back
    "awaiting_data",
}
LOCAL_AREA = Area(uuid="a1", service="tg", location=Side.LOCAL, generation=7)
REMOTE_AREA = Area(uuid="a2", service="tg", location=Side.REMOTE, generation=3)


def state_of(*txns: Transaction, tunnel_conflict: bool = False, orphans: int = 0) -> ServiceState:
    return status.service_state(
        service="tg",
        authoritative=[LOCAL_AREA],
        transactions=txns,
        tunnel_conflict=tunnel_conflict,
        orphans=orphans,
    )


class TestServiceState:
    """Each service shows exactly one of the contract states, most urgent first."""

    def test_the_states_are_exactly_the_contract(self) -> None:
        assert {s.value for s in ServiceState} == CONTRACT_STATES

    @pytest.mark.parametrize(
        ("phase", "expected"),
        [
            (Phase.PREFLIGHT, "preflight"),
            (Phase.SUPPRESS_SOURCE, "suppressing_source"),
            (Phase.COPY, "copying"),
            (Phase.CREATE_DESTINATION, "starting_destination"),
            (Phase.HEALTHCHECK_DESTINATION, "awaiting_healthcheck"),
            (Phase.COMMIT_LOCATION, "committing"),
            (Phase.CLEANUP_SOURCE, "cleaning_orphans"),
            (Phase.ROLLBACK, "rolling_back"),
            (Phase.PARKED, "parked"),
            (Phase.DONE, "idle"),
            (Phase.ROLLED_BACK, "idle"),
        ],
    )
    def test_a_single_transaction_shows_its_phase(self, phase: Phase, expected: str) -> None:
        assert state_of(transaction(phase=phase)) == expected

    def test_parked_wins_over_everything(self) -> None:
        txns = (
            transaction(phase=Phase.PARKED),
            transaction(phase=Phase.COPY).model_copy(update={"area": "a3"}),
        )
        assert state_of(*txns, tunnel_conflict=True) == "parked"

    def test_tunnel_conflict_shows_only_for_a_service_that_uses_the_tunnel(self) -> None:
        assert state_of(tunnel_conflict=True) == "idle"
        assert state_of(transaction(phase=Phase.COPY), tunnel_conflict=True) == "tunnel_conflict"
        uses_remote = status.service_state(
            service="tg", authoritative=[REMOTE_AREA], transactions=[], tunnel_conflict=True,
            orphans=0,
        )
        assert uses_remote == "tunnel_conflict"

    def test_orphans_show_as_cleaning(self) -> None:
        assert state_of(orphans=2) == "cleaning_orphans"

    def test_other_services_do_not_count(self) -> None:
        other = transaction(phase=Phase.COPY).model_copy(update={"service": "chats"})
        assert state_of(other) == "idle"


class TestAreaCounts:
    """Areas count on their committed side unless migrating; orphans come from plan + cleanup."""

    def test_counts(self) -> None:
        moving = transaction(phase=Phase.COPY).model_copy(update={"area": "a2"})
        counts = status.area_counts(
            service="tg", authoritative=[LOCAL_AREA, REMOTE_AREA], transactions=[moving], orphans=1
        )
        assert counts == status.AreaCounts(local=1, remote=0, migrating=1, orphan=1)

    def test_parked_area_counts_on_its_source(self) -> None:
        parked = transaction(phase=Phase.PARKED)
        counts = status.area_counts(
            service="tg", authoritative=[LOCAL_AREA], transactions=[parked], orphans=0
        )
        assert (counts.local, counts.migrating) == (1, 0)

    def test_orphan_count_takes_removals_and_cleanup_items_not_creations(self) -> None:
        actions = [
            planner.RemoveRemoteEntry(service="tg", area="x", side=Side.REMOTE, generation=1),
            planner.StopProcess(service="tg", area="y", side=Side.LOCAL, generation=1),
            planner.CreateRemoteEntry(service="tg", area="z", side=Side.REMOTE, generation=1),
            planner.StopProcess(service="chats", area="w", side=Side.LOCAL, generation=1),
        ]
        items = [
            CleanupItem(id="c", service="tg", area="v", side=Side.REMOTE, generation=2,
                        next_attempt_at=0.0, created_at=0.0),
        ]
        assert status.orphan_count(service="tg", plan_actions=actions, cleanup_items=items) == 3


class TestRemoteStateProjection:
    """remote_state.json is a projection of transactions, one entry per configured service."""

    def test_projection_of_each_situation(self) -> None:
        failing = transaction(phase=Phase.ROLLBACK, last_error_code="HEALTHCHECK_TIMEOUT")
        projected = status.remote_state(
            services=["tg", "chats"], transactions=[failing], fail_counts={"tg": 2}
        )
        assert projected == {
            "tg": {"migrating": False, "resuming": True, "parked": False, "fail_count": 2,
                   "last_error": "HEALTHCHECK_TIMEOUT"},
            "chats": {"migrating": False, "resuming": False, "parked": False, "fail_count": 0,
                      "last_error": ""},
        }

    def test_forward_migration_is_migrating(self) -> None:
        projected = status.remote_state(
            services=["tg"], transactions=[transaction(phase=Phase.COPY)], fail_counts={}
        )
        assert projected["tg"]["migrating"] and not projected["tg"]["parked"]


class TestLegacyNormalisation:
    """A legacy remote_state.json is cleaned against monitord's records, noting every change."""

    LEGACY = {
        "tg": {"migrating": True, "resuming": True, "parked": True, "fail_count": 9,
               "last_error": "ssh: tcpip-forward request denied by peer",
               "areas": {"a1": {"x": 1}, "ghost": {"x": 2}}},
        "whatsapp_old": {"migrating": True},
        "chats": "garbage",
    }

    def test_stuck_flags_without_transactions_are_cleared(self) -> None:
        result = status.normalise_legacy(
            self.LEGACY, services=["tg", "chats"], known_areas=["a1"], transactions=[]
        )
        assert result.state["tg"] == {
            "migrating": False, "resuming": False, "parked": False, "fail_count": 0,
            "last_error": "ssh: tcpip-forward request denied by peer", "areas": {"a1": {"x": 1}},
        }
        assert "whatsapp_old" not in result.state
        assert result.state["chats"]["fail_count"] == 0
        joined = "\n".join(result.notes)
        for expected in ("stuck migrating", "stuck resuming", "stale parked", "'whatsapp_old'",
                         "'ghost'", "chats: replaced a malformed entry"):
            assert expected in joined

    def test_flags_backed_by_a_transaction_are_kept(self) -> None:
        parked = transaction(phase=Phase.PARKED)
        result = status.normalise_legacy(
            {"tg": {"parked": True, "fail_count": 5}}, services=["tg"], known_areas=["a1"],
            transactions=[parked],
        )
        assert result.state["tg"]["parked"] is True
        assert result.state["tg"]["fail_count"] == 5
        assert result.notes == ()

    def test_malformed_fail_count_is_reset(self) -> None:
        result = status.normalise_legacy(
            {"tg": {"fail_count": "lots"}}, services=["tg"], known_areas=[], transactions=[]
        )
        assert result.state["tg"]["fail_count"] == 0
        assert any("fail_count" in note for note in result.notes)


class TestServiceView:
    """The API view of a service: desired side, state, counts and an actionable last error."""

    def test_view_of_a_failing_migration(self) -> None:
        failing = transaction(
            phase=Phase.ROLLBACK, last_error_code="HEALTHCHECK_TIMEOUT",
            last_error_detail="uptime 1.2 s < 3 s", updated_at=1_234.0,
        )
        view = status.service_view(
            service="tg", areas=[LOCAL_AREA], transactions=[failing], desired=Side.REMOTE,
            area_desired={}, orphans=0, tunnel_conflict=False,
        )
        assert view.desired == "remote"
        assert view.state == "rolling_back"
        assert dict(view.counts) == {"local": 0, "remote": 0, "migrating": 1, "orphan": 0}
        assert view.last_error is not None
        assert view.last_error["code"] == "HEALTHCHECK_TIMEOUT"
        assert view.last_error["phase"] == "ROLLBACK"
        assert view.last_error["at"] == 1_234.0
        assert view.last_error["action"]  # the catalogue's recommended action

    def test_mixed_desired_sides(self) -> None:
        view = status.service_view(
            service="tg", areas=[LOCAL_AREA, REMOTE_AREA], transactions=[], desired=None,
            area_desired={"a1": Side.LOCAL, "a2": Side.REMOTE}, orphans=0,
            tunnel_conflict=False,
        )
        assert view.desired == "mixed" and view.state == "idle" and view.last_error is None

    def test_pending_cleanup_shows_as_cleaning(self) -> None:
        view = status.service_view(
            service="tg", areas=[LOCAL_AREA], transactions=[], desired=None, area_desired={},
            orphans=0, tunnel_conflict=False, cleanup_pending=True,
        )
        assert view.state == "cleaning_orphans"

    def test_remote_state_row_keys_are_the_contract(self) -> None:
        row = status.remote_state_row(transactions=[], fail_count=1, last_error="X")
        assert row == {"migrating": False, "resuming": False, "parked": False, "fail_count": 1,
                       "last_error": "X"}

    def test_legacy_normalisation_without_an_area_list_keeps_area_entries(self) -> None:
        result = status.normalise_legacy(
            {"tg": {"areas": {"u": {}}}}, services=["tg"], transactions=[]
        )
        assert result.state["tg"]["areas"] == {"u": {}}
        assert not result  # nothing had to change


class TestAwaitingData:
    """A rollback waiting for the destination's newer data shows as awaiting_data."""

    def test_a_rollback_waiting_for_its_data_is_awaiting_data_not_rolling_back(self) -> None:
        waiting = transaction(
            phase=Phase.ROLLBACK, rollback_from=Phase.HEALTHCHECK_DESTINATION,
            destination_fenced=True, data_wait_since=5.0,
        )
        rolling = waiting.model_copy(update={"data_wait_since": None})
        for txn, expected in ((waiting, "awaiting_data"), (rolling, "rolling_back")):
            state = status.service_state(
                service="tg", authoritative=[LOCAL_AREA], transactions=[txn],
                tunnel_conflict=False, orphans=0,
            )
            assert state == expected

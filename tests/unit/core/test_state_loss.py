"""What may start after state.db was lost or found older than custom_config.json
(orchestrator/state_loss.py): held on both sides until the VPS has said what it holds."""

from __future__ import annotations

from orchestrator import state_loss
from orchestrator.models import Area, ProcessInfo, RemoteEntry, RemoteInventory, Side

A = Area(uuid="a1", service="tg", location=Side.LOCAL, generation=4)
B = Area(uuid="b1", service="tg", location=Side.REMOTE, generation=2)


def _inventory(*generations: int, running: int | None = None) -> RemoteInventory:
    return RemoteInventory(
        entries=tuple(RemoteEntry(area="a1", service="tg", generation=g, created_at=0.0)
                      for g in generations),
        processes=() if running is None else (ProcessInfo(
            area="a1", service="tg", generation=running, pid=10, started_at=0.0),))


def test_held_at_start_when_lost_or_when_state_db_is_older_than_the_file() -> None:
    assert set(state_loss.held_at_start([A, B], highest_issued={"a1": 4, "b1": 2},
                                        state_lost=True)) == {"a1", "b1"}
    older = state_loss.held_at_start([A, B], highest_issued={"a1": 3, "b1": 2},
                                     state_lost=False)
    assert set(older) == {"a1"} and "older than the file" in older["a1"].detail
    assert state_loss.held_at_start([A, B], highest_issued={"a1": 9, "b1": 2},
                                    state_lost=False) == {}
    # the first start in a work_dir: a file's generations are no one's to doubt
    assert state_loss.held_at_start([A, B], highest_issued={}, state_lost=False,
                                    state_new=True) == {}


def test_released_once_the_vps_holds_nothing_newer_or_at_once_with_no_vps() -> None:
    held = state_loss.Held("lost")
    assert state_loss.verdict(A, held, remote=None, remote_configured=False) is None
    assert state_loss.verdict(A, held, remote=None, remote_configured=True) == held
    assert state_loss.verdict(A, held, remote=_inventory(), remote_configured=True) is None
    assert state_loss.verdict(A, held, remote=_inventory(3, 4), remote_configured=True) is None


def test_a_newer_generation_on_the_vps_keeps_it_held_and_names_the_step() -> None:
    held = state_loss.Held("lost")
    for inventory in (_inventory(5), _inventory(running=6), _inventory(4, 7, running=4)):
        still = state_loss.verdict(A, held, remote=inventory, remote_configured=True)
        assert still is not None and "newer than the committed 4" in still.detail
        assert "put back the state.db" in still.detail

"""Warm copies: taken only of an area settled on the VPS, started from only by the give-up that
chose them, for the epoch it opened, and kept no longer than a rule still needs them."""

from __future__ import annotations

import dataclasses

from orchestrator import lineage, warm_copy
from orchestrator.lineage import Lineage
from orchestrator.models import Area, Side
from orchestrator.warm_copy import WarmCopy

ON_VPS = Area(uuid="a1", service="tg", location=Side.REMOTE, generation=7)
AT_HOME = Area(uuid="a1", service="tg", location=Side.LOCAL, generation=8)
REMOTE_NEWEST = Lineage(area="a1", holders=frozenset({Side.REMOTE}), epoch=4)
BOTH = Lineage(area="a1", holders=frozenset({Side.REMOTE, Side.LOCAL}), epoch=4)
COPY = WarmCopy(area="a1", service="tg", generation=7, epoch=4, taken_at=1000.0,
                received_at=1002.0, files=3, bytes=4096, sent_bytes=512, digest="d" * 64)


class TestDue:
    def test_a_settled_remote_area_is_copied_every_interval(self) -> None:
        def due(last_try: float | None, now: float) -> bool:
            return warm_copy.due(ON_VPS, REMOTE_NEWEST, moving=False, last_try=last_try,
                                 now=now, interval_s=30.0)

        assert due(None, 5.0)
        assert not due(100.0, 129.9)
        assert due(100.0, 130.0)

    def test_never_while_any_move_runs_nor_of_an_area_not_settled_on_the_vps(self) -> None:
        for area, lin, moving in ((ON_VPS, REMOTE_NEWEST, True), (AT_HOME, REMOTE_NEWEST, False),
                                  (ON_VPS, BOTH, False)):
            assert not warm_copy.due(area, lin, moving=moving, last_try=None, now=1e6,
                                     interval_s=30.0), (area, lin, moving)


class TestGiveUp:
    def test_the_copy_of_the_copy_given_up_is_chosen_for_the_epoch_the_give_up_opens(
        self
    ) -> None:
        assert warm_copy.usable_at_give_up(COPY, REMOTE_NEWEST, generations=frozenset({7}))
        chosen = warm_copy.chosen(COPY, REMOTE_NEWEST)
        after = lineage.discarded(REMOTE_NEWEST, keep=Side.LOCAL)
        assert warm_copy.restores(chosen, after)
        # the move home's start claims the PBX's data: the same epoch, still the copy
        assert warm_copy.restores(chosen, lineage.claimed(after, Side.LOCAL))

    def test_a_copy_of_another_epoch_generation_or_area_is_never_chosen(self) -> None:
        for copy in (dataclasses.replace(COPY, epoch=3), dataclasses.replace(COPY, generation=6),
                     dataclasses.replace(COPY, area="a2"), None):
            assert not warm_copy.usable_at_give_up(copy, REMOTE_NEWEST,
                                                   generations=frozenset({7})), copy
        # the PBX already holds the newest too (a move home copied it): nothing to gain
        assert not warm_copy.usable_at_give_up(COPY, BOTH, generations=frozenset({7}))

    def test_a_choice_no_give_up_recorded_restores_nothing(self) -> None:
        """The choice is written before the give-up: a crash between leaves it for an epoch
        the lineage never reaches, and an unchosen copy is never started from."""
        chosen = warm_copy.chosen(COPY, REMOTE_NEWEST)
        assert not warm_copy.restores(chosen, REMOTE_NEWEST)
        assert not warm_copy.restores(COPY, lineage.discarded(REMOTE_NEWEST, keep=Side.LOCAL))
        later = lineage.discarded(lineage.discarded(REMOTE_NEWEST, keep=Side.LOCAL),
                                  keep=Side.LOCAL)
        assert not warm_copy.restores(chosen, later)


class TestKept:
    def test_kept_while_it_is_the_current_epochs_or_a_give_up_may_use_it(self) -> None:
        assert warm_copy.kept(COPY, ON_VPS, REMOTE_NEWEST, moving=False)
        chosen = warm_copy.chosen(COPY, REMOTE_NEWEST)
        given_up = lineage.discarded(REMOTE_NEWEST, keep=Side.LOCAL)
        assert warm_copy.kept(chosen, ON_VPS, given_up, moving=False)
        assert warm_copy.kept(COPY, ON_VPS, BOTH, moving=True), "a move home diffs against it"

    def test_dropped_once_its_epoch_or_generation_is_over(self) -> None:
        home = lineage.claimed(lineage.copied(REMOTE_NEWEST, source=Side.REMOTE,
                                              destination=Side.LOCAL), Side.LOCAL)
        assert not warm_copy.kept(COPY, AT_HOME, home, moving=False)
        assert not warm_copy.kept(COPY, None, REMOTE_NEWEST, moving=False)
        moved_again = Lineage(area="a1", holders=frozenset({Side.REMOTE}), epoch=6)
        assert not warm_copy.kept(COPY, ON_VPS.model_copy(update={"generation": 9}), moved_again,
                                  moving=False)


def test_age_and_overdue_count_from_the_vps_snapshot_or_from_when_copies_began() -> None:
    assert warm_copy.age_s(COPY, now=1030.0) == 30.0
    assert warm_copy.age_s(COPY, now=990.0) == 0.0, "a PBX clock behind the VPS's: never < 0"
    assert warm_copy.overdue_at(COPY, since=0.0, interval_s=30.0) == 1090.0
    assert warm_copy.overdue_at(None, since=500.0, interval_s=30.0) == 590.0


def test_a_record_survives_storage_whole() -> None:
    chosen = warm_copy.chosen(COPY, REMOTE_NEWEST)
    assert WarmCopy.from_storage(chosen.to_storage()) == chosen

"""A copy's progress: the rate over the last seconds and an ETA that never promises an end
while nothing moves (orchestrator/copy_progress.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrator.copy_progress import MIN_SPAN_S, WINDOW_S, CopyProgress

MIB = 1 << 20


def _copy(*, total: int = 100 * MIB) -> CopyProgress:
    progress = CopyProgress(stage="pre_copy", from_side="local", started=1000.0,
                            started_at=1_700_000_000.0)
    progress.advance(0, total, now=1000.0)
    return progress


def _steady(progress: CopyProgress, *, rate: int, until: float, step: float = 0.25) -> None:
    assert progress.total is not None
    at = progress.started
    while at < until:
        at = min(at + step, until)
        progress.advance(int((at - progress.started) * rate), progress.total, now=at)


class TestRate:
    def test_no_total_nor_end_until_the_copy_has_listed_what_it_copies(self) -> None:
        progress = CopyProgress(stage="copy", from_side="remote", started=1000.0,
                                started_at=0.0)
        view = progress.view(1003.0)
        assert (view["bytes_total"], view["bytes_done"], view["eta_s"]) == (None, 0, None)

    def test_no_rate_before_the_least_span(self) -> None:
        progress = _copy()
        progress.advance(MIB, 100 * MIB, now=1000.0 + MIN_SPAN_S / 2)
        assert progress.rate(1000.0 + MIN_SPAN_S / 2) is None
        assert progress.eta_s(1000.0 + MIN_SPAN_S / 2) is None

    def test_a_steady_copy_shows_its_rate_and_the_time_left(self) -> None:
        progress = _copy()
        _steady(progress, rate=2 * MIB, until=1010.0)
        assert progress.rate(1010.0) == pytest.approx(2 * MIB, rel=0.01)
        assert progress.eta_s(1010.0) == pytest.approx(40.0, rel=0.01)  # 80 MiB left

    def test_a_slower_link_shows_within_the_window(self) -> None:
        progress = _copy()
        _steady(progress, rate=4 * MIB, until=1010.0)
        done = progress.done
        at = 1010.0
        while at < 1010.0 + WINDOW_S:
            at += 0.25
            progress.advance(done + int((at - 1010.0) * MIB), 100 * MIB, now=at)
        assert progress.rate(at) == pytest.approx(MIB, rel=0.06)

    def test_a_stalled_copy_has_no_rate_and_promises_no_end(self) -> None:
        progress = _copy()
        _steady(progress, rate=2 * MIB, until=1010.0)
        later = 1010.0 + WINDOW_S + 1
        assert progress.rate(later) == 0
        assert progress.eta_s(later) is None
        assert progress.view(later)["eta_s"] is None

    def test_the_rate_falls_while_nothing_arrives(self) -> None:
        progress = _copy()
        _steady(progress, rate=2 * MIB, until=1010.0)
        assert progress.rate(1012.0) < progress.rate(1010.0)  # type: ignore[operator]

    def test_the_view_says_what_the_status_shows(self) -> None:
        progress = _copy(total=10 * MIB)
        _steady(progress, rate=MIB, until=1004.0)
        assert progress.view(1004.0) == {
            "stage": "pre_copy", "from": "local", "bytes_done": 4 * MIB,
            "bytes_total": 10 * MIB, "started_at": 1_700_000_000.0,
            "rate_bytes_s": MIB, "eta_s": 6.0,
        }

    @given(st.lists(st.tuples(st.floats(0, 3), st.integers(0, 8 * MIB)), max_size=60),
           st.floats(0, 20))
    def test_never_negative_nor_a_past_end(self, steps: list[tuple[float, int]],
                                          after: float) -> None:
        """Whatever the readings (a download's done may even go back: a redone copy)."""
        progress = _copy(total=8 * MIB)
        at = progress.started
        for pause, done in steps:
            at += pause
            progress.advance(done, 8 * MIB, now=at)
        rate, eta = progress.rate(at + after), progress.eta_s(at + after)
        assert rate is None or rate >= 0
        assert eta is None or eta >= 0
        assert len(progress._readings) <= len(steps) + 2

"""The split-brain detector's bookkeeping, fed with synthetic heartbeats on a made-up clock."""

from __future__ import annotations

import pytest

from monitord.testing.split_brain import LifeKey, LifeLog, MalformedHeartbeat

STALE = 0.3


def beat(area: str, side: str, generation: int, pid: int, *, goodbye: bool = False) -> dict:
    message = {"area": area, "side": side, "generation": generation, "pid": pid, "ts": 0.0}
    if goodbye:
        message["event"] = "goodbye"
    return message


def beats(log: LifeLog, message: dict, *, start: float, end: float, step: float = 0.1) -> None:
    at = start
    while at <= end + 1e-9:
        log.record(message, at=at)
        at += step


class TestOverlapReporting:
    """Two processes alive for one area at the same instant are reported with both names."""

    def test_two_sides_alive_at_once_is_an_overlap(self) -> None:
        log = LifeLog(staleness_s=STALE)
        beats(log, beat("a", "local", 1, 100), start=0.0, end=2.0)
        beats(log, beat("a", "remote", 2, 200), start=1.5, end=3.0)
        [overlap] = log.overlaps(now=3.0)
        assert (overlap.first.side, overlap.second.side) == ("local", "remote")
        assert overlap.start == pytest.approx(1.5)
        assert overlap.end == pytest.approx(2.0 + STALE)
        assert "area a" in overlap.describe()

    def test_two_processes_on_one_side_are_an_overlap_too(self) -> None:
        log = LifeLog(staleness_s=STALE)
        beats(log, beat("a", "local", 1, 100), start=0.0, end=1.0)
        beats(log, beat("a", "local", 1, 101), start=0.5, end=1.0)
        assert len(log.overlaps(now=1.0)) == 1

    def test_a_silent_process_counts_as_alive_for_the_staleness_allowance(self) -> None:
        log = LifeLog(staleness_s=STALE)
        beats(log, beat("a", "local", 1, 100), start=0.0, end=1.0)  # killed: no goodbye
        beats(log, beat("a", "remote", 2, 200), start=1.2, end=2.0)
        assert len(log.overlaps(now=2.0)) == 1


class TestCleanHandover:
    """Stop-then-start of one area, and different areas at once, are not overlaps."""

    def test_goodbye_then_start_is_not_an_overlap(self) -> None:
        log = LifeLog(staleness_s=STALE)
        beats(log, beat("a", "local", 1, 100), start=0.0, end=1.0)
        log.record(beat("a", "local", 1, 100, goodbye=True), at=1.05)
        beats(log, beat("a", "remote", 2, 200), start=1.1, end=2.0)
        assert log.overlaps(now=2.0) == []

    def test_silence_longer_than_the_allowance_then_start_is_not_an_overlap(self) -> None:
        log = LifeLog(staleness_s=STALE)
        beats(log, beat("a", "local", 1, 100), start=0.0, end=1.0)
        beats(log, beat("a", "remote", 2, 200), start=1.0 + STALE + 0.01, end=2.0)
        assert log.overlaps(now=2.0) == []

    def test_different_areas_never_overlap_each_other(self) -> None:
        log = LifeLog(staleness_s=STALE)
        beats(log, beat("a", "local", 1, 100), start=0.0, end=1.0)
        beats(log, beat("b", "remote", 1, 200), start=0.0, end=1.0)
        assert log.overlaps(now=1.0) == []


class TestAliveView:
    """A process is alive from its first heartbeat until goodbye or staleness."""

    def test_alive_lists_only_processes_heard_recently_and_not_gone(self) -> None:
        log = LifeLog(staleness_s=STALE)
        log.record(beat("a", "local", 1, 100), at=0.0)
        log.record(beat("b", "local", 1, 101), at=0.0)
        log.record(beat("b", "local", 1, 101, goodbye=True), at=0.1)
        log.record(beat("c", "remote", 3, 102), at=0.9)
        assert log.alive(now=1.0) == [LifeKey("c", "remote", 3, 102)]

    def test_a_line_that_is_not_a_heartbeat_is_refused(self) -> None:
        with pytest.raises(MalformedHeartbeat):
            LifeLog().record({"area": "a"}, at=0.0)

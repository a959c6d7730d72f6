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


def written(area: str, side: str, generation: int, pid: int, *, start: int, now: int,
            goodbye: bool = False) -> dict:
    return {**beat(area, side, generation, pid, goodbye=goodbye),
            "start_records": start, "records": now}


class TestDataLineage:
    """A start on fewer session records than its area had written is a data regression."""

    def test_a_start_on_the_newest_data_is_not_a_regression(self) -> None:
        log = LifeLog(staleness_s=STALE)
        log.record(written("a", "local", 1, 100, start=0, now=40, goodbye=True), at=1.0)
        log.record(written("a", "remote", 2, 200, start=40, now=41), at=2.0)
        log.record(written("a", "local", 3, 300, start=55, now=60), at=9.0)
        assert log.regressions() == []

    def test_a_rollback_onto_the_older_source_data_is_reported_with_the_loss(self) -> None:
        log = LifeLog(staleness_s=STALE)
        log.record(written("a", "local", 1, 100, start=0, now=20, goodbye=True), at=1.0)
        log.record(written("a", "remote", 2, 200, start=20, now=53), at=2.0)  # then SIGKILL
        log.record(written("a", "local", 1, 101, start=20, now=20), at=9.0)
        [regression] = log.regressions()
        assert (regression.found, regression.newest) == (20, 53)
        assert regression.writer.side == "remote"
        assert "33 update(s) lost" in regression.describe()

    def test_other_areas_do_not_count(self) -> None:
        log = LifeLog(staleness_s=STALE)
        log.record(written("a", "local", 1, 100, start=0, now=90), at=1.0)
        log.record(written("b", "local", 1, 101, start=3, now=3), at=2.0)
        assert log.regressions() == []

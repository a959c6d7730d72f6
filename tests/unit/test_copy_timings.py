"""The pre-copy rule is fed per direction from the copies the phase actions time."""

from __future__ import annotations

from pathlib import Path

from monitord.base import config
from monitord.engine.copy_timings import CopyTimings
from monitord.remote.copy import CopyReport, Staged
from orchestrator.models import Side
from orchestrator.pre_copy import DecidedBy

MIB = 1024 * 1024


def remote(tmp_path: Path, **keys: object) -> config.RemoteSection:
    parsed = config.parse({"remote": {"host": "vps.example.net", "user": "offload",
                                      "key_file": str(tmp_path / "id_ed25519"),
                                      "known_hosts": str(tmp_path / "known_hosts"), **keys}})
    assert parsed.remote is not None
    return parsed.remote


def staged(*, sent_bytes: int, send_s: float) -> Staged:
    return Staged(local_dir=Path("/d"), remote_dir="/r", upload=True, files={}, cache={},
                  sent_bytes=sent_bytes, send_s=send_s)


class TestCopyTimings:
    """A pre-copy gives a throughput and a fixed cost, a copy a throughput, per direction."""

    def test_a_timed_pre_copy_lets_the_measured_rule_decide_for_its_direction_only(
        self, tmp_path: Path
    ) -> None:
        timings = CopyTimings()
        section = remote(tmp_path)  # adaptive, from 1 MiB
        timings.pre_copied(Side.LOCAL, staged(sent_bytes=4 * MIB, send_s=0.4), wall_s=0.65)
        up = timings.decide(Side.LOCAL, size=2 * MIB, remote=section)
        assert up.decided_by is DecidedBy.ADAPTIVE and not up.pre_copy
        assert up.threshold_bytes == round(0.25 * 10 * MIB)
        down = timings.decide(Side.REMOTE, size=2 * MIB, remote=section)
        assert down.decided_by is DecidedBy.COLD_START and down.pre_copy

    def test_a_copy_after_the_stop_gives_only_a_throughput(self, tmp_path: Path) -> None:
        timings = CopyTimings()
        timings.copied(Side.LOCAL, CopyReport(files=1, bytes=MIB, sent_bytes=MIB, send_s=0.1))
        costs = timings.costs(Side.LOCAL)
        assert costs.throughput == 10 * MIB and costs.fixed_cost is None
        decision = timings.decide(Side.LOCAL, size=10, remote=remote(tmp_path))
        assert decision.decided_by is DecidedBy.COLD_START

    def test_an_explicit_threshold_is_not_replaced_by_the_timings(self, tmp_path: Path) -> None:
        timings = CopyTimings()
        timings.pre_copied(Side.LOCAL, staged(sent_bytes=4 * MIB, send_s=0.4), wall_s=0.65)
        decision = timings.decide(Side.LOCAL, size=2 * MIB,
                                  remote=remote(tmp_path, pre_copy_min_bytes=1 << 40))
        assert decision.decided_by is DecidedBy.BY_SIZE and not decision.pre_copy
        assert decision.threshold_bytes == 1 << 40

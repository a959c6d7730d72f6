"""`make bench-openssh` (benchmarks/openssh_vps.py) at its smallest size, end to end, so it
cannot rot: one area of a few KiB moved to a namespace VPS with a Debian release's sshd by the
floor, by hand (rsync and ssh) and by monitord. Checked: every way put the area's data on the
VPS intact and the figures are there and positive — never their values (benchmarks are not
pass/fail, docs/benchmarks.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import openssh_vps
from monitord.testing.fake_daemon import verify_session_db

DATA_BYTES = 4096
POSITIVE_WALL = ("wall_s", "reference_s", "by_hand_s", "ratio", "ratio_by_hand",
                 "ssh_connect_p50_s", "monitord_cpu_s")
POSITIVE_DOWNTIME = ("p50_s", "p99_s", "reference_p99_s", "by_hand_p50_s", "by_hand_p99_s",
                     "ratio", "ratio_by_hand_p99", "by_hand_rsync_p50_s",
                     "by_hand_start_p50_s")


@pytest.mark.skipif(openssh_vps.unavailable_reason() is not None,
                    reason=str(openssh_vps.unavailable_reason()))
class TestOpensshBenchmark:
    async def test_one_area_reaches_the_vps_three_ways_and_every_figure_is_reported(
        self, tmp_path: Path
    ) -> None:
        figures = await openssh_vps.measure_case(tmp_path, areas=1, data_bytes=DATA_BYTES,
                                                 keep_files=True)

        assert [f["benchmark"] for f in figures] == [
            "openssh_migration_local_to_remote", "openssh_area_downtime_local_to_remote"]
        wall, downtime = figures
        assert "error" not in wall and "error" not in downtime, figures
        assert wall["committed_remote"] == 1 and wall["transactions_started"] == 1, wall
        assert (wall["rollbacks"], wall["split_brain_overlaps"], wall["data_regressions"]) \
            == (0, 0, 0), wall
        assert downtime["measured_areas"] == 1, downtime
        for figure, keys in ((wall, POSITIVE_WALL), (downtime, POSITIVE_DOWNTIME)):
            for key in keys:
                assert isinstance(figure[key], float | int) and figure[key] > 0, (key, figure)
            assert figure["reference"] and figure["by_hand_reference"], figure
            assert len(figure["load_avg_1m"]) == 2, figure

        # The floor's copy of the area's data on the PBX, taken before any move, against what
        # each way left on the VPS: monitord's move, the floor's SFTP upload, the rsync.
        case = tmp_path / "o1"
        sources = list((case / "floor").iterdir())
        assert len(sources) == 1
        area, media = sources[0].name, (sources[0] / "media.bin").read_bytes()
        assert len(media) == DATA_BYTES
        vps_files = case / "vps" / "opt"
        for moved in (vps_files / "data" / "tg" / area, vps_files / "floor" / area,
                      vps_files / "hand" / area):
            assert (moved / "media.bin").read_bytes() == media, moved
            records, _ = verify_session_db(moved / "session.db")  # a whole chain
            assert records > 0, moved

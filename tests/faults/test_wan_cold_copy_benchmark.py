"""`python -m benchmarks.wan_cold_copy` at a small size on a short link, end to end, so it
cannot rot: an area is pre-copied cold to the namespace VPS and home again with the PBX's
own copy removed, and rsync by hand copies the same bytes both ways. Checked: the figures are
there and each cold copy sent the area once (not a delta, not twice) — never a timing
(docs/benchmarks.md)."""

from __future__ import annotations

from pathlib import Path

from benchmarks import wan_cold_copy
from tests.support.wan_link import LinkProfile

MIB = 1 << 20


class TestWanColdCopyBenchmark:
    async def test_both_cold_copies_send_the_area_once_and_rsync_is_the_reference(
        self, tmp_path: Path
    ) -> None:
        link = LinkProfile.parse("delay=5ms,rate=100mbit")
        up, down = await wan_cold_copy.measure(tmp_path, link=link, data_bytes=MIB, cut_s=None)
        assert [up["benchmark"], down["benchmark"]] == ["wan_cold_copy_up",
                                                        "wan_cold_copy_down"]
        for figure in (up, down):
            assert "error" not in figure, figure
            assert MIB <= figure["sent_bytes"] < MIB + 64 * 1024, figure  # once, cold
            assert figure["wire_bytes"] > figure["sent_bytes"], figure
            assert figure["copy_s"] > 0 and figure["reference_s"] > 0, figure
            assert 0 < figure["line_share"], figure

"""`python -m benchmarks.warm_copies` at its smallest on a short link, end to end, so it cannot
rot: two areas with warm copies run on the namespace VPS for a few seconds, then the VPS is
black-holed and given up. Checked: the three figures are there, copies were taken and read,
the copies sent no more than the pages that changed and a little more, and both areas
started on their warm copies with no overlap — never a timing (docs/benchmarks.md)."""

from __future__ import annotations

from pathlib import Path

from benchmarks import warm_copies
from tests.support.wan_link import LinkProfile


class TestWarmCopiesBenchmark:
    async def test_two_areas_are_copied_and_given_up_onto_their_warm_copies(
        self, tmp_path: Path
    ) -> None:
        run = warm_copies.Run(link=LinkProfile.parse("delay=5ms,rate=100mbit"), areas=2,
                              interval_s=1.0, seconds=5.0, row_bytes=4096)
        age, cost, given_up = await warm_copies.measure(tmp_path, run)
        assert [age["benchmark"], cost["benchmark"], given_up["benchmark"]] == [
            "warm_copy_age", "warm_copy_cost", "give_up"]
        assert age["copies"] > 0 and age["samples"] > 0 and age["p99_s"] is not None, age
        assert cost["copies_read"] > 0 and cost["bytes_changed"] > 0, cost
        assert 0 < cost["uplink_bytes"] <= 2 * cost["bytes_changed"], cost  # a page delta
        assert cost["wire_vps_to_pbx_bytes"] > cost["uplink_bytes"], cost
        assert cost["vps_snapshots"] > 0, cost
        assert given_up["kept_warm"] == given_up["abandoned"] == 2, given_up
        assert given_up["overlaps"] == 0, given_up


"""`python -m benchmarks.wan_live_store` at a small size on a short link, end to end, so it
cannot rot: a store whose pages keep changing is moved to the namespace VPS and home. Checked:
the figures are there, and moving out sent the changed pages after the stop, not the store
(the engine's block delta over real OpenSSH) — never a timing (docs/benchmarks.md)."""

from __future__ import annotations

from pathlib import Path

from benchmarks import wan_live_store
from tests.support.wan_link import LinkProfile

MIB = 1 << 20


class TestWanLiveStoreBenchmark:
    async def test_a_live_store_moves_both_ways_and_sends_its_changed_pages_only(
        self, tmp_path: Path
    ) -> None:
        link = LinkProfile.parse("delay=5ms,rate=100mbit")
        out, home = await wan_live_store.measure(tmp_path, link=link, data_bytes=MIB,
                                                 pages_per_s=8)
        assert [out["benchmark"], home["benchmark"]] == [
            "wan_live_store_local_to_remote", "wan_live_store_remote_to_local"]
        for figure in (out, home):
            assert figure["downtime_s"] > 0 and figure["reference_downtime_s"] > 0, figure
            assert figure["area_bytes"] > MIB and figure["wire_bytes"] > MIB, figure
        assert out["pre_copied_bytes"] > MIB, out
        assert out["final_copy_sent_bytes"] < out["area_bytes"] // 2, out

"""`python -m benchmarks.wan_live_store` at a small size on a short link, end to end, so it
cannot rot: a store whose pages keep changing is moved to the namespace VPS and home. Checked:
the figures are there; after the stop, each move sent the changed pages, not the store, and
the move home's pre-copy sent what changed since the move out, not the store (the block
deltas over real OpenSSH and the real agent) — never a timing (docs/benchmarks.md)."""

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
            assert figure["area_bytes"] > MIB, figure
            assert figure["wire_bytes"] > figure["pre_copied_bytes"] + figure[
                "final_copy_sent_bytes"], figure  # (the wire counts what the copies sent)
        assert out["pre_copied_bytes"] > MIB, out
        for figure in (out, home):  # the changed pages after the stop, both ways
            assert figure["final_copy_sent_bytes"] < figure["area_bytes"] // 2, figure
        # home, the pre-copy starts from the PBX's archive of the move out: what changed
        assert home["pre_copied_bytes"] < home["area_bytes"] // 2, home

"""A VPS that never comes back, on real OpenSSH: SSH to the namespace VPS is black-holed for
good (its daemons still reach the split-brain detector over the veth, so an overlap would be
seen). The operator gives the VPS up: refused until the copy there is provably fenced, then
the area runs on the PBX's own copy; when SSH returns, the VPS never runs it again."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from monitord.testing.stack import Stack
from tests.faults.conftest import FaultStackFactory
from tests.faults.netns_vps import NetnsVps
from tests.integration.operator.conftest import run_cli


def _runs_on(stack: Stack, area: str, side: str) -> bool:
    return any(k.side == side for k in stack.detector.alive(area))


class TestAVpsThatNeverComesBack:
    async def test_given_up_after_the_lease_bound_home_on_the_pbxs_copy_never_there_again(
        self, fault_stack: FaultStackFactory, netns_vps: NetnsVps
    ) -> None:
        stack = await fault_stack(services={"tg": 1})
        (area,) = stack.areas["tg"]
        await stack.place("tg", "remote")
        await stack.wait_settled(expect={"tg": "remote"}, timeout_s=90)
        await asyncio.sleep(1.0)  # records written on the VPS only
        netns_vps.black_hole()
        await stack.place("tg", "local")

        result = await run_cli("give-up", "tg", "-c", str(stack.config_path))
        assert result.code == 1 and "VPS_NOT_FENCED" in result.stderr, result
        assert "allowed in" in result.stderr
        assert stack.events("remote_data_abandoned") == []

        stack.accepted_data_loss.add(area)  # the operator's explicit choice
        for _ in range(120):
            code, body = await stack.request("POST", "/v1/services/tg/give-up", {})
            if code != 409:
                break
            assert body["error"]["code"] == "VPS_NOT_FENCED", body
            await asyncio.sleep(0.5)
        assert code == 202, body
        gave_up_at = time.time()
        await stack.wait_until(lambda: _runs_on(stack, area, "local"), timeout_s=60,
                               what="tg runs on the PBX's own copy")
        assert not _runs_on(stack, area, "remote"), "the VPS's copy fenced itself"

        netns_vps.heal()  # the VPS answers again, with its stale entry and data
        await stack.wait_settled(expect={"tg": "local"}, timeout_s=120)
        await asyncio.sleep(2.0)
        late = [life.key for life in stack.detector.lives(area)
                if life.key.side == "remote" and life.first_seen >= gave_up_at]
        assert late == [], "a given-up VPS never runs the area again"
        assert area not in stack.agent_cache()
        # its data there set aside, not deleted, and listed in the status
        rows = [r for r in (await stack.status())["abandoned_data"] if r["area"] == area]
        assert rows and rows[0]["set_aside_path"], rows
        kept = Path(rows[0]["set_aside_path"])
        assert kept.parent == stack.vps_dir / "abandoned" and any(kept.iterdir())

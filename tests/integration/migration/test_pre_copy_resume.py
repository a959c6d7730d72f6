"""A pre-copy cut by the link does not go on to stop the source: the move fails its
preflight (the source runs on), and its next try resumes the pre-copy from what reached the
VPS's staging dir, so the copy after the stop sends the few bytes that changed, not the
store (orchestrator/pre_copy.ends_the_preflight; a whole installation: monitord run, the
in-process VPS, the real agent, fake daemons; the detector's after-check: no overlap, no
regression)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from monitord.base import tree_digest
from monitord.testing.stack import Stack
from tests.integration.migration.conftest import StackFactory

MIB = 1 << 20
STORE = 64 * MIB


def _events(stack: Stack, name: str) -> list[dict[str, Any]]:
    found = []
    for line in stack.log_lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == name:
            found.append(event)
    return found


class TestPreCopyCutByTheLink:
    async def test_the_source_runs_on_and_the_next_try_resumes_the_pre_copy(
        self, stack_factory: StackFactory
    ) -> None:
        stack = await stack_factory(services={"tg": 1}, data_bytes=STORE,
                                    remote_overrides={"pre_copy_min_bytes": 0})
        await stack.wait_settled(expect={"tg": "local"}, timeout_s=60)
        [area] = stack.areas["tg"]
        staged = tree_digest.staging_dir(stack.vps_dir / "data" / "tg" / area) / "media.bin"
        assert stack.vps is not None
        await stack.place("tg", "remote")
        deadline = asyncio.get_running_loop().time() + 60
        while not (staged.exists() and staged.stat().st_size >= 8 * MIB):
            assert asyncio.get_running_loop().time() < deadline, "the pre-copy never began"
            await asyncio.sleep(0.001)
        stack.vps.drop_all_sessions()  # the link goes, mid-store

        await stack.wait_settled(expect={"tg": "remote"}, timeout_s=120)
        [failed, *_] = _events(stack, "area_pre_copy_failed")
        assert failed["error_code"] in ("SSH_UNREACHABLE", "AGENT_UNREACHABLE"), failed
        # the failed try stopped nothing: the one downtime is the move that got there (its
        # record comes once the destination is seen up, which may be after the settle)
        def downtimes() -> list[dict[str, Any]]:
            return [e for e in _events(stack, "area_downtime") if e.get("area") == area]
        await stack.wait_until(downtimes, timeout_s=30, what="the move's downtime measured")
        assert len(downtimes()) == 1, downtimes()
        resumed = [e for e in _events(stack, "area_pre_copied") if e["resumed_bytes"] > 0]
        assert resumed, _events(stack, "area_pre_copied")
        assert resumed[0]["resumed_bytes"] >= 4 * MIB, resumed
        [copied] = [e for e in _events(stack, "area_copied") if e.get("area") == area]
        assert copied["sent_bytes"] < STORE // 4, copied  # not the store while it was down

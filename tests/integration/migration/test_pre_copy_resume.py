"""A pre-copy cut — by the link, or by a crash of monitord — does not go on to stop the
source, and the next try resumes it from what reached the receiving side's staging dir:
nothing of it is remembered on the PBX, the receiving side says what it holds (moving out,
the VPS staging dir, by the agent's block digests; moving home, the PBX's own staging dir,
`local_tree.resumable`). A cut link fails the move's preflight
(orchestrator/pre_copy.ends_the_preflight); after a crash, recovery rolls the cut move back
(nothing had stopped) and the placement asked for opens the next move. Either way the copy
after the stop sends the few bytes that changed, not the store (a whole installation:
monitord run, the in-process VPS, the real agent, fake daemons; the detector's after-check:
no overlap, no regression). docs/design.md, "Copies that resume"."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
from pathlib import Path
from typing import Any

from monitord.base import tree_digest
from monitord.testing.stack import Stack
from tests.integration.migration.conftest import StackFactory, settle_remote

MIB = 1 << 20
STORE = 64 * MIB
# Small, and still four times the 8 MiB at which monitord is killed: the kill comes mid-file
# however loaded the machine (checked after each kill).
CRASH_STORE = 32 * MIB


def _events(stack: Stack, name: str, *, since: int = 0) -> list[dict[str, Any]]:
    """The `name` events monitord logged after its first `since` log lines."""
    found = []
    for line in stack.log_lines[since:]:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("event") == name:
            found.append(event)
    return found


async def _store_stack(stack_factory: StackFactory, store: int) -> tuple[Stack, str]:
    """One area of `store` bytes, settled on the PBX, every move pre-copied; its id."""
    stack = await stack_factory(services={"tg": 1}, data_bytes=store,
                                remote_overrides={"pre_copy_min_bytes": 0})
    await stack.wait_settled(expect={"tg": "local"}, timeout_s=60)
    [area] = stack.areas["tg"]
    return stack, area


async def _staged_past(path: Path, size: int, *, timeout_s: float = 60) -> None:
    """Until the staged file holds `size` bytes (polled closely: the copy is fast)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not (path.exists() and path.stat().st_size >= size):
        assert loop.time() < deadline, f"the pre-copy never reached {size} bytes of {path}"
        await asyncio.sleep(0.001)


class TestPreCopyCutByTheLink:
    async def test_the_source_runs_on_and_the_next_try_resumes_the_pre_copy(
        self, stack_factory: StackFactory
    ) -> None:
        stack, area = await _store_stack(stack_factory, STORE)
        staged = tree_digest.staging_dir(stack.vps_dir / "data" / "tg" / area) / "media.bin"
        assert stack.vps is not None
        await stack.place("tg", "remote")
        await _staged_past(staged, 8 * MIB)
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


async def _killed_and_started_again(stack: Stack, staged: Path) -> int:
    """SIGKILL monitord once the staged file holds 8 MiB (mid-file), start it again; the
    number of log lines before the new run."""
    await _staged_past(staged, 8 * MIB)
    assert await stack.stop_monitord(signal.SIGKILL) == -signal.SIGKILL
    left = staged.stat().st_size
    assert 8 * MIB <= left < CRASH_STORE, (
        f"the crash came at {left} bytes of {CRASH_STORE}: not mid-file")
    mark = len(stack.log_lines)
    await stack.start_monitord()
    return mark


async def _the_next_move_resumed(stack: Stack, mark: int, *, area: str, from_side: str
                                 ) -> None:
    """After the restart: the cut move was rolled back from its preflight, one move got there,
    its pre-copy resumed (4 MiB or more not sent again) and its copy after the stop sent the
    changed bytes only."""
    recovered = _events(stack, "transaction_recovering", since=mark)
    assert [(e["phase"], e["outcome"]) for e in recovered] == [
        ("PREFLIGHT", "recovered_uncommitted")], recovered
    def downtimes() -> list[dict[str, Any]]:
        return [e for e in _events(stack, "area_downtime", since=mark) if e.get("area") == area]
    await stack.wait_until(downtimes, timeout_s=30, what="the move's downtime measured")
    assert len(downtimes()) == 1, downtimes()  # the cut move stopped nothing
    pre_copied = [e for e in _events(stack, "area_pre_copied", since=mark)
                  if e.get("area") == area]
    assert pre_copied and pre_copied[0]["resumed_bytes"] >= 4 * MIB, pre_copied
    assert pre_copied[0]["bytes"] < CRASH_STORE - 4 * MIB, pre_copied  # resumed, not sent
    [copied] = [e for e in _events(stack, "area_copied", since=mark) if e.get("area") == area]
    assert copied["from_side"] == from_side, copied
    assert copied["sent_bytes"] < CRASH_STORE // 4, copied  # not the store while it was down


class TestPreCopyCutByACrash:
    """A pre-copy cut by a crash of monitord resumes from the receiving side's staging dir."""

    async def test_a_move_out_resumes_from_the_vps_staging_dir_after_a_restart(
        self, stack_factory: StackFactory
    ) -> None:
        stack, area = await _store_stack(stack_factory, CRASH_STORE)
        staged = tree_digest.staging_dir(stack.vps_dir / "data" / "tg" / area) / "media.bin"
        await stack.place("tg", "remote")
        mark = await _killed_and_started_again(stack, staged)

        await stack.wait_settled(expect={"tg": "remote"}, timeout_s=60)
        await _the_next_move_resumed(stack, mark, area=area, from_side="local")

    async def test_a_move_home_resumes_from_the_local_staging_dir_after_a_restart(
        self, stack_factory: StackFactory
    ) -> None:
        stack, area = await _store_stack(stack_factory, CRASH_STORE)
        await settle_remote(stack)
        # No copy of its own on the PBX (the source's archive gone), so that every byte of
        # the move home crosses the link and a resume is the only way to send fewer.
        shutil.rmtree(stack.work_dir / "archive" / "tg")
        staged = tree_digest.staging_dir(stack.root / "pbx" / "tg" / area) / "media.bin"
        await stack.place("tg", "local")
        mark = await _killed_and_started_again(stack, staged)

        await stack.wait_settled(expect={"tg": "local"}, timeout_s=60)
        await _the_next_move_resumed(stack, mark, area=area, from_side="remote")

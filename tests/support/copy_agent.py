"""The agent's copy routes, answered in this process (a `monitord.remote.copy.CopyAgent`):
for copy tests that need the agent's way on the VPS without an agent process."""

from __future__ import annotations

import asyncio
from pathlib import Path

from monitord.base import tree_digest
from orchestrator import block_delta
from orchestrator.block_delta import Blocks, ChangedGroups


class InProcessAgent:
    """What the agent runs for a copy's steps on the VPS (the same functions of
    monitord.base.tree_digest its routes call), in this process, on the same files (`calls`: the
    name of each step asked, with a promote's expected SHA-256; `asked`: how often it was
    asked whether it serves them)."""

    def __init__(self, remote: Path) -> None:
        self.remote = remote
        self.calls: list[str] = []
        self.asked = 0

    async def serves_copies(self) -> bool:
        self.asked += 1
        return True

    async def data_listing(self) -> bytes:
        self.calls.append("data_listing")
        return await asyncio.to_thread(tree_digest.cached_listing, self.remote)

    async def blocks(self, paths: list[str], known: dict[str, bytes] | None = None,
                     ) -> dict[str, Blocks | ChangedGroups | None]:
        """As the agent answers (`known`: only the groups that differ, through the same
        orchestrator/block_delta.changed_groups)."""
        self.calls.append("blocks")
        answered: dict[str, Blocks | ChangedGroups | None] = {}
        for rel in paths:
            found = await asyncio.to_thread(tree_digest.file_blocks, self.remote, rel)
            answered[rel] = (block_delta.changed_groups(found, known[rel])
                             if found is not None and known and rel in known else found)
        return answered

    async def reset(self) -> None:
        self.calls.append("reset")
        await asyncio.to_thread(tree_digest.reset_staging, self.remote)

    async def staged_blocks(self) -> dict[str, Blocks | None] | None:
        self.calls.append("staged_blocks")
        return await asyncio.to_thread(tree_digest.staged_blocks, self.remote)

    async def listing(self) -> bytes:
        self.calls.append("listing")
        return await asyncio.to_thread(tree_digest.staging_listing, self.remote)

    async def promote(self, expect: str) -> bool:
        self.calls.append(f"promote {expect}")
        return await asyncio.to_thread(tree_digest.verify_and_promote, self.remote, expect)

    def promotes(self) -> int:
        return sum(call.startswith("promote ") for call in self.calls)

"""The in-memory placement never loses or undoes a commit of custom_config.json."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from monitord.engine.placement_state import PlacementState
from monitord.store.state_db import Store
from orchestrator.models import Side

AREAS = 40


class TestConcurrentCommits:
    """Commits of many areas at once, interleaved with re-reads, all land on disk and in memory."""

    async def test_concurrent_commits_and_reloads_keep_every_commit(self, tmp_path: Path) -> None:
        path = tmp_path / "custom_config.json"
        entries = [{"uuid": f"area-{i}", "service": "tg", "note": i} for i in range(AREAS)]
        path.write_text(json.dumps({"custom_daemons": entries}))
        async with await Store.open(tmp_path / "work") as store:
            state = PlacementState(store=store, custom_config_path=path)
            await state.load()
            commits = [
                state.commit(area=f"area-{i}", location=Side.REMOTE, generation=i + 1)
                for i in range(AREAS)
            ]
            reloads = [state.reload_committed() for _ in range(AREAS)]
            await asyncio.gather(*(c for pair in zip(commits, reloads, strict=True) for c in pair))
            on_disk = json.loads(path.read_text())["custom_daemons"]
        assert [e["uuid"] for e in on_disk] == [f"area-{i}" for i in range(AREAS)]
        assert all(e["location"] == "remote" and e["generation"] == e["note"] + 1 for e in on_disk)
        assert all(state.committed[f"area-{i}"].location is Side.REMOTE for i in range(AREAS))

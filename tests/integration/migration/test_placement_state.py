"""The in-memory placement never loses or undoes a commit of custom_config.json."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
from pathlib import Path

import pytest
from structlog.testing import capture_logs

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


class TestFieldsTheUiOwns:
    """A commit keeps every field monitord does not own as the file held it: a lone
    surrogate (a title the UI cut mid-emoji, `"\\ud83d"`), which UTF-8 cannot encode, is
    written back as the same escape, and the commit succeeds."""

    @pytest.mark.parametrize("area", ["a1", "a2"])
    async def test_a_title_cut_mid_emoji_survives_a_commit_as_the_same_escape(
        self, tmp_path: Path, area: str
    ) -> None:
        path = tmp_path / "custom_config.json"
        path.write_text('{"custom_daemons": [\n'
                        '  {"uuid": "a1", "service": "tg", "title": "Shop \\ud83d",'
                        ' "note\\udc80": "\\ude00 \\u00e9"},\n'
                        '  {"uuid": "a2", "service": "tg"}\n]}\n')
        async with await Store.open(tmp_path / "work") as store:
            state = PlacementState(store=store, custom_config_path=path)
            await state.load()
            await state.commit(area=area, location=Side.REMOTE, generation=7)
        text = path.read_bytes().decode("utf-8")
        assert '"title": "Shop \\ud83d"' in text and '"note\\udc80": "\\ude00 é"' in text
        first, second = json.loads(text)["custom_daemons"]
        assert (first["title"], first["note\udc80"]) == ("Shop \ud83d", "\ude00 é")
        written = {entry["uuid"]: entry for entry in (first, second)}
        assert (written[area]["location"], written[area]["generation"]) == ("remote", 7)
        assert state.committed[area].location is Side.REMOTE


def _ui_write(path: Path, document: dict[str, object]) -> None:
    """How the PBX's UI writes the file: a temp file renamed over it."""
    temp = path.with_name(path.name + ".ui-tmp")
    temp.write_text(json.dumps(document))
    temp.replace(path)


class TestTheUiAsASecondWriter:
    """The UI read-modify-writes custom_config.json too (titles, new areas). Writers share a
    lock (`custom_config.json.lock`, flock), and a write of an older copy of the file — a
    committed location put back — is a stale write: the committed truth stays, in memory and
    on disk, and `custom_config_reverted` names the entry."""

    async def test_a_revert_of_a_committed_location_is_refused_and_repaired(
        self, tmp_path: Path
    ) -> None:
        path = tmp_path / "custom_config.json"
        old = {"custom_daemons": [{"uuid": "a1", "service": "tg", "title": "one"},
                                  {"uuid": "a2", "service": "tg"}]}
        path.write_text(json.dumps(old))
        async with await Store.open(tmp_path / "work") as store:
            state = PlacementState(store=store, custom_config_path=path)
            await state.load()
            await state.commit(area="a1", location=Side.REMOTE, generation=3)
            # the UI had read the file before the commit, and writes its edit of it now
            edited = {"custom_daemons": [{**old["custom_daemons"][0], "title": "renamed"},
                                         old["custom_daemons"][1]]}
            _ui_write(path, edited)
            with capture_logs() as events:
                await state.reload_committed()
            assert (state.committed["a1"].location, state.committed["a1"].generation) == (
                Side.REMOTE, 3)
        first = json.loads(path.read_text())["custom_daemons"][0]
        assert first == {"uuid": "a1", "service": "tg", "title": "renamed",
                         "location": "remote", "generation": 3}, "repaired, the title kept"
        [reverted] = [e for e in events if e["event"] == "custom_config_reverted"]
        assert (reverted["area"], reverted["generation"], reverted["committed_generation"]) == (
            "a1", 0, 3)

    async def test_a_commit_waits_for_a_writer_holding_the_lock(self, tmp_path: Path) -> None:
        path = tmp_path / "custom_config.json"
        path.write_text(json.dumps({"custom_daemons": [{"uuid": "a1", "service": "tg"}]}))
        async with await Store.open(tmp_path / "work") as store:
            state = PlacementState(store=store, custom_config_path=path)
            await state.load()
            lock = os.open(tmp_path / "custom_config.json.lock", os.O_RDWR | os.O_CREAT, 0o660)
            try:
                fcntl.flock(lock, fcntl.LOCK_EX)
                commit = asyncio.ensure_future(
                    state.commit(area="a1", location=Side.REMOTE, generation=1))
                await asyncio.sleep(0.5)
                assert not commit.done(), "the commit did not wait for the lock"
                # the UI's read-modify-write, under the lock: a title added
                document = json.loads(path.read_text())
                document["custom_daemons"][0]["title"] = "added"
                _ui_write(path, document)
                fcntl.flock(lock, fcntl.LOCK_UN)
                await asyncio.wait_for(commit, 10)
            finally:
                os.close(lock)
        assert json.loads(path.read_text())["custom_daemons"] == [
            {"uuid": "a1", "service": "tg", "title": "added", "location": "remote",
             "generation": 1}]


class TestGenerationsTheFileBrought:
    """A file's generations that this state.db did not issue (written before monitord's
    first start, an entry the UI added later) are taken as issued once, so that a later
    start does not take state.db for older than the file and hold those areas."""

    async def test_neither_a_first_start_nor_an_added_entry_is_held_at_the_next(
        self, tmp_path: Path
    ) -> None:
        path = tmp_path / "custom_config.json"
        path.write_text(json.dumps({"custom_daemons": [
            {"uuid": "a1", "service": "tg", "generation": 3}]}))
        async with await Store.open(tmp_path / "work") as store:
            state = PlacementState(store=store, custom_config_path=path)
            await state.load()
            assert state.held == {}
            _ui_write(path, {"custom_daemons": [
                {"uuid": "a1", "service": "tg", "generation": 3},
                {"uuid": "a2", "service": "tg", "location": "remote", "generation": 9}]})
            await state.reload_committed()
        (tmp_path / "work" / "owner_id").write_text("x\n")  # (monitord ran here)
        async with await Store.open(tmp_path / "work") as store:
            again = PlacementState(store=store, custom_config_path=path)
            await again.load()
            assert again.held == {}, again.held
            # ... while a generation above what state.db knows still is
            _ui_write(path, {"custom_daemons": [
                {"uuid": "a1", "service": "tg", "generation": 3},
                {"uuid": "a2", "service": "tg", "location": "remote", "generation": 10}]})
        async with await Store.open(tmp_path / "work") as store:
            third = PlacementState(store=store, custom_config_path=path)
            await third.load()
            assert set(third.held) == {"a2"}, third.held

"""The agent's manager API: authorisation, generation- and owner-checked create, stop, delete."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import os
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from monitord.base import proc_identity, tree_digest
from monitord.remote.agent_client import AgentClient, unix_channel
from monitord.remote.copy import AreaCopy, vps_tree
from monitord.testing.split_brain import Detector
from orchestrator import block_delta
from orchestrator.block_delta import Blocks
from orchestrator.errors import ErrorCode, MonitordError
from tests.integration.agent.conftest import area_body
from tests.support.agent_process import AgentProcess

AREA = "5b1d0c2e-0000-4000-8000-000000000001"


async def _created(agent: AgentProcess, detector: Detector, *, generation: int
                   ) -> dict[str, Any]:
    """The body of a PUT that created AREA at `generation` (201)."""
    body = area_body(agent, detector, area=AREA, generation=generation)
    status, answer = await agent.request("PUT", f"/v1/areas/{AREA}", json_body=body)
    assert status == 201, answer
    return body


async def _running_pid(agent: AgentProcess, area: str = AREA) -> int | None:
    processes = [p for p in (await agent.inventory())["processes"] if p["area"] == area]
    assert len(processes) <= 1, processes
    return processes[0]["pid"] if processes and processes[0]["alive"] else None


class TestAuthorisation:
    """Every route except /livez answers 401 AGENT_UNAUTHORIZED without the bearer secret."""

    async def test_request_without_the_secret_is_refused(self, agent: AgentProcess) -> None:
        status, body = await agent.request("GET", "/v1/inventory", auth=False)
        assert status == 401
        assert body["error"]["code"] == "AGENT_UNAUTHORIZED"

    async def test_request_with_a_wrong_secret_is_refused(self, agent: AgentProcess) -> None:
        status, body = await agent.request("GET", "/readyz", token=agent.secret + "x")
        assert (status, body["error"]["code"]) == (401, "AGENT_UNAUTHORIZED")

    async def test_a_write_without_the_secret_changes_nothing(
        self, agent: AgentProcess, detector: Detector
    ) -> None:
        body = area_body(agent, detector, area=AREA, generation=1)
        status, _ = await agent.request("PUT", f"/v1/areas/{AREA}", json_body=body, auth=False)
        assert status == 401
        assert (await agent.inventory())["entries"] == []

    async def test_livez_needs_no_secret(self, agent: AgentProcess) -> None:
        status, _ = await agent.request("GET", "/livez", auth=False)
        assert status == 200


class TestCreate:
    """Creating an area is checked against owner and generation and never runs a second
    process for one area."""

    async def test_create_starts_the_daemon_and_repeating_it_is_idempotent(
        self, agent: AgentProcess, detector: Detector
    ) -> None:
        body = area_body(agent, detector, area=AREA, generation=3)
        status, created = await agent.request("PUT", f"/v1/areas/{AREA}", json_body=body)
        assert status == 201, created
        assert await detector.wait_for(lambda d: d.alive(AREA), timeout_s=10)
        pid = await _running_pid(agent)
        status, again = await agent.request("PUT", f"/v1/areas/{AREA}", json_body=body)
        assert (status, again["result"]) == (200, "unchanged")
        assert await _running_pid(agent) == pid
        assert [life.key.pid for life in detector.lives(AREA)] == [pid]

    async def test_create_at_an_older_generation_is_refused_with_409(
        self, agent: AgentProcess, detector: Detector
    ) -> None:
        newer = area_body(agent, detector, area=AREA, generation=5)
        assert (await agent.request("PUT", f"/v1/areas/{AREA}", json_body=newer))[0] == 201
        older = area_body(agent, detector, area=AREA, generation=4)
        status, body = await agent.request("PUT", f"/v1/areas/{AREA}", json_body=older)
        assert status == 409
        assert body["error"]["code"] == "DESTINATION_CONFLICT"
        entry = (await agent.inventory())["entries"][0]
        assert entry["generation"] == 5

    async def test_create_by_another_owner_is_refused_with_409(
        self, agent: AgentProcess, detector: Detector
    ) -> None:
        mine = area_body(agent, detector, area=AREA, generation=1)
        assert (await agent.request("PUT", f"/v1/areas/{AREA}", json_body=mine))[0] == 201
        theirs = area_body(agent, detector, area=AREA, generation=9, owner_id="other-pbx")
        status, body = await agent.request("PUT", f"/v1/areas/{AREA}", json_body=theirs)
        assert (status, body["error"]["code"]) == (409, "DESTINATION_CONFLICT")
        assert "other-pbx" not in str(await agent.inventory())

    async def test_a_newer_generation_replaces_the_old_process_without_overlap(
        self, agent: AgentProcess, detector: Detector
    ) -> None:
        old = area_body(agent, detector, area=AREA, generation=1)
        assert (await agent.request("PUT", f"/v1/areas/{AREA}", json_body=old))[0] == 201
        assert await detector.wait_for(lambda d: d.alive(AREA), timeout_s=10)
        new = area_body(agent, detector, area=AREA, generation=2)
        assert (await agent.request("PUT", f"/v1/areas/{AREA}", json_body=new))[0] == 201
        assert await detector.wait_for(
            lambda d: [k.generation for k in d.alive(AREA)] == [2], timeout_s=10
        )
        assert detector.overlaps() == []

    async def test_a_changed_command_at_the_same_generation_restarts_without_overlap(
        self, agent: AgentProcess, detector: Detector
    ) -> None:
        body = await _created(agent, detector, generation=4)
        assert await detector.wait_for(lambda d: d.alive(AREA), timeout_s=10)
        old_pid = detector.alive(AREA)[0].pid
        body["command"] = [*body["command"], "--interval", "0.05"]
        status, answer = await agent.request("PUT", f"/v1/areas/{AREA}", json_body=body)
        assert (status, answer["result"]) == (200, "updated")
        assert await detector.wait_for(
            lambda d: [k.pid for k in d.alive(AREA)] not in ([], [old_pid]), timeout_s=10
        )
        assert detector.overlaps() == []

    async def test_bad_input_is_rejected_with_400_and_changes_nothing(
        self, agent: AgentProcess, detector: Detector, tmp_path: Path
    ) -> None:
        outside = area_body(agent, detector, area=AREA, generation=1)
        outside["data_dir"] = str(tmp_path / "elsewhere")
        for path, body in (
            (f"/v1/areas/{AREA}", {"service": "tg"}),
            (f"/v1/areas/{AREA}", outside),
            ("/v1/areas/..%2Fetc", area_body(agent, detector, area=AREA, generation=1)),
        ):
            status, answer = await agent.request("PUT", path, json_body=body)
            assert (status, answer["error"]["code"]) == (400, "BAD_REQUEST"), answer
        assert (await agent.inventory())["entries"] == []


class TestStopAndDelete:
    """Stop and delete act only at the named generation; deleting an absent area succeeds."""

    async def test_stop_stops_the_process_and_keeps_the_entry(
        self, agent: AgentProcess, detector: Detector
    ) -> None:
        body = area_body(agent, detector, area=AREA, generation=2)
        await agent.request("PUT", f"/v1/areas/{AREA}", json_body=body)
        assert await detector.wait_for(lambda d: d.alive(AREA), timeout_s=10)
        status, result = await agent.request("POST", f"/v1/areas/{AREA}/stop?generation=2")
        assert (status, result["result"]) == (200, "stopped")
        inventory = await agent.inventory()
        assert inventory["processes"] == []
        assert inventory["entries"][0]["state"] == "stopped"
        assert detector.alive(AREA) == []

    async def test_delete_at_a_wrong_generation_touches_nothing(
        self, agent: AgentProcess, detector: Detector
    ) -> None:
        body = area_body(agent, detector, area=AREA, generation=7)
        await agent.request("PUT", f"/v1/areas/{AREA}", json_body=body)
        assert await detector.wait_for(lambda d: d.alive(AREA), timeout_s=10)
        pid = await _running_pid(agent)
        assert pid is not None
        data_dir = Path(body["data_dir"])
        for method, path in (("DELETE", f"/v1/areas/{AREA}?generation=6"),
                             ("POST", f"/v1/areas/{AREA}/stop?generation=8")):
            status, answer = await agent.request(method, path)
            assert (status, answer["error"]["code"]) == (409, "DESTINATION_CONFLICT")
        assert await _running_pid(agent) == pid
        assert proc_identity.is_alive(pid)
        assert (data_dir / "session.db").exists()
        assert (await agent.inventory())["entries"][0]["generation"] == 7

    async def test_delete_removes_process_entry_and_data_and_is_idempotent(
        self, agent: AgentProcess, detector: Detector
    ) -> None:
        body = area_body(agent, detector, area=AREA, generation=7)
        await agent.request("PUT", f"/v1/areas/{AREA}", json_body=body)
        assert await detector.wait_for(lambda d: d.alive(AREA), timeout_s=10)
        digests = Path(body["data_dir"] + ".digests")  # what a copy's digest leaves beside it
        digests.write_bytes(b"{}")
        status, answer = await agent.request("DELETE", f"/v1/areas/{AREA}?generation=7")
        assert (status, answer["result"]) == (200, "deleted")
        inventory = await agent.inventory()
        assert (inventory["entries"], inventory["processes"]) == ([], [])
        assert not Path(body["data_dir"]).exists() and not digests.exists()
        assert detector.alive(AREA) == []
        status, answer = await agent.request("DELETE", f"/v1/areas/{AREA}?generation=7")
        assert (status, answer["result"]) == (200, "absent")

    async def test_delete_removes_the_areas_copy_dir_and_no_area_named_by_a_suffix(
        self, agent: AgentProcess, detector: Detector
    ) -> None:
        """Areas `{AREA}.digests`, `.staging` and `.old` are areas of their own: deleting
        {AREA} removes what its copies left, never their data."""
        body = area_body(agent, detector, area=AREA, generation=7)
        await agent.request("PUT", f"/v1/areas/{AREA}", json_body=body)
        assert await detector.wait_for(lambda d: d.alive(AREA), timeout_s=10)
        data_dir = Path(body["data_dir"])
        tree_digest.data_cache(data_dir).parent.mkdir(parents=True, exist_ok=True)
        tree_digest.data_cache(data_dir).write_bytes(b"{}")
        namesakes = [data_dir.with_name(AREA + suffix)
                     for suffix in (".digests", ".staging", ".old")]
        for other in namesakes:
            (other / "session.db").parent.mkdir(parents=True)
            (other / "session.db").write_bytes(other.name.encode())
        status, answer = await agent.request("DELETE", f"/v1/areas/{AREA}?generation=7")
        assert (status, answer["result"]) == (200, "deleted"), answer
        assert not data_dir.exists() and not tree_digest.copy_dir(data_dir).exists()
        assert [(other / "session.db").read_bytes() for other in namesakes] == [
            other.name.encode() for other in namesakes]


class TestHealth:
    """GET /v1/areas/{area}/health answers when the daemon's window closes, never before,
    and only for the generation asked about."""

    async def test_it_answers_healthy_once_the_daemon_has_run_for_the_window(
        self, agent: AgentProcess, detector: Detector
    ) -> None:
        await _created(agent, detector, generation=3)
        status, answer = await agent.request(
            "GET", f"/v1/areas/{AREA}/health?generation=3&min_uptime_s=0.8&wait_s=5"
        )
        assert status == 200, answer
        assert answer["healthy"] is True and answer["running"] is True
        assert answer["uptime_s"] >= 0.8
        # the kernel's own start time of that process, as the inventory reports it
        process = next(p for p in (await agent.inventory())["processes"] if p["area"] == AREA)
        assert answer["pid"] == process["pid"]

    async def test_another_generation_is_not_running_and_the_wait_is_held(
        self, agent: AgentProcess, detector: Detector
    ) -> None:
        body = area_body(agent, detector, area=AREA, generation=3)
        await agent.request("PUT", f"/v1/areas/{AREA}", json_body=body)
        started = time.monotonic()
        status, answer = await agent.request(
            "GET", f"/v1/areas/{AREA}/health?generation=4&min_uptime_s=0&wait_s=0.5"
        )
        assert status == 200, answer
        assert (answer["running"], answer["healthy"], answer["uptime_s"]) == (False, False, None)
        assert time.monotonic() - started >= 0.5  # held until wait_s, not answered at once

    async def test_an_unknown_area_is_not_running(self, agent: AgentProcess) -> None:
        status, answer = await agent.request(
            "GET", f"/v1/areas/{AREA}/health?generation=1&min_uptime_s=0&wait_s=0"
        )
        assert (status, answer["running"], answer["healthy"]) == (200, False, False)

    async def test_bad_parameters_are_refused_with_400(self, agent: AgentProcess) -> None:
        for query in ("generation=1&min_uptime_s=0", "generation=1&min_uptime_s=nan&wait_s=1",
                      "generation=1&min_uptime_s=1&wait_s=11", "min_uptime_s=1&wait_s=1",
                      "generation=1&min_uptime_s=-1&wait_s=1"):
            status, answer = await agent.request("GET", f"/v1/areas/{AREA}/health?{query}")
            assert status == 400, (query, answer)


def _expect(files: dict[str, bytes]) -> str:
    return hashlib.sha256(tree_digest.listing(
        {rel: hashlib.sha256(data).hexdigest() for rel, data in files.items()})).hexdigest()


def _stage(data_dir: Path, files: dict[str, bytes]) -> None:
    staging = tree_digest.staging_dir(data_dir)
    for rel, data in files.items():
        (staging / rel).parent.mkdir(parents=True, exist_ok=True)
        (staging / rel).write_bytes(data)


STAGED_FILES = {"session.db": b"records", "media/a.jpg": b"\xff\xd8"}


def _older_data_and_staged(agent: AgentProcess, files: dict[str, bytes]) -> Path:
    """AREA's data dir holding older data (old.db), `files` in its staging dir beside it."""
    data_dir = agent.base_dir / "data" / "tg" / AREA
    data_dir.mkdir(parents=True)
    (data_dir / "old.db").write_bytes(b"older data")
    _stage(data_dir, files)
    return data_dir


class TestPromote:
    """POST /v1/areas/{area}/copy/promote swaps an upload's staging dir in only when it lists
    exactly as expected, never under a running daemon, never outside the agent's dir."""

    FILES = STAGED_FILES

    async def test_the_expected_staging_dir_replaces_the_data_dir(
        self, agent: AgentProcess
    ) -> None:
        data_dir = _older_data_and_staged(agent, self.FILES)
        status, answer = await agent.request(
            "POST", f"/v1/areas/{AREA}/copy/promote",
            json_body={"data_dir": str(data_dir), "expect": _expect(self.FILES)})
        assert (status, answer["promoted"]) == (200, True), answer
        assert sorted(p.relative_to(data_dir).as_posix() for p in data_dir.rglob("*")
                      if p.is_file()) == ["media/a.jpg", "session.db"]
        assert not tree_digest.staging_dir(data_dir).exists()
        assert tree_digest.load_cache(tree_digest.data_cache(data_dir))

    async def test_a_staging_dir_that_differs_changes_nothing(self, agent: AgentProcess) -> None:
        data_dir = _older_data_and_staged(agent, {**self.FILES, "session.db": b"torn"})
        status, answer = await agent.request(
            "POST", f"/v1/areas/{AREA}/copy/promote",
            json_body={"data_dir": str(data_dir), "expect": _expect(self.FILES)})
        assert (status, answer["promoted"]) == (200, False), answer
        assert [p.name for p in data_dir.iterdir()] == ["old.db"]
        assert tree_digest.staging_dir(data_dir).is_dir()

    async def test_never_under_a_running_daemon_of_the_area(
        self, agent: AgentProcess, detector: Detector
    ) -> None:
        body = await _created(agent, detector, generation=3)
        data_dir = Path(body["data_dir"])
        _stage(data_dir, self.FILES)
        status, answer = await agent.request(
            "POST", f"/v1/areas/{AREA}/copy/promote",
            json_body={"data_dir": str(data_dir), "expect": _expect(self.FILES)})
        assert (status, answer["error"]["code"]) == (409, "DESTINATION_CONFLICT"), answer
        assert tree_digest.staging_dir(data_dir).is_dir()

    async def test_bad_bodies_are_refused_with_400(
        self, agent: AgentProcess, tmp_path: Path
    ) -> None:
        inside = str(agent.base_dir / "data" / "tg" / AREA)
        good = _expect(self.FILES)
        bodies: tuple[object, ...] = (
            {"data_dir": str(tmp_path / "elsewhere"), "expect": good},
            {"data_dir": str(agent.base_dir), "expect": good},
            {"data_dir": inside, "expect": good.upper()},
            {"data_dir": inside, "expect": good[:-1]},
            {"data_dir": inside}, {"expect": good}, [],
        )
        for body in bodies:
            status, answer = await agent.request("POST", f"/v1/areas/{AREA}/copy/promote",
                                                 json_body=body)
            assert (status, answer["error"]["code"]) == (400, "BAD_REQUEST"), (body, answer)
        assert not (tmp_path / "elsewhere").exists()


class TestStaging:
    """POST /v1/areas/{area}/copy/staging makes a copy's staging dir empty ("reset") or lists what
    it holds, fsynced ("digest"); never touches the data dir, never outside the agent's dir."""

    FILES = STAGED_FILES

    async def _staging(self, agent: AgentProcess, body: object) -> tuple[int, Any]:
        return await agent.request("POST", f"/v1/areas/{AREA}/copy/staging", json_body=body)

    async def test_reset_leaves_an_empty_staging_dir_and_no_digest_cache(
        self, agent: AgentProcess
    ) -> None:
        data_dir = _older_data_and_staged(agent, self.FILES)
        staging = tree_digest.staging_dir(data_dir)
        cache = tree_digest.staging_cache(data_dir)
        cache.write_bytes(b"{}")
        status, answer = await self._staging(agent, {"data_dir": str(data_dir),
                                                     "action": "reset"})
        assert (status, answer["action"]) == (200, "reset"), answer
        assert staging.is_dir() and list(staging.iterdir()) == []
        assert not cache.exists()
        assert [p.name for p in data_dir.iterdir()] == ["old.db"]

    async def test_digest_lists_the_staging_dir_as_the_verb_does(
        self, agent: AgentProcess
    ) -> None:
        data_dir = agent.base_dir / "data" / "tg" / AREA
        _stage(data_dir, self.FILES)
        status, answer = await self._staging(agent, {"data_dir": str(data_dir),
                                                     "action": "digest"})
        assert status == 200, answer
        expected = tree_digest.listing(
            {rel: hashlib.sha256(data).hexdigest() for rel, data in self.FILES.items()})
        assert base64.b64decode(answer["listing"]) == expected
        assert not data_dir.exists()  # only the staging dir was read
        # the cache it kept lets the next digest skip re-reading unchanged files
        assert set(tree_digest.load_cache(
            tree_digest.staging_cache(data_dir))) <= set(self.FILES)

    async def test_blocks_digest_what_a_cut_copy_left_and_the_client_reads_them(
        self, agent: AgentProcess
    ) -> None:
        data_dir = agent.base_dir / "data" / "tg" / AREA
        _stage(data_dir, self.FILES)
        staging = tree_digest.staging_dir(data_dir)
        (staging / "empty" / "deeper").mkdir(parents=True)  # no copy makes one: removed
        (staging / "outside").symlink_to("/etc/passwd")  # never followed, never named
        status, answer = await self._staging(agent, {"data_dir": str(data_dir),
                                                     "action": "blocks"})
        assert (status, answer["action"]) == (200, "blocks"), answer
        assert set(answer["blocks"]) == set(self.FILES)
        client = AgentClient(channel=unix_channel(agent.address), secret=agent.secret.encode())
        found = await client.staged_blocks(area=AREA, data_dir=str(data_dir))
        assert found == {rel: tree_digest.file_blocks(staging, rel) for rel in self.FILES}
        assert not (staging / "empty").exists()
        assert not data_dir.exists()  # only the staging dir was read

    async def test_bad_bodies_are_refused_with_400(
        self, agent: AgentProcess, tmp_path: Path
    ) -> None:
        inside = str(agent.base_dir / "data" / "tg" / AREA)
        bodies: tuple[object, ...] = (
            {"data_dir": str(tmp_path / "elsewhere"), "action": "reset"},
            {"data_dir": str(agent.base_dir), "action": "reset"},
            {"data_dir": inside, "action": "remove"},
            {"data_dir": inside}, {"action": "reset"}, [],
        )
        for body in bodies:
            status, answer = await self._staging(agent, body)
            assert (status, answer["error"]["code"]) == (400, "BAD_REQUEST"), (body, answer)
        assert not tree_digest.copy_dir(tmp_path / "elsewhere").exists()
        assert not tree_digest.copy_dir(agent.base_dir).exists()


class TestListing:
    """POST /v1/areas/{area}/listing lists an area's data dir as the tree-digest verb does,
    keeping its digest cache beside it; never outside the agent's dir."""

    async def test_it_lists_the_data_dir_as_the_verb_does(self, agent: AgentProcess) -> None:
        data_dir = agent.base_dir / "data" / "tg" / AREA
        for rel, data in STAGED_FILES.items():
            (data_dir / rel).parent.mkdir(parents=True, exist_ok=True)
            (data_dir / rel).write_bytes(data)
        status, answer = await agent.request("POST", f"/v1/areas/{AREA}/listing",
                                             json_body={"data_dir": str(data_dir)})
        assert status == 200, answer
        assert base64.b64decode(answer["listing"]) == tree_digest.listing(
            {rel: hashlib.sha256(data).hexdigest() for rel, data in STAGED_FILES.items()})
        assert tree_digest.data_cache(data_dir).is_file()

    async def test_a_missing_dir_lists_nothing_and_bad_bodies_are_refused(
        self, agent: AgentProcess, tmp_path: Path
    ) -> None:
        missing = agent.base_dir / "data" / "tg" / AREA
        status, answer = await agent.request("POST", f"/v1/areas/{AREA}/listing",
                                             json_body={"data_dir": str(missing)})
        assert (status, answer["listing"]) == (200, ""), answer
        for body in ({"data_dir": str(tmp_path)}, {"data_dir": str(agent.base_dir)}, {}, []):
            status, answer = await agent.request("POST", f"/v1/areas/{AREA}/listing",
                                                 json_body=body)
            assert (status, answer["error"]["code"]) == (400, "BAD_REQUEST"), (body, answer)


class TestBlocks:
    """POST /v1/areas/{area}/copy/blocks digests the blocks of the named files of a data dir
    as orchestrator/block_delta.py does; a name that is no regular file reached without a
    symlink is answered null (the PBX fetches it whole), never read through the link."""

    async def test_it_digests_the_files_named_and_nothing_through_a_symlink(
        self, agent: AgentProcess, tmp_path: Path
    ) -> None:
        data_dir = agent.base_dir / "data" / "tg" / AREA
        (data_dir / "db").mkdir(parents=True)
        store = bytes(range(256)) * 40  # 10240 bytes: two whole blocks and a short one
        (data_dir / "db" / "session.db").write_bytes(store)
        outside = tmp_path / "outside"
        (outside / "db").mkdir(parents=True)
        (outside / "db" / "session.db").write_bytes(b"not the area's")
        (data_dir / "shadow").symlink_to(outside / "db" / "session.db")
        (data_dir / "via").symlink_to(outside / "db")
        client = AgentClient(channel=unix_channel(agent.address), secret=agent.secret.encode())
        names = ["db/session.db", "shadow", "via/session.db", "missing", "../escape", "db"]
        answer = await AreaCopy(client, AREA, str(data_dir)).blocks(names)
        assert answer["db/session.db"] == Blocks(size=len(store),
                                                 digests=block_delta.blocks_of(store))
        assert {rel: answer[rel] for rel in names[1:]} == dict.fromkeys(names[1:])

    async def test_a_copy_the_pbx_summarises_is_answered_by_its_changed_groups(
        self, agent: AgentProcess
    ) -> None:
        """After the stop a live store's answer is its changed pages' 64 KiB groups, not a
        digest per page of the store; the PBX rebuilds the store's digests from its own."""
        data_dir = agent.base_dir / "data" / "tg" / AREA
        data_dir.mkdir(parents=True)
        pbx_copy = os.urandom(512 * block_delta.BLOCK_BYTES)  # 2 MiB, 32 groups
        now = bytearray(pbx_copy)
        for page in (3, 200, 201):
            now[page * block_delta.BLOCK_BYTES] ^= 0xFF
        now += b"appended"
        (data_dir / "session.db").write_bytes(bytes(now))
        have = Blocks(size=len(pbx_copy), digests=block_delta.blocks_of(pbx_copy))
        client = AgentClient(channel=unix_channel(agent.address), secret=agent.secret.encode())
        area = AreaCopy(client, AREA, str(data_dir))
        answer = await area.blocks(["session.db"],
                                   {"session.db": block_delta.group_digests(have)})
        changed = answer["session.db"]
        assert isinstance(changed, block_delta.ChangedGroups), changed
        assert changed.groups == (0, 12, 32)  # pages 3, 200-201, and the appended block
        assert block_delta.with_changes(have, changed) == Blocks(
            size=len(now), digests=block_delta.blocks_of(bytes(now)))
        rebuilt = await vps_tree.AgentTree(area, vps_tree.ShellTree(
            conn=None, remote_dir=str(data_dir), vps_command=())).blocks(  # type: ignore[arg-type]
                ["session.db"], {"session.db": have})
        assert rebuilt == {"session.db": Blocks(size=len(now),
                                                digests=block_delta.blocks_of(bytes(now)))}

    async def test_a_summary_of_a_name_not_asked_for_is_refused(
        self, agent: AgentProcess
    ) -> None:
        data_dir = str(agent.base_dir / "data" / "tg" / AREA)
        for known in ({"other": ""}, {"x": "not base64!"}, ["x"]):
            status, answer = await agent.request(
                "POST", f"/v1/areas/{AREA}/copy/blocks",
                json_body={"data_dir": data_dir, "paths": ["x"], "known": known})
            assert (status, answer["error"]["code"]) == (400, "BAD_REQUEST"), (known, answer)

    async def test_bad_questions_are_refused(self, agent: AgentProcess, tmp_path: Path) -> None:
        data_dir = str(agent.base_dir / "data" / "tg" / AREA)
        too_many = [f"f{i}" for i in range(tree_digest.MAX_BLOCK_PATHS + 1)]
        for body in ({"data_dir": data_dir, "paths": too_many},
                     {"data_dir": data_dir, "paths": []}, {"data_dir": data_dir},
                     {"data_dir": str(tmp_path), "paths": ["x"]}):
            status, answer = await agent.request("POST", f"/v1/areas/{AREA}/copy/blocks",
                                                 json_body=body)
            assert (status, answer["error"]["code"]) == (400, "BAD_REQUEST"), (body, answer)


def _live_store(path: Path, rows: int) -> sqlite3.Connection:
    """A SQLite store in WAL mode holding `rows` rows, left open (its -wal and -shm there)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("CREATE TABLE rows (n INTEGER PRIMARY KEY, payload BLOB)")
    db.executemany("INSERT INTO rows VALUES (?, randomblob(100))", [(n,) for n in range(rows)])
    return db


class TestSnapshot:
    """POST /v1/areas/{area}/copy/snapshot takes a consistent snapshot of a live area's data
    dir beside it, for an area held at exactly that generation only; the copy routes read it
    as they read a data dir."""

    async def _snapshot(self, agent: AgentProcess, body: object) -> tuple[int, Any]:
        return await agent.request("POST", f"/v1/areas/{AREA}/copy/snapshot", json_body=body)

    async def test_a_snapshot_at_the_areas_generation_is_what_the_listing_route_lists(
        self, agent: AgentProcess, detector: Detector
    ) -> None:
        body = await _created(agent, detector, generation=3)
        assert await detector.wait_for(lambda d: d.alive(AREA), timeout_s=10)
        data_dir = Path(body["data_dir"])
        with contextlib.closing(_live_store(data_dir / "db" / "store.db", 500)):
            assert (data_dir / "db" / "store.db-wal").exists()
            status, answer = await self._snapshot(agent, {
                "data_dir": body["data_dir"], "generation": 3, "sqlite": ["db/*.db"]})
            assert status == 200, answer
        warm = tree_digest.warm_dir(data_dir)
        assert (answer["area"], answer["generation"], answer["dir"]) == (AREA, 3, str(warm))
        assert (answer["files"], answer["databases"]) == (2, 1), answer
        files = {p.relative_to(warm).as_posix(): p.read_bytes()
                 for p in warm.rglob("*") if p.is_file()}
        assert sorted(files) == ["db/store.db", "session.db"]  # the daemon's, and no sidecar
        assert answer["bytes"] == sum(map(len, files.values()))
        with contextlib.closing(sqlite3.connect(warm / "db" / "store.db")) as db:
            assert db.execute("SELECT count(*) FROM rows").fetchone() == (500,)
        status, listed = await agent.request("POST", f"/v1/areas/{AREA}/listing",
                                             json_body={"data_dir": answer["dir"]})
        assert status == 200, listed
        assert base64.b64decode(listed["listing"]) == tree_digest.listing(
            {rel: hashlib.sha256(data).hexdigest() for rel, data in files.items()})
        client = AgentClient(channel=unix_channel(agent.address), secret=agent.secret.encode())
        again = await client.snapshot(area=AREA, data_dir=body["data_dir"], generation=3,
                                      sqlite=["db/*.db"])
        assert (again.dir, again.generation, again.files, again.databases) == (
            str(warm), 3, 2, 1)
        assert again.taken_at >= answer["taken_at"]
        # fetched, it is removed: kept, it would double the area's room on the VPS
        await client.discard_snapshot(area=AREA, data_dir=body["data_dir"])
        assert not warm.exists() and data_dir.joinpath("db", "store.db").exists()

    async def test_two_at_once_are_taken_one_after_the_other(
        self, agent: AgentProcess, detector: Detector
    ) -> None:
        body = await _created(agent, detector, generation=3)
        data_dir = Path(body["data_dir"])
        for k in range(50):
            (data_dir / "media" / f"{k}.bin").parent.mkdir(parents=True, exist_ok=True)
            (data_dir / "media" / f"{k}.bin").write_bytes(os.urandom(256 << 10))
        request = {"data_dir": body["data_dir"], "generation": 3, "sqlite": []}
        answers = await asyncio.gather(*(self._snapshot(agent, request) for _ in range(3)))
        assert [status for status, _ in answers] == [200] * 3, answers
        assert len({answer["taken_at"] for _, answer in answers}) == 3
        warm = tree_digest.warm_dir(data_dir)
        assert {p.name for p in warm.parent.iterdir()} == {"warm"}
        assert all((warm / "media" / f"{k}.bin").read_bytes()
                   == (data_dir / "media" / f"{k}.bin").read_bytes() for k in range(50))

    async def test_another_generation_or_data_dir_is_refused_and_takes_nothing(
        self, agent: AgentProcess, detector: Detector
    ) -> None:
        body = await _created(agent, detector, generation=3)
        other_dir = str(agent.base_dir / "data" / "tg" / "other")
        for generation, data_dir in ((2, body["data_dir"]), (4, body["data_dir"]),
                                     (3, other_dir)):
            status, answer = await self._snapshot(agent, {
                "data_dir": data_dir, "generation": generation, "sqlite": []})
            assert (status, answer["error"]["code"]) == (409, "WARM_COPY_REFUSED"), answer
            assert "\n" not in answer["error"]["detail"]
        client = AgentClient(channel=unix_channel(agent.address), secret=agent.secret.encode())
        with pytest.raises(MonitordError) as refused:
            await client.snapshot(area=AREA, data_dir=body["data_dir"], generation=4, sqlite=[])
        assert refused.value.code == ErrorCode.WARM_COPY_REFUSED
        assert "generation 3, not 4" in refused.value.detail
        assert not tree_digest.copy_dir(Path(body["data_dir"])).exists()
        assert not tree_digest.copy_dir(Path(other_dir)).exists()

    async def test_an_unknown_area_is_404(self, agent: AgentProcess) -> None:
        status, answer = await self._snapshot(agent, {
            "data_dir": str(agent.base_dir / "data" / "tg" / AREA), "generation": 1,
            "sqlite": []})
        assert (status, answer["error"]["code"]) == (404, "UNKNOWN_AREA"), answer

    async def test_a_snapshot_that_cannot_be_whole_fails_and_keeps_the_last_one(
        self, agent: AgentProcess, detector: Detector
    ) -> None:
        body = await _created(agent, detector, generation=3)
        assert await detector.wait_for(lambda d: d.alive(AREA), timeout_s=10)
        request = {"data_dir": body["data_dir"], "generation": 3, "sqlite": ["*.db"]}
        data_dir = Path(body["data_dir"])
        status, answer = await self._snapshot(agent, {**request, "sqlite": []})
        assert status == 200, answer
        kept = tree_digest.warm_dir(data_dir) / "session.db"
        before = kept.read_bytes()
        (data_dir / "broken.db").write_bytes(b"no SQLite store" * 100)
        status, answer = await self._snapshot(agent, request)
        assert (status, answer["error"]["code"]) == (409, "WARM_COPY_FAILED"), answer
        assert "broken.db" in answer["error"]["detail"]
        assert kept.read_bytes() == before
        assert not (data_dir.parent / ".monitord-copy" / AREA / "warm.new").exists()

    async def test_bad_bodies_are_refused_with_400(
        self, agent: AgentProcess, detector: Detector, tmp_path: Path
    ) -> None:
        body = await _created(agent, detector, generation=3)
        good = {"data_dir": body["data_dir"], "generation": 3, "sqlite": ["*.db"]}
        bodies: tuple[object, ...] = (
            {**good, "sqlite": "*.db"}, {**good, "sqlite": [""]}, {**good, "sqlite": ["/x"]},
            {**good, "sqlite": ["a\u0000b"]}, {**good, "sqlite": ["x" * 256]},
            {**good, "sqlite": [f"{k}.db" for k in range(65)]}, {**good, "sqlite": [7]},
            {k: v for k, v in good.items() if k != "sqlite"},
            {**good, "generation": -1}, {**good, "generation": "3"},
            {**good, "generation": True}, {**good, "generation": 2**63},
            {**good, "data_dir": str(tmp_path)}, {**good, "data_dir": str(agent.base_dir)},
            [],
        )
        for refused in bodies:
            status, answer = await self._snapshot(agent, refused)
            assert (status, answer["error"]["code"]) == (400, "BAD_REQUEST"), (refused, answer)
        assert not tree_digest.copy_dir(Path(body["data_dir"])).exists()
        status, answer = await self._snapshot(agent, {**good, "sqlite": ["x" * 255] * 64})
        assert status == 200, answer
        command = {k: v for k, v in good.items() if k != "sqlite"}
        for refused in ({**command, "command": ["true"]},  # (no timeout_s)
                        {**command, "command": [], "timeout_s": 5},
                        {**command, "command": ["true"], "timeout_s": 0},
                        {**good, "command": ["true"], "timeout_s": 5}):
            status, answer = await self._snapshot(agent, refused)
            assert (status, answer["error"]["code"]) == (400, "BAD_REQUEST"), (refused, answer)

    async def test_the_services_own_command_runs_in_the_data_dir_with_the_areas_env(
        self, agent: AgentProcess, detector: Detector
    ) -> None:
        """`warm_copy = {command = [...]}`: the agent runs it as the area's daemon runs and
        takes what it leaves in $MONITORD_SNAPSHOT_DIR; its failure is WARM_COPY_FAILED
        with the end of its output."""
        body = {**area_body(agent, detector, area=AREA, generation=3),
                "env": {"MONITORD_TEST_AREA_ENV": "the area's"}}
        status, answer = await agent.request("PUT", f"/v1/areas/{AREA}", json_body=body)
        assert status == 201, answer
        client = AgentClient(channel=unix_channel(agent.address), secret=agent.secret.encode())
        script = ("import os, pathlib; out = pathlib.Path(os.environ['MONITORD_SNAPSHOT_DIR']);"
                  " (out / 'cwd').write_text(os.getcwd());"
                  " (out / 'env').write_text(os.environ.get('MONITORD_TEST_AREA_ENV', ''))")
        taken = await client.snapshot(area=AREA, data_dir=body["data_dir"], generation=3,
                                      command=[sys.executable, "-c", script],
                                      command_timeout_s=20)
        warm = Path(taken.dir)
        assert warm.joinpath("cwd").read_text() == body["data_dir"]
        assert warm.joinpath("env").read_text() == "the area's"
        assert (taken.files, taken.databases) == (2, 0)
        with pytest.raises(MonitordError) as failed:
            await client.snapshot(area=AREA, data_dir=body["data_dir"], generation=3,
                                  command=[sys.executable, "-c", "print('no session'); exit(2)"])
        assert failed.value.code == "WARM_COPY_FAILED"
        assert "status 2: no session" in failed.value.detail
        assert warm.joinpath("cwd").exists(), "the last snapshot stays"


class TestRoutes:
    """GET /v1/routes names every route the agent serves, so that the PBX chooses its way
    once; a path it does not serve is 404 AGENT_ROUTE_MISSING, never UNKNOWN_AREA."""

    async def test_the_agent_names_the_copy_routes_it_serves(self, agent: AgentProcess) -> None:
        client = AgentClient(channel=unix_channel(agent.address), secret=agent.secret.encode())
        served = await client.routes()
        assert vps_tree.COPY_ROUTES <= served, served
        assert {"GET /v1/routes", "GET /v1/areas/{area}/health",
                "POST /v1/areas/{area}/copy/snapshot"} <= served
        assert await AreaCopy(client, AREA, str(agent.base_dir / "data" / AREA)).serves_copies()

    async def test_the_agent_says_the_vps_memory_as_the_kernel_does(
        self, agent: AgentProcess
    ) -> None:
        """GET /v1/host: MemTotal and MemAvailable of this machine's /proc/meminfo, read at
        the request (a move's preflight judges its room by them)."""
        client = AgentClient(channel=unix_channel(agent.address), secret=agent.secret.encode())
        host = await client.host()
        meminfo = {line.split(":")[0]: int(line.split()[1]) * 1024
                   for line in Path("/proc/meminfo").read_text().splitlines()}
        assert host is not None and host.total_bytes == meminfo["MemTotal"]
        assert host.available_bytes is not None
        assert 0 < host.available_bytes <= host.total_bytes
        # (it moves between two reads; within a quarter of the machine's memory of each other)
        assert abs(host.available_bytes - meminfo["MemAvailable"]) < meminfo["MemTotal"] // 4
        status, _ = await agent.request("GET", "/v1/host", auth=False)
        assert status == 401

    async def test_a_route_it_lists_is_never_missing(self, agent: AgentProcess) -> None:
        status, answer = await agent.request("GET", "/v1/routes")
        assert status == 200, answer
        for route in answer["routes"]:
            method, path = route.split(" ")
            status, body = await agent.request(method, path.replace("{area}", AREA),
                                               json_body={})
            assert not (status == 404 and body["error"]["code"] == "AGENT_ROUTE_MISSING"), route

    async def test_a_path_it_does_not_serve_is_route_missing(self, agent: AgentProcess) -> None:
        status, answer = await agent.request("POST", f"/v1/areas/{AREA}/unheard-of",
                                             json_body={})
        assert (status, answer["error"]["code"]) == (404, "AGENT_ROUTE_MISSING"), answer
        status, answer = await agent.request("GET", f"/v1/areas/{AREA}")
        assert (status, answer["error"]["code"]) == (404, "UNKNOWN_AREA"), answer


class TestSetAsideCopies:
    """DELETE /v1/areas/{area}?aside=1 moves a given-up copy into `abandoned/`; once the PBX
    has kept it long enough, DELETE /v1/abandoned/{name} removes exactly that directory."""

    async def test_a_set_aside_copy_is_removed_by_its_name_once(
        self, agent: AgentProcess, detector: Detector
    ) -> None:
        body = area_body(agent, detector, area=AREA, generation=7)
        await agent.request("PUT", f"/v1/areas/{AREA}", json_body=body)
        assert await detector.wait_for(lambda d: d.alive(AREA), timeout_s=10)
        status, answer = await agent.request("DELETE",
                                             f"/v1/areas/{AREA}?generation=7&aside=1")
        assert status == 200, answer
        kept = Path(answer["set_aside"])
        assert kept.parent == agent.base_dir / "abandoned" and (kept / "session.db").exists()
        status, answer = await agent.request("DELETE", f"/v1/abandoned/{kept.name}")
        assert (status, answer["result"]) == (200, "deleted")
        assert not kept.exists() and (agent.base_dir / "abandoned").is_dir()
        status, answer = await agent.request("DELETE", f"/v1/abandoned/{kept.name}")
        assert (status, answer["result"]) == (200, "absent")

    async def test_only_a_plain_directory_named_as_a_copy_is_removed(
        self, agent: AgentProcess
    ) -> None:
        aside = agent.base_dir / "abandoned"
        aside.mkdir(exist_ok=True)
        elsewhere = agent.base_dir / "data" / "kept"
        elsewhere.mkdir(parents=True)
        (elsewhere / "f").write_bytes(b"x")
        (aside / f"{AREA}-g3-1700000000").symlink_to(elsewhere)
        status, answer = await agent.request("DELETE", f"/v1/abandoned/{AREA}-g3-1700000000")
        assert (status, answer["error"]["code"]) == (409, "CLEANUP_STUCK"), answer
        assert (elsewhere / "f").exists(), "never through a link"
        for name in ("x", f"{AREA}", f".{AREA}-g3-1", f"{AREA}-g3-1%2F..",
                     f"{AREA}-gx-1"):
            status, answer = await agent.request("DELETE", f"/v1/abandoned/{name}")
            assert (status, answer["error"]["code"]) == (400, "BAD_REQUEST"), (name, answer)
        assert (elsewhere / "f").exists() and (aside / f"{AREA}-g3-1700000000").is_symlink()


class TestAreaLog:
    """GET /v1/areas/{area}/log reads the area's log back, read-only and bounded, for the
    PBX's `monitord logs` (through the agent client, over the same socket)."""

    async def test_the_last_lines_then_what_was_appended_since(
        self, agent: AgentProcess
    ) -> None:
        log = agent.base_dir / "logs" / f"{AREA}.log"
        log.parent.mkdir(exist_ok=True)
        log.write_text("".join(f"line {i}\n" for i in range(50)))
        client = AgentClient(channel=unix_channel(agent.address), secret=agent.secret.encode())
        found = await client.area_log(area=AREA, lines=2)
        assert (found["data"], found["missing"]) == ("line 48\nline 49\n", False)
        with log.open("a") as f:
            f.write("line 50\n")
        more = await client.area_log(area=AREA, file=found["file"], offset=found["offset"])
        assert more["data"] == "line 50\n" and more["offset"] == log.stat().st_size
        assert (await client.area_log(area="never-ran", lines=5))["missing"] is True

    async def test_bounds_and_names_are_checked_and_nothing_is_written(
        self, agent: AgentProcess
    ) -> None:
        log = agent.base_dir / "logs" / f"{AREA}.log"
        log.parent.mkdir(exist_ok=True)
        log.write_bytes(b"x" * 100 + b"\n")
        before = log.stat()
        for query in ("lines=10001", "lines=-1", "max_bytes=2000000", "offset=x",
                      "offset=" + "9" * 5000, "lines=%C2%B2"):
            status, answer = await agent.request("GET", f"/v1/areas/{AREA}/log?{query}")
            assert (status, answer["error"]["code"]) == (400, "BAD_REQUEST"), query
        # the generation of the other routes: only ASCII digits, and not thousands of them
        for generation in ("%C2%B2", "9" * 5000):
            status, answer = await agent.request(
                "POST", f"/v1/areas/{AREA}/stop?generation={generation}")
            assert (status, answer["error"]["code"]) == (400, "BAD_REQUEST"), generation
        status, answer = await agent.request("GET", "/v1/areas/..%2Fagent.secret/log")
        assert (status, answer["error"]["code"]) == (400, "BAD_REQUEST")
        status, answer = await agent.request("PUT", f"/v1/areas/{AREA}/log", json_body={})
        assert status == 405
        after = log.stat()
        assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)

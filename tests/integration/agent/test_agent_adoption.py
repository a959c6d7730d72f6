"""A restarted agent adopts the guards of daemons started through scripts: a `#!` script
(python, sh, `/usr/bin/env python3`), one found through PATH, a wrapper that execs, one that
overwrites its environment — the area runs on with the same daemon, one life, no restart."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from monitord.base import proc_identity
from monitord.testing.split_brain import Detector
from monitord.vps import spool_cache
from tests.integration.agent.conftest import OWNER, area_body
from tests.support import script_daemons
from tests.support.agent_process import running_agent

AREA = "9a7e0c2e-0000-4000-8000-00000000002a"


class TestScriptDaemonsSurviveAnAgentRestart:
    """Whether the agent stopped (SIGTERM) or was killed (SIGKILL), the next agent adopts the
    guard of a daemon whose kernel argv is not its configured command: same guard, same
    daemon, one life in the split-brain detector."""

    @pytest.mark.parametrize("kind", script_daemons.KINDS)
    @pytest.mark.parametrize("ended_by", [signal.SIGTERM, signal.SIGKILL])
    async def test_the_next_agent_adopts_the_script_daemon_without_a_restart(
        self, kind: str, ended_by: signal.Signals, tmp_path: Path, detector: Detector
    ) -> None:
        base_dir = tmp_path / "vps"
        script = script_daemons.write(kind, tmp_path / "bin")
        async with running_agent(base_dir, kill_daemons_on_exit=False) as first:
            body = area_body(first, detector, area=AREA, generation=1, ttl_s=30)
            body["command"] = [*script.head, *body["command"][3:]]  # the script, not -m
            body["env"] = script.env
            status, answer = await first.request("PUT", f"/v1/areas/{AREA}", json_body=body)
            assert status == 201, answer
            assert await detector.wait_for(lambda d: d.alive(AREA), timeout_s=10)
            [key] = detector.alive(AREA)
            [before] = (await first.inventory())["processes"]
            await first.kill(ended_by)
        async with running_agent(base_dir) as second:
            [after] = (await second.inventory())["processes"]
            assert (after["guard_pid"], after["pid"], after["adopted"], after["alive"]) == (
                before["guard_pid"], before["pid"], True, True)
            assert not await detector.wait_for(lambda d: len(d.lives(AREA)) > 1, timeout_s=1.0)
            assert [life.key.pid for life in detector.lives(AREA)] == [key.pid]
            status, _ = await second.request("DELETE", f"/v1/areas/{AREA}?generation=1")
            assert status == 200
            assert not proc_identity.is_alive(key.pid)
        assert detector.overlaps() == []


class TestChangedCommandIsReplaced:
    """A guard whose daemon command is not the one its entry names (the cache was written
    for another command than the guard runs) is not adopted: it is stopped with a
    `survivor_replaced` event, `reason: "command_changed"`, and the owner's next grant starts
    the entry's command."""

    async def test_a_guard_running_another_command_is_replaced_and_says_why(
        self, tmp_path: Path, detector: Detector
    ) -> None:
        base_dir = tmp_path / "vps"
        script = script_daemons.write("python_shebang", tmp_path / "bin")
        async with running_agent(base_dir, kill_daemons_on_exit=False) as first:
            body = area_body(first, detector, area=AREA, generation=1, ttl_s=30)
            body["command"] = [*script.head, *body["command"][3:]]
            status, answer = await first.request("PUT", f"/v1/areas/{AREA}", json_body=body)
            assert status == 201, answer
            assert await detector.wait_for(lambda d: d.alive(AREA), timeout_s=10)
            [old] = detector.alive(AREA)
            await first.kill(signal.SIGKILL)
        cache = base_dir / "spool" / spool_cache.CACHE_NAME
        document = json.loads(cache.read_text())
        [entry] = document["custom_daemons"]
        changed = [*entry["command"], "--interval", "0.05"]
        entry["command"] = changed
        cache.write_text(json.dumps(document))

        async with running_agent(base_dir) as second:
            assert (await second.inventory())["processes"] == []
            assert not proc_identity.is_alive(old.pid)
            [event] = [json.loads(line) for line in second.log_text().splitlines()
                       if '"survivor_' in line]
            assert (event["event"], event["reason"], event["now"]) == (
                "survivor_replaced", "command_changed", changed)
            assert event["was"] == body["command"]
            renew = {"owner_id": OWNER, "ttl_s": 30, "areas": {AREA: 1}}
            _, answer = await second.request("POST", "/v1/leases/renew", json_body=renew)
            assert answer["areas"][AREA]["result"] == "renewed"
            assert await detector.wait_for(
                lambda d: [k.pid for k in d.alive(AREA)] not in ([], [old.pid]), timeout_s=10
            )
            [process] = (await second.inventory())["processes"]
            assert process["adopted"] is False
        assert detector.overlaps() == []

"""Area leases and self-fencing on the VPS: no remote daemon outlives its lease, whatever
happens to the agent, and a restarted agent starts nothing until the owner grants again."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

from monitord.base import proc_identity
from monitord.testing.split_brain import Detector
from monitord.vps import lease_table
from tests.integration.agent.conftest import OWNER, area_body
from tests.support.agent_process import AgentProcess, running_agent, wait_until

AREA = "9a7e0c2e-0000-4000-8000-00000000000a"
OTHER = "9a7e0c2e-0000-4000-8000-00000000000b"
TTL_S = 2.0


def _last_sign_of_life(detector: Detector, area: str) -> float:
    lives = detector.lives(area)
    assert lives, f"no heartbeat ever seen for {area}"
    return max(life.goodbye_at or life.last_seen for life in lives)


async def _create(agent: AgentProcess, detector: Detector, area: str, **kwargs: object) -> float:
    """PUT the area with a TTL_S lease; returns the wall time just after the grant answered."""
    body = area_body(
        agent, detector, area=area, generation=1, ttl_s=TTL_S, **kwargs  # type: ignore[arg-type]
    )
    status, answer = await agent.request("PUT", f"/v1/areas/{area}", json_body=body)
    assert status == 201, answer
    granted_at = time.time()
    assert await detector.wait_for(lambda d: d.alive(area), timeout_s=10)
    return granted_at


class TestLeaseLapse:
    """A daemon whose lease lapses is stopped within one second of the expiry."""

    async def test_daemon_stops_within_ttl_plus_one_second_without_renewal(
        self, agent: AgentProcess, detector: Detector
    ) -> None:
        granted_at = await _create(agent, detector, AREA)
        assert await detector.wait_for(lambda d: not d.alive(AREA), timeout_s=TTL_S + 3)
        assert _last_sign_of_life(detector, AREA) <= granted_at + TTL_S + 1.0
        entry = (await agent.inventory())["entries"][0]
        assert entry["state"] == "awaiting_grant"

    async def test_daemon_ignoring_sigterm_is_killed_within_ttl_plus_one_second(
        self, agent: AgentProcess, detector: Detector
    ) -> None:
        granted_at = await _create(agent, detector, AREA, extra=("--ignore-sigterm",))
        pid = detector.alive(AREA)[0].pid
        await wait_until(lambda: not proc_identity.is_alive(pid), timeout_s=TTL_S + 3,
                         what="the daemon ignoring SIGTERM to be killed")
        assert _last_sign_of_life(detector, AREA) <= granted_at + TTL_S + 1.0

    async def test_renewal_keeps_the_daemon_running_past_the_first_ttl(
        self, agent: AgentProcess, detector: Detector
    ) -> None:
        granted_at = await _create(agent, detector, AREA)
        pid = detector.alive(AREA)[0].pid
        renew = {"owner_id": OWNER, "ttl_s": TTL_S, "areas": {AREA: 1, OTHER: 1}}
        while time.time() < granted_at + 2 * TTL_S:
            status, answer = await agent.request("POST", "/v1/leases/renew", json_body=renew)
            assert status == 200
            assert answer["areas"][AREA]["result"] == "renewed"
            assert answer["areas"][OTHER]["result"] == "absent"
            assert 0 < answer["areas"][AREA]["lease_expires_in_s"] <= TTL_S
            await detector.wait_for(lambda d: not d.alive(AREA), timeout_s=TTL_S / 4)
        assert [key.pid for key in detector.alive(AREA)] == [pid]

    async def test_a_renewal_right_after_another_leaves_the_lease_file_alone(
        self, agent: AgentProcess, detector: Detector
    ) -> None:
        # The owner renews all its areas on every change of placement; rewriting every
        # lease file each time was most of the agent's work while a service moved.
        await _create(agent, detector, AREA)
        lease = agent.base_dir / "leases" / f"{AREA}.json"
        renew = {"owner_id": OWNER, "ttl_s": TTL_S, "areas": {AREA: 1}}

        async def renewed() -> tuple[int, bytes, float]:
            status, answer = await agent.request("POST", "/v1/leases/renew", json_body=renew)
            assert status == 200 and answer["areas"][AREA]["result"] == "renewed"
            return (lease.stat().st_ino, lease.read_bytes(),
                    answer["areas"][AREA]["lease_expires_in_s"])

        first = await renewed()
        again = await renewed()
        assert again[:2] == first[:2]  # not rewritten
        assert again[2] <= first[2]  # and the owner is told the lease as it stands
        await asyncio.sleep(TTL_S * lease_table.RENEWAL_REWRITE_FRACTION + 0.1)
        later = await renewed()
        assert later[:2] != first[:2]
        assert later[2] > again[2]

    async def test_one_bad_name_never_fails_the_batch(
        self, agent: AgentProcess, detector: Detector
    ) -> None:
        await _create(agent, detector, AREA)
        bad = ["{5b1d}", " padded", "../x", "tg\n", "a" * 300]
        renew = {"owner_id": OWNER, "ttl_s": TTL_S, "areas": {AREA: 1, **dict.fromkeys(bad, 1)}}
        status, answer = await agent.request("POST", "/v1/leases/renew", json_body=renew)
        assert status == 200
        assert answer["areas"][AREA]["result"] == "renewed"
        assert {answer["areas"][name[:200]]["result"] for name in bad} == {"invalid"}

    async def test_renewal_by_another_owner_or_generation_grants_nothing(
        self, agent: AgentProcess, detector: Detector
    ) -> None:
        await _create(agent, detector, AREA)
        for owner, generation, outcome in (("other-pbx", 1, "other_owner"),
                                           (OWNER, 2, "generation_mismatch")):
            renew = {"owner_id": owner, "ttl_s": 60, "areas": {AREA: generation}}
            _, answer = await agent.request("POST", "/v1/leases/renew", json_body=renew)
            assert answer["areas"][AREA]["result"] == outcome
        entry = (await agent.inventory())["entries"][0]
        assert entry["lease_expires_in_s"] <= TTL_S


class TestRenewalIndependence:
    """A slow stop of one area never holds up the renewal of the others."""

    async def test_renewal_answers_while_another_area_is_still_stopping(
        self, agent: AgentProcess, detector: Detector
    ) -> None:
        await _create(agent, detector, AREA, extra=("--ignore-sigterm",))  # stop takes the grace
        await _create(agent, detector, OTHER)
        order: list[str] = []

        async def stop_slow_area() -> None:
            status, _ = await agent.request("POST", f"/v1/areas/{AREA}/stop?generation=1")
            assert status == 200
            order.append("stop")

        async def renew_other_area() -> None:
            guard_log = agent.base_dir / "logs" / f"{AREA}.log"
            await wait_until(lambda: b'"stop_requested"' in guard_log.read_bytes(),
                             timeout_s=10, what="the stop of the slow area to begin")
            renew = {"owner_id": OWNER, "ttl_s": TTL_S, "areas": {AREA: 1, OTHER: 1}}
            _, answer = await agent.request("POST", "/v1/leases/renew", json_body=renew)
            assert answer["areas"][OTHER]["result"] == "renewed"
            order.append("renew")

        await asyncio.gather(stop_slow_area(), renew_other_area())
        assert order == ["renew", "stop"]


class TestAgentKilled:
    """A remote daemon never outlives its lease, even when the agent is killed with SIGKILL."""

    async def test_daemons_are_gone_within_ttl_plus_one_second_after_kill_9(
        self, agent: AgentProcess, detector: Detector
    ) -> None:
        granted_at = {area: await _create(agent, detector, area) for area in (AREA, OTHER)}
        pids = [p["pid"] for p in (await agent.inventory())["processes"]]
        assert len(pids) == 2
        await agent.kill(signal.SIGKILL)
        await wait_until(lambda: not any(proc_identity.is_alive(pid) for pid in pids),
                         timeout_s=TTL_S + 3, what="the orphaned daemons to be fenced")
        for area in (AREA, OTHER):
            assert _last_sign_of_life(detector, area) <= granted_at[area] + TTL_S + 1.0


class TestAgentRestart:
    """After an agent restart the cached config starts nothing until the owner grants again."""

    async def test_a_stale_cache_starts_nothing_until_a_renewal_grants_it(
        self, tmp_path: Path, detector: Detector
    ) -> None:
        base_dir = tmp_path / "vps"
        async with running_agent(base_dir) as first:
            await _create(first, detector, AREA)
            await first.kill(signal.SIGKILL)
            assert await detector.wait_for(lambda d: not d.alive(AREA), timeout_s=TTL_S + 3)
        assert (base_dir / "spool" / "custom_config.json").exists()
        async with running_agent(base_dir) as second:
            inventory = await second.inventory()
            assert [e["state"] for e in inventory["entries"]] == ["awaiting_grant"]
            assert inventory["processes"] == []
            assert not await detector.wait_for(lambda d: d.alive(AREA), timeout_s=1.0)
            renew = {"owner_id": OWNER, "ttl_s": 30, "areas": {AREA: 1}}
            _, answer = await second.request("POST", "/v1/leases/renew", json_body=renew)
            assert answer["areas"][AREA]["result"] == "renewed"
            assert await detector.wait_for(lambda d: d.alive(AREA), timeout_s=10)
        assert detector.overlaps() == []

    async def test_an_unreadable_cache_is_moved_aside_and_starts_nothing(
        self, tmp_path: Path, detector: Detector
    ) -> None:
        base_dir = tmp_path / "vps"
        (base_dir / "spool").mkdir(parents=True)
        (base_dir / "spool" / "custom_config.json").write_text('{"custom_daemons": [{"uu')
        async with running_agent(base_dir) as agent:
            inventory = await agent.inventory()
            assert (inventory["entries"], inventory["processes"]) == ([], [])
            assert list((base_dir / "spool").glob("custom_config.json.corrupt-*"))

    async def test_a_restart_within_the_lease_adopts_the_running_daemon(
        self, tmp_path: Path, detector: Detector
    ) -> None:
        base_dir = tmp_path / "vps"
        async with running_agent(base_dir, kill_daemons_on_exit=False) as first:
            body = area_body(first, detector, area=AREA, generation=1, ttl_s=30)
            assert (await first.request("PUT", f"/v1/areas/{AREA}", json_body=body))[0] == 201
            assert await detector.wait_for(lambda d: d.alive(AREA), timeout_s=10)
            pid = detector.alive(AREA)[0].pid
            await first.kill(signal.SIGKILL)
        async with running_agent(base_dir) as second:
            processes = (await second.inventory())["processes"]
            assert [(p["pid"], p["adopted"]) for p in processes] == [(pid, True)]
            status, _ = await second.request("DELETE", f"/v1/areas/{AREA}?generation=1")
            assert status == 200
            assert not proc_identity.is_alive(pid)
        assert [life.key.pid for life in detector.lives(AREA)] == [pid]
        assert detector.overlaps() == []


class TestGuardDeath:
    """A daemon dies with its lease guard (PR_SET_PDEATHSIG), and the agent restarts the area
    while its lease is current."""

    async def test_killing_the_guard_kills_its_daemon_and_the_agent_restarts_it(
        self, agent: AgentProcess, detector: Detector
    ) -> None:
        body = area_body(agent, detector, area=AREA, generation=1, ttl_s=30)
        assert (await agent.request("PUT", f"/v1/areas/{AREA}", json_body=body))[0] == 201
        assert await detector.wait_for(lambda d: d.alive(AREA), timeout_s=10)
        [process] = (await agent.inventory())["processes"]
        proc_identity.signal_group(process["guard_pid"], signal.SIGKILL)
        await wait_until(lambda: not proc_identity.is_alive(process["pid"]), timeout_s=5,
                         what="the daemon to die with its guard")
        assert await detector.wait_for(
            lambda d: [k.pid for k in d.alive(AREA)] not in ([], [process["pid"]]), timeout_s=10
        )
        assert detector.overlaps() == []

    async def test_a_crashing_daemon_is_restarted_while_its_lease_is_current(
        self, agent: AgentProcess, detector: Detector
    ) -> None:
        body = area_body(agent, detector, area=AREA, generation=1, ttl_s=30,
                         extra=("--crash-after", "0.3"))
        assert (await agent.request("PUT", f"/v1/areas/{AREA}", json_body=body))[0] == 201
        assert await detector.wait_for(lambda d: len(d.lives(AREA)) >= 3, timeout_s=15)
        entry = (await agent.inventory())["entries"][0]
        assert entry["restarts"] >= 2
        assert detector.overlaps() == []

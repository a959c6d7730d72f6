"""A VPS that never comes back, on real OpenSSH: SSH to the namespace VPS is black-holed for
good (its daemons still reach the split-brain detector over the veth, so an overlap would be
seen). The operator gives the VPS up: refused until the copy there is provably fenced, then
the area runs on the PBX's own copy; when SSH returns, the VPS never runs it again."""

from __future__ import annotations

import asyncio
import subprocess
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


class TestTimedGiveUpAndForensics:
    async def test_given_up_by_itself_then_fetched_for_forensics_over_real_openssh(
        self, fault_stack: FaultStackFactory, netns_vps: NetnsVps
    ) -> None:
        """`vps_lost_after_s` with `on_vps_lost = "home"`: nobody asks, and tg still comes
        home — no earlier than the VPS's copy is provably fenced. When SSH returns, the copy
        is set aside there, and `monitord fetch-abandoned` brings exactly it to the PBX."""
        stack = await fault_stack(services={"tg": 1},
                                  monitord_overrides={"vps_lost_after_s": 2.0},
                                  service_overrides={"on_vps_lost": "home"})
        (area,) = stack.areas["tg"]
        await stack.place("tg", "remote")
        await stack.wait_settled(expect={"tg": "remote"}, timeout_s=90)
        await asyncio.sleep(1.0)  # records written on the VPS only
        stack.accepted_data_loss.add(area)  # the policy's accepted loss
        lost_at = time.time()
        netns_vps.black_hole()

        await stack.wait_until(lambda: _runs_on(stack, area, "local"), timeout_s=90,
                               what="tg home by itself on the PBX's copy")
        [abandoned] = stack.events("remote_data_abandoned")
        assert (abandoned["area"], abandoned["reason"]) == (area, "policy")
        [life] = [x for x in stack.detector.lives(area)
                  if x.key.side == "local" and x.first_seen >= lost_at]
        # the area lease (3 s in the stack) and its margin: never before the copy fenced
        assert life.first_seen - lost_at >= 3.0
        assert not _runs_on(stack, area, "remote")

        netns_vps.heal()
        await stack.wait_settled(expect={"tg": "local"}, timeout_s=120)

        async def set_aside() -> list[dict[str, object]]:
            return [r for r in (await stack.status())["abandoned_data"]
                    if r["area"] == area and r["set_aside_path"]]
        await stack.wait_until(set_aside, timeout_s=60, what="the VPS's copy set aside")
        [row] = await set_aside()
        kept = Path(str(row["set_aside_path"]))
        fetched = await run_cli("fetch-abandoned", area, "-c", str(stack.config_path))
        assert fetched.code == 0, fetched.stderr
        to = stack.work_dir / "abandoned" / kept.name
        files = {p.relative_to(kept): p.read_bytes() for p in kept.rglob("*") if p.is_file()}
        assert files and files == {
            p.relative_to(to): p.read_bytes() for p in to.rglob("*") if p.is_file()}
        late = [x.key for x in stack.detector.lives(area)
                if x.key.side == "remote" and x.first_seen >= lost_at]
        assert late == [], "neither the VPS's return nor the fetch ran it there again"


def _held_back(netns_vps: NetnsVps) -> list[str]:
    """The PBX's TCP sockets to the VPS's sshd that still hold bytes to send (a connection
    being opened aside: a SYN holds none)."""
    out = subprocess.run(["ss", "-tnH", "state", "all", "dst", netns_vps.vps_address,
                          "dport", "=", f":{netns_vps.port}"],
                         capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines()
            if line.split()[0] != "SYN-SENT" and int(line.split()[2]) > 0]


class TestALateRenewal:
    async def test_nothing_sent_before_the_tunnel_was_declared_down_arrives_after(
        self, fault_stack: FaultStackFactory, netns_vps: NetnsVps
    ) -> None:
        """The PBX's renewals go on while the link is black-holed, until it declares the
        tunnel down and dates every lease from then. Given up once the bound passed, the
        area runs at home. Nothing the PBX wrote on the old connection may still be waiting
        in its kernel then: once the link passes that connection's packets again (sshd
        still holds the session: its ClientAlive window) a renewal would revive the lapsed
        lease and start the copy on the VPS beside the PBX's."""
        stack = await fault_stack(services={"tg": 1})
        (area,) = stack.areas["tg"]
        await stack.place("tg", "remote")
        await stack.wait_settled(expect={"tg": "remote"}, timeout_s=90)
        netns_vps.black_hole()
        await stack.place("tg", "local")
        stack.accepted_data_loss.add(area)  # the operator's explicit choice
        for _ in range(120):
            code, body = await stack.request("POST", "/v1/services/tg/give-up", {})
            if code != 409:
                break
            await asyncio.sleep(0.5)
        assert code == 202, body
        gave_up_at = time.time()
        await stack.wait_until(lambda: _runs_on(stack, area, "local"), timeout_s=60,
                               what="tg runs on the PBX's own copy")
        assert _held_back(netns_vps) == [], "bytes of a connection declared down wait to go"

        netns_vps.black_hole_new_connections()  # the old connection's packets pass again
        # (TCP retransmits a segment the black hole dropped at 0.2 s doubling: by 25 s after
        # its first try, every held-back byte has had its next chance)
        await asyncio.sleep(15.0)
        late = [life.key for life in stack.detector.lives(area)
                if life.key.side == "remote" and life.first_seen >= gave_up_at]
        assert late == [], "a renewal sent before the tunnel was declared down ran it again"

        netns_vps.heal()
        await stack.wait_settled(expect={"tg": "local"}, timeout_s=120)

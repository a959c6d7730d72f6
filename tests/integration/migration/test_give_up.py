"""A VPS that never comes back: the operator gives it up with one command, the areas start on
the PBX's own copy once every copy on the VPS is provably fenced, and a VPS that returns
never runs them again.

Every test ends with the stack's after-check: no overlap ever, and no start on older data
except for the areas a test names as the operator's accepted loss.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from monitord.testing.stack import Stack
from tests.integration.migration.conftest import (
    StackFactory,
    parked_waiting_for_data,
    settle_remote,
)
from tests.integration.operator.conftest import run_cli


async def _set_aside(stack: Stack, area: str) -> list[dict[str, object]]:
    rows = (await stack.status())["abandoned_data"]
    return [r for r in rows if r["area"] == area and r["set_aside_path"]]


def _runs_on(stack: Stack, area: str, side: str) -> bool:
    return any(k.side == side for k in stack.detector.alive(area))


async def _vps_gone_with_tg(stack: Stack, area: str) -> None:
    """tg runs on the VPS and has written there; the VPS vanishes; the operator asks for tg
    home, which cannot stop a source it cannot reach."""
    await settle_remote(stack)
    await stack.wait_until(lambda: _runs_on(stack, area, "remote"), timeout_s=20,
                           what="tg runs on the VPS")
    await asyncio.sleep(1.0)  # records the PBX never sees
    await stack.partition()
    await stack.place("tg", "local")


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


async def _given_up(stack: Stack, area: str) -> None:
    """The operator gives the VPS up as soon as it is allowed; tg runs on the PBX's copy."""
    stack.accepted_data_loss.add(area)
    while True:
        code, body = await stack.request("POST", "/v1/services/tg/give-up", {})
        if code == 202:
            break
        assert body["error"]["code"] == "VPS_NOT_FENCED", body
        await asyncio.sleep(body["retry_after_s"])
    await stack.wait_until(lambda: _runs_on(stack, area, "local"), timeout_s=30,
                           what="tg runs on the PBX's own copy")


class TestGivingTheVpsUp:
    """`monitord give-up SERVICE` brings the accounts home on the PBX's copy, safely."""

    async def test_refused_until_fenced_then_home_on_the_pbxs_copy_and_never_on_the_vps(
        self, stack_factory: StackFactory
    ) -> None:
        stack = await stack_factory(services={"tg": 1})
        area = stack.areas["tg"][0]
        await _vps_gone_with_tg(stack, area)

        code, body = await stack.request("POST", "/v1/services/tg/give-up", {})
        assert (code, body["error"]["code"]) == (409, "VPS_NOT_FENCED"), body
        assert body["retry_after_s"] >= 1 and "allowed in" in body["error"]["detail"]
        assert stack.events("remote_data_abandoned") == [], "a refusal records nothing"
        assert not _runs_on(stack, area, "local")

        await asyncio.sleep(body["retry_after_s"])
        stack.accepted_data_loss.add(area)  # the operator's explicit choice
        gave_up_at = time.time()
        result = await run_cli("give-up", "tg", "-c", str(stack.config_path))
        assert result.code == 0, result.stderr
        assert "given up" in result.stdout and "lost" in result.stdout
        await stack.wait_until(lambda: _runs_on(stack, area, "local"), timeout_s=30,
                               what="tg runs on the PBX's own copy")
        [abandoned] = stack.events("remote_data_abandoned")
        assert (abandoned["area"], abandoned["reason"], abandoned["kept"]) == (
            area, "operator", "local")
        assert abandoned["local_copy"] and abandoned["local_copy_modified_at"] <= gave_up_at
        [local] = [life for life in stack.detector.lives(area) if life.key.side == "local"
                   and life.first_seen >= gave_up_at]
        assert local.start_records, "it started on what the PBX kept when tg moved out"

        again = await run_cli("give-up", "tg", "-c", str(stack.config_path))
        assert again.code == 1 and "TRANSACTION_CONFLICT" in again.stderr

        await stack.heal()  # the VPS returns with its copy and its stale entry
        await stack.wait_settled(expect={"tg": "local"}, timeout_s=90)
        await asyncio.sleep(2.0)
        late = [life.key for life in stack.detector.lives(area)
                if life.key.side == "remote" and life.first_seen >= gave_up_at]
        assert late == [], "a given-up VPS never runs the area again"
        assert area not in stack.agent_cache(), "its entry there is cleaned up"
        # ... and its data set aside there, not deleted: listed in the status, for forensics
        await stack.wait_until(lambda: _set_aside(stack, area), timeout_s=30,
                               what="the VPS's copy set aside")
        [aside] = await _set_aside(stack, area)
        kept = Path(str(aside["set_aside_path"]))
        assert kept.parent == stack.vps_dir / "abandoned" and any(kept.iterdir())
        assert aside["remove_after"] == aside["set_aside_at"] + 7 * 86400.0

        # an operator fetches it for forensics: the PBX gets exactly what the VPS kept
        fetched = await run_cli("fetch-abandoned", area, "-c", str(stack.config_path))
        assert fetched.code == 0, fetched.stderr
        [aside] = await _set_aside(stack, area)
        to = Path(str(aside["fetch"]["to"]))
        assert (aside["fetch"]["state"], to.parent) == ("done", stack.work_dir / "abandoned")
        assert _tree(to) == _tree(kept) and _tree(to)
        assert stack.events("set_aside_fetched")[0]["files"] == len(_tree(kept))
        assert not _runs_on(stack, area, "remote"), "a fetch starts nothing"

    async def test_a_set_aside_copy_is_removed_once_kept_long_enough(
        self, stack_factory: StackFactory
    ) -> None:
        stack = await stack_factory(services={"tg": 1},
                                    monitord_overrides={"abandoned_data_keep_s": 3.0})
        area = stack.areas["tg"][0]
        await _vps_gone_with_tg(stack, area)
        await _given_up(stack, area)
        await stack.heal()
        await stack.wait_until(lambda: _set_aside(stack, area), timeout_s=30,
                               what="the VPS's copy set aside")
        [aside] = await _set_aside(stack, area)
        kept = Path(str(aside["set_aside_path"]))
        assert kept.is_dir()

        async def removed() -> bool:
            return not (await stack.status())["abandoned_data"]
        await stack.wait_until(removed, timeout_s=30, what="the set-aside copy removed")
        assert not kept.exists(), "gone from the VPS too"
        # The record goes first, then the event is logged, and the log reaches us through a
        # pipe: the status can say "removed" a moment before the line arrives.
        await stack.wait_until(lambda: stack.events("set_aside_removed"), timeout_s=10,
                               what="the set_aside_removed event")
        [event] = stack.events("set_aside_removed")
        assert (event["area"], event["path"], event["result"]) == (area, str(kept), "deleted")
        assert event["kept_s"] >= 3
        code, body = await stack.request("POST", f"/v1/abandoned/{area}/fetch", {})
        assert (code, body["error"]["code"]) == (404, "NOT_FOUND"), "nothing left to fetch"
        assert _runs_on(stack, area, "local")

    async def test_a_rollback_parked_waiting_for_the_vpss_data_is_given_up_too(
        self, stack_factory: StackFactory
    ) -> None:
        stack = await stack_factory(services={"tg": 1}, rollback_data_wait_s=3.0)
        area = stack.areas["tg"][0]
        await parked_waiting_for_data(stack, area)
        stack.accepted_data_loss.add(area)
        for _ in range(60):  # asked again as the operator would, until it is allowed
            code, body = await stack.request("POST", "/v1/services/tg/give-up", {})
            if code != 409 or body["error"]["code"] != "VPS_NOT_FENCED":
                break
            await asyncio.sleep(0.5)
        assert code == 202, body
        await stack.wait_until(lambda: _runs_on(stack, area, "local"), timeout_s=30,
                               what="the source runs again on the PBX's copy")
        [abandoned] = stack.events("remote_data_abandoned")
        assert abandoned["area"] == area
        await stack.heal()
        await stack.wait_settled(expect={"tg": "local"}, timeout_s=90)

    async def test_bad_requests_and_nothing_to_give_up_change_nothing(
        self, stack_factory: StackFactory
    ) -> None:
        stack = await stack_factory(services={"tg": 1})
        await stack.wait_settled(expect={"tg": "local"})
        assert (await stack.request("POST", "/v1/services/tg/give-up", {"x": 1}))[0] == 400
        code, body = await stack.request("POST", "/v1/services/nope/give-up", {})
        assert (code, body["error"]["code"]) == (404, "UNKNOWN_SERVICE")
        code, body = await stack.request("POST", "/v1/services/tg/give-up",
                                         {"area": "5b1d0000-0000-4000-8000-00000000dead"})
        assert (code, body["error"]["code"]) == (404, "UNKNOWN_AREA")
        code, body = await stack.request("POST", "/v1/services/tg/give-up", {})
        assert (code, body["error"]["code"]) == (409, "TRANSACTION_CONFLICT")
        assert "nothing" in body["error"]["detail"]
        assert stack.events("remote_data_abandoned") == []


class TestTimedGiveUp:
    """`vps_lost_after_s` + `on_vps_lost = "home"`: a service that opted in is given up by
    monitord itself once the VPS has been unreachable that long — and no earlier than every
    copy there is provably fenced; a service that did not opt in waits."""

    async def test_an_opted_in_service_comes_home_by_itself_the_other_waits(
        self, stack_factory: StackFactory
    ) -> None:
        stack = await stack_factory(
            services={"tg": 1, "chats": 1}, monitord_overrides={"vps_lost_after_s": 2.0},
        )
        # only tg opts in: the option applies to every service the stack writes, so opt-in
        # is per service in the file the stack wrote
        config = stack.config_path.read_text()
        stack.config_path.write_text(config.replace(
            "[services.tg]\n", '[services.tg]\non_vps_lost = "home"\n'))
        assert await stack.stop_monitord() == 0
        await stack.start_monitord()
        (tg,), (chats,) = stack.areas["tg"], stack.areas["chats"]
        await stack.place("tg", "remote")
        await stack.place("chats", "remote")
        await stack.wait_settled(expect={"tg": "remote", "chats": "remote"}, timeout_s=60)
        stack.accepted_data_loss.add(tg)
        lost_at = time.time()
        await stack.partition()

        await stack.wait_until(lambda: _runs_on(stack, tg, "local"), timeout_s=60,
                               what="tg home by itself on the PBX's copy")
        [abandoned] = stack.events("remote_data_abandoned")
        assert (abandoned["area"], abandoned["reason"]) == (tg, "policy")
        [life] = [x for x in stack.detector.lives(tg)
                  if x.key.side == "local" and x.first_seen >= lost_at]
        # never before the VPS's copy was provably fenced: 3 s lease * 1.1 + margin
        assert life.first_seen - lost_at >= 3.0
        assert not _runs_on(stack, chats, "local"), "chats did not opt in: it waits"
        status = await stack.status()
        assert status["services"]["chats"]["give_up"] is not None
        await stack.heal()
        await stack.wait_settled(expect={"tg": "local", "chats": "remote"}, timeout_s=90)

"""One bad custom_config.json entry stays in its box: it is quarantined (never started,
never sent to the VPS) while every other area keeps running and renewing its lease."""

from __future__ import annotations

import asyncio
import json

from tests.integration.migration.conftest import StackFactory, settle_remote

HOSTILE_IDS = ["{5b1d0c2e-aaaa-bbbb-cccc-000000000001}", " 5b1d0c2e", "../chats/x", "victim#",
               "a" * 300, "nul\u0000id"]


class TestOneBadEntry:
    """A bad entry is shown with its position and code; the other areas never notice."""

    async def test_bad_ids_next_to_remote_areas_never_cost_them_their_leases(
        self, stack_factory: StackFactory
    ) -> None:
        stack = await stack_factory(services={"tg": 2}, area_lease_ttl_s=3.0)
        await settle_remote(stack)
        lives_before = {a: stack.detector.alive(a) for a in stack.areas["tg"]}
        path = stack.root / "spool" / "custom_config.json"
        document = json.loads(path.read_text())
        hostile = [{"uuid": u, "service": "tg", "location": "remote", "generation": 1}
                   for u in HOSTILE_IDS]
        document["custom_daemons"].extend(hostile)
        path.write_text(json.dumps(document))

        async def quarantined() -> bool:
            return len((await stack.status())["quarantined"]) == len(HOSTILE_IDS)

        await stack.wait_until(quarantined, timeout_s=20, what="the bad entries quarantined")
        status = await stack.status()
        positions = [q["position"] for q in status["quarantined"]]
        assert positions == list(range(2, 2 + len(HOSTILE_IDS)))
        assert {q["code"] for q in status["quarantined"]} == {"AREA_ID_INVALID"}
        await asyncio.sleep(3.0 * 3)  # three lease TTLs: every renewal batch went through
        for area in stack.areas["tg"]:
            assert stack.detector.alive(area) == lives_before[area], "a good area was hit"
        assert set(stack.agent_cache()) == set(stack.areas["tg"]), "nothing bad reached the VPS"
        status = await stack.status()
        assert status["tunnel"]["reconnects"] <= 1, "the tunnel was never recycled"
        assert json.loads(path.read_text())["custom_daemons"][2:] == hostile, "left untouched"


class TestHostileNumbersAndNesting:
    """A custom_config.json nested past any bound, written while monitord runs, is
    CONFIG_CORRUPT in the status; the reconciler's loop records no failure (it raised
    RecursionError before), what runs keeps running, and the file fixed is read again. A
    number Python cannot hold (5000 digits) is valid JSON: it quarantines only the entry
    whose generation it is (it refused the whole file before) and stays in the file."""

    async def test_the_running_daemon_shows_config_corrupt_and_recovers(
        self, stack_factory: StackFactory
    ) -> None:
        stack = await stack_factory(services={"tg": 1})
        area = stack.areas["tg"][0]
        assert await stack.detector.wait_for(lambda d: d.alive(area), timeout_s=30)
        path = stack.root / "spool" / "custom_config.json"
        good = path.read_text()
        document = json.loads(good)
        hostile = "[" * 100_000 + "]" * 100_000
        text = json.dumps(document).replace('"phone"', f'"x": {hostile}, "phone"', 1)
        path.write_text(text)

        async def corrupt() -> bool:
            error = (await stack.status()).get("config_error") or {}
            return error.get("code") == "CONFIG_CORRUPT"

        await stack.wait_until(corrupt, timeout_s=20, what="CONFIG_CORRUPT shown")
        path.write_text(good)

        async def clean() -> bool:
            return (await stack.status()).get("config_error") is None

        await stack.wait_until(clean, timeout_s=20, what="the fixed file read again")
        status = await stack.status()
        failed = {name: loop for name, loop in (status.get("loops") or {}).items()
                  if loop.get("errors")}
        assert failed == {}, failed
        assert stack.detector.alive(area), "what ran kept running"

    async def test_a_5000_digit_generation_quarantines_only_its_entry(
        self, stack_factory: StackFactory
    ) -> None:
        stack = await stack_factory(services={"tg": 1})
        area = stack.areas["tg"][0]
        assert await stack.detector.wait_for(lambda d: bool(d.alive(area)), timeout_s=30)
        path = stack.root / "spool" / "custom_config.json"
        document = json.loads(path.read_text())
        digits = "9" * 5000
        text = json.dumps(document).replace('"phone"', f'"x": {digits}, "phone"', 1)
        assert text.endswith("]}")
        text = text[:-2] + (', {"uuid": "huge", "service": "tg", "location": "remote",'
                            f' "generation": {digits}}}]}}')
        path.write_text(text)

        async def quarantined() -> bool:
            return len((await stack.status())["quarantined"]) == 1

        await stack.wait_until(quarantined, timeout_s=20, what="the entry quarantined")
        status = await stack.status()
        (entry,) = status["quarantined"]
        assert (entry["position"], entry["code"]) == (1, "AREA_ENTRY_INVALID")
        assert status.get("config_error") is None, "the file as a whole was read"
        failed = {name: loop for name, loop in (status.get("loops") or {}).items()
                  if loop.get("errors")}
        assert failed == {}, failed
        assert stack.detector.alive(area), "what ran kept running"
        assert path.read_text() == text, "left untouched"

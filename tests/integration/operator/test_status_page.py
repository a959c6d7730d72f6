"""The status page at `/`, rendered by a real headless chromium against a whole installation."""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path

from monitord.testing.stack import Stack
from orchestrator import errors
from tests.integration.operator.conftest import Browser, StackFactory
from tests.integration.operator.rendered_page import Element, parse

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


async def render(browser: Browser, stack: Stack) -> Element:
    page = parse(await browser.dump_dom(f"http://127.0.0.1:{stack.http_port}/"))
    body = page.one("body")
    assert body.attrs.get("data-loaded") == "1", "the page never rendered a status document"
    return page


def buttons(row: Element) -> dict[str, Element]:
    return {
        b.attrs.get("data-location") or b.attrs["data-action"]: b for b in row.find_all("button")
    }


def cells(row: Element) -> dict[str, str]:
    return {
        name: row.one("td", cls=name).text
        for name in ("name", "desired", "state", "phase", "local", "remote", "migrating", "orphan")
    }


async def park_tg(stack: Stack) -> None:
    """A placement while the VPS refuses connections: preflight fails and tg parks."""
    await stack.partition()
    await stack.place("tg", "remote")

    async def parked() -> bool:
        return (await stack.status())["services"]["tg"]["state"] == "parked"

    await stack.wait_until(parked, timeout_s=30, what="tg parked")


class TestServicesAndCounts:
    """The page shows every service with its state, its area counts and the overall counts."""

    async def test_each_service_row_shows_state_desired_and_counts_per_side(
        self, stack_factory: StackFactory, browser: Browser
    ) -> None:
        stack = await stack_factory(services={"tg": 2, "chats": 1})
        await stack.place("chats", "remote")
        await stack.wait_settled(expect={"tg": "local", "chats": "remote"}, timeout_s=60)
        page = await render(browser, stack)

        tg = page.one("tr", data_service="tg")
        chats = page.one("tr", data_service="chats")
        assert cells(tg) == {"name": "tg", "desired": "local", "state": "idle", "phase": "",
                             "local": "2", "remote": "0", "migrating": "0", "orphan": "0"}
        assert cells(chats) == {"name": "chats", "desired": "remote", "state": "idle",
                                "phase": "", "local": "0", "remote": "1", "migrating": "0",
                                "orphan": "0"}
        counts = {k: page.by_id(f"count-{k}").text for k in ("local", "remote", "migrating",
                                                              "orphan")}
        assert counts == {"local": "2", "remote": "1", "migrating": "0", "orphan": "0"}
        assert page.by_id("tunnel").attrs["data-state"] == "connected"
        assert page.by_id("errors").find_all(cls="error") == []

    async def test_only_the_move_to_the_other_side_is_offered_when_nothing_is_in_flight(
        self, stack_factory: StackFactory, browser: Browser
    ) -> None:
        stack = await stack_factory(services={"tg": 1})
        await stack.wait_settled(expect={"tg": "local"}, timeout_s=60)
        page = await render(browser, stack)
        offered = buttons(page.one("tr", data_service="tg"))
        assert set(offered) == {"local", "remote"}
        assert offered["local"].disabled and not offered["remote"].disabled
        assert offered["remote"].attrs["type"] == "button"
        assert offered["remote"].attrs["aria-label"] == "move tg to remote"


class TestPageStructure:
    """The page is self-contained and safe, and its dialog, live region and error region are
    in place, closed and empty, before anyone clicks."""

    async def test_the_dialog_live_region_and_error_region_wait_closed_and_empty(
        self, stack_factory: StackFactory, browser: Browser
    ) -> None:
        stack = await stack_factory(services={"tg": 1})
        # Nothing may change while the page renders: a tunnel coming up meanwhile is a real
        # change and would (rightly) be announced.
        await stack.wait_settled(expect={"tg": "local"})
        page = await render(browser, stack)
        dialog = page.by_id("confirm-move")
        assert dialog.tag == "dialog" and "open" not in dialog.attrs
        choices = {b.text: b for b in dialog.find_all("button")}
        assert set(choices) == {"Confirm", "Cancel"}
        assert "autofocus" in choices["Cancel"].attrs, "the safe choice has the focus"
        changes = page.by_id("changes")
        assert changes.attrs["aria-live"] == "polite" and changes.text == ""
        refused = page.by_id("request-error")
        assert "hidden" in refused.attrs and refused.attrs["role"] == "alert"
        assert "hidden" in page.by_id("config-error").attrs
        assert int(page.one("body").attrs["data-refreshes"]) >= 1

    def test_the_source_loads_nothing_external_and_never_writes_data_as_markup(self) -> None:
        source = resources.files("monitord.surface").joinpath("static/index.html").read_text()
        for markup_sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write"):
            assert markup_sink not in source
        assert not re.search(r"\b(alert|confirm|prompt)\s*\(", source), "no browser pop-ups"
        assert not re.search(r"\b(src|href)\s*=|@import|url\(", source), "no external assets"


class TestErrorBlock:
    """A failed placement shows service, area, phase, time, stable code and the recommended
    action, and locks that service's buttons while its transaction is active."""

    async def test_a_parked_service_shows_its_error_and_only_its_buttons_are_locked(
        self, stack_factory: StackFactory, browser: Browser
    ) -> None:
        stack = await stack_factory(services={"tg": 2, "chats": 1}, park_after_failures=1)
        await stack.wait_settled(expect={"tg": "local", "chats": "local"}, timeout_s=60)
        await park_tg(stack)
        page = await render(browser, stack)

        block = page.by_id("errors").one("div", cls="error", data_service="tg")
        code = block.one(cls="err-code").text
        entry = errors.lookup(code)  # a stable code from the catalogue, not free text
        assert block.one(cls="err-service").text == "tg"
        assert block.one(cls="err-area").text in stack.areas["tg"]
        assert block.one(cls="err-phase").text == "PREFLIGHT"
        assert block.one(cls="err-at").text.endswith("UTC")
        assert entry.action and block.one(cls="err-action-text").text == entry.action
        assert page.by_id("errors").find_all(cls="error", data_service="chats") == []

        tg = page.one("tr", data_service="tg")
        assert cells(tg)["state"] == "parked" and cells(tg)["phase"] == "PARKED"
        assert tg.attrs.get("class") == "parked", "a parked row stands out"
        assert "class" not in page.one("tr", data_service="chats").attrs
        tg_buttons = buttons(tg)
        assert tg_buttons["local"].disabled and tg_buttons["remote"].disabled
        assert not tg_buttons["retry"].disabled
        chats_buttons = buttons(page.one("tr", data_service="chats"))
        assert not chats_buttons["remote"].disabled, "another service's change must stay open"
        assert "retry" not in chats_buttons


class TestWhatTheStatusKnows:
    """The page shows what the status document knows: every area with its title, side,
    health and last downtime; quarantined entries; the version, the forwards and when it was
    updated; and the last day's moves with their downtime."""

    async def test_areas_titles_quarantine_version_forwards_and_moves(
        self, stack_factory: StackFactory, browser: Browser
    ) -> None:
        stack = await stack_factory(services={"tg": 1, "chats": 1})
        await stack.place("chats", "remote")
        await stack.wait_settled(expect={"tg": "local", "chats": "remote"}, timeout_s=60)
        (tg,), (chats,) = stack.areas["tg"], stack.areas["chats"]
        path = stack.root / "spool" / "custom_config.json"
        document = json.loads(path.read_text())
        for entry in document["custom_daemons"]:
            if entry["uuid"] == tg:
                entry["title"] = "Sales <b>line</b>"  # text, never markup
        document["custom_daemons"].append({"uuid": "../escape", "service": "tg"})
        path.write_text(json.dumps(document))

        async def known() -> bool:
            status = await stack.status()
            return bool(status["quarantined"]) and any(
                a["title"] for a in status["services"]["tg"]["areas"])
        await stack.wait_until(known, timeout_s=30, what="the title and the quarantine read")
        page = await render(browser, stack)

        row = page.one("tr", data_area=tg)
        texts = [td.text for td in row.find_all("td")]
        assert texts[:4] == ["tg", f"Sales <b>line</b> ({tg[:8]})", "local", "up"]
        assert texts[4].isdigit() and re.fullmatch(r"\d+m\d\ds", texts[5]), texts
        moved = page.one("tr", data_area=chats)
        assert [td.text for td in moved.find_all("td")][2:4] == ["remote", "up"]
        assert re.fullmatch(r"\d+\.\d\d s", moved.find_all("td")[8].text)
        assert page.by_id("quarantined").attrs.get("hidden") is None
        [entry] = page.by_id("quarantined").find_all("p", cls="quarantined-entry")
        assert "AREA_ID_INVALID" in entry.text
        assert page.by_id("version").text.startswith("v")
        assert page.by_id("updated").text.endswith("UTC")
        assert "nats: " in page.by_id("forwards").text
        # the VPS's memory from the agent's inventory (the in-process VPS: this machine's)
        total_mib = round(int(Path("/proc/meminfo").read_text().split()[1]) * 1024 / 1048576)
        assert page.by_id("vps-memory-row").attrs.get("hidden") is None
        assert re.fullmatch(rf"\d+ MiB available of {total_mib} MiB",
                            page.by_id("vps-memory").text), page.by_id("vps-memory").text
        # newest first; on a loaded machine the move may have rolled back once and been
        # tried again by itself: the newest is the one that got there
        move, *_ = page.by_id("moves").find_all("tr", cls=None)[1:] or [None]
        assert move is not None
        cols = [td.text for td in move.find_all("td")]
        assert cols[1:5] == ["chats", "local to remote", "1", "done 1"], cols
        assert cols[0].endswith("UTC") and cols[5].endswith(" s")


class TestScreenshot:
    """The page renders to an image in a real browser."""

    async def test_the_page_renders_to_a_png(
        self, stack_factory: StackFactory, browser: Browser, tmp_path: Path
    ) -> None:
        stack = await stack_factory(services={"tg": 1})
        shot = tmp_path / "status-page.png"
        await browser.screenshot(f"http://127.0.0.1:{stack.http_port}/", shot)
        assert shot.read_bytes()[:8] == PNG_MAGIC

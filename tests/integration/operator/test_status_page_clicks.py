"""The status page at `/`, clicked in a real headless chromium against a whole installation.

Selenium drives Debian's chromium through /usr/bin/chromedriver (clicking_browser.py); the
stack is a real `monitord run` with the in-process SSH VPS. Without chromedriver (apt-get
install chromium chromium-driver) these tests skip, which fails them under CI=true.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from monitord.testing.stack import Stack
from orchestrator import errors
from tests.support.stacks import StackFactory

pytest.importorskip("selenium", reason="selenium is in the test extra: pip install -e .[test]")

from tests.integration.operator.clicking_browser import (
    CHROMEDRIVER,
    CHROMIUM,
    ClickingBrowser,
)

MOVE_TIMEOUT_S = 90.0


@pytest.fixture
async def browser(tmp_path: Path) -> AsyncIterator[ClickingBrowser]:
    missing = [str(p) for p in (CHROMEDRIVER, CHROMIUM) if not p.exists()]
    if missing:
        pytest.skip(f"{', '.join(missing)} missing (apt-get install chromium chromium-driver);"
                    " CI installs them")
    clicking = await ClickingBrowser.start(tmp_path / "chromium-profile")
    try:
        yield clicking
    finally:
        await clicking.quit()


def button(service: str, location: str) -> str:
    return f'tr[data-service="{service}"] button[data-location="{location}"]'


def cell(service: str, name: str) -> str:
    return f'tr[data-service="{service}"] td.{name}'


TOKEN_KEY = "monitord-api-token"


async def open_page(browser: ClickingBrowser, stack: Stack, *, authorised: bool = True) -> None:
    """Open the page; `authorised`: as an operator who already gave this tab the API token
    (TestLocalAuthority gives it through the page's own dialog)."""
    await browser.open(f"http://127.0.0.1:{stack.http_port}/")
    await browser.wait_js("return document.body.dataset.loaded === '1'",
                          what="the first status document rendered")
    if authorised:
        token = stack.api_token()
        assert token is not None
        await browser.js("sessionStorage.setItem(arguments[0], arguments[1])", TOKEN_KEY, token)
    await browser.sent()  # what loading the page sent is not what a test asks about


async def wait_row(browser: ClickingBrowser, service: str, *, timeout_s: float = 30.0,
                   **cells: str) -> None:
    """Poll the DOM until the service's row shows these cell texts."""
    await browser.wait_js(
        "const row = document.querySelector(`tr[data-service=\"${arguments[0]}\"]`);"
        "return row !== null && Object.entries(arguments[1]).every("
        "  ([name, want]) => row.querySelector(`td.${name}`).textContent === want);",
        service, cells, what=f"{service} showing {cells}", timeout_s=timeout_s,
    )


async def open_dialog(browser: ClickingBrowser, service: str, location: str) -> dict[str, str]:
    """Click a move button, wait for the confirmation dialog; what it says."""
    await browser.click(button(service, location))
    await browser.wait_js("return document.getElementById('confirm-move').open",
                          what="the confirmation dialog")
    shown = {
        key: await browser.text(f"#confirm-move .confirm-{key}")
        for key in ("service", "location", "count", "total")
    }
    assert await browser.alert_open() is False, "a confirmation must be in the page"
    return shown


async def wait_outcome(browser: ClickingBrowser, outcome: str) -> None:
    await browser.wait_js(
        "const d = document.getElementById('confirm-move');"
        "return !d.open && d.dataset.outcome === arguments[0];",
        outcome, what=f"the dialog closed as {outcome}",
    )


async def changes(browser: ClickingBrowser) -> list[str]:
    return list(await browser.js(
        "return [...document.querySelectorAll('#changes p')].map((p) => p.textContent)"
    ))


class TestConfirmedMove:
    """Moving a whole service asks first in an in-page dialog; only Confirm sends the request,
    and the page follows the move in place and announces it."""

    async def test_cancel_sends_nothing_and_confirm_moves_the_service_to_idle_on_remote(
        self, stack_factory: StackFactory, browser: ClickingBrowser
    ) -> None:
        stack = await stack_factory(services={"tg": 2, "chats": 1})
        await stack.wait_settled(expect={"tg": "local", "chats": "local"})
        await open_page(browser, stack)
        live = await browser.find("#changes")
        assert await browser.js("return arguments[0].getAttribute('aria-live')", live) == "polite"
        assert await changes(browser) == []

        shown = await open_dialog(browser, "tg", "remote")
        assert shown == {"service": "tg", "location": "remote", "count": "2", "total": "2"}
        await browser.click("#confirm-move .confirm-cancel")
        await wait_outcome(browser, "cancelled")
        assert await browser.sent_changes() == [], "Cancel must send nothing"
        status = await stack.status()
        assert status["services"]["tg"]["desired"] == "local" and status["transactions"] == []

        await open_dialog(browser, "tg", "remote")
        await browser.click("#confirm-move .confirm-ok")
        await wait_outcome(browser, "confirmed")
        await wait_row(browser, "tg", desired="remote", state="idle", local="0", remote="2",
                       migrating="0", timeout_s=MOVE_TIMEOUT_S)
        [put] = await browser.changes_sent(1)
        assert (put.method, put.url.rsplit("/v1/", 1)[1]) == ("PUT", "services/tg/placement")
        assert json.loads(put.body) == {"location": "remote"}
        await stack.wait_settled(expect={"tg": "remote", "chats": "local"})

        announced = await changes(browser)
        assert "move tg to remote: accepted" in announced
        assert any(re.fullmatch(r"tg: [a-z_]+ → idle on remote", line) for line in announced), \
            announced

        # Escape, also right after a confirmed move, is a cancel.
        shown = await open_dialog(browser, "tg", "local")
        assert shown == {"service": "tg", "location": "local", "count": "2", "total": "2"}
        await browser.press_escape()
        await wait_outcome(browser, "cancelled")
        assert await browser.sent_changes() == []
        assert (await stack.status())["services"]["tg"]["desired"] == "remote"


class TestRefreshInPlace:
    """A refresh updates the rows in place: keyboard focus and a text selection survive it,
    also while another service's row changes."""

    async def test_focus_and_selection_survive_refreshes_while_another_service_moves(
        self, stack_factory: StackFactory, browser: ClickingBrowser
    ) -> None:
        stack = await stack_factory(services={"tg": 1, "chats": 1})
        await stack.wait_settled(expect={"tg": "local", "chats": "local"})
        await open_page(browser, stack)
        name_cell = await browser.find(cell("chats", "name"))
        await browser.js(
            "const range = document.createRange(); range.selectNodeContents(arguments[0]);"
            "getSelection().removeAllRanges(); getSelection().addRange(range);", name_cell,
        )
        focused = await browser.find(button("chats", "remote"))
        await browser.js("arguments[0].focus()", focused)
        assert await browser.active_element() == focused

        await stack.place("tg", "remote")
        await wait_row(browser, "tg", desired="remote")  # a refresh that changed the table
        await browser.wait_refreshes(2)
        assert await browser.active_element() == focused, "a refresh took the keyboard focus"
        assert await browser.js("return getSelection().toString()") == "chats"

        await wait_row(browser, "tg", state="idle", remote="1", timeout_s=MOVE_TIMEOUT_S)
        await browser.wait_refreshes(2)
        assert await browser.active_element() == focused
        assert await browser.js("return getSelection().toString()") == "chats"
        await stack.wait_settled(expect={"tg": "remote", "chats": "local"})


class TestRefusedRequest:
    """A refused request shows its stable code and detail in the page's error region, never in
    an alert(); the state change behind it is announced."""

    async def test_a_placement_refused_while_the_file_is_corrupt_shows_config_corrupt(
        self, stack_factory: StackFactory, browser: ClickingBrowser
    ) -> None:
        stack = await stack_factory(services={"tg": 1})
        await stack.wait_settled(expect={"tg": "local"})
        await open_page(browser, stack)
        custom_config = stack.root / "spool" / "custom_config.json"
        good = custom_config.read_bytes()
        custom_config.write_bytes(good[: len(good) // 2])

        await open_dialog(browser, "tg", "remote")
        await browser.click("#confirm-move .confirm-ok")
        await browser.wait_js(
            "const r = document.getElementById('request-error');"
            "return !r.hidden && r.dataset.code === 'CONFIG_CORRUPT';",
            what="the refusal in the error region",
        )
        assert not await browser.alert_open()
        code = await browser.text("#request-error .req-code")
        assert errors.lookup(code).code == "CONFIG_CORRUPT"
        assert "custom_config.json" in await browser.text("#request-error .req-detail")
        assert await browser.text("#request-error .req-what") == "move tg to remote"
        [put] = await browser.changes_sent(1)
        assert put.method == "PUT"

        custom_config.write_bytes(good)
        await browser.wait_js("return document.getElementById('config-error').hidden",
                              what="the banner gone once the file is readable")
        announced = await changes(browser)
        assert "custom_config.json: CONFIG_CORRUPT" in announced, announced
        assert announced[-1] == "custom_config.json readable again", announced
        # The refusal stays in view across refreshes until the operator dismisses it.
        assert await browser.js("return document.getElementById('request-error').hidden") is False
        await browser.click("#request-error-dismiss")
        assert await browser.js("return document.getElementById('request-error').hidden") is True
        assert (await stack.status())["services"]["tg"]["desired"] == "local"
        await stack.wait_settled(expect={"tg": "local"})


class TestGiveUpTheVps:
    """A service on a VPS that does not answer offers "give up VPS" — disabled until it is
    allowed, then through a dialog that names what is lost; nowhere else."""

    async def test_offered_only_while_the_vps_is_gone_and_confirmed_in_a_dialog(
        self, stack_factory: StackFactory, browser: ClickingBrowser
    ) -> None:
        stack = await stack_factory(services={"tg": 1, "chats": 1})
        (area,) = stack.areas["tg"]
        await stack.place("tg", "remote")
        await stack.wait_settled(expect={"tg": "remote", "chats": "local"}, timeout_s=60)
        await open_page(browser, stack)
        give_up = 'tr[data-service="tg"] button[data-action="give-up"]'
        await browser.wait_refreshes(2)
        assert await browser.js(f"return document.querySelector('{give_up}')") is None, \
            "a VPS that answers is not given up: the button is not there"

        await stack.partition()
        await browser.wait_js(f"return document.querySelector('{give_up}') !== null",
                              what="the give-up button once the VPS is gone", timeout_s=30)
        assert await browser.js(
            'return document.querySelector(\'tr[data-service="chats"] '
            'button[data-action="give-up"]\')') is None, "chats has nothing on the VPS"
        assert await browser.js(f"return document.querySelector('{give_up}').disabled"), \
            "not allowed before the VPS's copy is provably fenced"
        await browser.wait_js(f"return !document.querySelector('{give_up}').disabled",
                              what="allowed once the lease bound passed", timeout_s=60)

        await browser.click(give_up)
        await browser.wait_js("return document.getElementById('confirm-give-up').open",
                              what="the give-up dialog")
        assert await browser.text("#confirm-give-up .give-up-count") == "1 area"
        assert "lost" in await browser.text("#give-up-text")
        await browser.click("#confirm-give-up .give-up-cancel")
        assert await browser.sent_changes() == [], "Cancel must send nothing"

        stack.accepted_data_loss.add(area)
        await browser.click(give_up)
        await browser.wait_js("return document.getElementById('confirm-give-up').open",
                              what="the give-up dialog, again")
        await browser.click("#confirm-give-up .give-up-ok")
        await wait_row(browser, "tg", desired="local", local="1", timeout_s=MOVE_TIMEOUT_S)
        [post] = await browser.changes_sent(1)
        assert (post.method, post.url.rsplit("/v1/", 1)[1]) == ("POST", "services/tg/give-up")
        await stack.heal()
        await stack.wait_settled(expect={"tg": "local", "chats": "local"}, timeout_s=90)


    async def test_with_warm_copies_the_dialog_names_the_loss_in_time(
        self, stack_factory: StackFactory, browser: ClickingBrowser
    ) -> None:
        """The areas table shows each remote area's warm copy age; giving the VPS up says
        how much of the accounts' data is lost, in time, when warm copies bound it."""
        stack = await stack_factory(
            services={"tg": 1}, local_daemon_args=("--store", "sqlite"),
            remote_daemon_args=("--store", "sqlite"),
            service_overrides={"warm_copy": "sqlite", "warm_copy_databases": ["session.sqlite"],
                               "warm_copy_interval_s": 1})
        (area,) = stack.areas["tg"]
        await stack.place("tg", "remote")
        await stack.wait_settled(expect={"tg": "remote"}, timeout_s=60)
        await open_page(browser, stack)
        warm_cell = f'#areas tr[data-area="{area}"] td.warm'
        await browser.wait_js(
            f"return /^0m0[0-9]s$/.test(document.querySelector('{warm_cell}').textContent)",
            what="the area's warm copy age, seconds old", timeout_s=30)
        await stack.partition()
        give_up = 'tr[data-service="tg"] button[data-action="give-up"]'
        await browser.wait_js(f"return document.querySelector('{give_up}') !== null"
                              f" && !document.querySelector('{give_up}').disabled",
                              what="give-up allowed once the VPS is gone", timeout_s=60)
        await browser.click(give_up)
        await browser.wait_js("return document.getElementById('confirm-give-up').open",
                              what="the give-up dialog")
        warm = await browser.text("#confirm-give-up .give-up-warm")
        assert warm.startswith("1 of them start on a warm copy instead: at most 0m"), warm
        assert warm.endswith("of their data is lost."), warm
        await browser.click("#confirm-give-up .give-up-cancel")
        assert await browser.sent_changes() == []
        await stack.heal()
        await stack.wait_settled(expect={"tg": "remote"}, timeout_s=90)


class TestLocalAuthority:
    """A change from a tab that has no API token yet is refused (nothing changes) and asks for
    the token in an in-page dialog; with the token pasted there, the same change goes through,
    and the tab keeps it for the next one."""

    async def test_the_page_asks_for_the_token_and_then_moves_with_it(
        self, stack_factory: StackFactory, browser: ClickingBrowser
    ) -> None:
        stack = await stack_factory(services={"tg": 1})
        await stack.wait_settled(expect={"tg": "local"})
        token = stack.api_token()
        assert token is not None
        await open_page(browser, stack, authorised=False)
        token_dialog_open = "return document.getElementById('token-dialog').open"

        # Cancelled: the refusal is shown in the page and nothing changed.
        await open_dialog(browser, "tg", "remote")
        await browser.click("#confirm-move .confirm-ok")
        await browser.wait_js(token_dialog_open, what="the token dialog")
        assert not await browser.alert_open()
        assert token not in await browser.js("return document.documentElement.outerHTML")
        [refused] = await browser.changes_sent(1)
        assert refused.method == "PUT" and "Authorization" not in refused.headers
        await browser.click("#token-dialog .token-cancel")
        await browser.wait_js(
            "const r = document.getElementById('request-error');"
            "return !r.hidden && r.dataset.code === 'API_UNAUTHORIZED';",
            what="the refusal in the error region",
        )
        assert await browser.sent_changes() == []
        status = await stack.status()
        assert status["services"]["tg"]["desired"] == "local" and status["transactions"] == []

        # A wrong token is refused too, and not kept.
        await open_dialog(browser, "tg", "remote")
        await browser.click("#confirm-move .confirm-ok")
        await browser.wait_js(token_dialog_open, what="the token dialog, again")
        wrong_token = token[:-1] + ("x" if token[-1] != "x" else "y")
        await browser.type("#token-input", wrong_token)
        await browser.click("#token-dialog .token-ok")
        # The error region still shows the first refusal's code: what tells that the change
        # went out again with the wrong token and was refused is the log and the tab's storage.
        await browser.wait_js(
            "return document.getElementById('token-dialog').dataset.outcome === 'given'",
            what="the wrong token given",
        )
        refused, with_wrong_token = await browser.changes_sent(2)
        assert "Authorization" not in refused.headers
        assert with_wrong_token.headers.get("Authorization") == f"Bearer {wrong_token}"
        await browser.wait_js(
            f"return sessionStorage.getItem('{TOKEN_KEY}') === null"
            " && document.getElementById('request-error').dataset.code === 'API_UNAUTHORIZED'",
            what="a wrong token refused and not kept",
        )
        assert (await stack.status())["services"]["tg"]["desired"] == "local"

        # The right one: the move the operator confirmed is sent again, with the token.
        await open_dialog(browser, "tg", "remote")
        await browser.click("#confirm-move .confirm-ok")
        await browser.wait_js(token_dialog_open, what="the token dialog, a third time")
        await browser.type("#token-input", token)
        await browser.click("#token-dialog .token-ok")
        await wait_row(browser, "tg", desired="remote", state="idle", local="0", remote="1",
                       timeout_s=MOVE_TIMEOUT_S)
        first, second = await browser.changes_sent(2)
        assert "Authorization" not in first.headers
        assert (second.method, second.url.rsplit("/v1/", 1)[1]) == ("PUT", "services/tg/placement")
        assert second.headers.get("Authorization") == f"Bearer {token}"
        assert await browser.js(f"return sessionStorage.getItem('{TOKEN_KEY}')") == token
        assert await browser.js("return document.getElementById('forget-token').hidden") is False
        await stack.wait_settled(expect={"tg": "remote"})

        # Kept for the tab: the next change needs no dialog.
        await open_dialog(browser, "tg", "local")
        await browser.click("#confirm-move .confirm-ok")
        await wait_row(browser, "tg", desired="local", state="idle", local="1", remote="0",
                       timeout_s=MOVE_TIMEOUT_S)
        [put] = await browser.changes_sent(1)
        assert put.headers.get("Authorization") == f"Bearer {token}"
        await stack.wait_settled(expect={"tg": "local"})

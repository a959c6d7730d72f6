"""A headless chromium that a test drives by clicks: Selenium with Debian's chromedriver.

Used by test_status_page_clicks.py. Selenium's calls block, and the stack under test runs
parts of itself (the SSH VPS, the split-brain detector) on the test's event loop, so every
call here runs in a worker thread (`asyncio.to_thread`) and the loop keeps serving them.

The driver and the browser are named by path (`CHROMEDRIVER`, `CHROMIUM`), so Selenium
Manager never runs and nothing is downloaded. Network requests are read from chromium's
performance log: what the page really sent, whatever its script does.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from selenium import webdriver
from selenium.common.exceptions import NoAlertPresentException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import WebDriverWait

CHROMEDRIVER = Path("/usr/bin/chromedriver")
CHROMIUM = Path("/usr/bin/chromium")
# Flags that let chromium run headless as root without reaching anything outside the machine.
CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage", "--window-size=1200,900",
)
WAIT_S = 30.0


@dataclass(frozen=True)
class SentRequest:
    method: str
    url: str
    body: str
    headers: dict[str, str] = field(default_factory=dict, compare=False)


class ClickingBrowser:
    """One chromium window; every method is awaited and runs the blocking call in a thread."""

    def __init__(self, driver: webdriver.Chrome) -> None:
        self.driver = driver

    @classmethod
    async def start(cls, profile_dir: Path) -> ClickingBrowser:
        options = webdriver.ChromeOptions()
        options.binary_location = str(CHROMIUM)
        for flag in CHROMIUM_FLAGS:
            options.add_argument(flag)
        options.add_argument(f"--user-data-dir={profile_dir}")
        options.set_capability("goog:loggingPrefs", {"performance": "ALL"})
        service = Service(executable_path=str(CHROMEDRIVER))
        driver = await asyncio.to_thread(webdriver.Chrome, service=service, options=options)
        return cls(driver)

    async def quit(self) -> None:
        await asyncio.to_thread(self.driver.quit)

    async def open(self, url: str) -> None:
        await asyncio.to_thread(self.driver.get, url)

    async def js(self, script: str, *args: Any) -> Any:
        return await asyncio.to_thread(self.driver.execute_script, script, *args)

    async def find(self, css: str) -> WebElement:
        return await asyncio.to_thread(self.driver.find_element, "css selector", css)

    async def click(self, css: str) -> WebElement:
        button = await self.find(css)
        await asyncio.to_thread(button.click)
        return button

    async def type(self, css: str, keys: str) -> None:
        """Type `keys` into the element, as a user typing (or pasting) them."""
        field_ = await self.find(css)
        await asyncio.to_thread(field_.send_keys, keys)

    async def press_escape(self) -> None:
        """The Escape key, sent to whatever has the keyboard focus."""
        await asyncio.to_thread(
            lambda: ActionChains(self.driver).send_keys(Keys.ESCAPE).perform()
        )

    async def text(self, css: str) -> str:
        """The element's text as the DOM holds it (textContent: hidden elements too)."""
        return str(await self.js("return document.querySelector(arguments[0]).textContent", css))

    async def active_element(self) -> WebElement:
        return await asyncio.to_thread(lambda: self.driver.switch_to.active_element)

    async def alert_open(self) -> bool:
        def probe() -> bool:
            try:
                _ = self.driver.switch_to.alert.text
            except NoAlertPresentException:
                return False
            return True

        return await asyncio.to_thread(probe)

    async def wait_for(
        self, condition: Callable[[webdriver.Chrome], Any], *, what: str, timeout_s: float = WAIT_S
    ) -> Any:
        """Poll the page until `condition(driver)` is truthy; its value."""
        wait = WebDriverWait(self.driver, timeout_s, poll_frequency=0.2)
        return await asyncio.to_thread(wait.until, condition, f"timed out waiting for {what}")

    async def wait_js(self, script: str, *args: Any, what: str, timeout_s: float = WAIT_S) -> Any:
        """Poll until the script returns a truthy value; that value."""
        return await self.wait_for(
            lambda d: d.execute_script(script, *args), what=what, timeout_s=timeout_s
        )

    async def refreshes(self) -> int:
        return int(await self.js("return Number(document.body.dataset.refreshes || 0)"))

    async def wait_refreshes(self, count: int) -> None:
        """Wait until the page has rendered `count` more status documents."""
        target = await self.refreshes() + count
        await self.wait_js(
            "return Number(document.body.dataset.refreshes || 0) >= arguments[0]", target,
            what=f"{count} refreshes",
        )

    async def sent(self) -> list[SentRequest]:
        """The requests the page sent since the last call (from the performance log)."""
        entries = await asyncio.to_thread(self.driver.get_log, "performance")
        found = []
        for entry in entries:
            message = json.loads(entry["message"])["message"]
            if message.get("method") != "Network.requestWillBeSent":
                continue
            request = message["params"]["request"]
            found.append(SentRequest(request["method"], request["url"],
                                     request.get("postData", ""),
                                     dict(request.get("headers", {}))))
        return found

    async def sent_changes(self) -> list[SentRequest]:
        """The requests since the last call that could change something (not GET)."""
        return [r for r in await self.sent() if r.method not in ("GET", "HEAD")]

    async def changes_sent(self, count: int, *, timeout_s: float = WAIT_S) -> list[SentRequest]:
        """The changes sent since the last call, once at least `count` are in the log: the
        log can lag what the page already shows (a refusal rendered before its request's
        entry reached the log). More than `count` are all returned: the caller compares."""
        found = await self.sent_changes()
        deadline = time.monotonic() + timeout_s
        while len(found) < count:
            if time.monotonic() >= deadline:
                raise AssertionError(f"{len(found)} changes in the log, {count} expected: {found}")
            await asyncio.sleep(0.1)
            found += await self.sent_changes()
        return found

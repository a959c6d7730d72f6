"""Fixtures of the operator-surface tests: a whole installation, the CLI, a headless browser.

`stack_factory` starts a `monitord.testing.stack.Stack` (a real `monitord run` subprocess, the
in-process SSH VPS, the real agent, fake daemons, the split-brain detector) and closes it at the
end of the test, then asserts the detector saw no overlap. `run_cli` runs `python -m monitord`
as the operator would. `browser` is the Debian chromium in headless mode; tests that need it
skip (and fail under CI=true) when it is not installed.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import stacks
from tests.support.stacks import StackFactory

CLI_TIMEOUT_S = 90.0
BROWSER_TIMEOUT_S = 60.0
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture
async def stack_factory(tmp_path: Path) -> AsyncIterator[StackFactory]:
    async with stacks.stack_factory(tmp_path) as make:
        yield make


@dataclass(frozen=True)
class CliResult:
    code: int
    stdout: str
    stderr: str


async def run_cli(*args: str, env: dict[str, str] | None = None) -> CliResult:
    """`monitord ARGS...` in a subprocess, as an operator's shell runs it."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "monitord", *args,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "COLUMNS": "120", **(env or {})},
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), CLI_TIMEOUT_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode is not None
    return CliResult(proc.returncode, out.decode(), err.decode())


class Browser:
    """Headless chromium: the rendered DOM of a page, or a screenshot of it."""

    def __init__(self, executable: str, profile_dir: Path) -> None:
        self.executable = executable
        self.profile_dir = profile_dir

    def _argv(self, *extra: str) -> list[str]:
        return [
            self.executable, "--headless", "--no-sandbox", "--disable-gpu",
            "--disable-dev-shm-usage", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync",
            f"--user-data-dir={self.profile_dir}", "--virtual-time-budget=3000", *extra,
        ]

    async def _run(self, *argv: str) -> str:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), BROWSER_TIMEOUT_S)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise
        if proc.returncode != 0:
            raise AssertionError(f"chromium exited {proc.returncode}: {err.decode()[-2000:]}")
        return out.decode()

    async def dump_dom(self, url: str) -> str:
        return await self._run(*self._argv("--dump-dom", url))

    async def screenshot(self, url: str, path: Path) -> None:
        await self._run(*self._argv(f"--screenshot={path}", "--window-size=1200,800", url))


@pytest.fixture
def browser(tmp_path: Path) -> Browser:
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (apt-get install chromium); CI installs it")
    return Browser(CHROMIUM, tmp_path / "chromium-profile")

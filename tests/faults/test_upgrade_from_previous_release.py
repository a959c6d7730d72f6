"""An upgrade from the previous release restarts no area: the previous release
(tests/faults/previous_release.txt), built into a venv of its own, runs one service on the
namespace VPS and another locally through a `#!/usr/bin/env python3` script; it is stopped
(SIGTERM) and this code is started on the same files. Every area runs on with the same
process (one life each in the split-brain detector), the VPS's artifact and agent are
replaced in place, and moves work both ways afterwards."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

import monitord
from monitord.remote import artifact
from monitord.testing.stack import Stack, StackOptions
from tests.faults.nats_server import NatsServer
from tests.faults.netns_vps import NetnsVps, external_vps
from tests.support import releases, script_daemons

# Both cases share the previous release's venv (module-scoped, built from its commit): one
# worker builds it once (make test: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("previous-release")


@pytest.fixture(scope="module")
def previous_python(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The previous release's python: its commit installed into a venv of its own."""
    release = releases.previous()
    yield releases.build_venv(release, tmp_path_factory.mktemp("previous-release"))


class ReleaseStack(Stack):
    """A Stack whose `monitord run` is `python -m monitord` (the previous release's venv,
    then this one's), run outside the repository so that `-m` finds that python's own
    monitord; its service "wa" runs locally through a `#!/usr/bin/env python3` script."""

    def __init__(self, root: Path, options: StackOptions, *, python: Path) -> None:
        super().__init__(root, options)
        self.python = python

    def _write_files(self) -> None:
        super()._write_files()
        script = script_daemons.write("env_shebang", self.root / "bin")
        lines = self.config_path.read_text().splitlines()
        section = lines.index("[services.wa]")
        at = next(i for i in range(section, len(lines)) if lines[i].startswith("command = "))
        command = json.loads(lines[at].removeprefix("command = "))
        fake_head = [sys.executable, "-m", "monitord.testing.fake_daemon"]
        assert command[:3] == fake_head
        lines[at] = "command = " + json.dumps([*script.head, *command[3:]])
        lines.insert(at + 1, "env = {PATH = " + json.dumps(script.env["PATH"]) + "}")
        self.config_path.write_text("\n".join(lines) + "\n")

    async def start_monitord(
        self, *, wait_ready: bool = True, env: Mapping[str, str] | None = None
    ) -> None:
        self.hold_release.unlink(missing_ok=True)
        self.daemon = await asyncio.create_subprocess_exec(
            str(self.python), "-m", "monitord", "run", "-c", str(self.config_path),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE, cwd=self.root,
            env={**os.environ, "MONITORD_STACK_ROOT": str(self.root),
                 "MONITORD_HOLD_RELEASE": str(self.hold_release),
                 **self.options.extra_env, **(env or {})},
        )
        self._reader = asyncio.create_task(self._read_log(self.daemon), name="monitord stderr")
        if wait_ready:
            await self.wait_until(self._ready, timeout_s=60, what="monitord ready")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _lives(stack: Stack) -> dict[str, list[tuple[str, int]]]:
    return {area: [(life.key.side, life.key.pid) for life in stack.detector.lives(area)]
            for areas in stack.areas.values() for area in areas}


def _last(stack: Stack, name: str) -> dict[str, Any]:
    events = stack.events(name)
    assert events, f"no {name} event"
    return events[-1]


class TestUpgradeFromThePreviousRelease:
    """Stopping the previous release and starting this code on the same files restarts no
    area on either side; the VPS is upgraded in place; moves work both ways after."""

    async def test_an_upgrade_restarts_no_area_and_moves_work_both_ways_after(
        self, tmp_path: Path, netns_vps: NetnsVps, nats: NatsServer, previous_python: Path
    ) -> None:
        # The production lease (30 s): a remote area outlives its owner's restart only while
        # its lease runs, and the fault tier's usual 3 s is shorter than a restart.
        options = StackOptions(services={"tg": 1, "wa": 1}, external_vps=external_vps(netns_vps),
                               nats_target=nats.address, area_lease_ttl_s=30.0)
        stack = ReleaseStack(tmp_path / "stack", options, python=previous_python)
        async with contextlib.AsyncExitStack() as exits:
            await exits.enter_async_context(stack)
            [tg], [wa] = stack.areas["tg"], stack.areas["wa"]
            status = await stack.status()
            assert status["version"] == releases.previous().version
            await stack.place("tg", "remote")
            await stack.wait_settled(expect={"tg": "remote", "wa": "local"}, timeout_s=120)
            before = _lives(stack)
            assert [side for side, _pid in before[tg]][-1:] == ["remote"]
            pyz = stack.vps_dir / artifact.PYZ_NAME
            old_pyz, old_agent = _sha256(pyz), (stack.vps_dir / "agent.pid").read_text()

            assert await stack.stop_monitord() == 0
            stack.python = Path(sys.executable)
            await stack.start_monitord()
            await stack.wait_settled(expect={"tg": "remote", "wa": "local"}, timeout_s=120)
            assert (await stack.status())["version"] == monitord.__version__
            # no area restarted: every process seen before is the one running now
            await stack.detector.wait_for(lambda d: _lives(stack) != before, timeout_s=3)
            assert _lives(stack) == before
            handled = _last(stack, "survivors_handled")
            assert (handled["adopted"], handled["stopped"], handled["replaced"]) == (
                [wa], [], [])
            assert not stack.events("survivor_replaced")
            # the VPS side was replaced in place, its area adopted by the new agent
            await stack.wait_until(lambda: _sha256(pyz) != old_pyz, timeout_s=30,
                                   what="the new artifact on the VPS")
            assert (stack.vps_dir / "agent.pid").read_text() != old_agent

            await stack.place("tg", "local")
            await stack.place("wa", "remote")
            await stack.wait_settled(expect={"tg": "local", "wa": "remote"}, timeout_s=120)
            assert stack.detector.alive(tg)[0].side == "local"
            assert stack.detector.alive(wa)[0].side == "remote"
        assert stack.detector.overlaps() == []
        assert stack.detector.regressions() == []


class TestTheReverseOrder:
    """The previous release started after this code (a rollback of the package) finds this
    code's agent on the VPS: it replaces it with its own in place and its agent adopts the
    guards, so the remote area runs on; the local areas follow that release's own adoption
    rule (0.1.0 compares argv text, so a `#!` script area is started again — once, never
    twice at the same time)."""

    async def test_a_rollback_to_the_previous_release_keeps_the_remote_area(
        self, tmp_path: Path, netns_vps: NetnsVps, nats: NatsServer, previous_python: Path
    ) -> None:
        options = StackOptions(services={"tg": 1, "wa": 1}, external_vps=external_vps(netns_vps),
                               nats_target=nats.address, area_lease_ttl_s=30.0)
        stack = ReleaseStack(tmp_path / "stack", options, python=Path(sys.executable))
        async with contextlib.AsyncExitStack() as exits:
            await exits.enter_async_context(stack)
            [tg], [wa] = stack.areas["tg"], stack.areas["wa"]
            await stack.place("tg", "remote")
            await stack.wait_settled(expect={"tg": "remote", "wa": "local"}, timeout_s=120)
            before = _lives(stack)
            pyz = stack.vps_dir / artifact.PYZ_NAME
            new_pyz, new_agent = _sha256(pyz), (stack.vps_dir / "agent.pid").read_text()

            assert await stack.stop_monitord() == 0
            stack.python = previous_python
            await stack.start_monitord()
            await stack.wait_settled(expect={"tg": "remote", "wa": "local"}, timeout_s=120)
            assert (await stack.status())["version"] == releases.previous().version
            await stack.wait_until(lambda: _sha256(pyz) != new_pyz, timeout_s=30,
                                   what="the previous release's artifact on the VPS")
            assert (stack.vps_dir / "agent.pid").read_text() != new_agent
            await stack.detector.wait_for(lambda d: _lives(stack)[tg] != before[tg],
                                          timeout_s=3)
            assert _lives(stack)[tg] == before[tg]
            assert [key.side for key in stack.detector.alive(wa)] == ["local"]
        assert stack.detector.overlaps() == []
        assert stack.detector.regressions() == []

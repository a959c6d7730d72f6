"""`monitord demo`: the whole product on one machine, no root and no VPS needed.

It starts a complete installation (see `monitord.testing.stack`): an embedded SSH server
playing the VPS, the real agent pushed to it, `monitord run`, a few fake messenger areas
per service and a split-brain detector that hears every daemon on both sides. Then it
plays a short story an operator would recognise:

  1. move Telegram to the VPS;
  2. move WhatsApp to the VPS, and cut the SSH link in the middle of that migration;
  3. let it recover by itself;
  4. move Telegram back to the PBX;

showing a live table after each step, and ends with a verdict: areas per side, overlaps
seen by the detector (must be 0), orphans and cleanup backlog (must be 0). Exit code 0
when the verdict holds, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console

STEP_TIMEOUT_S = 60.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dir", type=Path, default=None,
        help="where to put the demo's files (default: a temporary directory, removed after)",
    )
    parser.add_argument("--areas", type=int, default=3, help="fake areas per service")


def main(args: argparse.Namespace) -> int:
    from monitord.base import logs

    logs.configure("json")
    root = args.dir or Path(tempfile.mkdtemp(prefix="monitord-demo-"))
    try:
        return asyncio.run(Demo(root, areas=args.areas).run())
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


class Demo:
    def __init__(self, root: Path, *, areas: int) -> None:
        self.root = root
        self.areas = areas
        # A fixed width: `make demo` output is read in CI logs and pipes, not only terminals.
        self.console = Console(highlight=False, width=110)
        self.started = time.monotonic()

    def say(self, text: str) -> None:
        self.console.print(f"[{time.monotonic() - self.started:6.1f}s] {text}")

    async def run(self) -> int:
        from monitord.surface import status_view
        from monitord.testing.stack import Stack, StackOptions

        options = StackOptions(services={"tg": self.areas, "chats": self.areas, "max": 2})
        self.say(f"starting: embedded VPS, agent, monitord, {sum(options.services.values())}"
                 f" fake areas, split-brain detector (files in {self.root})")
        async with Stack(self.root, options) as stack:
            await self._settle(stack, {"tg": "local", "chats": "local", "max": "local"})
            status_view.print_status(await stack.status(), console=self.console)

            self.say("step 1: move Telegram (tg) to the VPS")
            await stack.place("tg", "remote")
            await self._settle(stack, {"tg": "remote"})

            self.say("step 2: move WhatsApp (chats) to the VPS, and cut SSH in the middle")
            await stack.place("chats", "remote")
            phase = await self._wait_phase(stack, "chats", ("COPY", "CREATE_DESTINATION",
                                                            "HEALTHCHECK_DESTINATION"))
            self.say(f"  cutting the SSH link while chats is in {phase} (down for 2 s)")
            await stack.cut_ssh(for_s=2.0)
            self.say("step 3: waiting for monitord to recover by itself")
            await self._settle(stack, {"tg": "remote", "chats": "remote"})

            self.say("step 4: move Telegram back to the PBX")
            await stack.place("tg", "local")
            await self._settle(stack, {"tg": "local", "chats": "remote", "max": "local"})
            return await self._verdict(stack)

    async def _settle(self, stack: Any, expect: dict[str, str]) -> None:
        from monitord.surface import status_view

        last = ""
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while not await stack.settled(expect=expect):
            status = await stack.status()
            line = "; ".join(
                f"{name} {svc['state']} ({svc['counts']['local']}L/{svc['counts']['remote']}R)"
                for name, svc in sorted(status["services"].items())
            ) + f"; tunnel {status['tunnel']['state']}"
            if line != last:
                self.say("  " + line)
                last = line
            if time.monotonic() > deadline:
                raise SystemExit(f"demo: not settled within {STEP_TIMEOUT_S:.0f} s: {line}")
            await asyncio.sleep(0.3)
        status_view.print_status(await stack.status(), console=self.console)

    async def _wait_phase(self, stack: Any, service: str, phases: tuple[str, ...]) -> str:
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while time.monotonic() < deadline:
            for txn in (await stack.status())["transactions"]:
                if txn["service"] == service and txn["phase"] in phases:
                    return str(txn["phase"])
            await asyncio.sleep(0.05)
        raise SystemExit(f"demo: {service} never reached {phases}")

    async def _verdict(self, stack: Any) -> int:
        status = await stack.status()
        overlaps = stack.detector.overlaps()
        for overlap in overlaps:
            self.say(f"OVERLAP: {overlap.describe()}")
        regressions = stack.detector.regressions()
        for regression in regressions:
            self.say(f"DATA REGRESSION: {regression.describe()}")
        counts = status["counts"]
        orphans = counts.get("orphan", 0) + status["drift"].get("after", 0)
        backlog = status["cleanup"]["backlog"]
        ok = not overlaps and not regressions and orphans == 0 and backlog == 0
        self.console.print(
            f"VERDICT: {'PASS' if ok else 'FAIL'} — areas local {counts['local']},"
            f" remote {counts['remote']}; overlaps seen {len(overlaps)};"
            f" data regressions {len(regressions)}; orphans {orphans};"
            f" cleanup backlog {backlog}; {time.monotonic() - self.started:.1f} s"
        )
        return 0 if ok else 1


# The verb this module serves (monitord.surface.cli): verb -> (add arguments, run).
VERBS = {"demo": (add_arguments, main)}

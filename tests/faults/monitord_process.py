"""Extra `monitord run` processes on a Stack's config: the duplicate starts of the incident.

`Stack` owns one monitord at a time. The incident replay also needs monitord started twice
at once on the same work_dir, so `spawn(stack)` starts one more `monitord run` with the
stack's environment (so `Stack.close()` still finds and kills it) and collects its stderr
JSON events apart from the stack's own; `adopt(stack, run)` makes the survivor the stack's
monitord for the rest of the test.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from monitord.testing.stack import Stack


@dataclass
class MonitordRun:
    """One spawned `monitord run` and the structured events it wrote."""

    process: asyncio.subprocess.Process
    lines: list[str] = field(default_factory=list)
    reader: asyncio.Task[None] | None = None

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        found = []
        for line in self.lines:
            with contextlib.suppress(json.JSONDecodeError):
                event = json.loads(line)
                if isinstance(event, dict) and name in (None, event.get("event")):
                    found.append(event)
        return found

    async def exit_code(self, *, timeout_s: float) -> int:
        """Wait for the process to exit and its stderr to be read; its exit code."""
        code = await asyncio.wait_for(self.process.wait(), timeout_s)
        if self.reader is not None:
            await asyncio.wait_for(self.reader, timeout_s)
        return code

    def running(self) -> bool:
        return self.process.returncode is None


async def _collect(run: MonitordRun) -> None:
    stream = run.process.stderr
    assert stream is not None
    while line := await stream.readline():
        run.lines.append(line.decode("utf-8", "replace").rstrip("\n"))


async def spawn(stack: Stack, *, env: Mapping[str, str] | None = None) -> MonitordRun:
    """Start `monitord run -c <stack config>` now, without waiting for anything."""
    full_env = {
        **os.environ,
        "MONITORD_STACK_ROOT": str(stack.root),
        "MONITORD_HOLD_RELEASE": str(stack.hold_release),
        **stack.options.extra_env,
        **(env or {}),
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "monitord", "run", "-c", str(stack.config_path),
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE, env=full_env,
    )
    run = MonitordRun(process=process)
    run.reader = asyncio.create_task(_collect(run), name=f"monitord {process.pid} stderr")
    return run


def adopt(stack: Stack, run: MonitordRun) -> None:
    """From now on the stack stops (and reads events of) this process."""
    stack.daemon = run.process
    stack.log_lines = run.lines

"""Fixtures of the end-to-end migration tests: a whole installation on one machine.

`stack_factory` starts a `Stack` (monitord run as a real subprocess, the in-process SSH VPS,
the real agent from the pushed monitord.pyz, fake daemons, the split-brain detector) and
closes it — killing every process it started — at the end of the test. Every test ends by
asserting the detector saw no overlap: that check runs here, after the test body, so no
test can forget it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from monitord.testing.stack import Stack
from tests.support import stacks
from tests.support.stacks import StackFactory

__all__ = ["StackFactory", "settle_remote", "stack_factory"]


@pytest.fixture
async def stack_factory(tmp_path: Path) -> AsyncIterator[StackFactory]:
    async with stacks.stack_factory(tmp_path) as make:
        yield make


async def settle_remote(stack: Stack, service: str = "tg") -> None:
    """Move a service to the VPS and wait until it is settled there."""
    await stack.place(service, "remote")
    await stack.wait_settled(expect={service: "remote"}, timeout_s=60)

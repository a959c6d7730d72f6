"""The child the fake daemon leaves behind with `--escape-child`: it calls setsid(), so it is
in no process group a fence signals, and only a cgroup fence (monitord/base/cgroup_fence.py)
stops it.

`Escapees.found(data_dir)` waits for the pid the child writes and returns its identity (pid
and start time: a later look can never mistake another process for it); `killed_at_the_end()`
kills every child it found when the test ends, whatever the code under test did to it.
`require_cgroup_v2()` skips a test where this machine gives the test process no cgroup v2 it
can fence by (under CI=true that skip is a failure: tests/conftest.py)."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from monitord.base import cgroup_fence, proc_identity
from monitord.base.proc_identity import ProcessIdentity
from monitord.testing.fake_daemon import ESCAPED_PID
from tests.support.agent_process import wait_until


def require_cgroup_v2() -> None:
    fences = cgroup_fence.prepare(cgroup_fence.instance_name(f"probe-{os.getpid()}"))
    if not fences.by_cgroup:
        pytest.skip(f"no cgroup v2 to fence by here: {fences.why}")


class Escapees:
    """The escaped children a test found."""

    def __init__(self) -> None:
        self.children: list[ProcessIdentity] = []

    async def found(self, data_dir: Path, *, not_this: int | None = None,
                    timeout_s: float = 10.0) -> ProcessIdentity:
        """The escaped child of the daemon running in `data_dir` (not the one `not_this`
        names: a restarted daemon's child replaces its predecessor's pid), once it runs in
        a session and process group of its own."""
        path = data_dir / ESCAPED_PID
        found: list[ProcessIdentity] = []

        def written() -> bool:
            with contextlib.suppress(OSError, ValueError):
                pid = int(path.read_text())
                identity = proc_identity.read(pid)
                if identity is not None and pid != not_this and os.getsid(pid) == pid:
                    found.append(identity)
                    return True
            return False

        await wait_until(written, timeout_s=timeout_s, what=f"an escaped child in {data_dir}")
        self.children.append(found[0])
        return found[0]

    def kill_all(self) -> None:
        for child in self.children:
            if proc_identity.is_same_process(child):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, signal.SIGKILL)


@contextlib.contextmanager
def killed_at_the_end() -> Iterator[Escapees]:
    """An `Escapees` whose children are all killed when the block ends."""
    children = Escapees()
    try:
        yield children
    finally:
        children.kill_all()

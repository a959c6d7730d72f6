"""A named parent for tasks: the one place on the PBX side where monitord creates a task.

Every task of `monitord run` has a parent that holds it, cancels it and awaits it:

    RootTasks (monitord/surface/components.py)   the daemon's named root tasks
    "migration engine: runners" / ": watchers"   one runner per area in a transaction, and the
                                                 source-health watchers after a rollback
    "tunnel keeper"                              its attempts, reconnect hooks and the standby
                                                 connection (monitord/remote/tunnel/)
    "local supervisor"                           its loop, for callers without a root task

Each owner is closed by the root task (or the component) that made it, so nothing runs on
the side and nothing outlives its parent. Unlike `asyncio.TaskGroup`, a child that dies of
an exception does not cancel its siblings — one area's runner meeting a bug must not stop
the others' moves — it is logged as `task_crashed` (`INTERNAL`, with its traceback) unless
the owner was made with `report_crashes=False` (RootTasks reports its own). A closed owner
spawns nothing more.

The VPS agent (monitord/vps/) is a separate program on the standard library alone and owns
its one task itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterable
from typing import Any, TypeVar

from monitord.base import logs

log = logs.get_logger(__name__)

T = TypeVar("T")


class OwnerClosed(RuntimeError):
    """A task was spawned into an owner that was closed (its root task is ending)."""


class TaskOwner:
    """Spawns, holds, cancels and awaits its children; see the module docstring."""

    def __init__(self, name: str, *, report_crashes: bool = True) -> None:
        self.name = name
        self._report_crashes = report_crashes
        self._children: set[asyncio.Task[Any]] = set()
        self._closed = False

    def spawn(self, name: str, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """Run `coro` as the child task `name`; OwnerClosed once the owner was closed."""
        if self._closed:
            coro.close()
            raise OwnerClosed(f"{self.name} is closed: cannot start {name!r}")
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._children.add(task)
        task.add_done_callback(self._ended)
        return task

    @property
    def closed(self) -> bool:
        return self._closed

    def running(self) -> list[asyncio.Task[Any]]:
        """The children that have not ended yet."""
        return [task for task in self._children if not task.done()]

    async def wait(self, tasks: Iterable[asyncio.Task[Any]], *, timeout_s: float) -> None:
        """Give `tasks` (children) up to `timeout_s` to end by themselves; cancel and await
        those that did not."""
        waiting = [task for task in tasks if not task.done()]
        if not waiting:
            return
        _, pending = await asyncio.wait(waiting, timeout=timeout_s)
        await self.cancel(pending)

    async def cancel(self, tasks: Iterable[asyncio.Task[Any]]) -> None:
        """Cancel `tasks` (children) and await them; their exceptions were reported."""
        chosen = [task for task in tasks if not task.done()]
        for task in chosen:
            task.cancel()
        await asyncio.gather(*chosen, return_exceptions=True)

    async def close(self) -> None:
        """Spawn nothing more; cancel every child still running and await them all."""
        self._closed = True
        await self.cancel(list(self._children))

    async def __aenter__(self) -> TaskOwner:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _ended(self, task: asyncio.Task[Any]) -> None:
        self._children.discard(task)
        if task.cancelled() or not self._report_crashes:
            return
        error = task.exception()
        if error is not None:
            log.error("task_crashed", owner=self.name, task=task.get_name(),
                      error_code="INTERNAL", detail=f"{type(error).__name__}: {error}",
                      exc_info=error)

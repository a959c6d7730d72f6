"""What the daemon hands its parts, and what it expects back (used by monitord.surface.daemon).

- `Component`: a long-lived part (the orchestration built by monitord.surface.wiring, or a test
  double) with `start(ctx)` and `stop()`.
- `RootTasks`: the named, owned, guarded long-running tasks of the daemon.
- `RuntimeContext`: the config and shared runtime objects a component receives at start.
- `Assembly` / `Assemble`: what one assemble function returns — the components in start order
  and the operator facade the HTTP API serves.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from monitord.base.task_owner import TaskOwner
from monitord.store import spool_files

if TYPE_CHECKING:
    from monitord.base.config import Config
    from monitord.engine.operator_facade import OperatorFacade
    from monitord.store.state_db import Store
    from monitord.surface.admission import Admission
    from monitord.surface.http_api import Liveness, PlacementIntake


@runtime_checkable
class Component(Protocol):
    """A long-lived part of the daemon (tunnel keeper, migration engine, reconciler, ...)."""

    name: str

    async def start(self, ctx: RuntimeContext) -> None:
        """Bring the part up; spawn its loops with `ctx.tasks.spawn()`. Raise to abort start-up."""

    async def stop(self) -> None:
        """Stop at a step boundary; called once, in reverse start order, with a timeout."""


class RootTasks:
    """The named, owned, guarded long-running tasks of the daemon.

    A task ending while the daemon is not stopping (an exception, or a plain return) is a fault:
    it is logged as `root_task_died` and `on_fault` asks the daemon to stop everything. Each
    root task owns the tasks it starts in turn (monitord/base/task_owner.py).
    """

    def __init__(self, *, log: Any, on_fault: Callable[[str], None]) -> None:
        self._log = log
        self._on_fault = on_fault
        self._tasks: dict[str, asyncio.Task[Any]] = {}
        # The parent of every root task (it reports their ends itself: _finished).
        self._owner = TaskOwner("monitord", report_crashes=False)
        self._stopping = False

    def spawn(self, name: str, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        if name in self._tasks and not self._tasks[name].done():
            coro.close()
            raise ValueError(f"root task {name!r} is already running")
        if self._stopping:
            coro.close()
            raise RuntimeError(f"cannot start root task {name!r}: the daemon is stopping")
        task = self._owner.spawn(name, coro)
        self._tasks[name] = task
        task.add_done_callback(self._finished)
        return task

    def expect_exits(self) -> None:
        """The daemon is shutting down: tasks that end from now on are not faults."""
        self._stopping = True

    @property
    def names(self) -> list[str]:
        return [name for name, task in self._tasks.items() if not task.done()]

    def _finished(self, task: asyncio.Task[Any]) -> None:
        if task.cancelled():
            if not self._stopping:
                self._log.error("root_task_died", task=task.get_name(), reason="cancelled")
                self._on_fault(f"root task {task.get_name()} was cancelled")
            return
        error = task.exception()
        if self._stopping and error is None:
            return
        self._log.error(
            "root_task_died",
            task=task.get_name(),
            reason="exception" if error else "returned",
            exc_info=error,
        )
        if not self._stopping:
            self._on_fault(f"root task {task.get_name()} ended unexpectedly")

    async def stop(self, *, grace_s: float) -> None:
        """Cancel what is still running and await it; log tasks that ignore cancellation."""
        self._stopping = True
        running = [task for task in self._tasks.values() if not task.done()]
        for task in running:
            task.cancel()
        if not running:
            return
        _, stuck = await asyncio.wait(running, timeout=grace_s)
        for task in stuck:
            self._log.error("root_task_stuck", task=task.get_name(), error_code="CLEANUP_STUCK")


@dataclass(frozen=True)
class RuntimeContext:
    """What components receive at start: the config and the shared runtime objects."""

    config: Config
    store: Store
    admission: Admission
    liveness: Liveness
    tasks: RootTasks
    request_stop: Callable[[str], None]

    @property
    def work_dir(self) -> Path:
        return self.config.monitord.work_dir

    @property
    def spool_dir(self) -> Path:
        return self.config.monitord.spool_dir

    @property
    def custom_config_path(self) -> Path:
        return spool_files.spool_paths(self.config.monitord.spool_dir)[0]

    @property
    def remote_state_path(self) -> Path:
        return spool_files.spool_paths(self.config.monitord.spool_dir)[1]


@dataclass(frozen=True, slots=True)
class Assembly:
    """The runtime's parts: components in start order, the facade the status routes serve
    (None: health and placement only) and the placement intake (None: the store's)."""

    components: Sequence[Component]
    operator: OperatorFacade | None = None
    intake: PlacementIntake | None = None


Assemble = Callable[[RuntimeContext], Assembly | Awaitable[Assembly]]

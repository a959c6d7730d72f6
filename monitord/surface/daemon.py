"""`monitord run -c FILE`: the daemon's life from the singleton lock to a clean exit.

Shape (after uvicorn): `main()` loads the config (a bad one: one line on stderr, exit 2) and runs
`Daemon.serve()`, which installs signal handlers, then

  startup    lock work_dir (duplicate: one `duplicate_instance` event, exit 3) -> open the store
             -> the API token (work_dir/api-token, monitord.surface.api_token) -> build
             components -> HTTP listening (/readyz 503) -> start components in order
             -> open admission (/readyz 200) -> READY=1
  main_loop  wait for a stop request, pinging the systemd watchdog every tick
  shutdown   STOPPING=1 -> stop intake (/readyz 503, new changes 503) -> wait for admitted
             requests (`http.drain_timeout_s`) -> close listeners -> stop components in reverse
             order (each finishes its current step: its state is durable) -> cancel root tasks
             -> close the store -> release the lock

Signal handlers only set flags: the first SIGTERM/SIGINT asks for a graceful stop, a second
SIGINT forces it (no drain waits). The previous handlers are restored on the way out.

What runs inside comes from one `assemble(ctx) -> Assembly` function (by default
`monitord.surface.wiring.assemble`): the components, started in order and stopped in reverse,
and the operator facade the HTTP API serves (None: only health and the placement intake). Every
long-running task is spawned by name in `RuntimeContext.tasks` (monitord.surface.components);
if one ends unexpectedly it is logged and the daemon stops the rest (exit 1).

Logging (monitord.base.logs): `--log-level {debug,info,warning,error}` (default info); under
systemd each line carries its journal priority (`<3>` error ... `<7>` debug).

Exit codes: 0 clean stop, 1 start-up failure / died / forced stop, 2 bad config, 3 duplicate.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import signal
import sys
import time
from collections.abc import Coroutine
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from monitord.surface.cli import EXIT_DUPLICATE, EXIT_FAILURE, EXIT_OK, EXIT_USAGE
from monitord.surface.components import Assemble, Component, RootTasks, RuntimeContext
from orchestrator.errors import ErrorCode, MonitordError, PermanentError

if TYPE_CHECKING:
    from aiohttp import web

    from monitord.base.config import Config
    from monitord.base.singleton import InstanceLock
    from monitord.store.state_db import Store
    from monitord.surface.sdnotify import Notifier

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)
HTTP_CLOSE_GRACE_S = 2.0  # after the admission drain: in-flight reads get this long
COMPONENT_STOP_TIMEOUT_S = 10.0
ROOT_TASK_GRACE_S = 5.0


class StartupError(PermanentError):
    """Start-up could not complete (code DAEMON_START_FAILED); the daemon exits 1."""

    def __init__(self, detail: str) -> None:
        super().__init__(ErrorCode.DAEMON_START_FAILED, detail)


class Daemon:
    """One run of `monitord run`; `await serve()` returns the process exit code."""

    def __init__(
        self,
        config: Config,
        *,
        assemble: Assemble | None = None,
        notifier: Notifier | None = None,
    ) -> None:
        from monitord.base import logs
        from monitord.surface.admission import Admission
        from monitord.surface.http_api import Liveness
        from monitord.surface.sdnotify import Notifier

        self.config = config
        self.log = logs.get_logger(__name__)
        self.admission = Admission()
        self.liveness = Liveness()
        self.notifier = notifier or Notifier.from_environ()
        self._assemble = assemble
        self.should_exit = False
        self.force_exit = False
        self.stop_reason = ""
        self.failed = False
        self._wake: asyncio.Event | None = None
        self._forced: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._previous_handlers: dict[int, Any] = {}
        self._lock: InstanceLock | None = None
        self._store: Store | None = None
        self._runner: web.AppRunner | None = None
        self._components: list[Component] = []
        self._started: list[Component] = []
        self._tasks: RootTasks | None = None
        self.listening: list[str] = []

    # --- stop requests --------------------------------------------------------------------

    def request_stop(self, reason: str, *, failed: bool = False) -> None:
        """Ask the main loop to shut down (from the loop's thread)."""
        if not self.should_exit:
            self.stop_reason = reason
        self.should_exit = True
        self.failed = self.failed or failed
        if self._wake is not None:
            self._wake.set()

    def _on_fault(self, reason: str) -> None:
        self.liveness.mark_failed(reason)
        self.request_stop(reason, failed=True)

    def _handle_signal(self, signum: int, frame: FrameType | None) -> None:
        # Runs between bytecodes of the main thread: only set flags and wake the loop.
        if self.should_exit and signum == signal.SIGINT:
            self.force_exit = True
            if self._loop is not None and self._forced is not None:
                self._loop.call_soon_threadsafe(self._forced.set)
        if not self.should_exit:
            self.stop_reason = signal.Signals(signum).name
        self.should_exit = True
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    def _install_signal_handlers(self) -> None:
        # signal.signal (not loop.add_signal_handler) so the previous handlers can be restored.
        for signum in HANDLED_SIGNALS:
            self._previous_handlers[signum] = signal.signal(signum, self._handle_signal)

    def _restore_signal_handlers(self) -> None:
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers.clear()

    # --- the three phases -----------------------------------------------------------------

    async def serve(self) -> int:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._forced = asyncio.Event()
        self._install_signal_handlers()
        try:
            try:
                code = await self.startup()
                if code is not None:
                    return code
                await self.main_loop()
            finally:
                await self.shutdown()
            return EXIT_FAILURE if self.failed or self.force_exit else EXIT_OK
        finally:
            self._restore_signal_handlers()

    async def startup(self) -> int | None:
        """Bring everything up; an exit code if the daemon must not run, None when serving."""
        from monitord.base import singleton

        work_dir = self.config.monitord.work_dir
        try:
            self._lock = await asyncio.to_thread(singleton.acquire, work_dir)
        except singleton.AlreadyRunning as e:
            self.log.error(
                "duplicate_instance",
                error_code=e.code,
                holder_pid=e.holder_pid,
                work_dir=str(work_dir),
                lock_file=str(e.lock_path),
            )
            singleton.record_refused_start(work_dir)
            return EXIT_DUPLICATE
        except OSError as e:
            self.log.error(
                "daemon_start_failed",
                error_code=ErrorCode.DAEMON_START_FAILED,
                detail=f"cannot lock {work_dir}: {e}",
            )
            return EXIT_FAILURE
        started_at = time.monotonic()
        self.log.info("daemon_starting", work_dir=str(work_dir), pid=self._lock.pid)
        try:
            await self._start_everything()
        except Exception as e:  # one report for any start-up failure, then an orderly unwind
            self.failed = True
            code = e.code if isinstance(e, MonitordError) else ErrorCode.DAEMON_START_FAILED
            self.log.error(
                "daemon_start_failed",
                error_code=code,
                detail=f"{type(e).__name__}: {e}",
            )
            return EXIT_FAILURE
        if self.should_exit:
            return None
        self.admission.open_intake()
        self.notifier.ready(status="serving")
        self.log.info(
            "daemon_ready",
            listen=self.listening,
            components=[c.name for c in self._started],
            startup_s=round(time.monotonic() - started_at, 3),
        )
        await self._record_event("daemon_ready", {"pid": self._lock.pid})
        return None

    async def _start_everything(self) -> None:
        from aiohttp import web

        from monitord.base.config import is_loopback_listen
        from monitord.base.hostport import split_hostport
        from monitord.store.state_db import Store
        from monitord.surface import api_token, http_api, status_api, wiring

        self._store = await Store.open(self.config.monitord.work_dir)
        ensured = await asyncio.to_thread(
            api_token.ensure, self.config.monitord.work_dir, self.config.http.token_group
        )
        if ensured.written is not None:  # where and why, never the token itself
            self.log.info("api_token_written", path=str(ensured.token.path),
                          group=ensured.token.group, reason=ensured.written)
        self._tasks = RootTasks(log=self.log, on_fault=self._on_fault)
        ctx = RuntimeContext(
            config=self.config,
            store=self._store,
            admission=self.admission,
            liveness=self.liveness,
            tasks=self._tasks,
            request_stop=self.request_stop,
        )
        assembled = (self._assemble or wiring.assemble)(ctx)
        assembly = await assembled if inspect.isawaitable(assembled) else assembled
        self._components.extend(assembly.components)
        operator = assembly.operator
        api_ctx = http_api.ApiContext(
            config=self.config,
            admission=self.admission,
            placement=assembly.intake or http_api.StorePlacementIntake(self._store),
            custom_config_path=ctx.custom_config_path,
            liveness=self.liveness,
            operator=operator,
            api_token=ensured.token,
        )
        routes = status_api.routes() if operator is not None else []
        app = http_api.build_app(api_ctx, extra_routes=routes)
        self._runner = web.AppRunner(
            app, handle_signals=False, shutdown_timeout=HTTP_CLOSE_GRACE_S, access_log=None
        )
        await self._runner.setup()
        host, port = split_hostport(self.config.http.listen)
        site = web.TCPSite(self._runner, host, port, reuse_address=True)
        try:
            await site.start()
        except OSError as e:
            where = self.config.http.listen
            raise StartupError(f"cannot listen on {where}: {e.strerror or e}") from e
        self.listening = [self.config.http.listen]
        if not is_loopback_listen(self.config.http.listen):  # allowed: http.allow_remote_api
            self.log.warning(
                "http_api_not_loopback",
                listen=self.config.http.listen,
                detail="the HTTP API is reachable beyond this machine"
                " (http.allow_remote_api = true): its reads need no token and the token of"
                " a change crosses the network in clear text; restrict it with a firewall",
            )

        for component in self._components:
            if self.should_exit:
                return
            await component.start(ctx)
            self._started.append(component)

    async def main_loop(self) -> None:
        assert self._wake is not None
        tick_s = self.notifier.watchdog_interval_s(self.config.monitord.watchdog_interval_s)
        while not self.should_exit:
            self.notifier.watchdog()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=tick_s)
            except TimeoutError:
                continue
            self._wake.clear()

    async def shutdown(self) -> None:
        """Undo whatever startup got to, in reverse; every wait is bounded."""
        if self._lock is None:
            return
        reason = self.stop_reason or ("start-up failed" if self.failed else "stopped")
        self.notifier.stopping(status=reason)
        self.log.info("daemon_stopping", reason=reason, forced=self.force_exit)
        self.admission.stop_intake()
        if self._tasks is not None:
            self._tasks.expect_exits()
        drain_s = self.config.http.drain_timeout_s
        if not await self._unless_forced(self.admission.wait_drained(grace_s=drain_s)):
            self.log.warning(
                "http_drain_timeout", still_active=self.admission.active, drain_timeout_s=drain_s
            )
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        for component in reversed(self._started):
            await self._stop_component(component)
        self._started.clear()
        if self._tasks is not None:
            await self._tasks.stop(grace_s=0.0 if self.force_exit else ROOT_TASK_GRACE_S)
        if self._store is not None:
            await self._record_event("daemon_stopped", {"reason": reason})
            await self._store.close()
            self._store = None
        self._lock.release()
        self._lock = None
        self.log.info("daemon_stopped", reason=reason)

    async def _record_event(self, event: str, fields: dict[str, Any]) -> None:
        """Keep a lifecycle event in state.db; a failed write is logged, never fatal here."""
        from monitord.store.state_db import StoreError

        if self._store is None:
            return
        try:
            await self._store.record_event(event, fields)
        except StoreError as e:
            self.log.error("event_not_recorded", recorded_event=event, error_code=e.code,
                           detail=e.detail)

    async def _unless_forced(self, waiting: Coroutine[Any, Any, bool]) -> bool:
        """Await `waiting` unless a forced exit comes first (then False, `waiting` cancelled)."""
        assert self._forced is not None
        if self.force_exit:
            waiting.close()
            return False
        task = asyncio.ensure_future(waiting)
        forced = asyncio.ensure_future(self._forced.wait())
        await asyncio.wait({task, forced}, return_when=asyncio.FIRST_COMPLETED)
        for pending in (task, forced):
            pending.cancel()
        await asyncio.gather(task, forced, return_exceptions=True)
        return not task.cancelled() and task.exception() is None and bool(task.result())

    async def _stop_component(self, component: Component) -> None:
        stopping = asyncio.ensure_future(component.stop())

        async def finished() -> bool:
            done, _ = await asyncio.wait({stopping}, timeout=COMPONENT_STOP_TIMEOUT_S)
            return bool(done)

        if not await self._unless_forced(finished()):
            stopping.cancel()
            await asyncio.wait({stopping}, timeout=ROOT_TASK_GRACE_S)
            self.log.error(
                "component_stop_timeout", component=component.name, error_code="DAEMON_STOP_FAILED"
            )
            return
        error = stopping.exception()
        if error is not None:
            self.log.error(
                "component_stop_failed",
                component=component.name,
                error_code="DAEMON_STOP_FAILED",
                exc_info=error,
            )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from monitord.base.config import default_path
    from monitord.base.logs import DEFAULT_LEVEL, LEVELS

    parser.add_argument(
        "-c",
        "--config",
        type=Path,
        default=None,
        help=f"monitord.toml (default: $MONITORD_CONFIG, then {default_path()})",
    )
    parser.add_argument(
        "--log-level", choices=tuple(LEVELS), default=DEFAULT_LEVEL,
        help="drop log lines below this level (default %(default)s)",
    )


def load_config_or_exit(path: Path | None) -> Config | int:
    """The validated config, or EXIT_USAGE after one line on stderr."""
    from monitord.base import config as config_module

    try:
        return config_module.load(path or config_module.default_path())
    except config_module.ConfigError as e:
        print(f"monitord: {e}", file=sys.stderr)
        return EXIT_USAGE


def main(args: argparse.Namespace) -> int:
    from monitord.base import logs

    loaded = load_config_or_exit(args.config)
    if isinstance(loaded, int):
        return loaded
    logs.configure(loaded.monitord.log_format, level=logs.LEVELS[args.log_level])
    return asyncio.run(Daemon(loaded).serve())


# The verb this module serves (monitord.surface.cli): verb -> (add arguments, run).
VERBS = {"run": (add_arguments, main)}

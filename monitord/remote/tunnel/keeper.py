"""The tunnel keeper: the root task that owns monitord's one working SSH connection to the
VPS (and the idle standby beside it that an attempt takes first: standby.py).

Lifecycle of one attempt: connect (host key checked against known_hosts, keepalive on)
-> acquire the tunnel lease on the VPS -> `before_forwards(conn)` (provisioning; on first
contact, when monitord is not on the VPS yet, it runs before the lease instead, since the
lease verb needs it) -> request every forward (a denial is diagnosed and
may fence our own stale session) -> prove every forward end to end -> `connected`; then
renew the lease every TTL/3 until the connection drops or the lease is lost. Between
attempts: exponential backoff with full jitter, capped, and at most
`reconnect_max_per_minute` attempts per minute whatever the cause.

asyncssh and OS exceptions become typed errors with stable codes through
monitord/remote/ssh_errors.py (`translate_connect` for connecting and preparing the VPS).
Anything else an attempt raises (a malformed reply, a bug) falls under the root loops' error
policy (monitord/base/periodic.py): counted and shown as INTERNAL, logged once with its
traceback, and the next attempt comes after the usual back-off; only cancellation ends run().
Its attempts, reconnect hooks and the standby connection are children of the keeper's task
owner (monitord/base/task_owner.py), closed when run() ends.
The state is published as a frozen `TunnelStatus` (`keeper.status()`,
`await keeper.wait_for(...)`, listeners) that the status document (GET /v1/status) shows
as `tunnel {state, connected, last_error, attempts, lease}`. Other parts use the live
connection only through `async with keeper.session() as conn:` and register
`add_reconnect_hook()` callbacks (cleanup worker, reconciler) run after every (re)connect.
Started by `monitord run` as the root task "tunnel keeper", whose first step loads the SSH
side (asyncssh and the modules on it) in a worker thread: the daemon becomes ready without
it (monitord/remote/ssh_side.py), so this module imports it only for type checking.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from monitord.base import logs
from monitord.base.config import RemoteSection
from monitord.base.periodic import LoopBook
from monitord.base.task_owner import TaskOwner
from monitord.remote import artifact, ssh_side
from monitord.remote.tunnel.backoff import ReconnectBackoff
from monitord.remote.tunnel.goodbye import say_goodbye
from monitord.remote.tunnel.lease_client import LeaseAnswer, LeaseClient, LeaseSession
from monitord.remote.tunnel.standby import LOGIN_WAIT_S, PROMOTE_TIMEOUT_S, Standby
from orchestrator.errors import ErrorCode, MonitordError, TransientError, error_for
from orchestrator.tunnel_lease import LeaseRecord

if TYPE_CHECKING:  # loaded by run() (monitord/remote/ssh_side.py)
    import asyncssh

    from monitord.remote.tunnel.forwards import ForwardSet, ForwardStatus

TASK_NAME = "tunnel keeper"
RELEASE_TIMEOUT_S = 3.0
ReconnectHook = Callable[["asyncssh.SSHClientConnection"], Awaitable[None]]
BeforeForwards = Callable[["asyncssh.SSHClientConnection"], Awaitable[None]]
StatusListener = Callable[["TunnelStatus"], None]


class TunnelState(StrEnum):
    STOPPED = "stopped"
    CONNECTING = "connecting"
    CONNECTED = "connected"
    BACKOFF = "backoff"
    AUTH_FAILED = "auth_failed"
    HOST_KEY_MISMATCH = "host_key_mismatch"
    LEASE_CONFLICT = "lease_conflict"
    PORT_OCCUPIED = "port_occupied"


# The state shown while waiting after an error with this code (others: BACKOFF).
STATE_FOR_ERROR: dict[str, TunnelState] = {
    ErrorCode.AUTH_FAILED: TunnelState.AUTH_FAILED,
    ErrorCode.HOST_KEY_MISMATCH: TunnelState.HOST_KEY_MISMATCH,
    ErrorCode.TUNNEL_LEASE_CONFLICT: TunnelState.LEASE_CONFLICT,
    ErrorCode.PORT_OCCUPIED: TunnelState.PORT_OCCUPIED,
}


@dataclass(frozen=True)
class TunnelError:
    """The last error, as the status shows it."""

    code: str
    detail: str
    at: float  # wall clock

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "detail": self.detail, "at": self.at}


@dataclass(frozen=True)
class TunnelStatus:
    """A snapshot of the keeper; `lease` is ours while held, `lease_holder` the record that
    blocks us in lease_conflict."""

    state: TunnelState = TunnelState.STOPPED
    attempts: int = 0  # connection attempts since start
    reconnects: int = 0  # times the tunnel became connected (first connect included)
    last_error: TunnelError | None = None
    next_retry_at: float | None = None  # wall clock
    lease: LeaseRecord | None = None
    lease_holder: LeaseRecord | None = None
    forwards: tuple[ForwardStatus, ...] = ()
    fenced_sessions: int = 0

    @property
    def connected(self) -> bool:
        return self.state is TunnelState.CONNECTED

    def to_dict(self) -> dict[str, Any]:
        """`tunnel {state, connected, last_error, attempts, lease}` plus extras."""
        return {
            "state": self.state.value,
            "connected": self.connected,
            "last_error": self.last_error.to_dict() if self.last_error else None,
            "attempts": self.attempts,
            "reconnects": self.reconnects,
            "next_retry_at": self.next_retry_at,
            "lease": self.lease.to_dict() if self.lease else None,
            "lease_holder": self.lease_holder.to_dict() if self.lease_holder else None,
            "forwards": [f.to_dict() for f in self.forwards],
            "fenced_sessions": self.fenced_sessions,
        }


@dataclass
class _Hooks:
    hooks: dict[str, ReconnectHook] = field(default_factory=dict)
    running: set[asyncio.Task[None]] = field(default_factory=set)


class TunnelKeeper:
    """Keeps the tunnel up; see the module docstring."""

    def __init__(
        self,
        config: RemoteSection,
        *,
        owner_id: str,
        owner_label: str,
        reconnect_window_s: float = 60.0,
        probe_timeout_s: float = 10.0,
        before_forwards: BeforeForwards | None = None,
        loops: LoopBook | None = None,
    ) -> None:
        self._config = config
        self._loops = loops if loops is not None else LoopBook()
        self._before_forwards = before_forwards
        self.owner_id = owner_id
        self.owner_label = owner_label
        self._lease_client = LeaseClient(
            prefix=artifact.remote_command(config),
            remote_dir=config.remote_bin_dir,
            owner_id=owner_id,
            owner_label=owner_label,
            ttl_s=config.tunnel_lease_ttl_s,
            timeout_s=max(probe_timeout_s, config.connect_timeout_s),
        )
        self._backoff = ReconnectBackoff(
            base_s=config.reconnect_backoff_base_s,
            cap_s=config.reconnect_backoff_cap_s,
            max_attempts_per_window=config.reconnect_max_per_minute,
            window_s=reconnect_window_s,
        )
        self._probe_timeout_s = probe_timeout_s
        self._status = TunnelStatus()
        self._changed = asyncio.Condition()
        self._listeners: list[StatusListener] = []
        self._conn: asyncssh.SSHClientConnection | None = None
        self._helper: LeaseSession | None = None
        self._forwards: ForwardSet | None = None
        self._closing = asyncio.Event()
        self._attempt_task: asyncio.Task[None] | None = None
        self._tasks = TaskOwner(TASK_NAME)
        self._hooks = _Hooks()
        self._log = logs.get_logger(__name__).bind(owner_label=owner_label)
        self._standby = Standby(
            connect=self._connect, open_helper=self._lease_client.open_session,
            retry_s=config.reconnect_backoff_cap_s, log=self._log, tasks=self._tasks,
            loops=self._loops,
        ) if config.standby_connection else None
        self._last_logged: tuple[str, str, float, int] | None = None
        detect_s = config.keepalive_interval_s * config.keepalive_count_max
        if detect_s >= config.tunnel_lease_ttl_s:
            # Safety relies on noticing a dead connection before our lease can expire.
            self._log.warning(
                "tunnel_keepalive_exceeds_lease_ttl", dead_peer_detection_s=detect_s,
                tunnel_lease_ttl_s=config.tunnel_lease_ttl_s,
            )
        # Monotonic start time of recent attempts (diagnostics and tests), bounded.
        self.attempt_times: deque[float] = deque(maxlen=1000)

    # -- public surface ------------------------------------------------------------------
    def status(self) -> TunnelStatus:
        return self._status

    def add_listener(self, listener: StatusListener) -> None:
        """Call `listener(status)` synchronously after every status change."""
        self._listeners.append(listener)

    def add_reconnect_hook(self, name: str, hook: ReconnectHook) -> None:
        """Run `await hook(conn)` (as task "tunnel-hook:NAME") after every (re)connect."""
        self._hooks.hooks[name] = hook

    async def wait_for(
        self, predicate: Callable[[TunnelStatus], bool], *, timeout_s: float
    ) -> TunnelStatus:
        """Wait until predicate(status) holds; raises TimeoutError after timeout_s."""
        async with asyncio.timeout(timeout_s), self._changed:
            await self._changed.wait_for(lambda: predicate(self._status))
            return self._status

    async def wait_connected(self, *, timeout_s: float) -> TunnelStatus:
        return await self.wait_for(lambda s: s.connected, timeout_s=timeout_s)

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[asyncssh.SSHClientConnection]:
        """The live connection while the tunnel is connected; SSH_UNREACHABLE otherwise."""
        conn = self._conn
        if conn is None or not self._status.connected:
            last = self._status.last_error
            why = f" (last error {last.code}: {last.detail})" if last else ""
            raise TransientError(ErrorCode.SSH_UNREACHABLE, f"the tunnel is down{why}")
        yield conn

    async def run(self) -> None:
        """The root task body: keep the tunnel up until close()."""
        try:
            # The SSH side, off the loop: the daemon was ready without it (ssh_side.py).
            await ssh_side.load()
            while not self._closing.is_set():
                await self._wait_before_attempt()
                if self._closing.is_set():
                    break
                # Each attempt is its own task so that close() can abort a connect in flight.
                attempt = self._tasks.spawn("tunnel keeper: attempt", self._attempt())
                self._attempt_task = attempt
                try:
                    await attempt
                except asyncio.CancelledError:
                    current = asyncio.current_task()
                    if current is not None and current.cancelling():
                        raise  # run() itself is being cancelled
                except Exception as e:  # not a MonitordError (those end in _failed)
                    await self._failed(self._loops.failed(TASK_NAME, e))
                else:
                    self._loops.passed(TASK_NAME)
        finally:
            await self._cancel_hooks()
            if self._standby is not None:
                await self._standby.close()
            await self._tasks.close()
            await self._publish(state=TunnelState.STOPPED, next_retry_at=None, forwards=())

    async def close(self) -> None:
        """Release the lease if held, drop the connection; run() then returns."""
        self._closing.set()
        conn, helper = self._conn, self._helper
        if conn is not None:
            if self._status.connected and helper is not None:
                with contextlib.suppress(MonitordError, TimeoutError):
                    async with asyncio.timeout(RELEASE_TIMEOUT_S):
                        await helper.release()
            forwards = self._forwards
            goodbye = await say_goodbye(conn, timeout_s=RELEASE_TIMEOUT_S,
                                        first=forwards.cancel if forwards else None)
            # `left` above 0: the VPS did not acknowledge within the bound; they went with
            # the disconnect, and the VPS may have answered into a closed connection.
            self._log.info("tunnel_channels_closed", closed=goodbye.closed, left=goodbye.left)
        attempt = self._attempt_task
        if attempt is not None and not attempt.done():
            attempt.cancel()
            await asyncio.gather(attempt, return_exceptions=True)

    # -- one attempt -----------------------------------------------------------------------
    async def _wait_before_attempt(self) -> None:
        delay = self._backoff.delay(time.monotonic())
        if delay <= 0:
            return
        error = self._status.last_error
        state = STATE_FOR_ERROR.get(error.code, TunnelState.BACKOFF) if error else (
            TunnelState.BACKOFF
        )
        await self._publish(state=state, next_retry_at=time.time() + delay)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay):
                await self._closing.wait()

    async def _attempt(self) -> None:
        now = time.monotonic()
        self._backoff.record_attempt(now)
        self.attempt_times.append(now)
        await self._publish(state=TunnelState.CONNECTING, attempts=self._status.attempts + 1,
                            next_retry_at=None)
        wait_s = min(LOGIN_WAIT_S, self._config.connect_timeout_s)
        ready = (await self._standby.take(wait_s=wait_s)
                 if self._standby is not None else None)
        if ready is not None:
            if await self._run_on(ready.conn, ready.helper):
                return
            self._log.info("tunnel_standby_unusable")
        try:
            conn = await self._connect()
        except MonitordError as e:
            await self._failed(e)
            return
        await self._run_on(conn, None)

    async def _run_on(
        self, conn: asyncssh.SSHClientConnection, standby_helper: LeaseSession | None
    ) -> bool:
        """Lease, provisioning, forwards, proof, then hold: the rest of an attempt on `conn`
        (which it closes). With `standby_helper` (a promoted standby connection) it returns
        False, having published nothing, if that connection turns out dead before the lease
        is held — the caller then connects afresh."""
        self._conn = conn
        forwards: ForwardSet | None = None
        dead_standby = False
        try:
            if standby_helper is None:
                helper, prepared = await self._open_helper_bootstrapping(conn)
            else:
                helper, prepared = standby_helper, False
            self._helper = helper
            try:
                answer = await self._acquire_lease(
                    helper, timeout_s=None if standby_helper is None else PROMOTE_TIMEOUT_S
                )
            except MonitordError as e:
                if standby_helper is None or e.code not in (
                    ErrorCode.SSH_UNREACHABLE, ErrorCode.SSH_TIMEOUT
                ):
                    raise
                dead_standby = True
                return False
            if not prepared:
                await self._prepare_vps(conn)
            forwards = self._forwards = self._forward_set(conn, helper=helper, answer=answer)
            await forwards.open()
            statuses = await forwards.prove()
            await self._connected(
                conn, answer=answer, statuses=statuses, fenced=len(forwards.fenced)
            )
            if self._standby is not None:
                self._standby.start()
            await self._hold(conn, helper)
        except MonitordError as e:
            # Reset before the tunnel is published down (the lease ledger dates every
            # uncertain grant from then): nothing written on it leaves the PBX after.
            conn.abort()
            await self._failed(e)
        finally:
            if forwards is not None:
                forwards.close()
            if self._helper is not None:
                self._helper.close()
            self._conn = self._helper = self._forwards = None
            if dead_standby:
                conn.abort()  # nothing to say goodbye to: do not wait for the peer
            else:
                conn.close()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(conn.wait_closed(), 2.0)
        return True

    async def _connect(self) -> asyncssh.SSHClientConnection:
        # Jump hosts, ssh_config, the timeout and translated errors: ssh_connect.py.
        from monitord.remote.tunnel import ssh_connect

        return await ssh_connect.open_connection(self._config)

    async def _open_helper_bootstrapping(
        self, conn: asyncssh.SSHClientConnection
    ) -> tuple[LeaseSession, bool]:
        """Start the VPS helper; if monitord is not on the VPS yet (first contact), run the
        before_forwards step (provisioning) once first. Returns the helper and whether
        before_forwards already ran in this attempt."""
        try:
            return await self._lease_client.open_session(conn), False
        except MonitordError as e:
            if e.code is not ErrorCode.PROVISION_FAILED or self._before_forwards is None:
                raise
            self._log.info("tunnel_bootstrap", detail=e.detail)
        await self._prepare_vps(conn)
        return await self._lease_client.open_session(conn), True

    async def _prepare_vps(self, conn: asyncssh.SSHClientConnection) -> None:
        """The before_forwards step (provisioning), with foreign errors translated."""
        from monitord.remote import ssh_errors

        if self._before_forwards is None:
            return
        try:
            await self._before_forwards(conn)
        except ssh_errors.SSH_ERRORS as e:
            raise ssh_errors.translate_connect(e, during="preparing the VPS") from e

    async def _acquire_lease(
        self, helper: LeaseSession, *, timeout_s: float | None = None
    ) -> LeaseAnswer:
        answer = await helper.acquire(timeout_s=timeout_s)
        if answer.ok:
            return answer
        holder = answer.holder
        await self._publish(lease=None, lease_holder=holder)
        who = f"{holder.owner_label} ({holder.owner_id})" if holder else "another owner"
        raise error_for(
            answer.code or ErrorCode.TUNNEL_LEASE_CONFLICT,
            f"the tunnel lease is held by {who}: {answer.reason}",
            delay=self._conflict_retry_s(),
        )

    def _forward_set(
        self, conn: asyncssh.SSHClientConnection, *, helper: LeaseSession, answer: LeaseAnswer
    ) -> ForwardSet:
        from monitord.remote.tunnel.forwards import ForwardSet

        c = self._config
        return ForwardSet(
            conn,
            reverse=c.reverse_forwards,
            local=c.local_forwards,
            helper=helper,
            our_sshd_pid=answer.session.sshd_pid if answer.session else None,
            lease_context=answer.holder or answer.lease,
            vps_now=answer.now,
            keepalive_interval_s=c.keepalive_interval_s,
            stale_after_s=c.keepalive_interval_s * c.keepalive_count_max,
            conflict_retry_s=self._conflict_retry_s(),
            timeout_s=self._probe_timeout_s,
            log=self._log,
        )

    def _conflict_retry_s(self) -> float:
        """How slowly to come back after a conflict: a lease period, at least the backoff cap
        (a live holder renews every TTL/3, so asking more often cannot change the answer)."""
        c = self._config
        return max(c.reconnect_backoff_cap_s, c.tunnel_lease_ttl_s)

    async def _connected(
        self,
        conn: asyncssh.SSHClientConnection,
        *,
        answer: LeaseAnswer,
        statuses: tuple[ForwardStatus, ...],
        fenced: int,
    ) -> None:
        self._backoff.record_success()
        self._last_logged = None
        await self._publish(
            state=TunnelState.CONNECTED, reconnects=self._status.reconnects + 1,
            lease=answer.lease, lease_holder=None, forwards=statuses,
            fenced_sessions=self._status.fenced_sessions + fenced, next_retry_at=None,
        )
        self._log.info("tunnel_connected", reconnects=self._status.reconnects,
                       attempts=self._status.attempts, fenced=fenced,
                       forwards=[f.name for f in statuses])
        for name, hook in self._hooks.hooks.items():
            task = self._tasks.spawn(
                f"tunnel-hook:{name}", self._run_hook(name=name, hook=hook, conn=conn)
            )
            self._hooks.running.add(task)
            task.add_done_callback(self._hooks.running.discard)

    async def _run_hook(
        self, *, name: str, hook: ReconnectHook, conn: asyncssh.SSHClientConnection
    ) -> None:
        try:
            await hook(conn)
        except MonitordError as e:
            self._log.warning("tunnel_hook_failed", hook=name, error_code=e.code, detail=e.detail)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            # A hook bug must not take the tunnel down: counted and shown under the loops'
            # policy (logged once per kind with its traceback).
            self._loops.failed(f"tunnel hook: {name}", e)
        else:
            self._loops.passed(f"tunnel hook: {name}")

    async def _cancel_hooks(self) -> None:
        await self._tasks.cancel(list(self._hooks.running))

    async def _hold(self, conn: asyncssh.SSHClientConnection, helper: LeaseSession) -> None:
        """Renew the lease every TTL/3 until the connection ends or the lease is lost."""
        ttl = self._config.tunnel_lease_ttl_s
        last_ok = time.monotonic()
        closed = asyncio.ensure_future(conn.wait_closed())
        try:
            while not self._closing.is_set():
                done, _ = await asyncio.wait({closed}, timeout=ttl / 3)
                if done or self._closing.is_set():
                    break
                try:
                    answer = await helper.renew()
                except MonitordError as e:
                    if time.monotonic() - last_ok > ttl * 2 / 3:
                        raise error_for(ErrorCode.LEASE_EXPIRED,
                                        f"could not renew the tunnel lease: {e.detail}") from e
                    continue
                if not answer.ok:
                    raise error_for(ErrorCode.LEASE_EXPIRED,
                                    f"the tunnel lease was lost: {answer.reason}")
                last_ok = time.monotonic()
                await self._publish(lease=answer.lease)
        finally:
            closed.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await closed
        if not self._closing.is_set():
            raise error_for(ErrorCode.SSH_UNREACHABLE, "the SSH connection was lost")

    async def _failed(self, e: MonitordError) -> None:
        delay = e.delay if isinstance(e, TransientError) and e.delay else 0.0
        if not e.retryable:
            delay = max(delay, self._config.reconnect_backoff_cap_s)
        self._backoff.record_failure(at_least_s=delay, now=time.monotonic())
        error = TunnelError(code=str(e.code), detail=e.detail, at=time.time())
        lease_holder = self._status.lease_holder if e.code is ErrorCode.TUNNEL_LEASE_CONFLICT \
            else None
        await self._publish(
            state=STATE_FOR_ERROR.get(error.code, TunnelState.BACKOFF), last_error=error,
            lease=None, lease_holder=lease_holder, forwards=(),
        )
        self._log_error(error)

    def _log_error(self, error: TunnelError) -> None:
        """Log an error once, then a repeat of the same code at most once a minute with a
        count, so a long outage never floods the log."""
        now = time.monotonic()
        last = self._last_logged
        if last is not None and last[0] == error.code and now - last[2] < 60.0:
            self._last_logged = (last[0], last[1], last[2], last[3] + 1)
            return
        repeats = last[3] if last is not None and last[0] == error.code else 0
        self._last_logged = (error.code, error.detail, now, 0)
        self._log.warning("tunnel_error", error_code=error.code, detail=error.detail,
                          repeats=repeats, attempts=self._status.attempts)

    async def _publish(self, **changes: Any) -> None:
        self._status = replace(self._status, **changes)
        async with self._changed:
            self._changed.notify_all()
        for listener in self._listeners:
            listener(self._status)

"""The standby connection: a second SSH connection to the VPS, logged in, with its
`tunnel-lease serve` helper already running, and holding nothing — no lease, no forward.

When the tunnel's connection ends while the VPS and the path to it stay up (the VPS kills
that one sshd session, a NAT or firewall drops that one flow, an sshd session process is
OOM-killed), the keeper's next attempt takes the standby instead of connecting: the key
exchange, the login and the helper's start — most of a reconnect — are already done, and
what is left is the lease (one JSON line each way) and the forwards. Only then is a new
standby made. When the standby turns out dead too (the whole path is gone), the attempt
finds out within `PROMOTE_TIMEOUT_S` and connects afresh, as it would have without one;
a standby still logging in is waited for `LOGIN_WAIT_S` at most.

The standby never takes the lease by itself and never opens a forward, so it cannot be a
second owner; the lease decides between our own sessions exactly as after any reconnect
(tunnel.md). Its connect attempts are paced by `retry_s` (the backoff cap) after a failure,
so it cannot storm. Owned by the keeper: its task is a child of the keeper's task owner,
started after each proven connection, closed with the keeper. An attempt that raises
anything but a MonitordError is counted under the root loops' error policy as loop
"tunnel standby" (monitord/base/periodic.py) and retried like a failed one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from monitord.base.periodic import LoopBook
from monitord.base.task_owner import TaskOwner
from monitord.remote.tunnel.goodbye import say_goodbye
from monitord.remote.tunnel.lease_client import LeaseSession
from orchestrator.errors import MonitordError

if TYPE_CHECKING:  # the SSH side loads after readiness (monitord/remote/ssh_side.py)
    import asyncssh

# How long a promoted standby's first answer may take before it counts as dead: a live
# helper answers within a few round trips; a dead path would otherwise cost a full
# request timeout before the fresh connect that is needed anyway.
PROMOTE_TIMEOUT_S = 1.0
# How long an attempt waits for a standby that is still logging in. One on its way is done
# within a few round trips; one whose path died under it hangs until the connect time-out,
# and waiting for that held a reconnect 8.5 s longer than a fresh login needed.
LOGIN_WAIT_S = 1.0
# A live VPS acknowledges the helper's close within a round trip; a dead path costs the
# bound once, at shutdown.
GOODBYE_TIMEOUT_S = 2.0
LOOP_NAME = "tunnel standby"


@dataclass(frozen=True)
class Ready:
    conn: asyncssh.SSHClientConnection
    helper: LeaseSession


class Standby:
    """Keeps one `Ready` connection in reserve; see the module docstring."""

    def __init__(
        self,
        *,
        connect: Callable[[], Awaitable[asyncssh.SSHClientConnection]],
        open_helper: Callable[[asyncssh.SSHClientConnection], Awaitable[LeaseSession]],
        retry_s: float,
        log: Any,
        tasks: TaskOwner,
        loops: LoopBook,
    ) -> None:
        self._connect = connect
        self._open_helper = open_helper
        self._retry_s = retry_s
        self._log = log
        self._tasks = tasks
        self._loops = loops
        self._ready: Ready | None = None
        self._task: asyncio.Task[None] | None = None
        # Set while no standby is on its way: none is ready, or an attempt just ended.
        self._settled = asyncio.Event()
        self._settled.set()

    def start(self) -> None:
        """Make (and then keep) a standby, unless one is being kept already."""
        if (self._task is None or self._task.done()) and not self._tasks.closed:
            self._task = self._tasks.spawn("tunnel keeper: standby", self._keep())

    async def take(self, *, wait_s: float) -> Ready | None:
        """The standby, now the caller's to use and close; None if none is ready. One that
        is logging in right now is waited for (up to `wait_s`): it is further along than a
        fresh connection would be. Stops keeping one until `start()` is called again."""
        if self._ready is None and self._task is not None and not self._task.done():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_s):
                    await self._settled.wait()
        ready, self._ready = self._ready, None
        await self._stop()
        return ready

    async def close(self) -> None:
        """Stop keeping one; a ready one says goodbye (its helper's channel closed and
        acknowledged before the disconnect, goodbye.py), bounded by `GOODBYE_TIMEOUT_S`."""
        ready, self._ready = self._ready, None
        await self._stop()
        if ready is not None:
            goodbye = await say_goodbye(ready.conn, timeout_s=GOODBYE_TIMEOUT_S)
            self._log.info("tunnel_standby_closed", closed=goodbye.closed, left=goodbye.left)

    async def _stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            await self._tasks.cancel([task])

    async def _keep(self) -> None:
        while True:
            await self._one()
            await asyncio.sleep(self._retry_s)

    async def _one(self) -> None:
        """Connect, start the helper, then wait until the connection ends or is taken."""
        self._settled.clear()
        conn: asyncssh.SSHClientConnection | None = None
        ready: Ready | None = None
        try:
            conn = await self._connect()
            ready = Ready(conn, await self._open_helper(conn))
            self._ready = ready
            self._settled.set()
            self._log.debug("tunnel_standby_ready")
            await conn.wait_closed()
            self._log.info("tunnel_standby_lost")
        except MonitordError as e:
            self._log.info("tunnel_standby_failed", error_code=e.code, detail=e.detail)
        except Exception as e:  # a malformed reply, a bug: counted, then tried again later
            self._loops.failed(LOOP_NAME, e)
        else:
            self._loops.passed(LOOP_NAME)
        finally:
            self._settled.set()
            if conn is not None and ready is None:  # never offered
                conn.close()
            elif ready is not None and self._ready is ready:  # offered, not taken: ours
                self._ready = None
                ready.helper.close()
                ready.conn.close()

"""The warm copier: a recent, verified copy of every remote area that declares how.

A root task ("warm copier"). Every few seconds it asks orchestrator/warm_copy.py which remote
areas of services with `warm_copy` ("sqlite", or a snapshot command) are due, and takes
their copies, each so:

1. the agent snapshots the running area's data dir on the VPS (`POST …/copy/snapshot`:
   SQLite's backup API for the declared databases, every other file checked unchanged
   during its copy; or the service's own command, run as its daemon runs) into the data
   dir's copy dir there;
2. the PBX downloads that snapshot as a move home downloads (monitord.remote.copy: a listing
   validated as untrusted input, block deltas against the previous warm copy — or, for the
   first, the PBX's own copy — every file hashed on arrival, the staging dir swapped in by
   rename) into `work_dir/warm/{service}/{area}`;
3. the copy is recorded (PlacementState.record_warm_copy) with the lineage epoch and the
   generation it was taken from, the SHA-256 of its listing and the VPS's snapshot time;
   the snapshot on the VPS is removed (it would double the area's room there).

Up to `COPIES_AT_ONCE` areas are copied at once (a copy's time is mostly round trips). Moves
own the link: no warm copy starts while any transaction is open, and those under way are
cancelled the moment a transaction opens (what they fetched stays in their staging dirs,
where the next ones resume). `[remote] warm_copy_max_rate` caps the bytes per second the
copies take together, by delaying the next copy's start. A failed copy keeps the last one, counts
`monitord_warm_copy_failures_total{service,code}` and is logged once per cause
(`warm_copy_failed`), never affects a move. A copy no rule keeps any more (the area moved,
its epoch is over) is removed with its record.

Only a give-up ever starts an area from a warm copy (monitord/engine/phase_actions.py).
The copy modules are imported when a copy is taken, never at start-up (they bring
asyncssh: monitord/remote/ssh_side.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from monitord.base import area_paths, logs, tree_digest
from monitord.base.config import Config, WarmCopyCommand
from monitord.base.metrics import Metrics
from monitord.base.periodic import LoopBook, Periodic
from monitord.engine.area_side import copy_over
from monitord.engine.local_side import LocalSide
from monitord.engine.placement_state import PlacementState
from orchestrator import warm_copy
from orchestrator.errors import ErrorCode, MonitordError, error_for
from orchestrator.models import Area
from orchestrator.warm_copy import WarmCopy

if TYPE_CHECKING:  # the SSH side loads after readiness (monitord/remote/ssh_side.py)
    from monitord.remote.remote_link import RemoteLink

log = logs.get_logger(__name__)

TASK_NAME = "warm copier"
# The longest the copier sleeps between passes (it wakes when the next area is due, sooner):
# how late it sees an area that became copyable (a move ended, the link came back).
TICK_S = 2.0
COPIES_AT_ONCE = 4


@dataclass(slots=True)
class _Tries:
    """What the copier knows of one area's copies since this start (not durable)."""

    since: float  # wall clock, copies became due (the status's overdue counts from here)
    last_try: float | None = None  # monotonic
    error: MonitordError | None = None  # the last try's, until one succeeds


class WarmCopier:
    def __init__(
        self,
        *,
        config: Config,
        state: PlacementState,
        link: RemoteLink | None,
        local_side: LocalSide,
        metrics: Metrics,
        loops: LoopBook | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.state = state
        self.link = link
        self.local_side = local_side
        self.metrics = metrics
        self._clock, self._wall = clock, wall
        self._tries: dict[str, _Tries] = {}
        self._started_at = wall()
        self.version = 0  # bumped by every change the status shows that the state does not
        self._current: set[asyncio.Task[WarmCopy]] = set()
        self._budget_at = 0.0  # monotonic: when warm_copy_max_rate lets the next copy start
        self.loop = Periodic(TASK_NAME, iteration=self._pass, interval_s=TICK_S, book=loops)
        state.add_listener(self._state_changed)

    def services(self) -> dict[str, float]:
        """{service: interval} of the services whose areas get warm copies."""
        return {name: s.warm_copy_interval_s for name, s in self.config.services.items()
                if s.warm_copy != "off"}

    def dir_of(self, *, service: str, area: str) -> Path:
        return area_paths.warm_copy_dir(self.config.monitord.work_dir, service=service,
                                        area=area)

    async def run(self) -> None:
        try:
            await self.loop.run()
        finally:
            await self._cancel_current()

    def close(self) -> None:
        """End the loop now: the copies under way are cancelled (what they fetched stays in
        their staging dirs, where the next ones resume), the loop returns at its next step."""
        self.loop.close()
        for task in self._current:
            task.cancel()

    async def _cancel_current(self) -> None:
        for task in self._current:
            task.cancel()
        for task in list(self._current):
            with contextlib.suppress(BaseException):
                await task

    # -- one pass ---------------------------------------------------------------------------

    async def _pass(self) -> float:
        """The loop's iteration: one pass, then the seconds until the next (the loop takes
        what an iteration returns as its wait: `run_once`'s count of 0 spun it)."""
        await self.run_once()
        return self._next_due_s()

    def _next_due_s(self) -> float:
        """Until the first area tried before is due again, at most TICK_S: copies come every
        interval, not every interval rounded up to a tick."""
        if self.link is None or not self.link.connected() or self.state.transactions:
            return TICK_S
        intervals, now = self.services(), self._clock()
        waits = [tries.last_try + intervals[area.service] - now
                 for area in self.state.committed.values()
                 if area.service in intervals
                 and (tries := self._tries.get(area.uuid)) is not None
                 and tries.last_try is not None]
        return max(0.0, min([TICK_S, *waits]))

    async def run_once(self) -> int:
        """Forget the copies nothing keeps, then take every due copy; how many were taken."""
        await self._forget_unkept()
        taken = 0
        if self.link is None or not self.link.connected():
            self._publish()
            return taken
        intervals = self.services()
        queue = sorted((a for a in self.state.committed.values() if a.service in intervals),
                       key=lambda a: a.uuid)

        async def worker() -> None:
            nonlocal taken
            while queue and not self.loop.closed:
                area = queue.pop(0)
                lineage = self.state.lineage(area.uuid)
                tries = self._tries.setdefault(area.uuid, _Tries(since=self._wall()))
                if not warm_copy.due(area, lineage, moving=bool(self.state.transactions),
                                     last_try=tries.last_try, now=self._clock(),
                                     interval_s=intervals[area.service]):
                    continue
                await self._wait_for_budget()
                tries.last_try = self._clock()
                if await self._take_one(area, tries):
                    taken += 1

        # A copy's time is mostly round trips (snapshot, listing, digests, fetch): a few at
        # once keep a long link busy where one at a time left 20 areas' copies end to end.
        await asyncio.gather(*(worker() for _ in range(COPIES_AT_ONCE)))
        self._publish()
        return taken

    async def _take_one(self, area: Area, tries: _Tries) -> bool:
        started = self._clock()
        task = asyncio.create_task(self._take(area))
        self._current.add(task)
        try:
            copy = await task
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if me is not None and me.cancelling():
                raise  # (the copier itself is stopped, not only the copy)
            log.info("warm_copy_yielded", area=area.uuid, service=area.service)
            return False
        except MonitordError as e:
            self._failed(area, tries, e)
            return False
        except OSError as e:
            from monitord.remote.copy import local_tree

            self._failed(area, tries, local_tree.local_file_error(
                e, during=f"warm copy of {area.uuid}"))
            return False
        finally:
            self._current.discard(task)
        if tries.error is not None:
            log.info("warm_copy_recovered", area=area.uuid, service=area.service)
            self.version += 1
        tries.error = None
        log.info("warm_copy_taken", area=area.uuid, service=area.service,
                 generation=copy.generation, files=copy.files, bytes=copy.bytes,
                 sent_bytes=copy.sent_bytes, took_s=round(self._clock() - started, 3))
        self._spent(copy.sent_bytes)
        return True

    async def _take(self, area: Area) -> WarmCopy:
        """Snapshot on the VPS, download here, record — or nothing recorded."""
        assert self.link is not None
        section = self.config.services[area.service]
        lineage = self.state.lineage(area.uuid)
        remote_dir, _ = area_paths.remote_paths(self.config, service=area.service,
                                                area=area.uuid, generation=area.generation)
        if isinstance(section.warm_copy, WarmCopyCommand):
            argv = [area_paths.expand(arg, area=area.uuid, data_dir=remote_dir,
                                      generation=area.generation, side="remote")
                    for arg in section.warm_copy.command]
            snapshot = await self.link.agent.snapshot(
                area=area.uuid, data_dir=remote_dir, generation=area.generation, command=argv,
                command_timeout_s=section.warm_copy.timeout_s)
        else:
            snapshot = await self.link.agent.snapshot(
                area=area.uuid, data_dir=remote_dir, generation=area.generation,
                sqlite=list(section.warm_copy_databases))
        local_dir = self.dir_of(service=area.service, area=area.uuid)
        # Received beside the recorded copy, never over it: until the new one is recorded,
        # the record still names a dir that holds it (a cut, a crash, a move opening).
        arriving = area_paths.arriving_warm_copy_dir(local_dir)
        await self._finish_install(area, arriving, local_dir)
        basis = local_dir if local_dir.is_dir() else self.local_side.basis_of(
            service=area.service, area=area.uuid, generation=area.generation)
        await self.local_side.check_room_for_warm_copy(local_dir.parent, bytes_=snapshot.bytes,
                                                       files=snapshot.files)
        from monitord.remote.copy import download, local_tree

        report = await copy_over(self.link, download, local_dir=arriving,
                                 remote_dir=snapshot.dir, area=area.uuid, basis=basis)
        # (checked again before a give-up starts the area on it)
        digest = await asyncio.to_thread(local_tree.tree_sha256, arriving)
        now_lineage = self.state.lineage(area.uuid)
        current = self.state.committed.get(area.uuid)
        if now_lineage != lineage or current is None or current.generation != area.generation:
            # The area moved (or was given up) while its copy crossed: the copy is of an
            # epoch that is over; it is never recorded as the one to start from.
            await asyncio.to_thread(_remove, arriving)
            raise error_for(ErrorCode.WARM_COPY_FAILED,
                            f"{area.uuid} moved while its warm copy was taken; discarded")
        copy = WarmCopy(area=area.uuid, service=area.service, generation=area.generation,
                        epoch=lineage.epoch, taken_at=snapshot.taken_at,
                        received_at=self._wall(), files=report.files, bytes=report.bytes,
                        sent_bytes=report.sent_bytes, digest=digest)
        # (not cut by a move opening now: recorded, then in place; whichever of the two
        # dirs holds it is what a give-up finds: LocalSide.warm_copy_dir_of)
        await asyncio.shield(self._install(copy, arriving, local_dir))
        await self._discard(area, remote_dir)
        return copy

    async def _finish_install(self, area: Area, arriving: Path, local_dir: Path) -> None:
        """What a cut `_install` left: the recorded copy still where it arrived goes into
        place; anything else there (a copy never recorded) goes."""
        if not await asyncio.to_thread(arriving.is_dir):
            return
        from monitord.remote.copy import local_tree

        recorded = self.state.warm.get(area.uuid)
        if recorded is not None and await asyncio.to_thread(
                local_tree.tree_sha256, arriving) == recorded.digest:
            await asyncio.to_thread(tree_digest.swap_in, arriving, local_dir)
        else:
            await asyncio.to_thread(shutil.rmtree, arriving, True)

    async def _install(self, copy: WarmCopy, arriving: Path, local_dir: Path) -> None:
        await self.state.record_warm_copy(copy)
        await asyncio.to_thread(tree_digest.swap_in, arriving, local_dir)

    async def _discard(self, area: Area, remote_dir: str) -> None:
        """The VPS's snapshot removed once fetched: kept, it would double the area's room
        there until the next one. A failure costs only that room (the next snapshot
        replaces it): logged, never the copy's."""
        assert self.link is not None
        try:
            await self.link.agent.discard_snapshot(area=area.uuid, data_dir=remote_dir)
        except MonitordError as e:
            log.info("warm_snapshot_kept", area=area.uuid, error_code=e.code.value,
                     detail=e.detail)

    def _failed(self, area: Area, tries: _Tries, error: MonitordError) -> None:
        code = error.code.value
        self.version += 1
        self.metrics.warm_copy_failures.labels(service=area.service, code=code).inc()
        if tries.error is None or tries.error.code != error.code:
            log.warning("warm_copy_failed", area=area.uuid, service=area.service,
                        error_code=code, detail=error.detail)
        tries.error = error

    def _spent(self, sent: int) -> None:
        """`sent` bytes more against warm_copy_max_rate: the next copy starts no sooner than
        the budget allows (shared by the copies at once, so the rate is theirs together)."""
        rate = None if self.config.remote is None else self.config.remote.warm_copy_max_rate
        if rate is not None:
            self._budget_at = max(self._budget_at, self._clock()) + sent / rate

    async def _wait_for_budget(self) -> None:
        wait = self._budget_at - self._clock()
        if wait > 0:
            await asyncio.sleep(wait)

    def _state_changed(self) -> None:
        """A transaction opened: the warm copies under way give the link up at once."""
        if self.state.transactions:
            for task in self._current:
                task.cancel()

    async def _forget_unkept(self) -> None:
        for area, copy in list(self.state.warm.items()):
            committed = self.state.committed.get(area)
            if warm_copy.kept(copy, committed, self.state.lineage(area),
                              moving=area in self.state.transactions):
                continue
            local_dir = self.dir_of(service=copy.service, area=area)
            for path in (local_dir, area_paths.arriving_warm_copy_dir(local_dir)):
                await asyncio.to_thread(_remove, path)
            await self.state.forget_warm_copy(area)
            self._tries.pop(area, None)
            log.info("warm_copy_forgotten", area=area, service=copy.service,
                     generation=copy.generation)

    # -- what the status shows --------------------------------------------------------------

    def _publish(self) -> None:
        """The metrics: per service its oldest remote area's warm copy age (one with none
        yet: the time since its copies became due) and the age past which it is overdue."""
        intervals, now = self.services(), self._wall()
        oldest = dict.fromkeys(intervals, 0.0)
        for area, row in self.status().items():
            tries = self._tries.get(area)
            since = self._started_at if tries is None else tries.since
            taken = row["taken_at"]
            age = now - (since if taken is None else taken)
            oldest[row["service"]] = max(oldest[row["service"]], age)
        for service, age in oldest.items():
            self.metrics.warm_copy_age.labels(service=service).set(age)
            self.metrics.warm_copy_bound.labels(service=service).set(
                warm_copy.OVERDUE_INTERVALS * intervals[service])

    def status(self) -> dict[str, dict[str, Any]]:
        """Per remote area of a service with warm copies: its newest copy and what the last
        try said (each area's `warm_copy` in the status document). Only fixed times, never
        an age: the document is served again while nothing changes (`version`)."""
        intervals = self.services()
        rows: dict[str, dict[str, Any]] = {}
        for area in self.state.committed.values():
            if area.service not in intervals or not warm_copy.copied_now(
                    area, self.state.lineage(area.uuid)):
                continue
            copy = self.state.warm.get(area.uuid)
            tries = self._tries.get(area.uuid)
            since = self._started_at if tries is None else tries.since
            error = None if tries is None else tries.error
            rows[area.uuid] = {
                "service": area.service,
                "taken_at": None if copy is None else copy.taken_at,
                "generation": None if copy is None else copy.generation,
                "bytes": None if copy is None else copy.bytes,
                "sent_bytes": None if copy is None else copy.sent_bytes,
                "overdue_at": warm_copy.overdue_at(copy, since=since,
                                                   interval_s=intervals[area.service]),
                "error": None if error is None else {"code": error.code.value,
                                                     "detail": error.detail},
            }
        return rows


def _remove(local_dir: Path) -> None:
    """A warm copy's dir and what its copies left beside it (staging dir, old tree)."""
    shutil.rmtree(local_dir, ignore_errors=True)
    tree_digest.forget(local_dir)

"""The agent's core: the lease table in memory, its cache on disk, and the guards it runs.

`AgentRuntime` is what the HTTP handlers (monitord.vps.server) call. Every change to one area
happens under that area's asyncio lock, so one area never gets two processes and a stop
never races a start. A background task, "agent lease loop", ticks every 100 ms: it fences
daemons whose lease lapsed (within the tick plus the fence grace), restarts crashed daemons
with capped backoff while their lease is current, and reaps guards that exited.

Start-up (`start()`), before the API answers: load the cache (entries come back without a
lease), then look at the guards a previous agent left: adopt a guard whose identity (pid +
start time), entry and still-current lease file all match and whose daemon command is the
entry's (the guard's own argv names it: a `#!` script's kernel argv plays no part); stop
every other one — a guard running another command with a `survivor_replaced` event,
`reason: "command_changed"`. Lease files of entries that were not adopted are revoked: a
grant given to a previous agent starts nothing now.

Shutdown (`close()`) stops the loop but leaves the daemons to their guards: an agent upgrade
or restart does not interrupt areas, and a daemon still stops when its lease lapses.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import os
import shutil
import stat
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from monitord.base import log_sink, proc_identity, run_as, tree_digest
from monitord.vps import (
    area_runner,
    event_log,
    host_memory,
    lease_file,
    lease_table,
    spool_cache,
    warm_snapshot,
)
from monitord.vps.area_runner import AreaRunner, GuardHandle, vps_environment
from monitord.vps.lease_table import AreaEntry, AreaSpec, CreateVerdict, GenerationCheck
from orchestrator import block_delta, names
from orchestrator.errors import ErrorCode, PermanentError, file_error_code

_RESET_BACKOFF_AFTER_S = 10.0
_FORKSERVER_WAIT_S = 2.0  # at the agent's start: how long readiness waits for it
MAX_HEALTH_WAIT_S = 10.0  # the longest a health question is held open
_HEALTH_POLL_S = 0.02  # while the daemon is not up yet: a look at /proc, no network

log = event_log.get_logger(__name__)


class AgentError(PermanentError):
    """A request the agent refuses: a catalogue code and the HTTP status it is answered with."""

    def __init__(self, *, code: str, detail: str, status: int) -> None:
        super().__init__(code, detail)
        self.status = status


T = TypeVar("T")


def _encoded(listing: bytes) -> str:
    """A listing in JSON: base64, since a listing is bytes (file names need not be UTF-8)."""
    return base64.b64encode(listing).decode("ascii")


def copy_step_error(error: OSError, *, area: str, doing: str, path: Path) -> AgentError:
    """A file system error of a copy step, named by its cause on the VPS (a full disk with
    the free space left, a refused path, a name too long: orchestrator.errors
    .file_error_code), else COPY_INCOMPLETE (500 either way: nothing was changed)."""
    code = file_error_code(error.errno, remote=True)
    detail = f"area {area}: cannot {doing}: {error.strerror or error}"
    if error.filename:
        detail += f" ({error.filename})"
    if code is ErrorCode.REMOTE_DISK_FULL:
        with contextlib.suppress(OSError):
            where = path
            while not where.exists() and where != where.parent:
                where = where.parent
            st = os.statvfs(where)
            detail += f" — VPS: {where} has {st.f_bavail * st.f_frsize} bytes free"
    return AgentError(code=str(code or "COPY_INCOMPLETE"), detail=detail, status=500)


def bad_request(detail: str) -> AgentError:
    return AgentError(code="BAD_REQUEST", detail=detail, status=400)


def check_name(kind: str, value: str) -> str:
    """`value` if it is a name (orchestrator.names, the one pattern); 400 otherwise."""
    reason = names.why_invalid(value)
    if reason is not None:
        raise bad_request(f"{kind}: {reason}")
    return value


class AgentRuntime:
    """The lease table, the guards and the cache of one agent dir."""

    def __init__(
        self,
        *,
        base_dir: Path,
        stop_grace_s: float = 5.0,
        fence_grace_s: float = 0.5,
        tick_s: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
        on_fatal: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.base_dir = base_dir.resolve()
        self._on_fatal = on_fatal
        self.cache_path = self.base_dir / "spool" / spool_cache.CACHE_NAME
        self.cache_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.runner = AreaRunner(
            base_dir=self.base_dir, stop_grace_s=stop_grace_s, fence_grace_s=fence_grace_s
        )
        self._tick_s = tick_s
        self._clock = clock
        self._entries: dict[str, AreaEntry] = {}
        self._handles: dict[str, GuardHandle] = {}
        self._started_mono: dict[str, float] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        # One snapshot of an area at a time, beside its lock: a stop or a create never waits
        # for a snapshot (a warm copy's, monitord.vps.warm_snapshot) to finish.
        self._snapshot_locks: dict[str, asyncio.Lock] = {}
        self._loop_task: asyncio.Task[None] | None = None
        self.ready = False

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Start the guards' fork server, load the cache, adopt or stop survivors, then start
        the lease loop."""
        self.runner.ensure_forkserver()  # first: it warms up while the agent gets ready
        try:
            self._entries = spool_cache.load(self.cache_path)
        except spool_cache.CacheUnreadable as e:
            log.error("agent_cache_unreadable", error_code=e.code, detail=str(e))
            self._entries = {}
        now = self._clock()
        for record, identity in self.runner.survivors():
            area = str(record.get("area", ""))
            entry = self._entries.get(area)
            lease = lease_file.read(self.runner.lease_path(area))
            if identity is None:
                self.runner.forget(area)
                continue
            if (
                entry is not None
                and lease is not None
                and entry.generation == record.get("generation") == lease.generation
                and entry.owner_id == record.get("owner_id") == lease.owner_id
                and entry.run_wanted
            ):
                remaining = min(
                    lease.expires_at_wall - time.time(),
                    lease.expires_at_boottime - lease_file.boottime(),
                )
                command = area_runner.recorded_command(record, identity)
                if command is not None and command != tuple(entry.spec.command):
                    gone = await self.runner.stop_survivor(identity, area)
                    log.warning("survivor_replaced", area=area, pid=identity.pid,
                                reason="command_changed", verified_gone=gone,
                                was=list(command), now=list(entry.spec.command))
                    continue
                if remaining > 0:
                    self._entries[area] = replace(entry, lease_expires=now + remaining)
                    self._handles[area] = self.runner.adopt(entry.spec, identity)
                    self._started_mono[area] = now
                    log.info("guard_adopted", area=area, generation=entry.generation,
                             pid=identity.pid, lease_remaining_s=round(remaining, 3))
                    continue
            gone = await self.runner.stop_survivor(identity, area)
            log.warning("survivor_stopped", area=area, pid=identity.pid, verified_gone=gone)
        for path in self.runner.leases_dir.glob("*.json"):
            if path.stem not in self._handles:
                path.unlink(missing_ok=True)
        for stuck in await self.runner.empty_leftover_cgroups(
                keep={h.cgroup for h in self._handles.values() if h.cgroup is not None}):
            log.error("cgroup_leftover_stuck", cgroup=stuck, error_code="CLEANUP_STUCK")
        # Ready only once guards can be forked (or it is late: then they start as commands),
        # so that the first areas after a start do not each cost an interpreter of their own.
        if not await self.runner.forkserver_listening(within_s=_FORKSERVER_WAIT_S):
            log.warning("guard_forkserver_not_listening", within_s=_FORKSERVER_WAIT_S)
        self._loop_task = asyncio.create_task(self._lease_loop(), name="agent lease loop")
        self._loop_task.add_done_callback(self._loop_ended)
        self.ready = True
        fences = self.runner.fences
        log.info("agent_started", dir=str(self.base_dir), entries=len(self._entries),
                 adopted=len(self._handles),
                 fence="cgroup" if fences.by_cgroup else "process_group",
                 cgroup=fences.base, fence_why=fences.why or None)

    def _loop_ended(self, task: asyncio.Task[None]) -> None:
        """The lease loop must never end on its own: escalate (the agent exits, its guards
        keep fencing, and the launcher or systemd starts a fresh agent)."""
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            self.ready = False
            log.critical("lease_loop_failed", error=repr(error), exc_info=error)
            if self._on_fatal is not None:
                self._on_fatal(error)

    async def close(self) -> None:
        """Stop the lease loop; daemons stay under their guards (see module docstring)."""
        self.ready = False
        task, self._loop_task = self._loop_task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        self.runner.close()
        log.info("agent_stopped", running=len(self._handles))

    # -- requests --------------------------------------------------------------------

    def _lock(self, area: str) -> asyncio.Lock:
        lock = self._locks.get(area)
        if lock is None:
            lock = self._locks[area] = asyncio.Lock()
        return lock

    def validate_data_dir(self, data_dir: str) -> str:
        path = Path(data_dir)
        if not path.is_absolute():
            path = self.base_dir / path
        resolved = path.resolve()
        if resolved == self.base_dir or not resolved.is_relative_to(self.base_dir):
            raise bad_request(f"data_dir must be inside the agent dir {self.base_dir}")
        return str(resolved)

    async def create(self, spec: AreaSpec, *, ttl_s: float) -> tuple[str, dict[str, Any]]:
        """PUT /v1/areas/{area}: create (or confirm) an entry, grant its lease, start it."""
        async with self._lock(spec.area):
            now = self._clock()
            existing = self._entries.get(spec.area)
            handle = self._handles.get(spec.area)
            decision = lease_table.decide_create(
                existing, spec, now=now, process_alive=handle is not None and not handle.exited()
            )
            if decision.verdict is CreateVerdict.CONFLICT:
                raise AgentError(code="DESTINATION_CONFLICT", detail=decision.detail, status=409)
            if decision.verdict in (
                CreateVerdict.SUPERSEDE, CreateVerdict.TAKE_OVER, CreateVerdict.UPDATE
            ):
                assert existing is not None
                await self._stop_process(spec.area, fence=False)
                log.warning("entry_replaced", area=spec.area, old_generation=existing.generation,
                            old_owner=existing.owner_id, generation=spec.generation,
                            reason=decision.detail)
            if existing is not None and decision.verdict in (
                CreateVerdict.SAME, CreateVerdict.UPDATE
            ):
                entry = replace(existing, spec=spec)
            else:
                entry = AreaEntry(spec=spec, created_at=time.time())
            entry = replace(entry, run_wanted=True, next_start=0.0).granted(now=now, ttl_s=ttl_s)
            self.runner.grant(spec, ttl_s=ttl_s)
            self._entries[spec.area] = entry
            spool_cache.save(self.cache_path, self._entries.values())
            self._start_if_due(spec.area)
            result = {CreateVerdict.SAME: "unchanged", CreateVerdict.UPDATE: "updated"}.get(
                decision.verdict, "created"
            )
            log.info("area_" + result, area=spec.area, service=spec.service,
                     generation=spec.generation, owner_id=spec.owner_id)
            return result, self._entry_view(spec.area, now=self._clock())

    async def stop(self, area: str, *, generation: int) -> dict[str, Any]:
        """POST /v1/areas/{area}/stop: stop the process at that generation, keep the entry."""
        async with self._lock(area):
            entry = self._generation_checked(area, generation)
            if entry is None:
                return {"area": area, "result": "absent"}
            self._entries[area] = replace(entry, run_wanted=False)
            spool_cache.save(self.cache_path, self._entries.values())
            await self._stop_process(area, fence=False)
            await asyncio.to_thread(self._hand_back, entry.spec)
            log.info("area_stopped", area=area, generation=generation)
            return {"area": area, "result": "stopped", "generation": generation}

    def _hand_back(self, spec: AreaSpec) -> None:
        """After a verified stop, give a service user's data back to the agent's own user:
        the copy that follows (over SFTP, as the SSH user the agent runs as) must read files
        the daemon created 0600. The next start hands it over again (area_runner)."""
        data_dir = Path(spec.data_dir)
        if spec.user is None and spec.group is None or not data_dir.is_dir():
            return
        if not data_dir.is_relative_to(self.base_dir) or data_dir == self.base_dir:
            return
        agent = run_as.RunAs(uid=os.getuid(), gid=os.getgid(), groups=())
        try:
            run_as.hand_over(data_dir, agent)
        except OSError as e:  # no CAP_CHOWN: the copy will say what it cannot read
            log.warning("area_hand_back_failed", area=spec.area, data_dir=str(data_dir),
                        detail=e.strerror or str(e))

    async def delete(self, area: str, *, generation: int, aside: bool = False
                     ) -> dict[str, Any]:
        """DELETE /v1/areas/{area}: stop, then remove the data, the lease and the entry.
        If the data cannot be removed the entry stays (stopped) and the caller retries.
        With `aside` (a copy the operator gave up) the data dir is moved to
        `{dir}/abandoned/{area}-g{generation}-{time}` instead, for forensics."""
        async with self._lock(area):
            entry = self._generation_checked(area, generation)
            if entry is None:
                return {"area": area, "result": "absent"}
            self._entries[area] = replace(entry, run_wanted=False)
            spool_cache.save(self.cache_path, self._entries.values())
            await self._stop_process(area, fence=False)
            data_dir = Path(entry.spec.data_dir)
            set_aside = None
            if data_dir.is_relative_to(self.base_dir) and data_dir != self.base_dir:
                if aside:
                    set_aside = self._set_aside(area, generation, data_dir)
                else:
                    try:
                        shutil.rmtree(data_dir)
                    except FileNotFoundError:
                        pass
                    except OSError as e:
                        raise AgentError(
                            code="CLEANUP_STUCK",
                            detail=f"area {area}: cannot remove {data_dir}: {e.strerror or e}",
                            status=500,
                        ) from e
                # what a copy left for the dir: its copy dir (caches, a staging dir), and a
                # previous release's cache file beside it (monitord.base.tree_digest.forget)
                try:
                    tree_digest.forget(data_dir)
                except OSError as e:
                    raise AgentError(
                        code="CLEANUP_STUCK",
                        detail=f"area {area}: cannot remove the copy dir of {data_dir}:"
                               f" {e.strerror or e}",
                        status=500,
                    ) from e
            self.runner.revoke(area)
            del self._entries[area]
            spool_cache.save(self.cache_path, self._entries.values())
            log.info("area_deleted", area=area, generation=generation, set_aside=set_aside)
            return {"area": area, "result": "deleted", "generation": generation,
                    "set_aside": set_aside}

    def _set_aside(self, area: str, generation: int, data_dir: Path) -> str | None:
        """Move a given-up area's data dir aside (a rename within the agent's dir); where it
        went, or None when there was no data dir."""
        if not data_dir.is_dir():
            return None
        aside_dir = self.base_dir / names.ABANDONED_DIR
        aside_dir.mkdir(mode=0o700, exist_ok=True)
        target = aside_dir / names.set_aside_name(area, generation, int(time.time()))
        try:
            os.rename(data_dir, target)
        except OSError as e:
            raise AgentError(
                code="CLEANUP_STUCK",
                detail=f"area {area}: cannot set {data_dir} aside: {e.strerror or e}",
                status=500,
            ) from e
        return str(target)

    async def remove_set_aside(self, name: str) -> dict[str, Any]:
        """DELETE /v1/abandoned/{name}: remove one copy `delete(aside=True)` set aside, once
        the PBX's keep time for it has passed ("absent" when it is gone already). Only a
        plain directory directly inside `{dir}/abandoned` is removed, never through a link."""
        target = self.base_dir / names.ABANDONED_DIR / name
        try:
            if not stat.S_ISDIR(os.lstat(target).st_mode):
                raise AgentError(code="CLEANUP_STUCK", status=409,
                                 detail=f"{target} is not a directory: left as it is")
            await asyncio.to_thread(shutil.rmtree, target)
        except FileNotFoundError:
            return {"name": name, "result": "absent"}
        except OSError as e:
            raise AgentError(code="CLEANUP_STUCK", status=500,
                             detail=f"cannot remove {target}: {e.strerror or e}") from e
        tree_digest.forget(target)  # what a forensic fetch's listing left beside it
        log.info("set_aside_removed", path=str(target))
        return {"name": name, "result": "deleted"}

    async def promote(self, area: str, *, data_dir: str, expect: str) -> dict[str, Any]:
        """POST /v1/areas/{area}/promote: an upload's last step, here rather than in a new
        process (inside the area's downtime). The staging dir of `data_dir` is digested
        (every file fsynced) in a thread, and swapped in for `data_dir` only if its listing's
        SHA-256 is `expect`; `promoted` says which. Never under a running daemon of the area
        (409 DESTINATION_CONFLICT): its files would change under it."""
        async with self._lock(area):
            handle = self._handles.get(area)
            if handle is not None and not handle.exited():
                raise AgentError(
                    code="DESTINATION_CONFLICT", status=409,
                    detail=f"area {area} runs here (generation {handle.spec.generation}):"
                           " its data dir is not replaced under it",
                )
            try:
                promoted = await asyncio.to_thread(
                    tree_digest.verify_and_promote, Path(data_dir), expect
                )
            except OSError as e:
                raise copy_step_error(e, area=area, doing=f"promote {data_dir}",
                                      path=Path(data_dir)) from e
        log.info("area_data_promoted" if promoted else "area_data_differs", area=area,
                 data_dir=data_dir)
        return {"area": area, "promoted": promoted}

    async def staging(self, area: str, *, data_dir: str, action: str) -> dict[str, Any]:
        """POST /v1/areas/{area}/staging: the other two steps of a copy to the VPS that used
        to be a shell and a Python start each. "reset": the staging dir of `data_dir`
        made empty, its digest cache gone (where a copy starts); "digest": its listing,
        every file fsynced (what a pre-copy delivered); "blocks": the block digests of
        every file it holds (what a copy cut by the link left: where the next one resumes,
        tree_digest.staged_blocks). None touches `data_dir` itself."""
        doing = f"{action} the staging dir of {data_dir}"
        if action == "reset":
            await self._copy_step(area, doing, tree_digest.reset_staging, Path(data_dir))
            return {"area": area, "action": action}
        if action == "blocks":
            found = await self._copy_step(area, doing, tree_digest.staged_blocks,
                                          Path(data_dir))
            return {"area": area, "action": action, "blocks": None if found is None else {
                rel: None if b is None else {"size": b.size, "digests": _encoded(b.digests)}
                for rel, b in found.items()}}
        listing = await self._copy_step(area, doing, tree_digest.staging_listing,
                                        Path(data_dir))
        return {"area": area, "action": action, "listing": _encoded(listing)}

    async def listing(self, area: str, *, data_dir: str) -> dict[str, Any]:
        """POST /v1/areas/{area}/listing: `data_dir`'s own listing with its digest cache (what
        the tree-digest verb prints for it), the first step of a copy from the VPS — read
        while the area may still run here (a pre-copy) or after its stop."""
        listing = await self._copy_step(area, f"list {data_dir}", tree_digest.cached_listing,
                                        Path(data_dir))
        return {"area": area, "listing": _encoded(listing)}

    async def blocks(self, area: str, *, data_dir: str, paths: Sequence[str],
                     limit: int, known: Mapping[str, bytes]) -> dict[str, Any]:
        """POST /v1/areas/{area}/copy/blocks: the block digests of each of `paths` in
        `data_dir` (tree_digest.file_blocks), what a copy to the PBX needs to fetch only the
        blocks its own copy lacks — of a name in `known` (the PBX's summary of its copy),
        those of the 64 KiB groups that differ only, with their indices
        (orchestrator/block_delta.changed_groups): after the stop a live store's answer is
        its changed pages' groups, not a digest per page of the whole store. A name that is
        no regular file there, or whose digests would take the answer past `limit` bytes,
        is answered null: the PBX fetches it whole."""
        def work(root: Path) -> dict[str, Any]:
            answered: dict[str, Any] = {}
            left = limit
            for rel in paths:
                found = tree_digest.file_blocks(root, rel)
                if found is None:
                    answered[rel] = None
                    continue
                changed = block_delta.changed_groups(found, known[rel]) if rel in known else None
                digests = found.digests if changed is None else changed.digests
                if len(digests) > left:
                    answered[rel] = None
                    continue
                left -= len(digests)
                answered[rel] = {"size": found.size, "digests": _encoded(digests)}
                if changed is not None:
                    answered[rel]["groups"] = list(changed.groups)
            return answered

        answered = await self._copy_step(area, f"digest blocks in {data_dir}", work,
                                         Path(data_dir))
        return {"area": area, "blocks": answered}

    async def snapshot(self, area: str, *, data_dir: str, generation: int,
                       sqlite: Sequence[str] = (), command: Sequence[str] | None = None,
                       timeout_s: float = 60.0) -> dict[str, Any]:
        """POST /v1/areas/{area}/copy/snapshot: a consistent snapshot of the area's live data
        dir in `tree_digest.warm_dir(data_dir)` (monitord.vps.warm_snapshot.take, in a
        thread), which the copy routes then read as a data dir: a warm copy's source. Only
        for an area held here at exactly `generation` with that data dir (409
        WARM_COPY_REFUSED otherwise, 404 UNKNOWN_AREA without an entry). A request for an
        area whose snapshot is under way waits for it, under the area's snapshot lock, never
        its lock. A snapshot that cannot be whole is 409 WARM_COPY_FAILED; the previous one
        stays either way. `command`: the service's own snapshot command instead, run as the
        area's daemon runs (its user and group, its env) with `timeout_s` to finish."""
        path = Path(data_dir)
        async with self._snapshot_lock(area):
            self._check_snapshot(area, data_dir=data_dir, generation=generation)
            try:
                run = None if command is None else self._snapshot_command(
                    area, command, timeout_s=timeout_s)
                taken = await asyncio.to_thread(warm_snapshot.take, path, sqlite=sqlite,
                                                command=run)
            except warm_snapshot.SnapshotFailed as e:
                raise AgentError(code="WARM_COPY_FAILED", status=409,
                                 detail=f"area {area}: {e.detail}") from e
            except OSError as e:
                raise copy_step_error(e, area=area, doing=f"take a snapshot of {data_dir}",
                                      path=path) from e
            if area not in self._entries:  # deleted meanwhile: what it left goes with it
                try:
                    await asyncio.to_thread(warm_snapshot.discard, path)
                except OSError as e:
                    raise copy_step_error(e, area=area, path=path,
                                          doing=f"remove the snapshot of {data_dir}") from e
            self._check_snapshot(area, data_dir=data_dir, generation=generation)
        log.info("area_warm_snapshot", area=area, generation=generation, files=taken["files"],
                 bytes=taken["bytes"], took_s=taken["took_s"], cpu_s=taken["cpu_s"])
        return {"area": area, "generation": generation,
                "dir": str(tree_digest.warm_dir(path)), **taken}

    async def discard_snapshot(self, area: str, *, data_dir: str) -> dict[str, Any]:
        """POST /v1/areas/{area}/copy/snapshot/discard: the snapshots of `data_dir` removed
        (a warm copy fetched it), under the area's snapshot lock: never one being taken."""
        path = Path(data_dir)
        async with self._snapshot_lock(area):
            try:
                await asyncio.to_thread(warm_snapshot.discard, path)
            except OSError as e:
                raise copy_step_error(e, area=area, path=path,
                                      doing=f"remove the snapshot of {data_dir}") from e
        return {"area": area, "discarded": True}

    def _snapshot_command(self, area: str, argv: Sequence[str], *, timeout_s: float
                          ) -> warm_snapshot.Command:
        """A service's snapshot command, to run as the area's daemon runs: its user and
        group (ServiceUserUnknown, an OSError, when they are gone), its environment."""
        spec = self._entries[area].spec
        who = run_as.resolve(user=spec.user, group=spec.group)
        env = vps_environment({**os.environ, **run_as.login_environment(who), **spec.env})
        return warm_snapshot.Command(
            argv=tuple(argv), env=env, popen=run_as.popen_kwargs(who), timeout_s=timeout_s,
            hand_over=None if who is None else functools.partial(run_as.hand_over, who=who))

    def _snapshot_lock(self, area: str) -> asyncio.Lock:
        lock = self._snapshot_locks.get(area)
        if lock is None:
            lock = self._snapshot_locks[area] = asyncio.Lock()
        return lock

    def _check_snapshot(self, area: str, *, data_dir: str, generation: int) -> None:
        """Raise unless `area` is held here at `generation` with `data_dir` (see snapshot)."""
        entry = self._entries.get(area)
        if entry is None:
            raise AgentError(code="UNKNOWN_AREA", status=404, detail=f"no entry for {area}")
        if entry.generation != generation:
            raise AgentError(code="WARM_COPY_REFUSED", status=409,
                             detail=f"area {area} is at generation {entry.generation},"
                                    f" not {generation}")
        if entry.spec.data_dir != data_dir:
            raise AgentError(code="WARM_COPY_REFUSED", status=409,
                             detail=f"area {area}'s data dir is {entry.spec.data_dir},"
                                    f" not {data_dir}")

    async def _copy_step(self, area: str, doing: str, work: Callable[[Path], T],
                         path: Path) -> T:
        """`work(path)` in a thread, under the area's lock; a file system error is a 500
        COPY_INCOMPLETE naming what it was `doing`."""
        async with self._lock(area):
            try:
                return await asyncio.to_thread(work, path)
            except OSError as e:
                raise copy_step_error(e, area=area, doing=doing, path=path) from e

    async def renew(
        self, *, owner_id: str, ttl_s: float, areas: Mapping[str, int]
    ) -> dict[str, Any]:
        """POST /v1/leases/renew: the grant. Renews exact (area, generation, owner) matches
        and starts any granted entry that should run and has no process.

        Deliberately without the area locks: the body per area has no await, so it is atomic
        on the event loop, and a slow stop of one area must never delay (and so lapse) the
        renewal of the others. It cannot start a second process: an area being stopped or
        replaced still has its handle until the old process is verified gone."""
        results: dict[str, Any] = {}
        for area, generation in areas.items():
            if not names.is_valid(area):
                results[area[:200]] = {"result": lease_table.RenewOutcome.INVALID.value}
                continue
            existing = self._entries.get(area)
            outcome = lease_table.decide_renew(existing, owner_id=owner_id, generation=generation)
            view: dict[str, Any] = {"result": outcome.value}
            if existing is not None and outcome is lease_table.RenewOutcome.RENEWED:
                now = self._clock()
                if existing.worth_a_rewrite(now=now, ttl_s=ttl_s):
                    self.runner.grant(existing.spec, ttl_s=ttl_s)
                    self._entries[area] = existing.granted(now=now, ttl_s=ttl_s)
                self._start_if_due(area)
                view.update(self._lease_view(self._entries[area], now=now))
            elif existing is not None:
                view.update(generation=existing.generation, owner_id=existing.owner_id)
            results[area] = view
        return {"owner_id": owner_id, "ttl_s": ttl_s, "areas": results}

    def _generation_checked(self, area: str, generation: int) -> AreaEntry | None:
        entry = self._entries.get(area)
        check = lease_table.check_generation(entry, generation)
        if check is GenerationCheck.MISMATCH:
            assert entry is not None
            raise AgentError(
                code="DESTINATION_CONFLICT",
                detail=f"area {area} is at generation {entry.generation}, not {generation}",
                status=409,
            )
        return entry

    # -- processes -------------------------------------------------------------------

    def _start_if_due(self, area: str) -> None:
        """Spawn the guard if the entry should run and has no process. Caller holds the lock."""
        entry = self._entries.get(area)
        if entry is None or area in self._handles or not entry.should_run(self._clock()):
            return
        try:
            spec = entry.spec
            self._handles[area] = self.runner.spawn(
                spec, user=spec.user, group=spec.group,
                log_max_bytes=spec.log_max_bytes or log_sink.DEFAULT_MAX_BYTES,
                log_keep=spec.log_keep if spec.log_keep >= 0 else log_sink.DEFAULT_KEEP,
            )
        except OSError as e:
            restarts = entry.restarts + 1
            delay = lease_table.restart_delay_s(restarts)
            next_start = self._clock() + delay
            self._entries[area] = replace(entry, restarts=restarts, next_start=next_start)
            log.error("daemon_spawn_failed", area=area, generation=entry.generation,
                      detail=f"{e.strerror or e}: {e.filename}", restart_in_s=delay)
            return
        self._started_mono[area] = self._clock()
        log.info("daemon_started", area=area, generation=entry.generation,
                 guard_pid=self._handles[area].pid, restarts=entry.restarts,
                 guard_forked=self._handles[area].popen is None)

    async def _stop_process(self, area: str, *, fence: bool) -> None:
        """Stop the area's guard and daemon, verified. Caller holds the lock."""
        handle = self._handles.get(area)
        if handle is None:
            return
        if not await self.runner.stop(handle, fence=fence):
            raise AgentError(
                code="CLEANUP_STUCK",
                detail=f"area {area}: guard {handle.pid} or its daemon did not go away",
                status=500,
            )
        del self._handles[area]

    async def _lease_loop(self) -> None:
        while True:
            await asyncio.sleep(self._tick_s)
            now = self._clock()
            self.runner.learn_daemons(list(self._handles.values()))
            due = [area for area in list(self._entries) if self._needs_care(area, now)]
            if due:
                await asyncio.gather(*(self._tend(area) for area in due))

    def _needs_care(self, area: str, now: float) -> bool:
        if self._lock(area).locked():
            return False
        entry = self._entries[area]
        handle = self._handles.get(area)
        if handle is not None:
            return handle.exited() or not entry.lease_current(now)
        return entry.should_run(now) or (
            entry.lease_expires is not None and not entry.lease_current(now)
        )

    async def _tend(self, area: str) -> None:
        async with self._lock(area):
            entry = self._entries.get(area)
            if entry is None:
                return
            now = self._clock()
            handle = self._handles.get(area)
            if handle is not None and handle.exited():
                if not await self.runner.reap_orphaned_daemon(handle):
                    log.error("orphaned_daemon_stuck", area=area, error_code="CLEANUP_STUCK",
                              pid=handle.daemon.pid if handle.daemon else None)
                    return  # keep the handle: never start a second process beside it
                del self._handles[area]
                self.runner.forget(area)
                ran_s = now - self._started_mono.pop(area, now)
                restarts = 1 if ran_s >= _RESET_BACKOFF_AFTER_S else entry.restarts + 1
                delay = lease_table.restart_delay_s(restarts)
                self._entries[area] = entry = replace(
                    entry, restarts=restarts, next_start=now + delay
                )
                log.warning("daemon_exited", area=area, generation=entry.generation,
                            status=handle.exit_status(), ran_s=round(ran_s, 3),
                            restart_in_s=delay)
            elif handle is not None and not entry.lease_current(now):
                log.warning("lease_lapsed", area=area, generation=entry.generation,
                            owner_id=entry.owner_id, error_code="LEASE_EXPIRED")
                try:
                    await self._stop_process(area, fence=True)
                except AgentError as e:
                    log.error("fence_failed", area=area, error_code=e.code, detail=e.detail)
                    return
            if not entry.lease_current(now) and entry.lease_expires is not None:
                self._entries[area] = entry.lapsed()
                self.runner.revoke(area)
                return
            self._start_if_due(area)

    # -- views -----------------------------------------------------------------------

    def _lease_view(self, entry: AreaEntry, *, now: float) -> dict[str, Any]:
        if entry.lease_expires is None:
            return {"lease_expires_in_s": None, "lease_expires_at": None}
        remaining = max(0.0, entry.lease_expires - now)
        return {
            "generation": entry.generation,
            "lease_expires_in_s": round(remaining, 3),
            "lease_expires_at": time.time() + remaining,
        }

    def _entry_view(self, area: str, *, now: float) -> dict[str, Any]:
        entry = self._entries[area]
        handle = self._handles.get(area)
        running = handle is not None and not handle.exited()
        return {
            "area": area,
            "service": entry.spec.service,
            "generation": entry.generation,
            "owner_id": entry.owner_id,
            "created_at": entry.created_at,
            "state": entry.state(now=now, process_running=running).value,
            "run_wanted": entry.run_wanted,
            "data_dir": entry.spec.data_dir,
            "restarts": entry.restarts,
            "next_start_in_s": round(max(0.0, entry.next_start - now), 3),
            **self._lease_view(entry, now=now),
        }

    def inventory(self) -> dict[str, Any]:
        """GET /v1/inventory: entries with their lease, and the processes actually running."""
        now = self._clock()
        handles = [h for h in self._handles.values() if not h.exited()]
        daemons = self.runner.daemons(handles)
        since_boot = proc_identity.seconds_since_boot()
        processes: list[dict[str, Any]] = []
        for handle in handles:
            identity = daemons.get(handle.pid)
            processes.append(
                {
                    "area": handle.spec.area,
                    "service": handle.spec.service,
                    "generation": handle.spec.generation,
                    "guard_pid": handle.pid,
                    # the daemon; the guard while the daemon is not (yet, or no longer) up
                    "pid": identity.pid if identity else handle.pid,
                    "started_at": proc_identity.started_at(identity) if identity else None,
                    "uptime_s": round(proc_identity.uptime_s(identity, since_boot=since_boot), 3)
                    if identity else 0.0,
                    "alive": identity is not None,
                    "adopted": handle.adopted,
                }
            )
        return {
            "agent": {"dir": str(self.base_dir), "now": time.time(), "ready": self.ready},
            "host": host_memory.read(),  # the VPS's memory, for the PBX's status
            "entries": [self._entry_view(area, now=now) for area in sorted(self._entries)],
            "processes": processes,
        }

    async def health(
        self, area: str, *, generation: int, min_uptime_s: float, wait_s: float
    ) -> dict[str, Any]:
        """GET /v1/areas/{area}/health: whether the area's daemon at `generation` has run
        for `min_uptime_s`, waiting up to `wait_s` (at most MAX_HEALTH_WAIT_S) for that.
        The agent sleeps until the moment the daemon's own start time says the window
        closes, then looks again; so the answer comes then, not at the asker's next poll,
        and one question replaces a full inventory per look."""
        deadline = self._clock() + max(0.0, min(wait_s, MAX_HEALTH_WAIT_S))
        while True:
            daemon = self._daemon_at(area, generation)
            uptime = None if daemon is None else proc_identity.uptime_s(daemon)
            healthy = uptime is not None and uptime >= min_uptime_s
            now = self._clock()
            if healthy or now >= deadline:
                return {
                    "area": area,
                    "generation": generation,
                    "running": daemon is not None,
                    "pid": None if daemon is None else daemon.pid,
                    "uptime_s": None if uptime is None else round(uptime, 3),
                    "healthy": healthy,
                }
            wait = _HEALTH_POLL_S if uptime is None else min_uptime_s - uptime
            await asyncio.sleep(max(0.0, min(wait, deadline - now)))

    def _daemon_at(self, area: str, generation: int) -> proc_identity.ProcessIdentity | None:
        """The running daemon of `area` at exactly `generation`, if any."""
        handle = self._handles.get(area)
        if handle is None or handle.spec.generation != generation or handle.exited():
            return None
        return self.runner.daemons([handle]).get(handle.pid)

    def entry(self, area: str) -> dict[str, Any] | None:
        if area not in self._entries:
            return None
        return self._entry_view(area, now=self._clock())

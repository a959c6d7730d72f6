"""The local supervisor: runs exactly the local areas it is told to, one process per area.

A root task of `monitord run` ("local supervisor"); the migration engine and the reconciler
drive it through `set_desired()`, `start_area()` and `stop_area()` and read `inventory()`.

- Each daemon runs in a session of its own (its PID is its process group), with two markers
  in its environment: MONITORD_SUPERVISOR={state_dir} and MONITORD_AREA={area}. Its stdout
  and stderr are the area's FIFO in `{state_dir}/log-pipes/`, which the side's one log hub
  (monitord/base/log_hub.py, a process in a session of its own that outlives monitord)
  copies into `{state_dir}/logs/{area}.log`, size-capped and rotated. The supervisor holds
  each FIFO while its area runs here (restarts reuse it), starts the hub when none runs
  (checked every second by the supervising pass), and lets a stopped area's FIFO go once the
  hub holds it, so that no daemon's last words are lost while no hub runs.
- A service with a `user` / `group` runs as them: resolved before each start (unknown:
  SERVICE_USER_UNKNOWN, retried with backoff), its data dir handed over to them, and the
  daemon started with setgroups/setgid/setuid and no capabilities
  (monitord/base/run_as.py).
- Where monitord owns a cgroup v2 (monitord/base/cgroup_fence.py: decided once, here, and
  said in `{state_dir}/fencing.json` for `monitord check`), each daemon runs in a cgroup of
  its own, `{own cgroup}/areas-…/{area}@{generation}`, which it enters between fork and exec:
  every fence below then also empties that cgroup (cgroup.kill), so a child that left the
  daemon's process group (setsid()) goes with it. Elsewhere the process group alone fences.
- A per-area record `{state_dir}/records/{area}.json` (written atomically right after the
  spawn) names the process by pid + start time, its generation, the configured command and
  its cgroup.
- A daemon that exits is restarted after a capped exponential backoff that never gives up
  (reset once a run lasted `min_uptime_s`); the next retry time is in the inventory.
- Stop = SIGTERM to the process group, a grace period, SIGKILL, then verified gone, and the
  area's cgroup killed and verified empty.
- `adopt_or_stop_survivors()` runs before anything starts: every process a previous
  instance left — found by its record, and also by the environment marker, which catches
  one spawned just before a crash and not yet recorded — is adopted when its identity
  matches, it is wanted at that generation and it runs the wanted command (resolved
  executable and arguments: a `#!` script's or a wrapper's argv is not its command), replaced
  with the reason logged when only its command changed, and stopped otherwise. Never a
  duplicate. A marked process in the recorded cgroup of a live daemon is that daemon's (a
  child that left its group): it goes with it. Then every area cgroup not adopted is emptied.
- `close()` stops supervising but leaves the daemons running: the next instance adopts them.
- The supervising passes run under the root loops' error policy (monitord/base/periodic.py):
  a pass that raises is counted and shown, and the next pass runs after a back-off.
See docs/supervisor.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import monitord
from monitord.base import (
    area_paths,
    atomic_file,
    cgroup_fence,
    group_stop,
    log_hub,
    log_sink,
    logs,
    proc_identity,
    run_as,
)
from monitord.base.config import ServiceSection
from monitord.base.periodic import LoopBook, Periodic
from monitord.base.proc_identity import ProcessIdentity
from monitord.base.task_owner import TaskOwner

SUPERVISOR_ENV = "MONITORD_SUPERVISOR"
AREA_ENV = "MONITORD_AREA"
GENERATION_ENV = "MONITORD_GENERATION"
TASK_NAME = "local supervisor"
EXITS_KEPT = 256  # per area: enough to count an hour of a fast crash loop's back-off
LOG_DRAIN_S = 2.0  # a stop waits this long for the hub to write the daemon's last words
CGROUP_EMPTY_S = 2.0  # what is left in an area's cgroup gets this long to die of cgroup.kill
_LOG_DRAIN_POLL_S = 0.005

log = logs.get_logger(__name__)


@dataclass(frozen=True)
class AreaRun:
    """One area to run locally: what to start and at which generation."""

    service: str
    area: str
    generation: int
    command: tuple[str, ...]
    data_dir: str
    env: Mapping[str, str] = field(default_factory=dict)
    min_uptime_s: float = 3.0
    user: str | None = None  # run the daemon as this user / group (None: as monitord)
    group: str | None = None


def area_run(*, service: str, section: ServiceSection, area: str, generation: int) -> AreaRun:
    """The local AreaRun of a configured service (command and data dir templates expanded)."""
    data_dir = area_paths.local_data_dir_text(section, area=area, generation=generation)
    command = area_paths.local_command(section, area=area, generation=generation)
    return AreaRun(service=service, area=area, generation=generation, command=command,
                   data_dir=data_dir, env=dict(section.env),
                   min_uptime_s=section.min_uptime_s, user=section.user, group=section.group)


@dataclass(frozen=True)
class ProcessView:
    """One area as the supervisor sees it (the inventory row)."""

    area: str
    service: str
    generation: int
    state: str  # running | backoff | stopped
    pid: int | None
    started_at: float | None  # wall clock, from the kernel's start time
    uptime_s: float
    restarts: int
    next_retry_at: float | None  # wall clock
    last_exit_status: int | None
    adopted: bool
    restarts_1h: int = 0  # exits in the last hour (each one followed by a restart)
    failures: int = 0  # consecutive runs shorter than min_uptime_s (the back-off count)

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(slots=True)
class _Ended:
    """The survivors stopped, replaced (stopped for a changed command) and stuck so far."""

    stopped: list[str] = field(default_factory=list)
    replaced: list[str] = field(default_factory=list)
    stuck: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class SurvivorReport:
    """What `adopt_or_stop_survivors` found: areas adopted, processes stopped."""

    adopted: tuple[str, ...]
    stopped: tuple[str, ...]
    stuck: tuple[str, ...]  # could not be verified gone
    replaced: tuple[str, ...] = ()  # stopped because their configured command changed


@dataclass
class _Slot:
    """Mutable per-area runtime state; only touched under that area's lock."""

    run: AreaRun
    identity: ProcessIdentity | None = None
    popen: subprocess.Popen[bytes] | None = None
    started_mono: float = 0.0
    failures: int = 0
    restarts: int = 0
    next_start: float = 0.0
    last_exit_status: int | None = None
    adopted: bool = False
    cgroup: str | None = None  # the area run's cgroup (cgroup_fence), None: its group alone
    # When it exited lately (wall clock, the last hour's): `restarts_1h` of the status.
    exits: deque[float] = field(default_factory=lambda: deque(maxlen=EXITS_KEPT))

    def running(self) -> bool:
        return self.identity is not None

    def exited(self) -> bool:
        if self.identity is None:
            return False
        if self.popen is not None:
            return proc_identity.child_has_exited(self.popen)
        return not proc_identity.is_same_process(self.identity)


@dataclass(frozen=True)
class _Record:
    """`{state_dir}/records/{area}.json`: the process a spawn started, and the configured
    command it was started with (None in a record of a release before it was written)."""

    area: str
    generation: int
    identity: ProcessIdentity
    command: tuple[str, ...] | None
    log_pipe: str | None = None  # the FIFO name of its output (None: an older release's sink)
    cgroup: object = None  # its cgroup as recorded (cgroup_fence.recorded_dir judges it)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> _Record:
        command = data.get("command")
        log_pipe = data.get("log_pipe")
        return cls(area=str(data["area"]), generation=int(data["generation"]),
                   identity=ProcessIdentity.from_json(data["identity"]),
                   command=None if command is None else tuple(str(p) for p in command),
                   log_pipe=None if log_pipe is None else str(log_pipe),
                   cgroup=data.get("cgroup"))


def _search_path(env: Mapping[str, str] | None) -> str:
    """The PATH a spawn with `env` searches (subprocess: os.get_exec_path of the env)."""
    return os.pathsep.join(os.get_exec_path(dict(env) if env is not None else None))


def _runs_command(
    record: _Record, identity: ProcessIdentity, *, env: Mapping[str, str] | None, want: AreaRun
) -> bool:
    """Whether the survivor runs `want.command`, judged by resolved executable and
    arguments, never by argv text: the command its record says it was started with is the
    same command (proc_identity.same_command); a record without one (an older release's) is
    matched by the argv /proc showed at its spawn or shows now against the forms the wanted
    command takes once it runs (`#!` interpreters, env's program)."""
    want_path = _search_path({**os.environ, **want.env})
    if record.command is not None:
        return proc_identity.same_command(
            record.command, want.command, a_path=_search_path(env) if env is not None
            else want_path, b_path=want_path, cwd=want.data_dir,
        )
    forms = proc_identity.exec_forms(want.command, search_path=want_path, cwd=want.data_dir)
    return record.identity.cmdline in forms or identity.cmdline in forms


class LocalSupervisor:
    """Runs the desired local areas; see the module docstring."""

    def __init__(
        self,
        *,
        state_dir: Path,
        stop_grace_s: float = 10.0,
        backoff_base_s: float = 1.0,
        backoff_cap_s: float = 60.0,
        tick_s: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
        log_max_bytes: int = log_sink.DEFAULT_MAX_BYTES,
        log_keep: int = log_sink.DEFAULT_KEEP,
        loops: LoopBook | None = None,
        fences: cgroup_fence.Fences | None = None,
    ) -> None:
        self.state_dir = state_dir.resolve()
        self.records_dir = self.state_dir / "records"
        self.logs_dir = self.state_dir / "logs"
        for directory in (self.records_dir, self.logs_dir):
            directory.mkdir(parents=True, exist_ok=True)
        # Where the areas' cgroups go, or why they have none (`fences`: a test's choice).
        self.fences = fences if fences is not None else cgroup_fence.prepare(
            cgroup_fence.instance_name(str(self.state_dir)), who="monitord")
        log.info("area_fence", by="cgroup" if self.fences.by_cgroup else "process_group",
                 cgroup=self.fences.base, why=self.fences.why or None)
        try:
            cgroup_fence.write_note(self.state_dir, self.fences)
        except OSError as e:  # only `check` reads it: it then says it does not know
            log.warning("area_fence_not_noted", detail=f"{e.strerror or e}: {e.filename}")
        self.stop_grace_s = stop_grace_s
        self.backoff_base_s = backoff_base_s
        self.backoff_cap_s = backoff_cap_s
        self.log_max_bytes = log_max_bytes
        self.log_keep = log_keep
        hub_env = {k: v for k, v in os.environ.items()
                   if k not in (SUPERVISOR_ENV, AREA_ENV, GENERATION_ENV)}
        hub_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (_package_root(), hub_env.get("PYTHONPATH", "")) if p
        )
        self._pipes = log_hub.LogPipes(
            pipes_dir=str(self.state_dir / "log-pipes"), logs_dir=str(self.logs_dir),
            hub_command=[sys.executable, "-m", "monitord", "log-hub"], hub_env=hub_env,
        )
        self._clock = clock
        self._desired: dict[str, AreaRun] = {}
        self._slots: dict[str, _Slot] = {}
        self.restarts_by_service: dict[str, int] = {}
        self.version = 0  # a daemon started, exited or left its crash loop (the status key)
        self._locks: dict[str, asyncio.Lock] = {}
        self._tasks = TaskOwner(TASK_NAME)  # run() as a task of its own: start()
        self.internal_errors = 0  # unexpected errors converging an area (logged once each)
        self._reported: set[tuple[str, str]] = set()
        self._survivors_handled = False
        # A pass converges every area once per tick (exits, restarts due, the log hub); a
        # wake-up in between, only the areas whose wanted run changed since (`_changed`):
        # every phase of every move changes the wanted set, and a pass over all areas per
        # change made a service's move O(areas²) in this loop.
        self._tick_s = tick_s
        self._changed: set[str] = set()
        self._full_pass_at = 0.0
        self.loop = Periodic(TASK_NAME, iteration=self._pass, interval_s=tick_s, book=loops)

    # -- the engine's API ------------------------------------------------------------

    def set_desired(self, areas: Mapping[str, AreaRun]) -> None:
        """Run exactly these areas (by area id); others are stopped by the loop. The areas
        whose run changed (added, removed, another generation or command) converge at once."""
        old, new = self._desired, dict(areas)
        self._desired = new
        changed = {area for area in old.keys() | new.keys()
                   if old.get(area) is not new.get(area) and old.get(area) != new.get(area)}
        if changed:
            self._changed |= changed
            self.loop.wake()

    def desired(self) -> dict[str, AreaRun]:
        return dict(self._desired)

    async def start_area(self, run: AreaRun) -> ProcessView:
        """Add `run` to the desired set and start it now unless it already runs (at that
        generation). A different generation running is stopped (verified) first."""
        self._desired[run.area] = run
        async with self._lock(run.area):
            await self._converge(run.area)
        return self._view(run.area)

    async def stop_area(self, area: str, *, grace_s: float | None = None) -> bool:
        """Remove `area` from the desired set and stop its process: SIGTERM to its group,
        `grace_s` (default: stop_grace_s), SIGKILL. True once verified gone."""
        self._desired.pop(area, None)
        async with self._lock(area):
            return await self._stop_slot(area, grace_s=grace_s)

    async def stop_area_at(
        self, area: str, generation: int, *, grace_s: float | None = None
    ) -> bool:
        """Stop `area` only if its process runs at exactly `generation` — a newer generation
        is never touched. True once nothing runs there at that generation."""
        async with self._lock(area):
            slot = self._slots.get(area)
            if slot is None or slot.identity is None or slot.run.generation != generation:
                return True
            wanted = self._desired.get(area)
            if wanted is not None and wanted.generation == generation:
                del self._desired[area]
            return await self._stop_slot(area, grace_s=grace_s)

    async def stop_all(self, *, grace_s: float | None = None) -> bool:
        """Stop every area (operator shutdown of the local side). True if all verified gone."""
        self._desired.clear()
        results = await asyncio.gather(
            *(self.stop_area(area, grace_s=grace_s) for area in list(self._slots))
        )
        return all(results)

    def resident_bytes(self, area: str) -> int | None:
        """What the area's daemon holds in memory now (its own process, shared pages
        counted); None when it does not run. A move to the VPS judges its room by it."""
        slot = self._slots.get(area)
        if slot is None or slot.identity is None:
            return None
        return proc_identity.resident_bytes(slot.identity)

    def inventory(self) -> list[ProcessView]:
        areas = sorted(set(self._desired) | set(self._slots))
        since_boot = proc_identity.seconds_since_boot()  # one /proc read for every area
        return [self._view(area, since_boot=since_boot) for area in areas]

    async def adopt_or_stop_survivors(
        self, wanted: Mapping[str, AreaRun] | None = None
    ) -> SurvivorReport:
        """Before anything starts: adopt what a previous instance left if it is ours (its
        record names it by pid + start time, its area and generation agree), it is wanted at
        that generation and it runs the wanted command; replace it (stop, the loop starts
        the new command) if only the command changed; stop everything else."""
        if wanted is not None:
            self.set_desired(wanted)
        adopted: list[str] = []
        ended = _Ended()
        recorded = self._read_records()
        daemons_cgroups = self._live_cgroups(recorded)
        for identity, env in self._survivors(recorded):
            try:
                leads_group = os.getpgid(identity.pid) == identity.pid
            except ProcessLookupError:
                continue
            if identity.pid == os.getpid() or not leads_group:
                continue  # ourselves, or a child inside a daemon's group (stopped with it)
            record = recorded.pop(identity.pid, None)
            in_cgroup = cgroup_fence.cgroup_of(identity.pid, fences=self.fences)
            if record is None and in_cgroup in daemons_cgroups:
                continue  # a child that left a recorded daemon's group: it goes with its cgroup
            if env is not None:
                area = env.get(AREA_ENV, "")
                generation = int(env.get(GENERATION_ENV, "-1") or -1)
            else:  # found by its record alone
                assert record is not None
                area, generation = record.area, record.generation
            verdict = self._survivor_verdict(identity, env=env, record=record, area=area,
                                             generation=generation)
            want = self._desired.get(area)
            if record is not None and record.log_pipe is not None:
                # held from now on: its last words survive its exit (or this stop) even
                # while no hub runs
                self._pipes.adopt(area, record.log_pipe)
            # its recorded cgroup, else the one it is in if that is this run's (a record of
            # a release before cgroups, or none)
            cgroup = (None if record is None else self._recorded_cgroup(record)) or \
                cgroup_fence.recorded_dir(in_cgroup, fences=self.fences, area=area,
                                          generation=generation)
            if verdict == "adopt" and want is not None:
                self._slots[area] = _Slot(run=want, identity=identity, adopted=True,
                                          started_mono=self._clock(), cgroup=cgroup)
                adopted.append(area)
                log.info("survivor_adopted", area=area, generation=generation,
                         pid=identity.pid, marker=env is not None)
                continue
            await self._end_survivor(identity, area=area, generation=generation,
                                     verdict=verdict, record=record, want=want, ended=ended,
                                     cgroup=cgroup)
        for left in recorded.values():
            # a record whose process is gone (or was never ours): drop it
            if not proc_identity.is_same_process(left.identity):
                self._record_path(left.area).unlink(missing_ok=True)
        await self._empty_leftover_cgroups()
        self._survivors_handled = True
        return SurvivorReport(adopted=tuple(adopted), stopped=tuple(ended.stopped),
                              stuck=tuple(ended.stuck), replaced=tuple(ended.replaced))

    def _survivors(
        self, recorded: Mapping[int, _Record]
    ) -> list[tuple[ProcessIdentity, dict[str, str] | None]]:
        """What a previous instance left running: the processes its marker names, and those
        its records name whose marker cannot be read (a daemon that rewrote its
        environment's memory, e.g. setproctitle: its record alone says it is ours)."""
        survivors: list[tuple[ProcessIdentity, dict[str, str] | None]] = list(
            proc_identity.find_by_environ(SUPERVISOR_ENV, str(self.state_dir))
        )
        marked = {identity.pid for identity, _env in survivors}
        for pid, known in recorded.items():
            if pid not in marked:
                live = proc_identity.read(pid)
                if live is not None and live == known.identity:
                    survivors.append((live, None))
        return survivors

    def _recorded_cgroup(self, record: _Record) -> str | None:
        return cgroup_fence.recorded_dir(record.cgroup, fences=self.fences, area=record.area,
                                         generation=record.generation)

    def _live_cgroups(self, recorded: Mapping[int, _Record]) -> set[str]:
        """The cgroups that records name of daemons still running: a marked process found in
        one (and not that daemon) is that daemon's child."""
        return {cgroup for record in recorded.values()
                if (cgroup := self._recorded_cgroup(record)) is not None
                and proc_identity.is_same_process(record.identity)}

    async def _empty_leftover_cgroups(self) -> None:
        """Once survivors are handled: every area cgroup of this instance that no adopted
        daemon runs in is emptied and removed (a child that escaped a daemon which died
        while no monitord ran, an area stopped then)."""
        if self.fences.base is None:
            return
        keep = {slot.cgroup for slot in self._slots.values() if slot.cgroup is not None}
        for path in cgroup_fence.leftovers(self.fences.base, keep=keep):
            try:
                held = cgroup_fence.populated(path)
            except OSError:
                held = True
            gone = await group_stop.empty_cgroup(path, timeout_s=CGROUP_EMPTY_S)
            if held or not gone:
                log.warning("survivor_stopped", cgroup=path, reason="left_in_cgroup",
                            verified_gone=gone)

    async def _end_survivor(
        self, identity: ProcessIdentity, *, area: str, generation: int, verdict: str,
        record: _Record | None, want: AreaRun | None, ended: _Ended, cgroup: str | None,
    ) -> None:
        """Stop a survivor not adopted (replaced when only its command changed), verified,
        with whatever else is in its cgroup."""
        gone = await group_stop.terminate_group(identity.pid, grace_s=self.stop_grace_s)
        if gone and cgroup is not None:
            gone = await group_stop.empty_cgroup(cgroup, timeout_s=CGROUP_EMPTY_S)
        if not gone:
            ended.stuck.append(area)
        if verdict == "command_changed" and want is not None and record is not None:
            if gone:
                ended.replaced.append(area)
            log.warning("survivor_replaced", area=area, generation=generation,
                        pid=identity.pid, reason=verdict, verified_gone=gone,
                        was=None if record.command is None else list(record.command),
                        now=list(want.command), cmdline=list(identity.cmdline))
        else:
            if gone:
                ended.stopped.append(area)
            log.warning("survivor_stopped", area=area, generation=generation,
                        pid=identity.pid, reason=verdict, verified_gone=gone,
                        recorded=record is not None)
        if gone and area not in self._slots:
            (self.records_dir / f"{area}.json").unlink(missing_ok=True)
            self._pipes.retire(area)

    def _read_records(self) -> dict[int, _Record]:
        """The records a previous instance left, by pid; an unreadable one is dropped."""
        recorded: dict[int, _Record] = {}
        for path in sorted(self.records_dir.glob("*.json")):
            try:
                record = _Record.from_json(json.loads(path.read_text()))
            except (OSError, ValueError, KeyError, TypeError):
                log.warning("supervisor_record_unreadable", path=str(path))
                path.unlink(missing_ok=True)
                continue
            recorded[record.identity.pid] = record
        return recorded

    def _survivor_verdict(
        self, identity: ProcessIdentity, *, env: Mapping[str, str] | None,
        record: _Record | None, area: str, generation: int,
    ) -> str:
        """What to do with one survivor: "adopt", "command_changed" (ours and wanted at its
        generation, but the configured command changed: replace it), or why it is stopped."""
        if record is None:
            return "unrecorded"  # spawned just before a crash: cannot be proven ours
        if record.identity != identity or record.area != area or record.generation != generation:
            return "record_mismatch"
        want = self._desired.get(area)
        if want is None:
            return "not_wanted"
        if want.generation != generation:
            return "generation_changed"
        if area in self._slots:
            return "duplicate"
        if not _runs_command(record, identity, env=env, want=want):
            return "command_changed"
        return "adopt"

    async def run(self) -> None:
        """The supervising loop, to run as a guarded root task ("local supervisor"): handle
        survivors (if not done yet), then converge every area until `close()`."""
        if not self._survivors_handled:
            await self.adopt_or_stop_survivors()
        await self._supervise()

    async def start(self) -> None:
        """`run()` as a task this supervisor owns (for callers without a root-task registry);
        survivors are handled before it returns."""
        if not self._survivors_handled:
            await self.adopt_or_stop_survivors()
        self._tasks.spawn(TASK_NAME, self.run())

    async def close(self) -> None:
        """Stop supervising; the daemons keep running for the next instance to adopt (their
        log FIFOs and the log hub too)."""
        self.loop.close()
        await self._tasks.close()
        self._pipes.close()

    # -- internals -------------------------------------------------------------------

    def _lock(self, area: str) -> asyncio.Lock:
        lock = self._locks.get(area)
        if lock is None:
            lock = self._locks[area] = asyncio.Lock()
        return lock

    def _record_path(self, area: str) -> Path:
        return self.records_dir / f"{area}.json"

    async def _supervise(self) -> None:
        await self.loop.run()

    async def _pass(self) -> float:
        """One supervising pass: the log hub runs, ended areas' FIFOs are let go, and every
        area converges once — or, woken before the tick is up, the areas that changed
        (`set_desired`). Returns the time left until the next pass over every area."""
        self._pipes.tick()
        full = self._clock() >= self._full_pass_at
        if full:
            self._changed.clear()
            areas = set(self._desired) | set(self._slots)
        else:
            areas, self._changed = self._changed, set()
        for area in sorted(areas):
            lock = self._lock(area)
            if lock.locked():
                continue  # held by a start or a stop under way: the next full pass looks again
            version = self.version
            async with lock:
                try:
                    await self._converge(area)
                except Exception as e:  # one area's failure never stops the others
                    self._report_internal(area, e)
            # A start is synchronous (two forks, an fsynced record): let the API, the
            # keepalives and the lease renewals run between areas that changed, not after
            # them all (an area left as it was costs no loop turn: a pass stays O(areas)).
            if self.version != version:
                await asyncio.sleep(0)
        if full:  # the next one a tick after this one ended, as the loop's own interval
            self._full_pass_at = self._clock() + self._tick_s
        return max(0.0, self._full_pass_at - self._clock())

    def _report_internal(self, area: str, error: Exception) -> None:
        """An unexpected error converging one area: logged with its traceback once per
        (area, kind of error), counted, and the loop goes on with the next area."""
        key = (area, type(error).__name__)
        self.internal_errors += 1
        if key in self._reported:
            return
        self._reported.add(key)
        log.error("supervisor_area_failed", area=area, error_code="INTERNAL",
                  detail=f"{type(error).__name__}: {error}", exc_info=error)

    async def _converge(self, area: str) -> None:
        """One step towards the desired state of `area`. Caller holds the area's lock."""
        want = self._desired.get(area)
        slot = self._slots.get(area)
        now = self._clock()
        if slot is not None and slot.exited():
            await self._on_exit(area, slot, now=now)
        elif slot is not None and slot.failures and slot.running() \
                and now - slot.started_mono >= slot.run.min_uptime_s:
            slot.failures = 0  # it has run long enough: out of the loop (the status says so)
            self.version += 1
        if slot is not None and slot.running() and (
            want is None or want.generation != slot.run.generation or want != slot.run
        ):
            await self._stop_slot(area, grace_s=None)
            slot = self._slots.get(area)
        if want is None:
            if slot is not None and not slot.running():
                del self._slots[area]
                self._pipes.retire(area)
            return
        if slot is None or slot.run.generation != want.generation:
            slot = self._slots[area] = _Slot(run=want)
        slot.run = want
        if not slot.running() and now >= slot.next_start:
            if (want.user, want.group) != (None, None):
                if not await self._hand_over(area, slot) or self._desired.get(area) != want:
                    return  # failed (retry scheduled), or no longer wanted meanwhile
            await self._spawn(area, slot)

    async def _on_exit(self, area: str, slot: _Slot, *, now: float) -> None:
        status = None
        if slot.popen is not None:
            # not reaped yet, so its group id is still ours: kill what the daemon left behind
            proc_identity.signal_group(slot.popen.pid, signal.SIGKILL)
            status = slot.popen.wait()
        if slot.cgroup is not None and not await group_stop.empty_cgroup(
                slot.cgroup, timeout_s=CGROUP_EMPTY_S):
            # (the restart enters it all the same: a later fence kills it all)
            log.error("daemon_leftovers_stuck", area=area, cgroup=slot.cgroup,
                      error_code="CLEANUP_STUCK")
        ran_s = now - slot.started_mono
        if ran_s >= slot.run.min_uptime_s:
            slot.failures = 0
        delay = self._schedule_retry(slot, now=now)
        slot.identity, slot.popen, slot.adopted = None, None, False
        slot.last_exit_status = status
        slot.exits.append(time.time())
        self.version += 1
        self._record_path(area).unlink(missing_ok=True)
        log.warning("daemon_exited", area=area, service=slot.run.service,
                    generation=slot.run.generation, status=status, ran_s=round(ran_s, 3),
                    restart_in_s=round(delay, 3), failures=slot.failures)

    def _schedule_retry(self, slot: _Slot, *, now: float) -> float:
        """Count a failure and set the next start: base x 2^(failures-1), capped. Never
        gives up; returns the delay."""
        slot.failures += 1
        delay = float(min(self.backoff_cap_s, self.backoff_base_s * 2 ** (slot.failures - 1)))
        slot.next_start = now + delay
        return delay

    async def _spawn(self, area: str, slot: _Slot) -> None:
        run = slot.run
        try:
            popen, log_pipe, cgroup = self._start(area, run)
        except OSError as e:
            self._spawn_failed(area, slot, e)
            return
        identity = proc_identity.read(popen.pid) or ProcessIdentity(
            pid=popen.pid, start_ticks=-1, cmdline=run.command
        )
        # The slot knows the daemon before its record is written, so that a cancelled
        # write (a shutdown) never leaves a daemon this instance does not know.
        if slot.started_mono:
            slot.restarts += 1
            # monotonic per service, whatever becomes of the slot (monitord_area_restarts)
            self.restarts_by_service[run.service] = \
                self.restarts_by_service.get(run.service, 0) + 1
        slot.identity, slot.popen, slot.adopted = identity, popen, False
        slot.cgroup = cgroup
        slot.started_mono = self._clock()
        self.version += 1
        record = {"area": area, "service": run.service, "generation": run.generation,
                  "identity": identity.to_json(), "command": list(run.command),
                  "log_pipe": log_pipe, "cgroup": cgroup}
        try:
            # in a thread: its fsyncs are most of a start's time, and the loop goes on
            await asyncio.to_thread(atomic_file.atomic_write_bytes, self._record_path(area),
                                    json.dumps(record).encode())
        except OSError as e:
            # An unrecorded daemon could not be adopted by name after a crash: do not keep it.
            proc_identity.signal_group(popen.pid, signal.SIGKILL)
            if cgroup is not None:
                with contextlib.suppress(OSError):  # (the next start's exit path empties it)
                    cgroup_fence.kill(cgroup)
            popen.wait()
            slot.identity, slot.popen = None, None
            self._schedule_retry(slot, now=self._clock())
            log.error("daemon_record_failed", area=area, error_code="STORE_WRITE_FAILED",
                      detail=f"{e.strerror or e}: {e.filename}")
            return
        log.info("daemon_started", area=area, service=run.service, generation=run.generation,
                 pid=popen.pid, restarts=slot.restarts)

    def _start(
        self, area: str, run: AreaRun
    ) -> tuple[subprocess.Popen[bytes], str, str | None]:
        """The daemon, started (synchronous: a fork), the name of its log FIFO and its
        cgroup (None: it has none)."""
        Path(run.data_dir).mkdir(parents=True, exist_ok=True)
        who = run_as.resolve(user=run.user, group=run.group)
        env = {**os.environ, **run_as.login_environment(who), **run.env,
               SUPERVISOR_ENV: str(self.state_dir), AREA_ENV: area,
               GENERATION_ENV: str(run.generation)}
        return self._start_logged(area, run, env=env, who=who)

    async def _hand_over(self, area: str, slot: _Slot) -> bool:
        """Before starting a daemon as its service's user: give its data dir (created if
        need be) and everything in it to that user, in a thread (it walks the whole dir).
        False, with a retry scheduled, if that fails (e.g. SERVICE_USER_UNKNOWN)."""
        run = slot.run
        try:
            who = run_as.resolve(user=run.user, group=run.group)
            assert who is not None

            def make_theirs() -> None:
                Path(run.data_dir).mkdir(parents=True, exist_ok=True)
                run_as.hand_over(Path(run.data_dir), who)

            await asyncio.to_thread(make_theirs)
        except OSError as e:
            self._spawn_failed(area, slot, e)
            return False
        return True

    def _spawn_failed(self, area: str, slot: _Slot, error: OSError) -> None:
        self._schedule_retry(slot, now=self._clock())
        code = (error.code if isinstance(error, run_as.ServiceUserUnknown)
                else "DAEMON_START_FAILED")
        log.error("daemon_spawn_failed", area=area, service=slot.run.service,
                  generation=slot.run.generation, error_code=str(code), detail=str(error))

    def _start_logged(
        self, area: str, run: AreaRun, *, env: Mapping[str, str], who: run_as.RunAs | None
    ) -> tuple[subprocess.Popen[bytes], str, str | None]:
        """Start the daemon with its stdout and stderr the area's log FIFO (a restarted one
        gets its predecessor's), in its cgroup where there is one. It does not inherit
        monitord's capabilities (docs/operations.md)."""
        run_as.clear_inheritable_capabilities()  # this thread's: the one that forks
        fd, name = self._pipes.open(area, max_bytes=self.log_max_bytes, keep=self.log_keep)
        cgroup, procs_fd = self._open_cgroup(area, run)
        # The child enters its cgroup before exec (so before it can fork): a write to a
        # descriptor opened here, nothing else run in the child of this threaded process.
        join = None if procs_fd is None else functools.partial(cgroup_fence.join, procs_fd)
        try:
            popen = subprocess.Popen(
                list(run.command), cwd=run.data_dir, env=dict(env),
                stdin=subprocess.DEVNULL, stdout=fd, stderr=fd, preexec_fn=join,
                start_new_session=True, close_fds=True, **run_as.popen_kwargs(who),
            )
        except OSError:
            if cgroup is not None:
                cgroup_fence.remove(cgroup)  # (empty: nothing ran in it)
            raise
        finally:
            if procs_fd is not None:
                os.close(procs_fd)
        if cgroup is not None and not cgroup_fence.joined(cgroup, popen.pid):
            log.warning("daemon_outside_cgroup", area=area, cgroup=cgroup, pid=popen.pid,
                        detail="the kernel refused it the cgroup: its process group alone"
                               " fences it")
        return popen, name, cgroup

    def _open_cgroup(self, area: str, run: AreaRun) -> tuple[str | None, int | None]:
        """The run's cgroup, made, and its cgroup.procs opened; (None, None) where areas
        have none, or it cannot be made (then only its process group fences the daemon)."""
        if self.fences.base is None:
            return None, None
        path = cgroup_fence.area_dir(self.fences.base, area=area, generation=run.generation)
        try:
            return path, cgroup_fence.open_procs(path)
        except OSError as e:
            log.warning("daemon_cgroup_failed", area=area, cgroup=path,
                        detail=f"{e.strerror or e}: its process group alone fences it")
            return None, None

    async def _let_log_finish(self, area: str) -> None:
        """After the daemon is verified gone: its FIFO is let go (LogPipes.finish)."""
        await self._pipes.finish(area, within_s=LOG_DRAIN_S, poll_s=_LOG_DRAIN_POLL_S)

    async def _stop_slot(self, area: str, *, grace_s: float | None) -> bool:
        slot = self._slots.get(area)
        if slot is None or slot.identity is None:
            if slot is not None:
                del self._slots[area]
                self._pipes.retire(area)
            return True
        pid = slot.identity.pid
        gone = await group_stop.terminate_group(
            pid, grace_s=self.stop_grace_s if grace_s is None else grace_s,
            reap=None if slot.popen is None else slot.popen.poll,
        )
        if slot.popen is not None:
            slot.popen.poll()  # reap our child
        if gone and slot.cgroup is not None:  # and what left the group: its cgroup, emptied
            gone = await group_stop.empty_cgroup(slot.cgroup, timeout_s=CGROUP_EMPTY_S)
        if not gone:
            log.error("daemon_stop_failed", area=area, pid=pid, cgroup=slot.cgroup,
                      error_code="CLEANUP_STUCK")
            return False
        if slot.popen is not None:
            await _reap(slot.popen)
        del self._slots[area]
        await self._let_log_finish(area)
        self.version += 1
        self._record_path(area).unlink(missing_ok=True)
        log.info("daemon_stopped", area=area, generation=slot.run.generation, pid=pid)
        return True

    def _view(self, area: str, *, since_boot: float | None = None) -> ProcessView:
        slot = self._slots.get(area)
        run = slot.run if slot is not None else self._desired[area]
        identity = slot.identity if slot is not None else None
        now, wall = self._clock(), time.time()
        next_retry_at = None
        if slot is not None and identity is None and area in self._desired:
            next_retry_at = wall + max(0.0, slot.next_start - now)
        state = "running" if identity is not None else (
            "backoff" if area in self._desired else "stopped"
        )
        return ProcessView(
            area=area,
            service=run.service,
            generation=run.generation,
            state=state,
            pid=identity.pid if identity else None,
            started_at=proc_identity.started_at(identity) if identity else None,
            uptime_s=(round(proc_identity.uptime_s(identity, since_boot=since_boot), 3)
                      if identity else 0.0),
            restarts=slot.restarts if slot else 0,
            next_retry_at=next_retry_at,
            last_exit_status=slot.last_exit_status if slot else None,
            adopted=slot.adopted if slot else False,
            restarts_1h=sum(1 for at in slot.exits if at > wall - 3600) if slot else 0,
            failures=slot.failures if slot else 0,
        )


def _package_root() -> str:
    """The sys.path entry that holds `monitord` (the log hub runs `-m monitord` from /)."""
    return str(Path(next(iter(monitord.__path__))).resolve().parent)


async def _reap(popen: subprocess.Popen[bytes], *, timeout_s: float = 2.0) -> None:
    """Collect the exit status of a child known to be dead (or dying)."""
    try:
        await asyncio.to_thread(popen.wait, timeout_s)
    except subprocess.TimeoutExpired:
        log.error("daemon_not_reaped", pid=popen.pid)

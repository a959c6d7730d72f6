"""Starting, stopping and adopting the lease guards that run the agent's daemons.

Layout under the agent's dir: `leases/{area}.json` (the lease file each guard watches),
`run/{area}.json` (the guard's identity: pid + start time, with its argv, which names the
daemon command; the generation and owner, so that a restarted agent can adopt or stop it —
never by PID alone), `run/{area}.daemon`
(the daemon's pid, written by the guard once it started it: believed only while that pid is
a live child of the guard, it spares the agent a scan of /proc per look),
`log-pipes/{area}.…` (the FIFO that is the guard's and the daemon's stdout and stderr, named
in the guard's record) and `logs/{area}.log`, which the agent's one log hub
(monitord/base/log_hub.py, a process in a session of its own that outlives the agent)
copies every FIFO into, capped and rotated. The runner holds each area's FIFO while it runs
and until the hub holds it, and starts the hub again within a second if it dies
(`learn_daemons`, once per agent tick).
A service's `user` / `group` (spawn's `user=`, `group=`) is resolved here, the data dir is
handed over to it, and the guard — which stays the agent's user, to read the lease and
signal the daemon — starts the daemon as that user (monitord/base/run_as.py).
Where the agent owns a cgroup v2 (monitord/base/cgroup_fence.py, decided once per runner and
said in `{dir}/fencing.json` for the self-check), each daemon runs in a cgroup of its own,
`{agent's cgroup}/areas-…/{area}@{generation}`, which its guard is given (`--cgroup`) and the
guard's record names: the guard's fences, and the agent's `stop` and `reap_orphaned_daemon`
after them, empty it (cgroup.kill, verified), so a daemon's child that left its process group
(setsid()) is stopped with it; at the agent's start every area cgroup no adopted guard's
daemon runs in is emptied (`empty_leftover_cgroups`).

Each guard runs in a session of its own (`start_new_session`), detached from the agent's
stdio, so neither the agent's death nor a signal to the agent's group reaches it. It is
started as `sys.executable monitord.pyz lease-guard ...` (`vps_command`), so it works under
the isolated system Python the agent runs in, and from a checkout as well.
Called by monitord.vps.runtime only.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import monitord
from monitord.base import (
    atomic_file,
    cgroup_fence,
    group_stop,
    log_hub,
    log_sink,
    proc_identity,
    run_as,
)
from monitord.base.proc_identity import ProcessIdentity
from monitord.vps import guard_forkserver, lease_file
from monitord.vps.lease_table import AreaSpec

_POLL_S = 0.02
# A guard we started reports its daemon's pid; one that has not after this long (it could
# not write the file) is looked for by a scan of /proc, as an adopted one always is.
_REPORT_WAIT_S = 2.0
_DYING_WAIT_S = 2.0  # a SIGKILLed member of a daemon's group gets this long to die
_LOG_DRAIN_S = 2.0  # a stop waits this long for the hub to write the last words
_FORKSERVER_RETRY_S = 5.0  # a fork server that died is started again at most this often


def package_root() -> str:
    """The sys.path entry that holds `monitord`: a directory, or the .pyz file itself."""
    return str(Path(next(iter(monitord.__path__))).parent)


def vps_command(*args: str) -> list[str]:
    """The argv that runs a VPS verb (monitord.vps.entry) of this very code under this very
    interpreter and its -I/-S flags: the .pyz itself when we run from one (so it also works
    under `python3 -I`, which ignores PYTHONPATH), else `-m monitord.vps` with PYTHONPATH
    naming our tree."""
    root = package_root()
    flags = [flag for flag, on in (("-I", sys.flags.isolated), ("-S", sys.flags.no_site)) if on]
    if Path(root).is_file():
        return [sys.executable, *flags, root, *args]
    return [sys.executable, *flags, "-m", "monitord.vps", *args]


def vps_environment(env: dict[str, str]) -> dict[str, str]:
    """`env` for a `vps_command` child: from a checkout, PYTHONPATH must name our tree; from
    the .pyz nothing is added (the daemons the guards start see the VPS's own environment)."""
    root = package_root()
    if Path(root).is_file():
        return env
    return {**env, "PYTHONPATH": os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)}


@dataclass
class GuardHandle:
    """A running (or just exited) guard: our child when we started it, adopted otherwise."""

    spec: AreaSpec
    identity: ProcessIdentity
    popen: subprocess.Popen[bytes] | None
    adopted: bool
    daemon: ProcessIdentity | None = None  # learnt once the guard has started it
    # Where the guard writes its daemon's pid (guards we started; adopted ones may predate it)
    daemon_file: Path | None = None
    spawned_at: float = 0.0  # time.monotonic() of the spawn
    cgroup: str | None = None  # the daemon's cgroup (cgroup_fence), None: its group alone

    @property
    def pid(self) -> int:
        return self.identity.pid

    def exited(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is not None
        return not proc_identity.is_same_process(self.identity)

    def exit_status(self) -> int | None:
        return self.popen.returncode if self.popen is not None else None


class AreaRunner:
    """Owns the on-disk layout and the guard processes of one agent dir."""

    def __init__(self, *, base_dir: Path, stop_grace_s: float, fence_grace_s: float) -> None:
        self.base_dir = base_dir
        self.stop_grace_s = stop_grace_s
        self.fence_grace_s = fence_grace_s
        self.leases_dir = base_dir / "leases"
        self.run_dir = base_dir / "run"
        self.logs_dir = base_dir / "logs"
        for directory in (self.leases_dir, self.run_dir, self.logs_dir):
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.pipes = log_hub.LogPipes(
            pipes_dir=str(base_dir / "log-pipes"), logs_dir=str(self.logs_dir),
            hub_command=vps_command("log-hub"), hub_env=vps_environment(dict(os.environ)),
        )
        self.forkserver_socket = self.run_dir / ".guards.sock"
        self._forkserver: subprocess.Popen[bytes] | None = None
        self._forkserver_started_at = -_FORKSERVER_RETRY_S  # (started by ensure_forkserver)
        self.fences = cgroup_fence.prepare(cgroup_fence.instance_name(str(base_dir)),
                                           who="the agent")
        try:
            cgroup_fence.write_note(base_dir, self.fences)
        except OSError:
            pass  # only the self-check reads it: it then says it does not know

    def lease_path(self, area: str) -> Path:
        return self.leases_dir / f"{area}.json"

    def _record_path(self, area: str) -> Path:
        return self.run_dir / f"{area}.json"

    def _daemon_path(self, area: str) -> Path:
        return self.run_dir / f"{area}.daemon"  # (not *.json: those are guard records)

    def grant(self, spec: AreaSpec, *, ttl_s: float) -> None:
        lease_file.write(
            self.lease_path(spec.area),
            area=spec.area,
            generation=spec.generation,
            owner_id=spec.owner_id,
            ttl_s=ttl_s,
        )

    def revoke(self, area: str) -> None:
        lease_file.revoke(self.lease_path(area))

    def spawn(
        self,
        spec: AreaSpec,
        *,
        user: str | None = None,
        group: str | None = None,
        log_max_bytes: int = log_sink.DEFAULT_MAX_BYTES,
        log_keep: int = log_sink.DEFAULT_KEEP,
    ) -> GuardHandle:
        """Start the guard (which starts the daemon, as `user` / `group` when given) with its
        output the area's log FIFO, and record its identity durably. An unknown
        user or group raises run_as.ServiceUserUnknown (an OSError) before anything starts."""
        who = run_as.resolve(user=user, group=group)
        data_dir = Path(spec.data_dir)
        data_dir.mkdir(parents=True, exist_ok=True)
        if who is not None:
            run_as.hand_over(data_dir, who)
        cgroup = None if self.fences.base is None else cgroup_fence.area_dir(
            self.fences.base, area=spec.area, generation=spec.generation)
        guard_argv = [
            "--lease-file",
            str(self.lease_path(spec.area)),
            "--stop-grace",
            str(self.stop_grace_s),
            "--fence-grace",
            str(self.fence_grace_s),
            *_run_as_arguments(who),
            "--daemon-file",
            str(self._daemon_path(spec.area)),
            *(() if cgroup is None else ("--cgroup", cgroup)),
            "--",
            *spec.command,
        ]
        self._daemon_path(spec.area).unlink(missing_ok=True)
        env = vps_environment({**os.environ, **run_as.login_environment(who), **spec.env})
        log_fd, log_pipe = self.pipes.open(spec.area, max_bytes=log_max_bytes, keep=log_keep)
        popen = None
        pid = self._fork_guard(guard_argv, env=env, cwd=data_dir, log_fd=log_fd)
        if pid is None:  # no fork server (yet): the guard as a command of its own
            argv = vps_command("lease-guard", *guard_argv)
            popen = subprocess.Popen(
                argv,
                cwd=data_dir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log_fd,
                stderr=log_fd,
                start_new_session=True,
                close_fds=True,
            )
            pid = popen.pid
        # (a guard that is gone already gets an identity no process has: it reads as exited)
        identity = proc_identity.read(pid) or ProcessIdentity(pid=pid, start_ticks=-1, cmdline=())
        record = {
            "area": spec.area,
            "generation": spec.generation,
            "owner_id": spec.owner_id,
            "guard": identity.to_json(),
            "command": list(spec.command),  # a forked guard's argv is its fork server's
            "log_pipe": log_pipe,
            "cgroup": cgroup,
        }
        atomic_file.atomic_write_bytes(self._record_path(spec.area), json.dumps(record).encode())
        return GuardHandle(spec=spec, identity=identity, popen=popen, adopted=False,
                           daemon_file=self._daemon_path(spec.area),
                           spawned_at=time.monotonic(), cgroup=cgroup)

    # -- the guards' fork server (monitord/vps/guard_forkserver.py) -------------------------

    def ensure_forkserver(self) -> None:
        """Start this runner's fork server unless it runs (at most every few seconds: one
        that cannot start must not cost a process per tick)."""
        if self.forkserver_pid() is not None:
            return
        now = time.monotonic()
        if now - self._forkserver_started_at < _FORKSERVER_RETRY_S:
            return
        self._forkserver_started_at = now
        # (a socket left by a dead server: once it exists again, the new one listens)
        self.forkserver_socket.unlink(missing_ok=True)
        self._forkserver = subprocess.Popen(
            vps_command("guard-forkserver", "--socket", str(self.forkserver_socket),
                        "--agent-pid", str(os.getpid())),
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            cwd="/", env=vps_environment(dict(os.environ)), start_new_session=True,
            close_fds=True,
        )

    async def forkserver_listening(self, *, within_s: float) -> bool:
        """Wait (at most `within_s`) until the fork server we started listens."""
        deadline = time.monotonic() + within_s
        while self.forkserver_pid() is not None and not self.forkserver_socket.exists():
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(_POLL_S)
        return self.forkserver_pid() is not None

    def forkserver_pid(self) -> int | None:
        """The pid of the fork server we started, while it runs."""
        server = self._forkserver
        return server.pid if server is not None and server.poll() is None else None

    def _fork_guard(self, guard_argv: list[str], *, env: dict[str, str], cwd: Path,
                    log_fd: int) -> int | None:
        """A guard forked by our fork server; None when it does not run or failed (the
        caller then starts the guard as a command: slower and bigger, as safe)."""
        if self.forkserver_pid() is None:
            return None
        try:
            return guard_forkserver.spawn(str(self.forkserver_socket), argv=guard_argv,
                                          env=env, cwd=str(cwd), log_fd=log_fd)
        except (OSError, ValueError):
            return None

    def _stop_forkserver(self) -> None:
        server, self._forkserver = self._forkserver, None
        if server is not None and server.poll() is None:
            server.terminate()
            try:
                server.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()

    def daemon_pids(self, handles: list[GuardHandle]) -> dict[int, int | None]:
        """guard pid -> its daemon's pid (None when the daemon is not running)."""
        return {guard: None if daemon is None else daemon.pid
                for guard, daemon in self.daemons(handles).items()}

    def daemons(self, handles: list[GuardHandle]) -> dict[int, ProcessIdentity | None]:
        """guard pid -> its daemon's identity (None when the daemon is not running). A daemon
        already learnt and still that very process (pid, start time, argv) is taken as it
        is; then the pid the guard reported (if its parent is that guard); only the others
        cost a scan of /proc (one for all of them) — the inventory and the lease loop ask
        this for every area, often, while areas start."""
        result: dict[int, ProcessIdentity | None] = {}
        unknown: set[int] = set()
        now = time.monotonic()
        for handle in handles:
            if handle.daemon is not None and proc_identity.is_same_process(handle.daemon):
                result[handle.pid] = handle.daemon
            elif (reported := _reported_daemon(handle)) is not None:
                result[handle.pid] = reported
            elif handle.daemon_file is not None and now - handle.spawned_at < _REPORT_WAIT_S:
                result[handle.pid] = None  # still starting: it reports its daemon itself
            else:
                unknown.add(handle.pid)
        if unknown:
            for guard, kids in proc_identity.children_of(unknown).items():
                result[guard] = proc_identity.read(kids[0]) if kids else None
        return result

    def learn_daemons(self, handles: list[GuardHandle]) -> None:
        """Remember each guard's daemon identity, so that it can still be found (and
        verified gone) after its guard died and it was re-parented."""
        self.pipes.tick()  # once per agent tick, like this: the log hub runs
        self.ensure_forkserver()  # ... and the guards' fork server
        waiting = [h for h in handles if h.daemon is None and not h.exited()]
        if not waiting:
            return
        found = self.daemons(waiting)
        for handle in waiting:
            handle.daemon = found.get(handle.pid) or handle.daemon

    async def reap_orphaned_daemon(self, handle: GuardHandle) -> bool:
        """After a guard exited: make sure its daemon is gone too (it dies by PDEATHSIG;
        this verifies it, and kills its group if it somehow lives), and its cgroup is empty
        (a child that left the daemon's group gets no PDEATHSIG). True once gone."""
        daemon = handle.daemon
        gone = True
        if daemon is not None and proc_identity.is_same_process(daemon):
            gone = await group_stop.terminate_group(daemon.pid, grace_s=0.0)
        if gone and handle.cgroup is not None:
            gone = await group_stop.empty_cgroup(handle.cgroup, timeout_s=_DYING_WAIT_S,
                                                 poll_s=_POLL_S)
        return gone

    async def stop(self, handle: GuardHandle, *, fence: bool) -> bool:
        """Stop a guard and its daemon; True once both are verified gone, and the daemon's
        cgroup empty.

        fence=False: SIGTERM to the guard, which stops the daemon with the stop grace.
        fence=True (lease lapsed): the lease file is revoked, which makes the guard fence
        with the short fence grace. Either way the guard gets until its grace + 1 s, then
        the agent SIGKILLs the guard's and the daemon's groups itself; and the cgroup is
        emptied last (the guard's own fence has done it, unless the guard was killed)."""
        daemon_pid = self.daemon_pids([handle]).get(handle.pid)
        if daemon_pid is None and handle.daemon is not None:
            if proc_identity.is_same_process(handle.daemon):
                daemon_pid = handle.daemon.pid
        if fence:
            self.revoke(handle.spec.area)
            grace = self.fence_grace_s
        else:
            if not handle.exited():
                proc_identity.signal_group(handle.pid, signal.SIGTERM)
            grace = self.stop_grace_s
        gone = await self._wait_exited(handle, timeout_s=grace + 1.0)
        if not gone:
            for pgid in (daemon_pid, handle.pid):
                if pgid is not None:
                    proc_identity.signal_group(pgid, signal.SIGKILL)
            gone = await self._wait_exited(handle, timeout_s=2.0)
        if daemon_pid is not None and gone:
            # The guard SIGKILLed the daemon's group before it exited, but a member may still
            # be dying: wait for it rather than signal again (the group may be empty and its
            # number anyone's by now). A signal 0 says "no process at all" without a scan.
            gone = await group_stop.wait_group_gone(daemon_pid, timeout_s=_DYING_WAIT_S,
                                                    poll_s=_POLL_S)
        if gone and handle.cgroup is not None:
            gone = await group_stop.empty_cgroup(handle.cgroup, timeout_s=_DYING_WAIT_S,
                                                 poll_s=_POLL_S)
        if gone:
            self._record_path(handle.spec.area).unlink(missing_ok=True)
            self._daemon_path(handle.spec.area).unlink(missing_ok=True)
            await self._let_log_finish(handle.spec.area)
        return gone

    async def _let_log_finish(self, area: str) -> None:
        """After guard and daemon are verified gone: the area's FIFO is let go
        (LogPipes.finish)."""
        await self.pipes.finish(area, within_s=_LOG_DRAIN_S, poll_s=_POLL_S)

    async def _wait_exited(self, handle: GuardHandle, *, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not handle.exited():
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(_POLL_S)
        return True

    def forget(self, area: str) -> None:
        """Drop the record of a guard that exited by itself (its FIFO goes once the hub has
        it: a new start gets a fresh one)."""
        self._record_path(area).unlink(missing_ok=True)
        self._daemon_path(area).unlink(missing_ok=True)
        self.pipes.retire(area)

    def close(self) -> None:
        """Stop holding the areas' FIFOs (the guards hold theirs; the next agent adopts them
        with their guards) and stop the fork server (the guards do not need it)."""
        self.pipes.close()
        self._stop_forkserver()

    def survivors(self) -> list[tuple[dict[str, Any], ProcessIdentity | None]]:
        """Records left by a previous agent: (record, the guard's identity if it still lives)."""
        found: list[tuple[dict[str, Any], ProcessIdentity | None]] = []
        for path in sorted(self.run_dir.glob("*.json")):
            try:
                record = json.loads(path.read_text())
                identity = ProcessIdentity.from_json(record["guard"])
            except (OSError, ValueError, KeyError, TypeError):
                path.unlink(missing_ok=True)
                continue
            alive = proc_identity.is_same_process(identity)
            found.append((record, identity if alive else None))
        return found

    def adopt(self, spec: AreaSpec, identity: ProcessIdentity) -> GuardHandle:
        """A guard a previous agent started, with its log FIFO and its daemon's cgroup (its
        record names them)."""
        try:
            record = json.loads(self._record_path(spec.area).read_text())
            log_pipe, cgroup = record.get("log_pipe"), self._recorded_cgroup(record)
        except (OSError, ValueError, AttributeError, TypeError):
            log_pipe = cgroup = None
        if isinstance(log_pipe, str):
            self.pipes.adopt(spec.area, log_pipe)
        return GuardHandle(spec=spec, identity=identity, popen=None, adopted=True,
                           cgroup=cgroup)

    def _recorded_cgroup(self, record: dict[str, Any]) -> str | None:
        """The cgroup a guard's record names, if it is that very area run's."""
        return cgroup_fence.recorded_dir(record.get("cgroup"), fences=self.fences,
                                         area=str(record.get("area")),
                                         generation=int(record.get("generation", -1)))

    async def empty_leftover_cgroups(self, *, keep: set[str]) -> list[str]:
        """Once the survivors are handled: empty and remove every area cgroup of this runner
        but those in `keep` (the adopted guards' daemons'): a child that escaped a daemon
        whose guard died while no agent ran, an area stopped then. Returns those that a
        process is still in."""
        if self.fences.base is None:
            return []
        return [path for path in cgroup_fence.leftovers(self.fences.base, keep=keep)
                if not await group_stop.empty_cgroup(path, timeout_s=_DYING_WAIT_S,
                                                     poll_s=_POLL_S)]

    async def stop_survivor(self, identity: ProcessIdentity, area: str) -> bool:
        """Stop an unwanted guard left by a previous agent (fence grace: it has no grant)."""
        spec = AreaSpec(
            area=area, service="", generation=-1, owner_id="", command=(), data_dir=""
        )
        return await self.stop(self.adopt(spec, identity), fence=True)


def recorded_command(record: dict[str, Any], guard: ProcessIdentity) -> tuple[str, ...] | None:
    """The daemon command a surviving guard was started with: its record's (a forked guard's
    argv is its fork server's), else, from a release that did not record it, the guard's argv."""
    command = record.get("command")
    if isinstance(command, list) and all(isinstance(part, str) for part in command):
        return tuple(command)
    return guard_daemon_command(guard.cmdline)


def guard_daemon_command(guard_argv: Sequence[str]) -> tuple[str, ...] | None:
    """The daemon command a lease guard was started with: its argv after the first `--`
    (`spawn` puts the command there, and no guard option's value is `--`); None if there is
    none. The guard is the interpreter itself, so its argv is what `spawn` passed, whatever
    the daemon's kernel argv is (a `#!` script, a wrapper that execs)."""
    try:
        return tuple(guard_argv[list(guard_argv).index("--") + 1 :])
    except ValueError:
        return None


def _reported_daemon(handle: GuardHandle) -> ProcessIdentity | None:
    """The daemon the guard reported, if that pid is a live child of that guard."""
    if handle.daemon_file is None:
        return None
    try:
        pid = int(handle.daemon_file.read_text())
    except (OSError, ValueError):
        return None
    return proc_identity.read(pid) if proc_identity.parent_of(pid) == handle.pid else None


def _run_as_arguments(who: run_as.RunAs | None) -> list[str]:
    """The lease guard's options that make it start the daemon as `who`."""
    if who is None:
        return []
    found = ["--gid", str(who.gid), "--groups", ",".join(str(g) for g in who.groups)]
    return found if who.uid is None else ["--uid", str(who.uid), *found]

"""The log hub: one process per side that copies every area's output into its rotated log.

Each running area has a FIFO in a pipes directory next to the logs
(`{pipes}/{area}.{max_bytes}.{keep}.{stamp}`); its spawner (`LogPipes`, below: the local
supervisor on the PBX, the agent's area runner on the VPS) creates it, opens it read-write and
hands that descriptor to the daemon as stdout and stderr. The hub (`monitord log-hub`, on the
VPS `monitord.pyz log-hub`) reads every FIFO with poll(), keeps a partial line per FIFO and
writes complete lines into `{logs}/{area}.log` through a RotatingLog (monitord/base/log_sink.py:
the same caps, rotation, lost-bytes note and partial-line hold as a per-daemon sink). So the
output of any number of areas costs one process per side, not one per area.

The promises, and how they are kept:

- **One hub per side**: it holds an exclusive flock on `{pipes}/.hub.lock` (and writes its pid
  there); a second one started meanwhile gives up. It runs in a session of its own, so a
  signal to monitord's, the agent's or a daemon's process group does not end it.
- **A dead hub is restarted without stopping any daemon**: a daemon's descriptor is read-write,
  so a write never fails with EPIPE while no hub reads; it lands in the pipe's buffer (asked
  1 MiB, best effort) and, once that is full, the daemon's write blocks until a hub reads again.
  The spawners check the hub every second (`LogPipes.tick`) and start one if none holds the lock.
- **What a killed hub loses**: only what it had read from a pipe and not yet written — the
  unfinished line it was holding (at most `_PARTIAL_HOLD_BYTES`, for at most `_PARTIAL_HOLD_S`)
  or, if it died inside a copy, that one read (at most `_READ_BYTES`). Everything still in the
  pipes (all that the daemons wrote while no hub ran) is written by the next hub. A hub that
  finds its predecessor's pid still in the lock file (it did not end cleanly) first writes a
  note line in the log of every area it finds, so that a line whose beginning was lost (its rest
  then starts the next line) is marked. Lines are never duplicated or reordered.
- **An area ends** when nobody writes its FIFO any more: the daemon (and anything that
  inherited its output) is gone and the spawner has closed its own descriptor. The hub then
  reads end of file once the pipe is empty, writes what is left, and removes the FIFO. The
  spawner keeps its descriptor open across the daemon's restarts and until the hub itself holds
  the FIFO open (`LogPipes.retire`), so a daemon's last words survive in the pipe even when it
  exits while no hub runs. They are lost only if the daemon, its spawner and the hub all end
  before a hub has opened the FIFO.
- The hub exits by itself when its pipes directory is gone, or after `_IDLE_EXIT_S` without any
  FIFO; the spawners start it again with the next area.

Standard library only, Python >= 3.9: it runs on the VPS too. See docs/operations.md, "Area logs".
"""

from __future__ import annotations

import argparse
import fcntl
import os
import select
import signal
import stat
import sys
import time
from collections.abc import Mapping, Sequence

from monitord.base import log_sink
from monitord.base.log_sink import RotatingLog

TYPE_CHECKING = False
if TYPE_CHECKING:
    import subprocess

LOCK_NAME = ".hub.lock"  # names starting with "." are never FIFOs of areas
_READ_BYTES = 256 * 1024
_PARTIAL_HOLD_S = log_sink._PARTIAL_HOLD_S
_PARTIAL_HOLD_BYTES = log_sink._PARTIAL_HOLD_BYTES
_SCAN_S = 0.25  # how soon a new FIFO is read (its data waits in the pipe meanwhile)
_IDLE_EXIT_S = 5.0
_LOCK_TRIES_S = 1.0  # a spawner's probe holds the lock for microseconds: retry that long
_CHECK_EVERY_S = 1.0  # LogPipes.tick: how often the spawner looks for a live hub
_NOTE = ("log-hub: the previous log hub (pid {pid}) ended abruptly: a line it was holding may "
         "be missing here, or its rest begin the next line\n")


def fifo_name(area: str, *, max_bytes: int, keep: int) -> str:
    """A fresh FIFO name for one area: unique, and naming the log's cap and kept files."""
    return f"{area}.{max_bytes}.{keep}.{time.time_ns()}"


def parse_name(name: str) -> tuple[str, int, int] | None:
    """(area, max_bytes, keep) of a FIFO name, or None for anything else in the directory."""
    if name.startswith("."):
        return None
    parts = name.rsplit(".", 3)
    if len(parts) != 4 or not parts[0] or "/" in parts[0]:
        return None
    try:
        max_bytes, keep, _stamp = int(parts[1]), int(parts[2]), int(parts[3])
    except ValueError:
        return None
    if max_bytes < log_sink.MIN_MAX_BYTES or keep < 0:
        return None
    return parts[0], max_bytes, keep


# -- the hub process ------------------------------------------------------------------


class _Stream:
    """One FIFO the hub reads."""

    __slots__ = ("name", "area", "fd", "pending", "pending_at")

    def __init__(self, name: str, area: str, fd: int) -> None:
        self.name = name
        self.area = area
        self.fd = fd
        self.pending = b""  # the unfinished line read so far
        self.pending_at = 0.0  # when data was last added to it


class Hub:
    """Copies every FIFO of `pipes_dir` into `logs_dir/{area}.log` (see the module doc)."""

    def __init__(self, *, pipes_dir: str, logs_dir: str) -> None:
        self.pipes_dir = pipes_dir
        self.logs_dir = logs_dir
        self._streams: dict[int, _Stream] = {}  # by fd
        self._names: set[str] = set()
        self._logs: dict[str, RotatingLog] = {}  # by area, while it has a stream
        self._poller = select.poll()
        self._predecessor = 0  # pid of a hub that died holding the lock (0: none)

    def lock(self) -> int:
        """Take the hub's lock (a spawner's probe holds it for microseconds: retried for
        `_LOCK_TRIES_S`); -1 if another hub holds it."""
        path = os.path.join(self.pipes_dir, LOCK_NAME)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        deadline = time.monotonic() + _LOCK_TRIES_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    return -1
                time.sleep(0.02)
        left = os.pread(fd, 32, 0).strip()
        self._predecessor = int(left) if left.isdigit() else 0
        return fd

    def serve(self, lock_fd: int) -> int:
        """Serve until idle (or the directory is gone), holding `lock_fd` (from `lock`)."""
        os.ftruncate(lock_fd, 0)
        os.pwrite(lock_fd, b"%d\n" % os.getpid(), 0)
        try:
            self._loop()
        finally:
            for stream in list(self._streams.values()):
                self._write(stream, stream.pending)
                stream.pending = b""
            for log in self._logs.values():
                log.close()
            os.ftruncate(lock_fd, 0)  # a clean end: the next hub writes no note
            os.close(lock_fd)
        return 0

    def _loop(self) -> None:
        idle_since = time.monotonic()
        next_scan = 0.0
        first_scan = True
        while True:
            now = time.monotonic()
            if now >= next_scan:
                if not os.path.isdir(self.pipes_dir):
                    return
                self._scan(note=first_scan and self._predecessor > 0)
                first_scan = False
                next_scan = now + _SCAN_S
                if self._streams:
                    idle_since = now
                elif now - idle_since >= _IDLE_EXIT_S:
                    return
            wait_s = next_scan - now
            for stream in self._streams.values():
                if stream.pending:
                    wait_s = min(wait_s, stream.pending_at + _PARTIAL_HOLD_S - now)
            for fd, _events in self._poller.poll(max(0, int(wait_s * 1000) + 1)):
                readable = self._streams.get(fd)
                if readable is not None:
                    self._read(readable)
            now = time.monotonic()
            for stream in self._streams.values():
                if stream.pending and now - stream.pending_at >= _PARTIAL_HOLD_S:
                    self._write(stream, stream.pending)  # the rest is not coming soon
                    stream.pending = b""

    def _scan(self, *, note: bool) -> None:
        try:
            names = os.listdir(self.pipes_dir)
        except OSError:
            return
        for name in names:
            if name in self._names:
                continue
            parsed = parse_name(name)
            if parsed is None:
                continue
            area, max_bytes, keep = parsed
            try:
                fd = os.open(os.path.join(self.pipes_dir, name),
                             os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError:
                continue  # removed meanwhile
            if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                os.close(fd)
                continue
            stream = _Stream(name, area, fd)
            self._streams[fd] = stream
            self._names.add(name)
            self._poller.register(fd, select.POLLIN)
            log = self._logs.get(area)
            if log is None:
                log = self._logs[area] = RotatingLog(
                    os.path.join(self.logs_dir, f"{area}.log"), max_bytes=max_bytes, keep=keep)
            log.max_bytes, log.keep = max_bytes, keep  # the newest spawn's settings
            if note:
                self._note(log)
            # A FIFO nobody writes any more (all its writers ended while no hub ran) shows no
            # hang-up to a reader that opened it since: one read finds its end of file now.
            self._read(stream)

    def _note(self, log: RotatingLog) -> None:
        line = _NOTE.format(pid=self._predecessor).encode()
        try:
            with open(log.path, "rb") as existing:
                existing.seek(-1, os.SEEK_END)
                if existing.read(1) != b"\n":
                    line = b"\n" + line
        except OSError:
            pass  # empty or missing: the note starts it
        log.write(line)

    def _read(self, stream: _Stream) -> None:
        try:
            chunk = os.read(stream.fd, _READ_BYTES)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._end(stream)
            return
        data = stream.pending + chunk if stream.pending else chunk
        last_newline = data.rfind(b"\n")
        if last_newline >= 0:
            self._write(stream, data[: last_newline + 1])
        stream.pending = data[last_newline + 1 :]
        stream.pending_at = time.monotonic()
        if len(stream.pending) >= _PARTIAL_HOLD_BYTES:
            self._write(stream, stream.pending)
            stream.pending = b""

    def _write(self, stream: _Stream, data: bytes) -> None:
        if data:
            self._logs[stream.area].write(data)

    def _end(self, stream: _Stream) -> None:
        """No writer left and the pipe empty: the area's last words are written; the FIFO
        goes (nobody will write it again: a restarted daemon gets a fresh one)."""
        self._write(stream, stream.pending)
        self._poller.unregister(stream.fd)
        os.close(stream.fd)
        del self._streams[stream.fd]
        try:
            os.unlink(os.path.join(self.pipes_dir, stream.name))
        except OSError:
            pass
        self._names.discard(stream.name)
        if not any(s.area == stream.area for s in self._streams.values()):
            self._logs.pop(stream.area).close()


# -- the spawner's side -----------------------------------------------------------------


class LogPipes:
    """The spawner's side of the hub, for one pipes directory: creates and holds each area's
    FIFO, starts the hub when none runs, and lets an area's FIFO go once the hub holds it.

    `hub_command` is the argv prefix that runs this module's verb (`monitord log-hub` on the
    PBX, `monitord.pyz log-hub` on the VPS); `hub_env` its environment."""

    def __init__(
        self,
        *,
        pipes_dir: str,
        logs_dir: str,
        hub_command: Sequence[str],
        hub_env: Mapping[str, str] | None = None,
    ) -> None:
        self.pipes_dir = pipes_dir
        self.logs_dir = logs_dir
        os.makedirs(pipes_dir, mode=0o700, exist_ok=True)
        self._hub_command = list(hub_command)
        self._hub_env = None if hub_env is None else dict(hub_env)
        self._held: dict[str, tuple[int, str]] = {}  # area -> (our fd, FIFO name)
        self._retiring: dict[str, tuple[int, str]] = {}  # ended areas: fd until the hub has it
        # the hubs we started, until reaped: each forks the hub itself and returns at once
        self._hubs: list[subprocess.Popen[bytes]] = []
        self._checked_at = -_CHECK_EVERY_S

    # -- areas ---------------------------------------------------------------------------

    def open(self, area: str, *, max_bytes: int, keep: int) -> tuple[int, str]:
        """The descriptor to give the area's daemon as stdout and stderr (our copy: the caller
        does not close it), and its FIFO's name. The same one while the area lives here
        (a restarted daemon writes the FIFO its predecessor wrote); a fresh one otherwise."""
        held = self._held.get(area)
        if held is not None:
            return held
        name = fifo_name(area, max_bytes=max_bytes, keep=keep)
        os.makedirs(self.pipes_dir, mode=0o700, exist_ok=True)  # (removed by hand meanwhile)
        # Made under a hidden name and opened before it gets its own: the hub never opens a
        # FIFO nobody writes yet (it would read end of file and remove it).
        hidden = os.path.join(self.pipes_dir, "." + name)
        os.mkfifo(hidden, 0o600)
        try:
            fd = os.open(hidden, os.O_RDWR | os.O_CLOEXEC)  # never blocks on a FIFO
        except OSError:
            os.unlink(hidden)
            raise
        try:
            fcntl.fcntl(fd, log_sink._F_SETPIPE_SZ, log_sink._PIPE_BYTES)
        except OSError:
            pass  # above the system's pipe-max-size or the user's pipe pages: default size
        os.rename(hidden, os.path.join(self.pipes_dir, name))
        self._held[area] = (fd, name)
        self.ensure_hub()
        return fd, name

    def adopt(self, area: str, name: str) -> bool:
        """Hold the FIFO `name` of a daemon a previous spawner started (its record names it),
        so that the daemon's last words survive its exit as with one we started."""
        parsed = parse_name(name)
        if area in self._held or parsed is None or parsed[0] != area:
            return area in self._held
        try:
            fd = os.open(os.path.join(self.pipes_dir, name), os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            return False
        self._held[area] = (fd, name)
        return True

    def retire(self, area: str) -> str | None:
        """The area's daemon is gone and will not be restarted here: let its FIFO go once the
        hub holds it (now, or at a later `tick`). Returns the FIFO's path, which the hub
        removes once it has written the last of it."""
        held = self._held.pop(area, None)
        if held is None:
            return None
        previous = self._retiring.pop(area, None)
        if previous is not None:
            os.close(previous[0])  # (cannot happen: an area is retired once per life)
        self._retiring[area] = held
        self._let_go()
        return os.path.join(self.pipes_dir, held[1])

    def ended(self, path: str) -> bool:
        """Whether the hub has written the last of the retired FIFO at `path` (and removed
        it); lets it go first if the hub holds it now."""
        self._let_go()
        return not os.path.exists(path)

    async def finish(self, area: str, *, within_s: float, poll_s: float) -> None:
        """`retire(area)`, then wait up to `within_s` for the hub to write the daemon's last
        words and remove the FIFO; what is left then is written later."""
        import asyncio  # here, not at the top: the hub process itself never needs it

        path = self.retire(area)
        if path is None:
            return
        for _ in range(int(within_s / poll_s)):
            if self.ended(path):
                return
            await asyncio.sleep(poll_s)  # the hub tells nobody: look again

    def tick(self) -> None:
        """Periodic (the spawner's loop): a hub runs, and ended areas' FIFOs are let go."""
        now = time.monotonic()
        if now - self._checked_at >= _CHECK_EVERY_S:
            self._checked_at = now
            self.ensure_hub()
        if self._retiring:
            self._let_go()
        self._hubs = [hub for hub in self._hubs if hub.poll() is None]

    def close(self) -> None:
        """Stop holding FIFOs (the daemons hold theirs; a new spawner adopts them)."""
        for fd, _name in (*self._held.values(), *self._retiring.values()):
            os.close(fd)
        self._held.clear()
        self._retiring.clear()
        for hub in self._hubs:
            hub.wait(timeout=30)  # it forks the hub and returns: an interpreter's start-up
        self._hubs.clear()

    # -- the hub ---------------------------------------------------------------------------

    def hub_pid(self) -> int | None:
        """The running hub's pid (0 if it runs but has not written it yet); None if none."""
        try:
            fd = os.open(os.path.join(self.pipes_dir, LOCK_NAME),
                         os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError:
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                text = os.pread(fd, 32, 0).strip()
                return int(text) if text.isdigit() else 0
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)

    def ensure_hub(self) -> None:
        """Start a hub unless one runs (two started at once: the second gives up)."""
        self._hubs = [hub for hub in self._hubs if hub.poll() is None]
        if self._hubs or self.hub_pid() is not None:
            return  # (a hub we started is still taking the lock)
        import subprocess  # here, not at the top: the hub process itself never needs them

        from monitord.base import run_as

        run_as.clear_inheritable_capabilities()  # this thread's: the one that forks
        self._hubs.append(subprocess.Popen(
            [*self._hub_command, *arguments(pipes_dir=self.pipes_dir, logs_dir=self.logs_dir)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            cwd="/", env=self._hub_env, start_new_session=True, close_fds=True,
        ))

    def _let_go(self) -> None:
        if not self._retiring:
            return
        pid = self.hub_pid()
        if not pid:
            return  # no hub (or not known yet): keep the pipes' data alive meanwhile
        held = _fifos_held_by(pid)
        for area, (fd, _name) in list(self._retiring.items()):
            try:
                st = os.fstat(fd)
            except OSError:
                del self._retiring[area]
                continue
            if (st.st_dev, st.st_ino) in held:
                os.close(fd)
                del self._retiring[area]


def _fifos_held_by(pid: int) -> set[tuple[int, int]]:
    """(device, inode) of every FIFO process `pid` has open (from /proc/{pid}/fd)."""
    found: set[tuple[int, int]] = set()
    fd_dir = f"/proc/{pid}/fd"
    try:
        entries = os.listdir(fd_dir)
    except OSError:
        return found
    for entry in entries:
        try:
            st = os.stat(f"{fd_dir}/{entry}")
        except OSError:
            continue
        if stat.S_ISFIFO(st.st_mode):
            found.add((st.st_dev, st.st_ino))
    return found


# -- the verb ---------------------------------------------------------------------------


def arguments(*, pipes_dir: str, logs_dir: str) -> list[str]:
    return ["--pipes", os.fspath(pipes_dir), "--logs", os.fspath(logs_dir)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pipes", required=True, help="the directory of the areas' FIFOs")
    parser.add_argument("--logs", required=True, help="the directory of the areas' logs")


def _end_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(0)


def _raise_fd_limit() -> None:
    """One descriptor per area: take the hard limit as the soft one (1024 is a common soft
    limit; the hard one is usually far higher)."""
    import resource

    try:
        _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (OSError, ValueError):
        pass  # the soft limit stays: FIFOs beyond it wait for a descriptor


def run(args: argparse.Namespace) -> int:
    log_sink._drop_capabilities()
    _raise_fd_limit()
    hub = Hub(pipes_dir=args.pipes, logs_dir=args.logs)
    try:
        lock_fd = hub.lock()
    except FileNotFoundError:
        return 0  # the pipes directory went away: nothing to serve
    if lock_fd < 0:
        return 0  # another hub runs
    if os.fork() > 0:
        # The spawner's child returns once the lock is taken (the forked hub keeps it); the
        # hub is nobody's child: no zombie for a spawner to reap, none when it goes first.
        os._exit(0)
    signal.signal(signal.SIGTERM, _end_on_signal)
    signal.signal(signal.SIGINT, _end_on_signal)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    try:
        return hub.serve(lock_fd)
    except FileNotFoundError:
        return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="log-hub", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


# The verb this module serves (monitord.surface.cli, monitord.vps.entry).
VERBS = {"log-hub": (add_arguments, run)}


if __name__ == "__main__":
    sys.exit(main())

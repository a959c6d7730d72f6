"""The one-instance-per-directory lock, taken by `monitord run` before anything else.

`acquire()` holds an exclusive, non-blocking flock(2) on `{dir}/{name}.lock`
for the life of the process and then writes a diagnostic PID file `{dir}/{name}.pid`. The lock
alone decides: the kernel drops it when the holder dies (even on `kill -9`), so a stale PID file
never blocks a start, and a held lock blocks whatever the PID file claims. The PID file is only
read to name the holder in the `duplicate_instance` event.

The lock file is never deleted: removing it would let a newcomer lock a fresh inode while the
holder still locks the old one. The descriptor is close-on-exec, so daemons spawned by monitord
never inherit (and never keep alive) the lock.

Callers: monitord.surface.daemon (run), monitord.surface.launcher (launch, probing with
`is_held`), the agent. Standard library only: the VPS runs it from monitord.pyz.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path
from types import TracebackType
from typing import IO

from monitord.base import atomic_file
from orchestrator.errors import ErrorCode, PermanentError

DEFAULT_NAME = "monitord"
HOLDER_PID_POLL_S = 0.02


class AlreadyRunning(PermanentError):
    """Another live process holds the lock; `holder_pid` comes from the PID file (diagnostic)."""

    def __init__(self, *, lock_path: Path, holder_pid: int | None) -> None:
        holder = f"pid {holder_pid}" if holder_pid is not None else "an unknown pid"
        super().__init__(ErrorCode.DUPLICATE_INSTANCE, f"{lock_path} is held by {holder}")
        self.lock_path = lock_path
        self.holder_pid = holder_pid


class InstanceLock:
    """A held instance lock; release it with `.release()` or by leaving the `with` block."""

    def __init__(self, *, handle: IO[str], lock_path: Path, pid_path: Path) -> None:
        self._handle: IO[str] | None = handle
        self.lock_path = lock_path
        self.pid_path = pid_path
        self.pid = os.getpid()

    @property
    def held(self) -> bool:
        return self._handle is not None

    def release(self) -> None:
        """Drop the PID file (if it still names us), then the lock. Safe to call twice."""
        handle, self._handle = self._handle, None
        if handle is None:
            return
        try:
            if read_holder_pid(self.pid_path) == self.pid:
                self.pid_path.unlink(missing_ok=True)
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
            handle.close()

    def __enter__(self) -> InstanceLock:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


def _paths(directory: Path, name: str) -> tuple[Path, Path]:
    return directory / f"{name}.lock", directory / f"{name}.pid"


def read_holder_pid(pid_path: Path) -> int | None:
    """The PID named by a PID file, or None if it is missing or unreadable (diagnostic only)."""
    try:
        text = pid_path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() and len(text) <= 10 else None  # ASCII: read as ascii


def _try_lock(lock_path: Path) -> IO[str] | None:
    """Open and lock `lock_path`; None if another open file description holds it."""
    handle = open(lock_path, "a", encoding="ascii")  # kept open for as long as the lock is held
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    except BaseException:
        handle.close()
        raise
    return handle


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _wait_for_holder_pid(pid_path: Path, *, wait_s: float) -> int | None:
    """The holder's PID for the diagnostic; a holder that has just locked may not have written
    its PID file yet (or an old one names a dead process), so re-read briefly before giving up."""
    deadline = time.monotonic() + wait_s
    while True:
        pid = read_holder_pid(pid_path)
        if (pid is not None and _pid_alive(pid)) or time.monotonic() >= deadline:
            return pid
        time.sleep(HOLDER_PID_POLL_S)


def acquire(
    directory: Path, *, name: str = DEFAULT_NAME, holder_wait_s: float = 1.0
) -> InstanceLock:
    """Take the instance lock for `directory` or raise AlreadyRunning naming the holder's PID.

    The lock decides at once; `holder_wait_s` only bounds how long a refused caller re-reads a
    missing or stale PID file to name the live holder correctly.
    """
    directory.mkdir(parents=True, exist_ok=True)
    lock_path, pid_path = _paths(directory, name)
    handle = _try_lock(lock_path)
    if handle is None:
        holder_pid = _wait_for_holder_pid(pid_path, wait_s=holder_wait_s)
        raise AlreadyRunning(lock_path=lock_path, holder_pid=holder_pid)
    try:
        atomic_file.atomic_write_bytes(pid_path, f"{os.getpid()}\n".encode("ascii"))
    except BaseException:
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()
        raise
    return InstanceLock(handle=handle, lock_path=lock_path, pid_path=pid_path)


def is_held(directory: Path, *, name: str = DEFAULT_NAME) -> bool:
    """Whether a live process holds the lock for `directory` (probes and lets go at once)."""
    lock_path, _ = _paths(directory, name)
    if not lock_path.exists():
        return False
    handle = _try_lock(lock_path)
    if handle is None:
        return True
    fcntl.flock(handle, fcntl.LOCK_UN)
    handle.close()
    return False


REFUSED_STARTS_FILE = "refused_starts"


def record_refused_start(directory: Path) -> None:
    """Count a start refused by the lock, for the holder's metrics (one line per refusal).

    The refused process cannot reach the holder's memory; an append-only file in the same
    directory can (O_APPEND writes of one short line do not interleave). Best effort.
    """
    line = f"{time.time():.3f} {os.getpid()}\n".encode()
    try:
        fd = os.open(directory / REFUSED_STARTS_FILE, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError:
        return
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def refused_starts(directory: Path) -> int:
    """How many starts the lock of `directory` has refused (see record_refused_start)."""
    try:
        with open(directory / REFUSED_STARTS_FILE, "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0

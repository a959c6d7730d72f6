"""The log sink: a process's output, copied into a size-capped, rotated log file.

`monitord log-sink --path P --max-bytes N --keep K` (on the VPS: `monitord.pyz log-sink ...`)
reads its stdin — the pipe that carries one process's stdout and stderr — and appends it to P.
When the next line would take P past N bytes, P is rotated first: P.{K-1} -> P.K, ...,
P -> P.1 (the old P.K is dropped), and a fresh P is opened. So:

- P and its rotations never hold more than (K+1)·N bytes, and the newest lines are in P;
- a line is split across two files only if it is longer than N (it is then cut at N bytes)
  or if its beginning was written before its end arrived (a partial line is held back up
  to `_PARTIAL_HOLD_S` and `_PARTIAL_HOLD_BYTES` first, so that is rare);
- nothing is lost at a rotation except the oldest file; a failed write (disk full, the
  directory removed) drops that data instead of blocking or killing the writer, and the
  number of bytes lost is noted in the log once writing works again;
- it exits when its stdin reaches end of file, i.e. when the daemon and everything that
  inherited its output are gone.

Spawned by `monitord launch` and `agent-launch` (`spawn_logged`) for `monitord.log` and
`logs/agent.log`, in a session of its own, so that neither the launcher's exit nor a signal
to its process group ends it before it has read the last words. The areas' logs are written
by the side's one log hub (monitord/base/log_hub.py) through this module's RotatingLog, with
the same caps, rotation and notes. See docs/operations.md, "Area logs".

Standard library only, Python >= 3.9: it runs on the VPS too.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import os
import select
import sys
import time
from collections.abc import Mapping, Sequence

# A sink (and the log hub, which imports this) imports little: no pathlib, typing or
# subprocess (a few hundred kB of memory); `start`, which the spawners call, imports
# subprocess itself.
TYPE_CHECKING = False
if TYPE_CHECKING:
    import subprocess

# Defaults, for the PBX ([monitord] area_log_max_bytes / area_log_keep) and the VPS alike.
# A 10 GB VPS with ~100 areas: 2 MiB x (1 + 3 kept) = 8 MiB per area, 800 MiB for 100 areas
# (8 % of the disk), and still about three files of history to read after a crash.
DEFAULT_MAX_BYTES = 2 * 1024 * 1024
DEFAULT_KEEP = 3
MIN_MAX_BYTES = 4096  # smaller caps would rotate on nearly every line

_READ_BYTES = 256 * 1024
_PIPE_BYTES = 1024 * 1024  # asked for, best effort: a burst fits in the pipe, not the writer
_F_SETPIPE_SZ = 1031  # fcntl.F_SETPIPE_SZ is only named from Python 3.10
_PARTIAL_HOLD_S = 0.2
_PARTIAL_HOLD_BYTES = 64 * 1024
_REOPEN_AFTER_S = 1.0


class RotatingLog:
    """The file side: appends to `path`, rotating before it would exceed `max_bytes`."""

    def __init__(self, path: str, *, max_bytes: int, keep: int) -> None:
        if max_bytes < 1 or keep < 0:
            raise ValueError("max_bytes must be >= 1 and keep >= 0")
        self.path = path
        self.max_bytes = max_bytes
        self.keep = keep
        self.dropped = 0  # bytes lost to failed writes, not yet noted in the log
        self._why = ""
        self._fd: int | None = None
        self._ino = -1
        self._size = 0
        self._mid_line = False  # the last byte written was not a newline
        self._reopen_at = 0.0
        self._open()

    def write(self, data: bytes) -> None:
        """Append `data`; rotate where the next line would not fit (see the module doc)."""
        self._follow()
        if self.dropped and self._fd is not None:
            lost, self.dropped = self.dropped, 0
            self._write(f"log-sink: {lost} bytes of output lost ({self._why})\n".encode())
        self._write(data)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    # -- internals -------------------------------------------------------------------

    def _follow(self) -> None:
        """Before each write: write where the path points now (another writer — a relaunched
        sink overlapping the old one's last reads — may have rotated it; one stat),
        retry a failed file at most every _REOPEN_AFTER_S, and count what others appended."""
        if self._fd is not None and self._moved():
            self.close()
            self._open()
        elif self._fd is None and time.monotonic() >= self._reopen_at:
            self._open()
        if self._fd is not None:
            self._size = os.fstat(self._fd).st_size

    def _moved(self) -> bool:
        try:
            return os.stat(self.path).st_ino != self._ino
        except OSError:
            return True

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        start, end_of_data = 0, len(data)
        while start < end_of_data:
            room = self.max_bytes - self._size
            if end_of_data - start <= room:
                end = end_of_data
            else:
                newline = data.rfind(b"\n", start, start + room)
                if newline >= 0:
                    end = newline + 1
                elif self._size > 0 and not self._mid_line:
                    self._rotate()  # the next line needs a fresh file
                    continue
                else:
                    end = start + room  # longer than a whole file, or already begun: cut
            if end > start:
                self._append(view[start:end])
                start = end
            if start < end_of_data:
                self._rotate()

    def _open(self) -> None:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o666)
            st = os.fstat(fd)
        except OSError as e:
            self._fail(e)
            return
        self._fd, self._ino, self._size, self._mid_line = fd, st.st_ino, st.st_size, False

    def _append(self, chunk: memoryview) -> None:
        if self._fd is None:
            self.dropped += len(chunk)
            return
        while chunk:
            try:
                written = os.write(self._fd, chunk)
            except OSError as e:
                self.dropped += len(chunk)
                self._fail(e)
                return
            self._size += written
            self._mid_line = chunk[written - 1] != 0x0A  # b"\n"
            chunk = chunk[written:]

    def _rotate(self) -> None:
        """P.{K-1} -> P.K ... P -> P.1, then a fresh P, under a lock on the directory so that
        two sinks on one file never both rotate it: the second just reopens the fresh P."""
        if self._fd is None:
            if time.monotonic() >= self._reopen_at:
                self._open()
            return
        self.close()
        self._mid_line = False
        try:
            lock_fd = os.open(os.path.dirname(self.path) or ".",
                              os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            self._fail(e)
            return
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)  # held for a few renames
            if not self._moved():
                if self.keep == 0:
                    os.unlink(self.path)
                for index in range(self.keep - 1, 0, -1):
                    _rename_if_present(f"{self.path}.{index}", f"{self.path}.{index + 1}")
                if self.keep > 0:
                    os.replace(self.path, f"{self.path}.1")
            self._open()
        except OSError as e:
            self._fail(e)
        finally:
            os.close(lock_fd)

    def _fail(self, error: OSError) -> None:
        self.close()
        self._size = 0
        self._why = f"{error.strerror or error}: {error.filename or self.path}"
        self._reopen_at = time.monotonic() + _REOPEN_AFTER_S


def _rename_if_present(source: str, target: str) -> None:
    try:
        os.replace(source, target)
    except FileNotFoundError:
        pass


def pump(source_fd: int, log: RotatingLog) -> None:
    """Copy `source_fd` into `log` until end of file. A partial line at the end of a read is
    held back briefly, so that a rotation almost never splits a line."""
    try:
        fcntl.fcntl(source_fd, _F_SETPIPE_SZ, _PIPE_BYTES)
    except OSError:
        pass  # not a pipe, or above the system's pipe-max-size: the default will do
    poller = select.poll()
    poller.register(source_fd, select.POLLIN)
    pending = b""
    while True:
        if pending and not poller.poll(_PARTIAL_HOLD_S * 1000):
            log.write(pending)  # the rest of that line is not coming soon: write what we have
            pending = b""
            continue
        chunk = os.read(source_fd, _READ_BYTES)
        if not chunk:
            break
        data = pending + chunk if pending else chunk
        last_newline = data.rfind(b"\n")
        if last_newline >= 0:
            log.write(data[: last_newline + 1])
        pending = data[last_newline + 1 :]
        if len(pending) >= _PARTIAL_HOLD_BYTES:
            log.write(pending)
            pending = b""
    if pending:
        log.write(pending)
    log.close()


def _drop_capabilities() -> None:
    """Give up every capability the spawner had (the agent may hold some, to run daemons as
    other users): the sink only appends to a file in its spawner's own log directory."""
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable: all empty
    try:
        ctypes.CDLL(None, use_errno=True).capset(header, data)
    except (OSError, AttributeError):
        pass  # not Linux, or no capset: nothing to give up


def arguments(*, path: os.PathLike[str] | str, max_bytes: int, keep: int) -> list[str]:
    """The verb's arguments for one log file (the spawner puts its own argv prefix first)."""
    return ["--path", os.fspath(path), "--max-bytes", str(max_bytes), "--keep", str(keep)]


def start(
    argv: Sequence[str], *, stdin_fd: int, env: Mapping[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start a sink reading `stdin_fd`, in a session of its own (see the module doc).
    The caller closes its copies of both pipe ends once the writer is started."""
    import subprocess  # here, not at the top: the sink process itself never needs it

    return subprocess.Popen(
        list(argv),
        stdin=stdin_fd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd="/",
        env=None if env is None else dict(env),
        start_new_session=True,
        close_fds=True,
    )


def spawn_logged(
    argv: Sequence[str],
    *,
    sink_argv: Sequence[str],
    env: Mapping[str, str] | None = None,
    sink_env: Mapping[str, str] | None = None,
) -> tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]]:
    """Start `argv` detached (a session of its own, stdin /dev/null) with its stdout and
    stderr through a sink started by `sink_argv` (this verb's whole command line): how
    `monitord launch` writes `monitord.log` and `agent-launch` the agent's `agent.log`, bounded
    like an area's log. Returns (the process, its sink)."""
    import subprocess

    read_end, write_end = os.pipe()
    try:
        sink = start(sink_argv, stdin_fd=read_end, env=sink_env)
        try:
            child = subprocess.Popen(
                list(argv), stdin=subprocess.DEVNULL, stdout=write_end, stderr=write_end,
                env=None if env is None else dict(env), start_new_session=True, close_fds=True,
            )
        except OSError:
            os.close(write_end)  # the sink sees end of file and ends
            write_end = -1
            sink.wait()
            raise
    finally:
        os.close(read_end)
        if write_end >= 0:
            os.close(write_end)
    return child, sink


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--path", required=True, help="the log file to write")
    parser.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES,
                        help=f"rotate before the file exceeds this (>= {MIN_MAX_BYTES})")
    parser.add_argument("--keep", type=int, default=DEFAULT_KEEP,
                        help="rotated files to keep: PATH.1 (newest) ... PATH.KEEP")


def run(args: argparse.Namespace) -> int:
    if args.max_bytes < MIN_MAX_BYTES or args.keep < 0:
        print(f"log-sink: --max-bytes must be >= {MIN_MAX_BYTES} and --keep >= 0",
              file=sys.stderr)
        return 2
    _drop_capabilities()
    pump(0, RotatingLog(args.path, max_bytes=args.max_bytes, keep=args.keep))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="log-sink", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


# The verb this module serves (monitord.surface.cli, monitord.vps.entry).
VERBS = {"log-sink": (add_arguments, run)}


if __name__ == "__main__":
    sys.exit(main())

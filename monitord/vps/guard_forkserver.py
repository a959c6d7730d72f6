"""The guards' fork server: lease guards forked from one warm process, sharing its memory.

A lease guard (monitord/vps/lease_guard.py) is a Python process per remote daemon. Started as
a fresh interpreter, each costs the VPS about 9 MiB of its own (the interpreter and the
modules it imports), so 100 areas would need most of a 1 GB VPS just to be watched. Forked
from a process that has already imported everything (and run a guard's code once, so that
what that leaves behind is shared too), a guard shares those pages copy-on-write and pays only
for what it touches itself: about a third (docs/agent.md, "The guards' fork server").
It also skips an interpreter's start-up (a remote start waits for it: it is part of every
move's downtime).

`monitord.pyz guard-forkserver --socket PATH` listens on a SOCK_SEQPACKET unix socket in the
agent's `run/` directory (0700: only the agent's user reaches it). One request per connection:
a JSON object `{"argv": [lease-guard options, "--", daemon command…], "env": {…}, "cwd": DIR}`
with the area's log FIFO passed as a descriptor (SCM_RIGHTS); the answer is `{"pid": N}`, once
the guard runs in a session of its own, or `{"error": "…"}`. The guard then waits for the
agent's `go` on the same connection before it does anything: an agent that gave up on the spawn
(a time-out, the server dying) starts the guard as a command instead, and the forked one, never
told to go, exits without starting a daemon, so an area never gets two. A guard is forked twice
(the fork server does not keep it as a child: it is reaped by init like any guard whose agent
died) and is then exactly what `lease-guard` started as a command would be: its own session and
process group, stdin /dev/null, stdout and stderr the FIFO, the given environment and working
directory, the fork server's user and capabilities (the agent's), no other descriptor. Only its
/proc/PID/cmdline differs (the fork server's): the agent's record of the guard carries the
daemon's command instead (monitord/vps/area_runner.py).

The fork server holds no state worth keeping: the guards outlive it. It belongs to the agent
that started it and exits within a second of that agent's end (or of its socket being removed
or replaced); a new agent starts its own. While none answers, the agent starts a guard as a
plain `lease-guard` command, as before.

Standard library only, Python >= 3.9: it runs on the VPS.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import select
import signal
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

from monitord.vps import lease_guard

_MAX_REQUEST = 256 * 1024  # argv + environment of one daemon; a SOCK_SEQPACKET message
_REQUEST_TIMEOUT_S = 5.0  # one client's request and our answer; a stuck client is dropped
_LOOK_S = 1.0  # how often the socket and the agent are looked at while no request comes
_WARM_UP_RUNS = 3
GO = b"go"  # the agent's word that releases a forked guard
_PR_SET_NAME = 15
_GUARD_NAME = b"lease-guard"  # what ps and top show for a forked guard


def serve(socket_path: str, *, agent_pid: int) -> int:
    """Accept requests on `socket_path` until it is gone or replaced, or the agent that
    started us (`agent_pid`, our parent) has ended: a new agent starts its own."""
    directory, name = os.path.split(socket_path)
    os.chdir(directory or ".")  # bound by its short name: a unix socket path has 108 bytes
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    staging = f".{name}.{os.getpid()}"
    try:
        os.unlink(staging)
    except FileNotFoundError:
        pass
    listener.bind(staging)
    listener.listen(64)
    os.rename(staging, name)  # appears only once it accepts
    ours = os.stat(name).st_ino
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    _warm_up()
    gc.collect()
    gc.freeze()  # a guard's collections would otherwise touch (and copy) every shared object
    while True:
        ready, _, _ = select.select([listener], [], [], _LOOK_S)
        try:
            if os.stat(name).st_ino != ours or os.getppid() != agent_pid:
                return 0
        except FileNotFoundError:
            return 0
        if ready:
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(_REQUEST_TIMEOUT_S)
                _answer(conn)


def _warm_up() -> None:
    """Run here, a few times, what every guard runs: a lease read, argument parsing, a daemon
    (`true`) started, reported and reaped. The caches this fills and the bytecode the
    interpreter specialises as it runs are then shared with every guard, not copied into each
    (it takes a guard's own memory from about 4.7 to 3.3 MiB on Python 3.11)."""
    import tempfile

    from monitord.vps import lease_file

    with tempfile.TemporaryDirectory() as tmp:
        lease, report = Path(tmp, "lease.json"), Path(tmp, "daemon")
        lease_file.write(lease, area="warm-up", generation=1, owner_id="warm-up", ttl_s=60.0)
        argv = ["--lease-file", str(lease), "--stop-grace", "1", "--fence-grace", "1",
                "--daemon-file", str(report), "--", "true"]
        with open(os.devnull, "w") as null:
            stderr, sys.stderr = sys.stderr, null  # (the guard's lines)
            try:
                for _ in range(_WARM_UP_RUNS):
                    lease_guard.main(argv)
            finally:
                sys.stderr = stderr
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def _answer(conn: socket.socket) -> None:
    fds: list[int] = []
    try:
        message, fds, _flags, _addr = socket.recv_fds(conn, _MAX_REQUEST, 1)
        request = json.loads(message)
        argv = [str(a) for a in request["argv"]]
        env = {str(k): str(v) for k, v in request["env"].items()}
        cwd = str(request["cwd"])
        if len(fds) != 1:
            raise ValueError("one descriptor (the area's log) is expected")
        pid, go = _fork_guard(argv, env, cwd, fds[0])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        _send(conn, {"error": f"{type(e).__name__}: {e}"})
        return
    finally:
        for fd in fds:
            os.close(fd)
    with os.fdopen(go, "wb", buffering=0) as release:
        try:
            if _send(conn, {"pid": pid}) and conn.recv(16) == GO:
                release.write(GO)
        except OSError:
            pass  # no go: closing `release` ends the guard before it starts anything


def _send(conn: socket.socket, answer: dict[str, object]) -> bool:
    try:
        conn.sendall(json.dumps(answer).encode())
    except OSError:
        return False  # the agent gave up
    return True


def _fork_guard(argv: list[str], env: dict[str, str], cwd: str,
                log_fd: int) -> tuple[int, int]:
    """Fork the guard as the grandchild (its own session): its pid once it runs, and the
    descriptor that releases it (one byte `go`; closed unwritten, the guard exits at once)."""
    os.stat(cwd)  # a missing directory is the agent's error, not a guard that dies at once
    sys.stdout.flush()
    sys.stderr.flush()
    report_r, report_w = os.pipe()
    go_r, go_w = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the forked processes
        try:
            os.close(report_r)
            os.close(go_w)
            if os.fork() != 0:
                os._exit(0)
            os.setsid()  # the guard leads its session and group, as `start_new_session` does
            _name_process(_GUARD_NAME)  # before its pid is known: nobody sees it unnamed
            os.write(report_w, str(os.getpid()).encode())
            os.close(report_w)
            if os.read(go_r, len(GO)) == GO:
                os.close(go_r)
                _become_guard(argv, env, cwd, log_fd)
        finally:
            os._exit(127)
    os.close(report_w)
    os.close(go_r)
    os.waitpid(child, 0)
    with os.fdopen(report_r, "rb") as report:
        pid = report.read()
    if not pid:
        os.close(go_w)
        raise OSError("the guard did not start")
    return int(pid), go_w


def _become_guard(argv: list[str], env: dict[str, str], cwd: str, log_fd: int) -> None:
    """In the guard: the state a freshly started `lease-guard` would have, then its main."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    for name in os.listdir("/proc/self/fd"):
        if int(name) > 2:
            try:
                os.close(int(name))
            except OSError:
                pass  # (the listing's own descriptor)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    status = lease_guard.main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _name_process(name: bytes) -> None:
    try:
        ctypes.CDLL(None).prctl(_PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)
    except (OSError, AttributeError):
        pass  # only cosmetic: ps shows the fork server's name


# -- the agent's side -------------------------------------------------------------------------


def spawn(socket_path: str, *, argv: Sequence[str], env: dict[str, str], cwd: str,
          log_fd: int, timeout_s: float = 2.0) -> int:
    """Ask the fork server at `socket_path` for a guard; its pid. OSError (no fork server,
    or it failed: the caller starts the guard as a command) or ValueError (a bad answer)."""
    request = json.dumps({"argv": list(argv), "env": env, "cwd": cwd}).encode()
    directory, name = os.path.split(socket_path)
    dir_fd = os.open(directory or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
            conn.settimeout(timeout_s)
            conn.connect(f"/proc/self/fd/{dir_fd}/{name}")  # short, however deep the dir
            socket.send_fds(conn, [request], [log_fd])
            answer = json.loads(conn.recv(4096) or b"{}")
            if "pid" not in answer:
                raise OSError(f"guard fork server: {answer.get('error', 'no answer')}")
            pid = int(answer["pid"])
            conn.sendall(GO)  # from here on the guard is ours: it starts its daemon
    finally:
        os.close(dir_fd)
    return pid


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--socket", required=True, help="the unix socket to listen on")
    parser.add_argument("--agent-pid", type=int, required=True,
                        help="exit once this process (our parent) is no longer our parent")


def run(args: argparse.Namespace) -> int:
    return serve(args.socket, agent_pid=args.agent_pid)


VERBS = {"guard-forkserver": (add_arguments, run)}

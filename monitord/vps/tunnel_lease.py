"""`monitord tunnel-lease`: the tunnel lease operations, run ON THE VPS over SSH exec.

The local keeper (through lease_client.py) runs
`monitord tunnel-lease --dir REMOTE_BIN_DIR acquire|renew|release|show|fence|serve …`.
Every lease operation holds an exclusive flock on `{dir}/tunnel_lease.lock` while it reads
`{dir}/tunnel_lease.json`, asks orchestrator/tunnel_lease.py what to do, and writes the new
record atomically (temp file, fsync, rename, fsync dir). The caller's session identity is
found by walking up the parent chain to the nearest SSH session process (PID + start time;
`sshd` or `sshd-session`, never the listener: orchestrator/sshd_session.py) plus
$SSH_CONNECTION. Output is ONE JSON object on stdout; exit status 0 whenever a decision
was made (granted or refused: see "ok"), 2 for a usage or environment problem.

`fence` terminates one SSH session process (verified by PID + start time and recognised as a
session, never the listener, never the caller's own).
`serve` is what the keeper runs: one helper process for the life of a connection that
answers JSON-line requests (the lease ops, fence, and the forward probe: bind a socket,
report its source port, then connect to a reverse-forwarded port and do a nonce round trip,
so the local side can prove the forward arrives through its own connection).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from monitord.base.atomic_file import atomic_write_bytes, fsync_path
from orchestrator.errors import PermanentError
from orchestrator.tunnel_lease import PROBE_PREFIX, PROBE_REPLY

LEASE_FILE = "tunnel_lease.json"
LOCK_FILE = "tunnel_lease.lock"
LOCK_TIMEOUT_S = 5.0
FENCE_TIMEOUT_S = 3.0
EXIT_DECIDED = 0
EXIT_USAGE = 2


class LeaseCommandError(PermanentError):
    """An environment problem the caller must see (bad dir, lock timeout, corrupt record)."""


def add_tunnel_lease_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", required=True, help="the remote bin dir holding the lease file")
    parser.add_argument(
        "op", choices=["acquire", "renew", "release", "show", "fence", "serve"]
    )
    parser.add_argument("--owner-id", default="")
    parser.add_argument("--owner-label", default="")
    parser.add_argument("--ttl", type=float, default=30.0)
    parser.add_argument("--pid", type=int, default=0, help="fence: the sshd session to end")
    parser.add_argument("--start-ticks", type=int, default=0, help="fence: its start time")


add_arguments = add_tunnel_lease_arguments


def main_tunnel_lease(args: argparse.Namespace) -> int:
    if args.op == "serve":
        return _serve(args)
    try:
        result = _dispatch(args)
    except LeaseCommandError as e:
        _emit({"ok": False, "op": args.op, "code": e.code, "detail": e.detail})
        return EXIT_USAGE
    _emit(result)
    return EXIT_DECIDED


main = main_tunnel_lease


def _emit(document: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(document, sort_keys=True) + "\n")
    sys.stdout.flush()


def _dispatch(args: argparse.Namespace) -> dict[str, Any]:
    if args.op == "fence":
        return _fence_op(args.pid, args.start_ticks)
    directory = Path(args.dir)
    if not directory.is_dir():
        raise LeaseCommandError("PREFLIGHT_BIN_DIR", f"{directory} is not a directory")
    if args.op in ("acquire", "renew", "release") and not args.owner_id:
        raise LeaseCommandError("BAD_REQUEST", f"{args.op} needs --owner-id")
    with _locked(directory / LOCK_FILE):
        return _lease_op(args, directory / LEASE_FILE)


# -- the lease -----------------------------------------------------------------------------
def _lease_op(args: argparse.Namespace, path: Path) -> dict[str, Any]:
    from orchestrator import tunnel_lease

    now = time.time()
    current = _read_record(path)
    base: dict[str, Any] = {"op": args.op, "now": now}
    if args.op == "show":
        alive = current is not None and _session_alive(current.session)
        return {**base, "ok": True, "lease": _as_dict(current), "holder_session_alive": alive}
    if args.op == "release":
        decision = tunnel_lease.decide_release(current, owner_id=args.owner_id)
        if decision.action is tunnel_lease.LeaseAction.RELEASE:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            fsync_path(path.parent)
        return {**base, "ok": True, "action": decision.action.value, "reason": decision.reason,
                "lease": None, "holder": _as_dict(decision.holder)}
    session = _caller_session()
    if args.op == "renew":
        decision = tunnel_lease.decide_renew(
            current, owner_id=args.owner_id, session=session, now=now
        )
    else:
        alive = current is not None and _session_alive(current.session)
        decision = tunnel_lease.decide_acquire(
            current, owner_id=args.owner_id, owner_label=args.owner_label or args.owner_id,
            ttl=args.ttl, session=session, now=now, holder_session_alive=alive,
        )
    fenced: int | None = None
    if decision.action is tunnel_lease.LeaseAction.FENCE_THEN_TAKE:
        assert decision.holder is not None
        if not _fence(decision.holder.session.sshd_pid, decision.holder.session.sshd_start_ticks):
            return {**base, "ok": False, "action": "refuse_conflict", "code":
                    "TUNNEL_LEASE_CONFLICT", "reason": "could not fence the expired holder",
                    "lease": None, "holder": _as_dict(decision.holder)}
        fenced = decision.holder.session.sshd_pid
    if decision.record is not None:
        _write_record(path, decision.record)
    granted = decision.record is not None
    result: dict[str, Any] = {
        **base, "ok": granted, "action": decision.action.value, "reason": decision.reason,
        "lease": _as_dict(decision.record), "holder": _as_dict(decision.holder),
        "session": _session_dict(session), "fenced_pid": fenced,
    }
    if not granted:
        foreign = decision.holder is not None and decision.holder.owner_id != args.owner_id
        result["code"] = "TUNNEL_LEASE_CONFLICT" if foreign else "LEASE_EXPIRED"
    return result


def _as_dict(record: Any) -> dict[str, Any] | None:
    return None if record is None else dict(record.to_dict())


def _session_dict(session: Any) -> dict[str, Any]:
    return {"sshd_pid": session.sshd_pid, "sshd_start_ticks": session.sshd_start_ticks,
            "ssh_connection": session.ssh_connection}


def _read_record(path: Path) -> Any:
    from orchestrator.tunnel_lease import LeaseRecord

    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise LeaseCommandError("STORE_WRITE_FAILED", f"cannot read {path}: {e}") from e
    try:
        return LeaseRecord.from_dict(json.loads(raw))
    except (ValueError, KeyError, TypeError) as e:
        raise LeaseCommandError("CONFIG_CORRUPT", f"{path} is not a lease record: {e}") from e


def _write_record(path: Path, record: Any) -> None:
    data = json.dumps(record.to_dict(), sort_keys=True, indent=2).encode() + b"\n"
    try:
        atomic_write_bytes(path, data, mode=0o600)
    except OSError as e:
        raise LeaseCommandError("STORE_WRITE_FAILED", f"cannot write {path}: {e}") from e


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Exclusive flock on `path`, waiting at most LOCK_TIMEOUT_S."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError as e:
                if time.monotonic() > deadline:
                    raise LeaseCommandError(
                        "TRANSACTION_CONFLICT", f"{path} stayed locked for {LOCK_TIMEOUT_S}s"
                    ) from e
                time.sleep(0.01)  # poll interval of a bounded lock wait
        yield
    finally:
        os.close(fd)  # closing the descriptor drops the flock


# -- sessions ------------------------------------------------------------------------------
# Which process is an SSH session is orchestrator/sshd_session.py's recognition; this module
# only reads the facts it needs from /proc. PROC_ROOT is where: a test points it at a fake
# process tree.
PROC_ROOT = Path("/proc")
_LISTEN = "0A"  # the LISTEN state in /proc/net/tcp


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(comm, ppid, start_ticks) of a live process, None if it is gone or a zombie."""
    try:
        raw = (PROC_ROOT / str(pid) / "stat").read_text()
    except OSError:
        return None
    comm = raw[raw.index("(") + 1 : raw.rindex(")")]
    fields = raw[raw.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):
        return None
    return comm, int(fields[1]), int(fields[19])


def _ancestor_pids(pid: int) -> list[int]:
    chain: list[int] = []
    while pid > 1:
        stat = _stat(pid)
        if stat is None:
            break
        chain.append(pid)
        pid = stat[1]
    return chain


def _ssh_port(ssh_connection: str) -> int | None:
    parsed = _tcp_tuple(ssh_connection)
    return None if parsed is None else parsed[3]


def _listening_inodes(port: int) -> set[str]:
    """Socket inodes listening on TCP `port` (IPv4 and IPv6) in this network namespace."""
    inodes: set[str] = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (PROC_ROOT / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if (len(fields) > 9 and fields[3] == _LISTEN
                    and int(fields[1].rsplit(":", 1)[1], 16) == port):
                inodes.add(fields[9])
    return inodes


def _listens_on(pid: int, port: int | None) -> bool | None:
    """Does the process hold a socket listening on `port`? None: cannot tell (unknown port,
    or another user's descriptors)."""
    if port is None:
        return None
    listening = _listening_inodes(port)
    fd_dir = PROC_ROOT / str(pid) / "fd"
    try:
        names = os.listdir(fd_dir)
    except FileNotFoundError:
        return False
    except OSError:
        return None
    for name in names:
        try:
            target = os.readlink(fd_dir / name)
        except OSError:
            continue
        if target.startswith("socket:[") and target[8:-1] in listening:
            return True
    return False


def _role(pid: int, stat: tuple[str, int, int], *, ssh_port: int | None) -> Any:
    """orchestrator/sshd_session.py's role of a live process."""
    from orchestrator import sshd_session

    parent = _stat(stat[1]) if stat[1] > 0 else None
    listens = _listens_on(pid, ssh_port) if stat[0] in sshd_session.SSHD_COMMANDS else None
    return sshd_session.role(sshd_session.ProcessFacts(
        comm=stat[0], parent_comm="" if parent is None else parent[0],
        listens_on_ssh_port=listens,
    ))


def _is_session(pid: int, stat: tuple[str, int, int], *, ssh_port: int | None) -> bool:
    from orchestrator.sshd_session import Role

    return bool(_role(pid, stat, ssh_port=ssh_port) is Role.SESSION)


def _caller_session() -> Any:
    """The nearest SSH session process above us (the per-connection process that owns our
    channel and forwards: `sshd` up to OpenSSH 9.7, `sshd-session` since 9.8, never the
    listener), and $SSH_CONNECTION.

    An SSH server without a per-connection process (an embedded server such as the one
    `monitord demo` runs) is identified by $SSH_CONNECTION alone (sshd_pid 0): such a
    session is alive while its TCP connection is established, and cannot be fenced.
    """
    from orchestrator.tunnel_lease import SessionIdentity

    ssh_connection = os.environ.get("SSH_CONNECTION", "")
    ssh_port = _ssh_port(ssh_connection)
    for pid in _ancestor_pids(os.getppid()):
        stat = _stat(pid)
        if stat is not None and _is_session(pid, stat, ssh_port=ssh_port):
            return SessionIdentity(
                sshd_pid=pid,
                sshd_start_ticks=stat[2],
                ssh_connection=ssh_connection,
            )
    if _tcp_tuple(ssh_connection) is not None:
        return SessionIdentity(sshd_pid=0, sshd_start_ticks=0, ssh_connection=ssh_connection)
    raise LeaseCommandError("BAD_REQUEST", "not running under an SSH session")


def _session_alive(session: Any) -> bool:
    if session.sshd_pid <= 0:
        return _tcp_established(session.ssh_connection)
    stat = _stat(session.sshd_pid)
    return (
        stat is not None
        and stat[2] == session.sshd_start_ticks
        and _is_session(session.sshd_pid, stat, ssh_port=_ssh_port(session.ssh_connection))
    )


def _tcp_tuple(ssh_connection: str) -> tuple[str, int, str, int] | None:
    """(client ip, client port, server ip, server port) from $SSH_CONNECTION."""
    parts = ssh_connection.split()
    if len(parts) != 4 or not all(p.isascii() and p.isdigit() and len(p) <= 5
                                  for p in (parts[1], parts[3])):
        return None
    return parts[0], int(parts[1]), parts[2], int(parts[3])


def _hex_endpoint(ip: str, port: int) -> str | None:
    """An endpoint as /proc/net/tcp writes it (IPv4 only: little-endian hex address)."""
    try:
        packed = socket.inet_aton(ip)
    except OSError:
        return None
    return f"{int.from_bytes(packed, 'little'):08X}:{port:04X}"


def _tcp_established(ssh_connection: str) -> bool:
    """Is the server side of this SSH connection an ESTABLISHED socket on this host?

    Unknown (not IPv4, unreadable /proc) counts as alive: never take a lease on a guess.
    """
    parsed = _tcp_tuple(ssh_connection)
    if parsed is None:
        return True
    client_ip, client_port, server_ip, server_port = parsed
    local = _hex_endpoint(server_ip, server_port)
    remote = _hex_endpoint(client_ip, client_port)
    if local is None or remote is None:
        return True
    try:
        lines = (PROC_ROOT / "net" / "tcp").read_text().splitlines()[1:]
    except OSError:
        return True
    for line in lines:
        fields = line.split()
        if len(fields) > 3 and fields[1] == local and fields[2] == remote and fields[3] == "01":
            return True
    return False


def _fence(pid: int, start_ticks: int) -> bool:
    """End that exact SSH session process: SIGTERM, then SIGKILL; True once it is gone.

    Refuses (False) for a process that is not a session by orchestrator/sshd_session.py
    (the listener, a pre-auth helper, anything not sshd), has another start time (a reused
    PID), or is one of our own ancestors (our own live session)."""
    if pid <= 0:
        return False  # a session without its own process cannot be fenced; wait for it
    stat = _stat(pid)
    if stat is None:
        return True
    ssh_port = _ssh_port(os.environ.get("SSH_CONNECTION", ""))
    if (stat[2] != start_ticks or not _is_session(pid, stat, ssh_port=ssh_port)
            or pid in _ancestor_pids(os.getpid())):
        return False
    for sig, wait_s in ((signal.SIGTERM, FENCE_TIMEOUT_S / 2), (signal.SIGKILL, FENCE_TIMEOUT_S)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            now_stat = _stat(pid)
            if now_stat is None or now_stat[2] != start_ticks:
                return True
            time.sleep(0.01)  # poll interval of a bounded wait for the process to exit
    return False


def _fence_op(pid: int, start_ticks: int) -> dict[str, Any]:
    if pid <= 1:
        raise LeaseCommandError("BAD_REQUEST", "fence needs --pid and --start-ticks")
    stat = _stat(pid)
    gone = _fence(pid, start_ticks)
    return {"op": "fence", "ok": gone, "pid": pid, "was_running": stat is not None,
            "now": time.time()}


# -- forward proof -------------------------------------------------------------------------
def _probe_bind(host: str) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, 0))
    return sock


def _probe_connect(sock: socket.socket, *, host: str, port: int, nonce: bytes,
                   timeout_s: float) -> dict[str, Any]:
    """From the already bound `sock`, connect to host:port, send the nonce and expect it
    back prefixed by PROBE_REPLY (only our own listener can answer that)."""
    if not 0 < port < 65536 or not nonce:
        raise LeaseCommandError("BAD_REQUEST", "probe needs a port and a nonce")
    with sock:
        sock.settimeout(timeout_s)
        started = time.monotonic()
        reply = b""
        try:
            sock.connect((host, port))
            sock.sendall(PROBE_PREFIX + nonce + b"\n")
            while not reply.endswith(b"\n") and len(reply) < 256:
                chunk = sock.recv(256)
                if not chunk:
                    break
                reply += chunk
        except OSError as e:
            return {"op": "probe", "ok": False, "detail": f"{type(e).__name__}: {e}"}
        rtt_ms = (time.monotonic() - started) * 1000
    ok = reply.strip() == PROBE_REPLY + nonce
    return {"op": "probe", "ok": ok, "rtt_ms": rtt_ms,
            "detail": "" if ok else f"unexpected reply {reply[:64]!r}"}


# -- serve: one helper process per connection -----------------------------------------------
def _serve(args: argparse.Namespace) -> int:
    """Answer JSON-line requests on stdin until EOF (the connection's end).

    Requests: {"op": "acquire"|"renew"|"release"|"show"} (owner from the command line),
    {"op": "fence", "pid", "start_ticks"}, {"op": "probe-bind", "host"} -> source_port,
    {"op": "probe-connect", "source_port", "host", "port", "nonce", "timeout"}.
    One reply line per request. Saves a process start (login shell + imports) per step."""
    directory = Path(args.dir)
    bound: dict[int, socket.socket] = {}
    _emit({"op": "ready", "ok": True})
    for line in sys.stdin:
        op = "?"
        try:
            request = json.loads(line)
            op = str(request["op"])
            reply = _serve_one(op, request, args=args, directory=directory, bound=bound)
        except LeaseCommandError as e:
            reply = {"ok": False, "op": op, "code": e.code, "detail": e.detail}
        except (ValueError, KeyError, TypeError) as e:
            reply = {"ok": False, "op": op, "code": "BAD_REQUEST",
                     "detail": f"{type(e).__name__}: {e}"}
        _emit(reply)
    for sock in bound.values():
        sock.close()
    return EXIT_DECIDED


def _serve_one(op: str, request: dict[str, Any], *, args: argparse.Namespace,
               directory: Path, bound: dict[int, socket.socket]) -> dict[str, Any]:
    if op in ("acquire", "renew", "release", "show"):
        if not directory.is_dir():
            raise LeaseCommandError("PREFLIGHT_BIN_DIR", f"{directory} is not a directory")
        with _locked(directory / LOCK_FILE):
            return _lease_op(argparse.Namespace(**{**vars(args), "op": op}),
                             directory / LEASE_FILE)
    if op == "fence":
        return _fence_op(int(request["pid"]), int(request["start_ticks"]))
    if op == "probe-bind":
        sock = _probe_bind(str(request.get("host", "127.0.0.1")))
        port = int(sock.getsockname()[1])
        bound[port] = sock
        return {"op": op, "ok": True, "source_port": port}
    if op == "probe-connect":
        sock = bound.pop(int(request["source_port"]))
        return _probe_connect(sock, host=str(request["host"]), port=int(request["port"]),
                              nonce=str(request["nonce"]).encode(),
                              timeout_s=float(request.get("timeout", 5.0)))
    raise LeaseCommandError("BAD_REQUEST", f"unknown op {op!r}")


# The verb this module serves (monitord.surface.cli): verb -> (add arguments, run).
VERBS = {"tunnel-lease": (add_tunnel_lease_arguments, main_tunnel_lease)}

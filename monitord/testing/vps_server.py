"""An in-process asyncssh server that plays the VPS on this machine's loopback.

Used by `monitord demo` and by the integration tests (provisioning, preflight, tunnel,
migration). It behaves like a small OpenSSH server for the features monitord uses:

- public-key authentication only, with a host key and a client key generated at run time
  (written to `work_dir` as `id_ed25519` (0600) and `known_hosts`);
- exec: each command runs as a real subprocess through `/bin/sh -c` (like sshd running the
  user's shell), with stdin/stdout/stderr and the exit status carried over the channel and
  `SSH_CONNECTION` set in its environment; a session without a command gets `/bin/sh`;
- `env` adds to (or overrides) the environment of every command, e.g. a PATH that puts a
  fake `uname` first; `command_log` records every exec'd command line;
- SFTP rooted at `/` (or `sftp_root`);
- remote port forwarding: `tcpip-forward` listens on this machine's loopback, which plays
  the VPS side; local forwarding: `direct-tcpip` connects from this machine, and
  `direct-streamlocal` to a Unix socket (the agent's);
- fault controls: `drop_all_sessions()`, `refuse_new_connections()` / `accept_new_connections()`,
  `stall()` / `resume()`, and `deny_forward(port)` to make a `tcpip-forward` request fail.

Differences from sshd worth knowing: commands run as the current user; when a session's
channel closes while its command still runs, the command's process group gets SIGTERM
(then SIGKILL), as a pty session would on hang-up; a daemon meant to outlive the session
must detach itself (new session, stdio closed), as it must under sshd.

    async with VpsServer(work_dir=tmp_path) as vps:
        async with vps.connect() as conn:
            result = await conn.run("uname -m")
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import asyncssh

from monitord.base import logs
from monitord.base.config import RemoteSection
from monitord.base.task_owner import TaskOwner
from monitord.testing import server_close_race

log = logs.get_logger(__name__)
# asyncssh's listeners of forwarded ports close while fake daemons reconnect to them.
server_close_race.install()

_CHUNK = 64 * 1024
_KILL_GRACE_S = 2.0


class VpsServer:
    """A live SSH server on 127.0.0.1:<free port>; use as `async with VpsServer(...) as vps`."""

    def __init__(
        self,
        *,
        work_dir: Path,
        host: str = "127.0.0.1",
        port: int = 0,
        sftp_root: Path | None = None,
        username: str = "offload",
        env: dict[str, str] | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.username = username
        self._work_dir = work_dir
        self._sftp_root = sftp_root
        self._host_key = asyncssh.generate_private_key("ssh-ed25519")
        self._client_key = asyncssh.generate_private_key("ssh-ed25519")
        self._listener: asyncssh.SSHAcceptor | None = None
        self._connections: set[asyncssh.SSHServerConnection] = set()
        self._children: set[asyncio.subprocess.Process] = set()
        self._command_tasks: set[asyncio.Task[None]] = set()
        self._relay_tasks: set[asyncio.Task[Any]] = set()
        self._stalled = False
        self._refusing = False
        self._denied_forward_ports: set[int] = set()
        self._forwarded_ports: set[int] = set()  # every port a tcpip-forward listened on
        self.key_file = work_dir / "id_ed25519"
        self.known_hosts = work_dir / "known_hosts"
        self.accepted_connections = 0
        self._home = os.path.expanduser("~")
        self._extra_env = dict(env or {})
        self.command_log: list[str] = []  # every exec'd command line, in order

    # -- what clients need -------------------------------------------------------------

    @property
    def host_key(self) -> asyncssh.SSHKey:
        """The server's public host key (the line in known_hosts)."""
        return self._host_key.convert_to_public()

    @property
    def client_key(self) -> asyncssh.SSHKey:
        """The one private key the server accepts (also written to `key_file`, mode 0600)."""
        return self._client_key

    @property
    def authorized_key(self) -> asyncssh.SSHKey:
        """The public half of `client_key`, as it would sit in authorized_keys."""
        return self._client_key.convert_to_public()

    @property
    def connection_count(self) -> int:
        """How many SSH connections are open right now."""
        return len(self._connections)

    @property
    def running_commands(self) -> int:
        """How many exec'd commands are still running."""
        return len(self._children)

    def connect(self, **options: Any) -> Any:
        """`asyncssh.connect(...)` to this server with the right key and known_hosts.

        Returns the awaitable/async-context-manager that `asyncssh.connect` returns.
        """
        options.setdefault("username", self.username)
        options.setdefault("client_keys", [self.key_file])
        options.setdefault("known_hosts", str(self.known_hosts))
        options.setdefault("agent_path", None)
        options.setdefault("config", None)
        return asyncssh.connect(self.host, self.port, **options)

    def remote_section(self, *, remote_bin_dir: str, **overrides: Any) -> RemoteSection:
        """A `[remote]` section pointing at this server (its key file and known_hosts)."""
        values: dict[str, Any] = {
            "host": self.host,
            "port": self.port,
            "user": self.username,
            "key_file": self.key_file,
            "known_hosts": self.known_hosts,
            "remote_bin_dir": remote_bin_dir,
        }
        values.update(overrides)
        return RemoteSection(**values)

    # -- fault controls ----------------------------------------------------------------

    def drop_all_sessions(self) -> int:
        """Abort every open SSH connection at once (like a VPS reboot); returns how many."""
        dropped = list(self._connections)
        for conn in dropped:
            conn.abort()
        log.info("vps_sessions_dropped", count=len(dropped))
        return len(dropped)

    async def refuse_new_connections(self) -> None:
        """Close the listening socket: new connects get ECONNREFUSED; open sessions stay.

        A connection the loop had accepted but whose SSH handler had not started yet is one
        of the new ones: it is aborted when its handler starts (closing the listener does not
        wait for it, so `drop_all_sessions()` right after would not see it). The loop stops
        accepting a moment before the listener closes, because asyncio (3.11) silently drops
        a connection accepted just before its server closed, without closing its socket: the
        client would hang until its own timeout."""
        self._refusing = True
        if self._listener is not None:
            loop = asyncio.get_running_loop()
            for sock in self._listener.sockets:
                loop.remove_reader(sock.fileno())
            for _ in range(2):  # an accepted connection's transport, then its handler
                await asyncio.sleep(0)
            self._listener.close()
            await self._listener.wait_closed()
            self._listener = None

    async def accept_new_connections(self) -> None:
        """Listen again on the same port after `refuse_new_connections()`."""
        self._refusing = False
        if self._listener is None:
            await self._listen()

    def stall(self) -> None:
        """Stop reading from every connection, open or new: the peer sees a silent server."""
        self._stalled = True
        for conn in self._connections:
            _set_reading(conn, reading=False)

    def resume(self) -> None:
        """Undo `stall()`."""
        self._stalled = False
        for conn in self._connections:
            _set_reading(conn, reading=True)

    def deny_forward(self, port: int) -> None:
        """Make `tcpip-forward` requests for this port fail, as when sshd cannot bind it."""
        self._denied_forward_ports.add(port)

    def allow_forward(self, port: int) -> None:
        self._denied_forward_ports.discard(port)

    # -- lifecycle ---------------------------------------------------------------------

    async def __aenter__(self) -> VpsServer:
        self._work_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(self._client_key.export_private_key("openssh"))
        await self._listen()
        host_pattern = f"[{self.host}]:{self.port}" if self.port != 22 else self.host
        public = self.host_key.export_public_key("openssh").decode().strip()
        self.known_hosts.write_text(f"{host_pattern} {public}\n")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop listening, drop every session, kill and reap every command still running."""
        await self.refuse_new_connections()
        self._stalled = False
        for conn in list(self._connections):
            conn.abort()
        for child in list(self._children):
            await _kill_group(child)
        tasks = [*self._command_tasks, *self._relay_tasks]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._close_leftover_sockets():
            await asyncio.sleep(0)  # (their connection_lost runs: nothing is left half-closed)

    async def _relay_unix(self, path: str, chan_reader: Any, chan_writer: Any) -> None:
        """Copy bytes both ways between a channel and a connection to the Unix socket `path`."""
        task = asyncio.current_task()
        assert task is not None
        self._relay_tasks.add(task)
        sock_writer: asyncio.StreamWriter | None = None
        try:
            try:
                sock_reader, sock_writer = await asyncio.open_unix_connection(path)
            except OSError:
                return
            await asyncio.gather(_copy(chan_reader, sock_writer), _copy(sock_reader, chan_writer))
        except (OSError, asyncssh.Error):
            pass
        finally:
            self._relay_tasks.discard(task)
            if sock_writer is not None:
                sock_writer.close()
                with contextlib.suppress(OSError):
                    await sock_writer.wait_closed()
            chan_writer.close()

    async def _listen(self) -> None:
        self._listener = await asyncssh.listen(
            self.host,
            self.port,
            server_factory=lambda: _VpsConnectionHandler(self),
            server_host_keys=[self._host_key],
            authorized_client_keys=asyncssh.import_authorized_keys(
                self.authorized_key.export_public_key("openssh").decode()
            ),
            process_factory=self._start_command,
            sftp_factory=self._sftp_factory,
            encoding=None,
            allow_scp=False,
            x509_trusted_certs=None,
            reuse_address=True,
            config=None,
        )
        self.port = self._listener.get_port()

    def _sftp_factory(self, chan: asyncssh.SSHServerChannel[bytes]) -> asyncssh.SFTPServer:
        root = self._sftp_root
        return asyncssh.SFTPServer(chan, chroot=os.fsencode(root) if root else None)

    # -- connection bookkeeping (_VpsConnectionHandler tells) ---------------------------

    def _connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
        if self._refusing:
            # Aborted from the loop, not inside asyncssh's own connection_made.
            asyncio.get_running_loop().call_soon(conn.abort)
            return
        self._connections.add(conn)
        self.accepted_connections += 1
        if self._stalled:
            _set_reading(conn, reading=False)

    def _connection_lost(self, conn: asyncssh.SSHServerConnection) -> None:
        self._connections.discard(conn)

    def _forward_allowed(self, port: int) -> bool:
        if port in self._denied_forward_ports:
            return False
        self._forwarded_ports.add(port)
        return True

    def _close_leftover_sockets(self) -> int:
        """Abort every connection still open to one of our ports. asyncssh's listener for a
        forwarded port closes with its SSH connection, and asyncio (3.11) can leave a
        connection it accepted just then with nothing to close it (here: a fake daemon's
        heartbeat reconnecting as monitord stops). A VPS that shuts down closes them all.
        Found among the live objects: asyncio keeps no list of a server's connections."""
        ports = {self.port, *self._forwarded_ports}
        closed = 0
        for obj in gc.get_objects():
            if not isinstance(obj, asyncio.Transport) or obj.is_closing():
                continue
            sockname = obj.get_extra_info("sockname")
            if isinstance(sockname, tuple) and len(sockname) >= 2 and sockname[1] in ports:
                obj.abort()
                closed += 1
        return closed

    # -- exec --------------------------------------------------------------------------

    async def _start_command(self, process: asyncssh.SSHServerProcess[bytes]) -> None:
        # asyncssh runs this coroutine as its own task; we hold it too so close() can end it.
        task = asyncio.current_task()
        assert task is not None
        self._command_tasks.add(task)
        try:
            await self._run_command(process)
        finally:
            self._command_tasks.discard(task)

    async def _run_command(self, process: asyncssh.SSHServerProcess[bytes]) -> None:
        conn = process.get_extra_info("connection")
        peer = conn.get_extra_info("peername") or ("", 0)
        local = conn.get_extra_info("sockname") or ("", 0)
        env = dict(os.environ)
        env["SSH_CONNECTION"] = f"{peer[0]} {peer[1]} {local[0]} {local[1]}"
        env["USER"] = env["LOGNAME"] = self.username
        env.update(self._extra_env)
        self.command_log.append(process.command or "")
        argv = ["/bin/sh", "-c", process.command] if process.command else ["/bin/sh"]
        try:
            child = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
                env=env,
                cwd=self._home,
            )
        except OSError as e:
            process.stderr.write(f"vps: cannot run command: {e}\n".encode())
            process.exit(127)
            return
        self._children.add(child)
        assert child.stdin and child.stdout and child.stderr
        tasks = TaskOwner("vps command", report_crashes=False)
        pump_in = tasks.spawn("vps stdin", _pump_stdin(process, child.stdin))
        outputs = asyncio.gather(
            _pump_output(child.stdout, process.stdout.write, process.stdout.drain),
            _pump_output(child.stderr, process.stderr.write, process.stderr.drain),
        )
        finished = tasks.spawn("vps command: finished", _finish(outputs, child))
        closed = tasks.spawn("vps command: closed", process.wait_closed())
        try:
            await asyncio.wait({finished, closed}, return_when=asyncio.FIRST_COMPLETED)
            if finished.done() and not closed.done():
                status = finished.result()
                if status < 0:
                    process.exit_with_signal(signal.Signals(-status).name.removeprefix("SIG"))
                else:
                    process.exit(status)
        finally:
            await tasks.cancel([pump_in, closed])
            if child.returncode is None:
                await _kill_group(child)
            await tasks.close()
            self._children.discard(child)


class _VpsConnectionHandler(asyncssh.SSHServer):
    """Per-connection callbacks: bookkeeping, auth policy and forwarding policy."""

    def __init__(self, vps: VpsServer) -> None:
        self._vps = vps
        self._conn: asyncssh.SSHServerConnection | None = None

    def connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
        self._conn = conn
        self._vps._connection_made(conn)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._conn is not None:
            self._vps._connection_lost(self._conn)

    def begin_auth(self, username: str) -> bool:
        return True

    def password_auth_supported(self) -> bool:
        return False

    def server_requested(self, listen_host: str, listen_port: int) -> bool:
        return self._vps._forward_allowed(listen_port)

    def connection_requested(
        self, dest_host: str, dest_port: int, orig_host: str, orig_port: int
    ) -> bool:
        return True

    def unix_connection_requested(self, dest_path: str) -> Any:
        # direct-streamlocal (how the owner reaches the agent's socket), as sshd's default
        # AllowStreamLocalForwarding=yes allows it. Relayed by our own task (not asyncssh's
        # built-in forwarder) so that close() can end and reap every relay.
        async def relay(reader: Any, writer: Any) -> None:
            await self._vps._relay_unix(dest_path, reader, writer)

        return relay


async def _copy(reader: Any, writer: Any) -> None:
    """reader -> writer until EOF, then EOF on the writer."""
    while data := await reader.read(_CHUNK):
        writer.write(data)
        await writer.drain()
    with contextlib.suppress(OSError, asyncssh.Error):
        writer.write_eof()


def _set_reading(conn: asyncssh.SSHServerConnection, *, reading: bool) -> None:
    # asyncssh exposes no public pause for an SSH connection; the asyncio transport
    # under it does, and pausing it is exactly "the server went silent".
    transport = getattr(conn, "_transport", None)
    if transport is None or transport.is_closing():
        return
    if reading:
        transport.resume_reading()
    else:
        transport.pause_reading()


async def _pump_stdin(
    process: asyncssh.SSHServerProcess[bytes], sink: asyncio.StreamWriter
) -> None:
    try:
        while data := await process.stdin.read(_CHUNK):
            sink.write(data)
            await sink.drain()
        sink.close()
    except (asyncssh.Error, OSError):
        sink.close()


async def _pump_output(
    source: asyncio.StreamReader,
    write: Callable[[bytes], None],
    drain: Callable[[], Awaitable[None]],
) -> None:
    while data := await source.read(_CHUNK):
        try:
            write(data)
            await drain()
        except (asyncssh.Error, OSError):
            return  # the channel is gone; keep reading so the child never blocks on a pipe


async def _finish(outputs: Awaitable[Any], child: asyncio.subprocess.Process) -> int:
    await outputs
    return await child.wait()


async def _kill_group(child: asyncio.subprocess.Process) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if child.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, sig)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(child.wait(), _KILL_GRACE_S)

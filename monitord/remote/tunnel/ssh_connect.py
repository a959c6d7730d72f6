"""Open monitord's SSH connection to the VPS, through its jump hosts if it has any.

Called by monitord/remote/tunnel/keeper.py, the one place monitord connects. The jump hosts are
`remote.proxy_jump`, or, when that key is not set, the ProxyJump that `remote.ssh_config`
gives for `remote.host`. monitord opens every hop itself, each through the one before it,
with the options it uses for the VPS: the host key checked against `remote.known_hosts`,
only `remote.key_file`, no SSH agent, keepalive on. (Given a ProxyJump string, asyncssh
would open the hops with its own defaults instead: ~/.ssh/known_hosts, ~/.ssh/id_*, the
agent.) Closing the returned connection closes the hops under it.

`remote.ssh_config` is passed to every connect (asyncssh's `config=`): its Host blocks supply
HostName, Port (when `remote.port` is not set) and the user of a hop written without `user@`;
the keys of the [remote] section and the policy options above always win over it. Failures
come out as catalogue errors (monitord/remote/ssh_errors.py) naming the hop that failed.

Ciphers: AES-GCM first. asyncssh's default first choice, chacha20-poly1305, is built from
several calls per packet (34 us to seal a 200-byte packet here, against 4-5 us for AES-GCM,
one OpenSSL call), and every tunnelled NATS message, SFTP chunk and agent call pays it on
both ends. OpenSSH offers AES-GCM by default. A `Ciphers` line in `remote.ssh_config` is kept
as written (its order too).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct

import asyncssh
from asyncssh.encryption import get_default_encryption_algs

from monitord.base.config import JumpHop, RemoteSection, parse_proxy_jump
from monitord.remote import ssh_errors
from orchestrator.errors import ErrorCode, error_for

CLOSE_TIMEOUT_S = 2.0
PREFERRED_CIPHERS = ("aes256-gcm@openssh.com", "aes128-gcm@openssh.com")


def describe(config: RemoteSection) -> str:
    """user@host[:port] of the VPS, as error details name it."""
    where = f"{config.user}@{config.host}"
    return f"{where}:{config.port}" if config.port_is_set() else where


async def open_connection(config: RemoteSection) -> asyncssh.SSHClientConnection:
    """The connection to the VPS within connect_timeout_s (jump hosts included); on any
    failure a MonitordError, with no hop left open."""
    during = target = describe(config)
    head: asyncssh.SSHClientConnection | None = None  # the last hop open: it owns the others
    file = _SshConfigFile(config)
    try:
        async with asyncio.timeout(config.connect_timeout_s):
            hops = await _jump_hops(config, file)
            for hop in hops:
                during = f"{target}: jump host {hop}"
                head = await _open(config, file, host=hop.host, port=hop.port or (),
                                   username=hop.user or (), tunnel=head)
            if hops:
                during = f"{target} via {','.join(str(hop) for hop in hops)}"
            return await _open(config, file, host=config.host,
                               port=config.port if config.port_is_set() else (),
                               username=config.user, tunnel=head)
    except ssh_errors.CONNECT_ERRORS as e:
        await _close(head)
        raise ssh_errors.translate_connect(e, during=during) from e
    except BaseException:
        await _close(head)
        raise


async def _open(
    config: RemoteSection,
    file: _SshConfigFile,
    *,
    host: str,
    port: int | tuple[()],
    username: str | tuple[()],
    tunnel: asyncssh.SSHClientConnection | None,
) -> asyncssh.SSHClientConnection:
    conn = await asyncssh.connect(
        host,
        port,
        # None, not a default: a ProxyJump of the ssh_config must not open hops of its own.
        tunnel=tunnel,
        username=username,
        client_keys=[str(config.key_file)],
        known_hosts=None if config.accept_any_host_key else str(config.known_hosts),
        agent_path=None,
        agent_forwarding=False,
        config=[str(config.ssh_config)] if config.ssh_config else [],
        preferred_auth="publickey",
        keepalive_interval=config.keepalive_interval_s,
        keepalive_count_max=config.keepalive_count_max,
        login_timeout=config.connect_timeout_s,
        encryption_algs=await _ciphers(file, host),
    )
    if tunnel is not None:
        # What asyncssh does for hops it opens itself: closing conn closes the hop too.
        conn.set_tunnel(tunnel)
    _reset_on_close(conn)
    return conn


def _reset_on_close(conn: asyncssh.SSHClientConnection) -> None:
    """SO_LINGER 0 on the connection's TCP socket (the first hop's: the others run inside
    it), so that closing it — a keepalive that gave up, a lease lost, a goodbye — resets the
    connection and the kernel drops what it still held to send. Otherwise a renewal written
    while the link was black-holed waited behind the close and reached the VPS once the link
    healed: after the PBX had declared the tunnel down and dated every lease from then
    (docs/design.md, "Fencing"). A goodbye loses nothing by it: it closes only once the VPS
    has answered every channel."""
    sock = conn.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


async def _jump_hops(config: RemoteSection, file: _SshConfigFile) -> tuple[JumpHop, ...]:
    configured = config.jump_hops()
    if config.ssh_config is None:
        return configured or ()
    from_file = (await file.options(config.host)).tunnel  # also proves the file loads
    from_file = from_file if isinstance(from_file, str) else None
    if configured is not None:
        return configured
    try:
        return parse_proxy_jump(from_file) if from_file else ()
    except ValueError as e:
        raise error_for(
            ErrorCode.CONFIG_INVALID,
            f"remote.ssh_config {config.ssh_config}: ProxyJump for {config.host}: {e}",
        ) from e


def cipher_preference() -> list[str]:
    """asyncssh's encryption algorithms with PREFERRED_CIPHERS first (benchmarks' reference
    connections use it too, so that they pay what monitord pays)."""
    defaults = [alg.decode() for alg in get_default_encryption_algs()]
    return [*PREFERRED_CIPHERS, *(alg for alg in defaults if alg not in PREFERRED_CIPHERS)]


async def _ciphers(file: _SshConfigFile, host: str) -> list[str]:
    """The encryption algorithms for a hop to `host`, in order of preference."""
    if file.config.ssh_config is not None:
        chosen = [alg.decode() for alg in (await file.options(host)).encryption_algs]
        if chosen != [alg.decode() for alg in get_default_encryption_algs()]:
            return chosen  # the file's Ciphers, as written
    return cipher_preference()


class _SshConfigFile:
    """remote.ssh_config as applied to each host of one connect, each read once (the hops
    and the ciphers of the same host asked the file twice)."""

    def __init__(self, config: RemoteSection) -> None:
        self.config = config
        self._by_host: dict[str, asyncssh.SSHClientConnectionOptions] = {}

    async def options(self, host: str) -> asyncssh.SSHClientConnectionOptions:
        if host not in self._by_host:
            try:
                self._by_host[host] = await asyncssh.SSHClientConnectionOptions.construct(
                    config=[str(self.config.ssh_config)], host=host,
                    username=self.config.user, known_hosts=None, client_keys=None,
                    agent_path=None,
                )
            except (OSError, ValueError) as e:
                raise ssh_errors.translate_ssh_config(e, path=self.config.ssh_config) from e
        return self._by_host[host]


async def _close(conn: asyncssh.SSHClientConnection | None) -> None:
    if conn is None:
        return
    conn.close()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(conn.wait_closed(), CLOSE_TIMEOUT_S)

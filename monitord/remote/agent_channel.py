"""The agent's channel over the tunnel's own SSH connection.

`over_ssh(session, socket_path)` is the `Channel` the local owner's AgentClient uses
(`session` is the tunnel keeper's `session`: the live connection, or SSH_UNREACHABLE): per
request, a `direct-streamlocal@openssh.com` channel of the live connection to the agent's
Unix socket on the VPS (`{remote_bin_dir}/api/agent.sock`, in a 0700 directory). Nothing
listens on the PBX for it, so while the tunnel is down a request fails here, before any
byte is written, instead of going to whoever took a local port meanwhile. sshd needs
`AllowStreamLocalForwarding` (its default, `yes`) and `AllowTcpForwarding yes` (OpenSSH
grants stream-local channels only where local TCP forwarding is allowed); docs/vps-setup.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from monitord.remote.agent_client import AgentUnreachable, Channel, ChannelReader, ChannelWriter
from orchestrator.errors import MonitordError

if TYPE_CHECKING:  # the SSH side loads after readiness (monitord/remote/ssh_side.py)
    import asyncssh

Session = Callable[[], contextlib.AbstractAsyncContextManager["asyncssh.SSHClientConnection"]]


def over_ssh(session: Session, socket_path: str) -> Channel:
    @contextlib.asynccontextmanager
    async def channel() -> AsyncIterator[tuple[ChannelReader, ChannelWriter]]:
        from monitord.remote import ssh_errors

        opened = False
        try:
            async with session() as conn:
                try:
                    reader, writer = await conn.open_unix_connection(socket_path)
                except ssh_errors.SSH_ERRORS as e:
                    refusal = ssh_errors.channel_refusal(e)
                    detail = f"channel to {socket_path} refused: {refusal}" if refusal else (
                        ssh_errors.translate(e, code="AGENT_UNREACHABLE",
                                             during=f"open a channel to {socket_path}").detail
                    )
                    raise AgentUnreachable(detail, maybe_delivered=False) from e
                opened = True
                try:
                    yield reader, writer
                except ssh_errors.SSH_ERRORS as e:
                    raise AgentUnreachable(
                        ssh_errors.translate(e, code="AGENT_UNREACHABLE",
                                             during=f"request over {socket_path}").detail,
                        maybe_delivered=True,
                    ) from e
                finally:
                    writer.close()
        except MonitordError as e:
            if opened or isinstance(e, AgentUnreachable):
                raise
            raise AgentUnreachable(e.detail, maybe_delivered=False) from e  # tunnel down

    return channel

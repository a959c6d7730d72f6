"""Everything the runtime needs to act on the VPS, in one object: tunnel, agent, artifacts.

Built once by `monitord.surface.wiring` when `[remote]` is configured. The migration engine, the
reconciler and the cleanup worker reach the VPS only through it, so "is the VPS reachable?"
has one answer (`connected()`), and preflight gets its inputs (tunnel owner view, forward
readiness, artifacts, secret) from one place.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from monitord.base.config import Config, RemoteSection
from monitord.remote.agent_client import AgentClient
from monitord.remote.artifact import LocalArtifact

if TYPE_CHECKING:  # the SSH side loads after readiness (monitord/remote/ssh_side.py)
    import asyncssh

    from monitord.remote.tunnel.keeper import TunnelKeeper


@dataclass
class RemoteLink:
    config: Config
    keeper: TunnelKeeper
    agent: AgentClient
    artifacts: list[LocalArtifact]
    secret: bytes

    @property
    def section(self) -> RemoteSection:
        """The configuration's [remote] section."""
        assert self.config.remote is not None
        return self.config.remote

    def connected(self) -> bool:
        return self.keeper.status().connected

    def connections(self) -> int:
        """How many times the tunnel has connected so far (a lease ledger's epoch)."""
        return self.keeper.status().reconnects

    def connected_agent(self) -> AgentClient | None:
        """The agent client while the tunnel is up; None while it is down."""
        return self.agent if self.connected() else None

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[asyncssh.SSHClientConnection]:
        """The live SSH connection; SSH_UNREACHABLE (transient) while the tunnel is down."""
        async with self.keeper.session() as conn:
            yield conn

    async def ensure_agent(self) -> None:
        """Start the agent through its idempotent launcher (it may have died on the VPS)."""
        from monitord.remote import provisioning

        self.agent.forget_routes()
        async with self.session() as conn:
            await provisioning.launch_agent(conn, remote=self.section, timeout_s=30.0)

    async def recycle(self) -> None:
        """Close the live SSH connection; the keeper reconnects. Ends every uncertainty
        about requests still in flight on it (nothing can arrive over a closed connection)."""
        if not self.connected():
            return
        async with self.session() as conn:
            conn.close()

    def tunnel_owner(self) -> tuple[bool, str, str]:
        """(ours, owner_id, owner_label) of the tunnel lease as last seen."""
        status = self.keeper.status()
        if status.lease is not None and status.connected:
            return True, status.lease.owner_id, status.lease.owner_label
        holder = status.lease_holder
        if holder is not None:
            return False, holder.owner_id, holder.owner_label
        return False, "", ""

    def forwards_ready(self) -> dict[str, bool]:
        status = self.keeper.status()
        proven = {f.name: f.state == "proven" for f in status.forwards}
        names = [f.name for f in (*self.section.reverse_forwards, *self.section.local_forwards)]
        return {name: status.connected and proven.get(name, False) for name in names}

"""The agent is reached over the SSH connection itself: no socket on the PBX carries its
secret, so a local user who takes the old manager-forward port while the tunnel is down
receives nothing; a configuration that still names that forward loads with one warning."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from monitord.testing.ports import free_port
from tests.integration.migration.conftest import StackFactory, settle_remote

LEGACY_AGENT = "127.0.0.1:8225"


@dataclass
class Eavesdropper:
    """A listener on the port the old local forward used, recording what reaches it."""

    connections: int = 0
    received: bytearray = field(default_factory=bytearray)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            self.received += await asyncio.wait_for(reader.read(65536), 2.0)
        except TimeoutError:
            pass
        finally:
            writer.close()


class TestNoLocalSocketCarriesTheSecret:
    async def test_a_listener_on_the_old_port_while_the_tunnel_is_down_receives_nothing(
        self, stack_factory: StackFactory
    ) -> None:
        port = free_port()
        spy = Eavesdropper()
        server = await asyncio.start_server(spy.handle, "127.0.0.1", port)
        try:
            legacy = {
                "agent_listen": LEGACY_AGENT,
                "local_forwards": [
                    {"name": "manager", "listen": f"127.0.0.1:{port}", "target": LEGACY_AGENT},
                ],
            }
            stack = await stack_factory(services={"tg": 2}, remote_overrides=legacy)
            deprecated = stack.events("config_deprecated")
            assert len(deprecated) == 1, deprecated
            assert "manager" in deprecated[0]["detail"]
            await settle_remote(stack)  # every agent call went over the SSH connection

            # Down: lease renewals, the reconciler and a move home all want the agent now.
            await stack.partition()
            async def tunnel_down() -> bool:
                return not (await stack.status())["tunnel"].get("connected")

            await stack.wait_until(tunnel_down, timeout_s=20, what="the tunnel seen down")
            await stack.place("tg", "local")
            await asyncio.sleep(stack.options.area_lease_ttl_s * 2)
            assert (spy.connections, bytes(spy.received)) == (0, b"")

            await stack.heal()
            await stack.wait_settled(expect={"tg": "local"}, timeout_s=90)
            assert (spy.connections, bytes(spy.received)) == (0, b"")
        finally:
            server.close()
            await server.wait_closed()

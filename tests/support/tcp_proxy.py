"""A fault-injecting TCP proxy for tests: sits between a client and a server on loopback.

Faults, all switchable at run time:
- `cut()`          close every current connection at once (both sides see EOF/RST);
- `blackhole()`    stop forwarding bytes both ways on current connections WITHOUT closing them
                   (a partition: the server keeps a stale session; closing the client side
                   later does not reach the server either);
- `set_delay(s)`   add latency to every chunk in both directions;
- `refuse(True)`   new connections are accepted and closed at once (server "down").
New connections made after `blackhole()` pass normally unless `blackhole(new_too=True)`.
Used by the tunnel tests and by the fault tests of other parts.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

CHUNK = 65536


@dataclass(eq=False)
class _Link:
    """One proxied connection: client socket, server socket, and its fault flags."""

    client_writer: asyncio.StreamWriter
    server_writer: asyncio.StreamWriter
    client_port: int  # the client's source port as seen by the proxy
    upstream_port: int  # the proxy's source port as seen by the server
    blackholed: bool = False
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    released: asyncio.Event = field(default_factory=asyncio.Event)


class TcpProxy:
    """Forwards 127.0.0.1:<port> to target_host:target_port with injectable faults."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target_host = target_host
        self.target_port = target_port
        self.port = 0
        self.delay_s = 0.0
        self._refusing = False
        self._blackhole_new = False
        self._links: set[_Link] = set()
        # Bumped by blackhole()/cut() so that a connection accepted before the fault but not
        # yet linked to the server when it happened still suffers it.
        self._blackhole_epoch = 0
        self._cut_epoch = 0
        self._server: asyncio.Server | None = None
        self.accepted = 0  # connections accepted in total (refused ones included)

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._on_client, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        await self.cut()
        if self._server is not None:
            await self._server.wait_closed()

    # -- faults --------------------------------------------------------------------------
    async def cut(self) -> None:
        """Close every current connection, both sides."""
        self._cut_epoch += 1
        links = list(self._links)
        for link in links:
            self._close_link(link)
        for link in links:
            for task in link.tasks:
                task.cancel()
            await asyncio.gather(*link.tasks, return_exceptions=True)

    def blackhole(self, *, new_too: bool = False) -> None:
        """Stop forwarding on current connections (and new ones if new_too), keep them open."""
        self._blackhole_epoch += 1
        for link in self._links:
            link.blackholed = True
        self._blackhole_new = new_too

    def heal(self) -> None:
        """New connections pass again; already black-holed ones stay black-holed."""
        self._blackhole_new = False
        self._refusing = False

    def refuse(self, refusing: bool = True) -> None:
        """While set, new connections are closed right after accept (server looks down)."""
        self._refusing = refusing

    def set_delay(self, seconds: float) -> None:
        self.delay_s = seconds

    def upstream_ports(self) -> list[int]:
        """The proxy's source ports towards the server, one per live connection."""
        return [link.upstream_port for link in self._links]

    def blackholed_upstream_ports(self) -> list[int]:
        return [link.upstream_port for link in self._links if link.blackholed]

    # -- plumbing ------------------------------------------------------------------------
    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        if self._refusing:
            writer.close()
            return
        blackhole_epoch, cut_epoch = self._blackhole_epoch, self._cut_epoch
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(self.target_host, self.target_port), 5.0
            )
        except (OSError, TimeoutError):
            writer.close()
            return
        link = _Link(
            client_writer=writer,
            server_writer=up_writer,
            client_port=int(writer.get_extra_info("peername")[1]),
            upstream_port=int(up_writer.get_extra_info("sockname")[1]),
            blackholed=self._blackhole_new or blackhole_epoch != self._blackhole_epoch,
        )
        if cut_epoch != self._cut_epoch:
            self._close_link(link)
            return
        self._links.add(link)
        link.tasks = [
            asyncio.create_task(self._pump(link, reader, up_writer), name="proxy-up"),
            asyncio.create_task(self._pump(link, up_reader, writer), name="proxy-down"),
        ]
        await asyncio.gather(*link.tasks, return_exceptions=True)

    async def _pump(
        self, link: _Link, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            while True:
                data = await reader.read(CHUNK)
                if not data:
                    break
                if link.blackholed:
                    continue  # swallow: the peer never hears of it
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)  # injected latency, the fault itself
                writer.write(data)
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        if link.blackholed:
            # A partition: the other side must not learn that this side went away.
            await link.released.wait()
        self._close_link(link)

    def _close_link(self, link: _Link) -> None:
        link.released.set()
        self._links.discard(link)
        for w in (link.client_writer, link.server_writer):
            with contextlib.suppress(OSError, RuntimeError):
                w.close()


@contextlib.asynccontextmanager
async def running_proxy(target_host: str, target_port: int) -> AsyncIterator[TcpProxy]:
    """Start a proxy to target and yield it; closes every connection on exit."""
    proxy = TcpProxy(target_host, target_port)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.close()

"""A real `nats-server` on the PBX side, and the few NATS protocol lines the fault tier speaks.

`running_nats_server(tmp)` starts `nats-server -a 127.0.0.1 -p PORT -m MONITOR_PORT` (the
Debian package) on free loopback ports, waits for its monitoring endpoint, and kills and
reaps it on exit. `NatsServer.connections()` reads `/connz` (who is connected, by client
name). `subscribe()` is a minimal PBX-side subscriber; `PUBLISHER_SCRIPT` is a publisher a
test runs *inside* the VPS namespace, so its only way to the server is the tunnel.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from monitord.testing.ports import free_port

NATS_BINARY = "nats-server"
START_TIMEOUT_S = 10.0
IO_TIMEOUT_S = 10.0

# Run as `python -c PUBLISHER_SCRIPT HOST:PORT NAME SUBJECT PAYLOAD`: connect with a client
# name, publish once, make sure the server has it (PING/PONG), print "published", then stay
# connected until stdin closes (so the test can see the connection in /connz).
PUBLISHER_SCRIPT = r"""
import socket, sys, json
host, port = sys.argv[1].rsplit(":", 1)
name, subject, payload = sys.argv[2], sys.argv[3], sys.argv[4].encode()
sock = socket.create_connection((host, int(port)), timeout=10)
stream = sock.makefile("rb")
assert stream.readline().startswith(b"INFO "), "no INFO from the server"
connect = json.dumps({"name": name, "verbose": False, "pedantic": False})
sock.sendall(f"CONNECT {connect}\r\n".encode())
sock.sendall(f"PUB {subject} {len(payload)}\r\n".encode() + payload + b"\r\nPING\r\n")
while (line := stream.readline()) and line.strip() != b"PONG":
    assert not line.startswith(b"-ERR"), line
print("published", flush=True)
sys.stdin.read()
"""


@dataclass
class NatsServer:
    """A running nats-server: its client address and monitoring port."""

    port: int
    monitor_port: int
    process: asyncio.subprocess.Process

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def monitoring(self, endpoint: str) -> dict[str, Any]:
        url = f"http://127.0.0.1:{self.monitor_port}/{endpoint}"
        async with aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=IO_TIMEOUT_S)
        ) as session, session.get(url) as resp:
            resp.raise_for_status()
            body = await resp.json(content_type=None)
            assert isinstance(body, dict)
            return body

    async def connections(self) -> list[dict[str, Any]]:
        """The `connections` of /connz (each with `name`, `ip`, `port`, …)."""
        return list((await self.monitoring("connz")).get("connections") or [])


def can_run_nats() -> bool:
    return shutil.which(NATS_BINARY) is not None


async def _wait_ready(server: NatsServer) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if server.process.returncode is not None:
            raise RuntimeError(f"nats-server exited with {server.process.returncode}")
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
            await server.monitoring("varz")
            return
        if time.monotonic() > deadline:
            raise RuntimeError("nats-server did not answer on its monitoring port")
        await asyncio.sleep(0.05)  # poll interval of a deadline loop


@contextlib.asynccontextmanager
async def running_nats_server(tmp: Path) -> AsyncIterator[NatsServer]:
    tmp.mkdir(parents=True, exist_ok=True)
    port, monitor_port = free_port(), free_port()
    with (tmp / "nats-server.log").open("ab") as log_file:
        process = await asyncio.create_subprocess_exec(
            NATS_BINARY, "-a", "127.0.0.1", "-p", str(port), "-m", str(monitor_port),
            stdin=asyncio.subprocess.DEVNULL, stdout=log_file, stderr=log_file,
        )
    server = NatsServer(port=port, monitor_port=monitor_port, process=process)
    try:
        await _wait_ready(server)
        yield server
    finally:
        if process.returncode is None:
            process.kill()
        await asyncio.wait_for(process.wait(), IO_TIMEOUT_S)


@contextlib.asynccontextmanager
async def subscribe(server: NatsServer, subject: str) -> AsyncIterator[asyncio.StreamReader]:
    """A PBX-side client subscribed to `subject` (SUB acknowledged by PING/PONG)."""
    async with asyncio.timeout(IO_TIMEOUT_S):
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        assert (await reader.readline()).startswith(b"INFO ")
        connect = json.dumps({"name": "pbx-subscriber", "verbose": False})
        writer.write(f"CONNECT {connect}\r\nSUB {subject} 1\r\nPING\r\n".encode())
        await writer.drain()
        while (await reader.readline()).strip() != b"PONG":
            pass
    try:
        yield reader
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def next_message(reader: asyncio.StreamReader, *, timeout_s: float) -> tuple[str, bytes]:
    """(subject, payload) of the next MSG, answering the server's PINGs meanwhile."""
    async with asyncio.timeout(timeout_s):
        while True:
            line = await reader.readline()
            if not line:
                raise ConnectionError("nats-server closed the subscriber's connection")
            if line.startswith(b"MSG "):
                parts = line.split()
                payload = await reader.readexactly(int(parts[-1]) + 2)
                return parts[1].decode(), payload[:-2]

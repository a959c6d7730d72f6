"""Tunnel recovery figures, against a real OpenSSH sshd on loopback (needs root).

- `tunnel_recovery_after_session_kill`: from killing our per-connection sshd on the VPS
  until a round trip through the reverse forward succeeds again (the keeper reconnects,
  re-takes the lease, re-requests and re-proves the forward);
- `tunnel_recovery_from_stale_session`: from black-holing the connection (the VPS keeps a
  stale session holding the port) until the round trip works again — keepalive detection,
  diagnosis and fencing included; keepalive settings are printed with it.
Both are given as a ratio against the floor measured in the same run: a fresh asyncssh
connect + `forward_remote_port` + first round trip through it. Not a test: never pass/fail.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from monitord.remote import artifact
from monitord.testing.stack import SYSTEM_PYTHON

RUNS = 5
STALE_RUNS = 3
KEEPALIVE_S = 0.5
KEEPALIVE_COUNT = 2


async def _round_trip_once(port: int, timeout_s: float = 0.5) -> bool:
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                writer.write(b"ping\n")
                await writer.drain()
                return await reader.readline() == b"ping\n"
            finally:
                writer.close()
    except (OSError, TimeoutError):
        return False


async def _until_round_trip(port: int, *, timeout_s: float) -> float:
    started = time.perf_counter()
    deadline = started + timeout_s
    while time.perf_counter() < deadline:
        if await _round_trip_once(port):
            return time.perf_counter() - started
        await asyncio.sleep(0.002)  # poll interval of a deadline loop
    raise TimeoutError(f"no round trip through port {port} within {timeout_s}s")


async def _measure(tmp: Path) -> list[dict[str, Any]]:
    import asyncssh

    from monitord.base.config import ForwardSpec, RemoteSection
    from monitord.remote.tunnel import ssh_connect
    from monitord.remote.tunnel.keeper import TunnelKeeper
    from tests.support.sshd import free_port, running_sshd
    from tests.support.tcp_proxy import running_proxy

    echo = await asyncio.start_server(_echo, "127.0.0.1", 0)
    echo_port = int(echo.sockets[0].getsockname()[1])
    figures: list[dict[str, Any]] = []
    async with running_sshd(tmp / "sshd") as sshd, running_proxy("127.0.0.1", sshd.port) as proxy:
        known_hosts = sshd.known_hosts_for_port(proxy.port)
        # Floor: fresh connect + forward + first round trip, same path (through the proxy).
        floor: list[float] = []
        for _ in range(RUNS):
            port = free_port()
            started = time.perf_counter()
            conn = await asyncssh.connect(
                "127.0.0.1", proxy.port, username="root",
                client_keys=[str(sshd.client_key.private_path)], known_hosts=str(known_hosts),
                agent_path=None, config=[], encryption_algs=ssh_connect.cipher_preference(),
            )
            await conn.forward_remote_port("127.0.0.1", port, "127.0.0.1", echo_port)
            await _until_round_trip(port, timeout_s=5)
            floor.append(time.perf_counter() - started)
            conn.close()
            await conn.wait_closed()
        floor_s = statistics.median(floor)

        remote_dir = tmp / "remote"
        remote_dir.mkdir()
        forward = ForwardSpec(name="nats", listen=f"127.0.0.1:{free_port()}",
                              target=f"127.0.0.1:{echo_port}")
        config = RemoteSection.model_validate({
            "host": "127.0.0.1", "port": proxy.port, "user": "root",
            "key_file": sshd.client_key.private_path, "known_hosts": known_hosts,
            "remote_bin_dir": str(remote_dir),
            # the tunnel-lease helper as a VPS runs it: the pyz, system python3, -I
            "remote_monitord": vps_pyz_command(remote_dir),
            "keepalive_interval_s": KEEPALIVE_S, "keepalive_count_max": KEEPALIVE_COUNT,
            "reconnect_backoff_base_s": 0.05, "reconnect_backoff_cap_s": 0.5,
            "reconnect_max_per_minute": 60, "tunnel_lease_ttl_s": 5.0,
            "reverse_forwards": (forward,), "local_forwards": (),
        })
        listen_port = int(forward.listen.rpartition(":")[2])
        keeper = TunnelKeeper(config, owner_id="bench", owner_label="bench")
        task = asyncio.create_task(keeper.run(), name="tunnel keeper (bench)")
        try:
            await keeper.wait_connected(timeout_s=30)
            kills: list[float] = []
            for _ in range(RUNS):
                lease = keeper.status().lease
                assert lease is not None
                started = time.perf_counter()
                sshd.kill_session(lease.session.sshd_pid)
                await keeper.wait_for(lambda s: not s.connected, timeout_s=10)
                await _until_round_trip(listen_port, timeout_s=30)
                kills.append(time.perf_counter() - started)
                await keeper.wait_connected(timeout_s=30)
            stale: list[float] = []
            for _ in range(STALE_RUNS):
                started = time.perf_counter()
                proxy.blackhole()
                await keeper.wait_for(lambda s: not s.connected, timeout_s=10)
                await _until_round_trip(listen_port, timeout_s=30)
                stale.append(time.perf_counter() - started)
                await keeper.wait_connected(timeout_s=30)
        finally:
            await keeper.close()
            await asyncio.wait_for(task, 15)
    echo.close()
    await echo.wait_closed()
    kill_s = statistics.median(kills)
    stale_s = statistics.median(stale)
    reference = {"reference": "fresh_connect_forward_round_trip",
                 "reference_ms": round(floor_s * 1000, 1)}
    figures.append({"benchmark": "tunnel_recovery_after_session_kill",
                    "value_ms": round(kill_s * 1000, 1), "runs": RUNS,
                    "ratio": round(kill_s / floor_s, 2), **reference})
    figures.append({"benchmark": "tunnel_recovery_from_stale_session",
                    "value_ms": round(stale_s * 1000, 1), "runs": STALE_RUNS,
                    "keepalive_interval_s": KEEPALIVE_S, "keepalive_count_max": KEEPALIVE_COUNT,
                    "ratio": round(stale_s / floor_s, 2), **reference})
    return figures


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while line := await reader.readline():
            writer.write(line)
            await writer.drain()
    except OSError:
        pass
    writer.close()



def vps_pyz_command(remote_dir: Path) -> tuple[str, ...]:
    """The VPS verbs as a VPS runs them: this checkout's monitord.pyz under the system
    python3 in isolated mode (the interpreter of this process when there is none)."""
    pyz = artifact.build(Path(remote_dir).parent / "artifact").path
    return (SYSTEM_PYTHON, "-I", str(pyz))

def run() -> list[dict[str, Any]]:
    from benchmarks.__main__ import BenchmarkUnavailable

    if os.geteuid() != 0 or not os.path.exists("/usr/sbin/sshd"):
        raise BenchmarkUnavailable("needs root and /usr/sbin/sshd")
    with tempfile.TemporaryDirectory(prefix="bench-tunnel-") as tmp:
        return asyncio.run(_measure(Path(tmp)))

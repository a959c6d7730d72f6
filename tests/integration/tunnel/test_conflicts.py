"""Conflicts: another owner's live lease, a foreign program on a forwarded port, and two
keepers racing for one VPS — each is named by its own state and code, never taken over and
never retried as a storm."""

from __future__ import annotations

import asyncio
import os
import time

from monitord.remote.tunnel.keeper import TunnelKeeper, TunnelState, TunnelStatus
from tests.integration.tunnel.conftest import (
    LEASE_TTL_S,
    Captured,
    EchoServer,
    Vps,
    poll,
    remote_section,
    reverse_to,
    round_trip,
    running_keeper,
)


class TestAnotherOwnerHoldsTheLease:
    """A second owner sees TUNNEL_LEASE_CONFLICT naming the holder; the holder keeps
    the lease and the forwards; the loser retries slowly."""

    async def test_the_loser_reports_the_holder_and_takes_nothing(
        self, vps: Vps, echo: EchoServer, captured: Captured
    ) -> None:
        forward = reverse_to(echo)
        config = remote_section(vps, reverse=(forward,))
        async with running_keeper(config, owner_id="owner-a", owner_label="pbx-a",
                                  captured=captured) as holder:
            held = await holder.wait_connected(timeout_s=20)
            assert held.lease is not None
            async with running_keeper(config, owner_id="owner-b", owner_label="pbx-b",
                                      captured=captured) as loser:
                conflict = await loser.wait_for(
                    lambda s: s.state is TunnelState.LEASE_CONFLICT, timeout_s=15
                )
                assert conflict.last_error is not None
                assert conflict.last_error.code == "TUNNEL_LEASE_CONFLICT"
                assert "pbx-a" in conflict.last_error.detail
                assert "owner-a" in conflict.last_error.detail
                assert conflict.lease_holder is not None
                assert conflict.lease_holder.owner_id == "owner-a"
                # Watch for a few lease periods: no takeover, no storm.
                watch_s = 2 * LEASE_TTL_S
                started = time.monotonic()
                await poll(lambda: time.monotonic() - started > watch_s, timeout_s=watch_s + 1,
                           what="the watch period")
                assert holder.status().connected
                assert holder.status().reconnects == 1
                assert holder.status().lease is not None
                assert holder.status().lease.session == held.lease.session
                assert not loser.status().connected
                assert loser.status().attempts <= 1 + watch_s / LEASE_TTL_S + 1
                assert await round_trip(forward.listen) == b"ping\n"


class TestForeignListener:
    """A non-sshd program on a reverse-forward port is PORT_OCCUPIED with its PID."""

    async def test_port_occupied_names_the_listening_process(
        self, vps: Vps, echo: EchoServer, captured: Captured
    ) -> None:
        forward = reverse_to(echo)
        host, _, port = forward.listen.rpartition(":")
        squatter = await asyncio.start_server(lambda r, w: w.close(), host, int(port))
        try:
            config = remote_section(vps, reverse=(forward,))
            async with running_keeper(config, captured=captured) as keeper:
                status = await keeper.wait_for(
                    lambda s: s.state is TunnelState.PORT_OCCUPIED
                    and s.next_retry_at is not None,
                    timeout_s=15,
                )
                assert status.last_error is not None
                assert status.last_error.code == "PORT_OCCUPIED"
                assert f"pid {os.getpid()}" in status.last_error.detail
                assert status.fenced_sessions == 0, "a foreign program is never fenced"
                assert status.next_retry_at is not None
                assert status.next_retry_at - status.last_error.at >= LEASE_TTL_S - 0.1
        finally:
            squatter.close()
            await squatter.wait_closed()

    async def test_the_tunnel_comes_up_once_the_port_is_freed(
        self, vps: Vps, echo: EchoServer, captured: Captured
    ) -> None:
        forward = reverse_to(echo)
        host, _, port = forward.listen.rpartition(":")
        squatter = await asyncio.start_server(lambda r, w: w.close(), host, int(port))
        config = remote_section(vps, reverse=(forward,), reconnect_backoff_cap_s=0.5)
        async with running_keeper(config, captured=captured) as keeper:
            await keeper.wait_for(lambda s: s.state is TunnelState.PORT_OCCUPIED, timeout_s=15)
            squatter.close()
            await squatter.wait_closed()
            await keeper.wait_connected(timeout_s=15)
            assert await round_trip(forward.listen) == b"ping\n"


class TestTwoKeepers:
    """Two keepers with different owner ids against one VPS: only one ever holds the
    lease and the forwards."""

    async def test_never_both_connected_and_exactly_one_wins(
        self, vps: Vps, echo: EchoServer, captured: Captured
    ) -> None:
        forward = reverse_to(echo)
        config = remote_section(vps, reverse=(forward,))
        connected: dict[str, bool] = {"a": False, "b": False}
        overlaps: list[str] = []

        def watcher(name: str):
            def on_status(status: TunnelStatus) -> None:
                connected[name] = status.connected
                if all(connected.values()):
                    overlaps.append(f"both connected at {time.monotonic()}")
            return on_status

        a = TunnelKeeper(config, owner_id="owner-a", owner_label="pbx-a", probe_timeout_s=5)
        b = TunnelKeeper(config, owner_id="owner-b", owner_label="pbx-b", probe_timeout_s=5)
        a.add_listener(watcher("a"))
        b.add_listener(watcher("b"))
        for keeper in (a, b):
            keeper.add_listener(captured.add_status)
        tasks = [asyncio.create_task(k.run(), name=f"tunnel keeper {k.owner_id}") for k in (a, b)]
        try:
            await poll(lambda: any(connected.values()), timeout_s=20, what="a winner")
            winner, loser = (a, b) if connected["a"] else (b, a)
            await loser.wait_for(lambda s: s.state is TunnelState.LEASE_CONFLICT, timeout_s=15)
            # Drop the winner's session: it comes back and keeps its lease (same owner);
            # the loser must not slip in meanwhile while the lease is still live.
            lease = winner.status().lease
            assert lease is not None
            vps.sshd.kill_session(lease.session.sshd_pid)
            await winner.wait_for(lambda s: s.connected and s.reconnects == 2, timeout_s=20)
            assert not loser.status().connected
            assert await round_trip(forward.listen) == b"ping\n"
        finally:
            for keeper in (a, b):
                await keeper.close()
            await asyncio.wait_for(asyncio.gather(*tasks), 15)
        assert overlaps == []


class TestTakeoverAfterExpiry:
    """An owner that vanished inside a partition keeps its lease until it expires; only
    then does another owner fence the dead session and take over."""

    async def test_the_other_owner_waits_for_expiry_then_fences_and_takes_over(
        self, vps: Vps, echo: EchoServer, captured: Captured
    ) -> None:
        forward = reverse_to(echo)
        config = remote_section(vps, reverse=(forward,))
        async with running_keeper(config, owner_id="owner-a", owner_label="pbx-a",
                                  captured=captured) as gone:
            held = await gone.wait_connected(timeout_s=20)
            assert held.lease is not None
            vps.proxy.blackhole()  # pbx-a is cut off, then dies inside the partition
        dead_pid = held.lease.session.sshd_pid
        assert dead_pid in vps.sshd.session_pids()

        async with running_keeper(config, owner_id="owner-b", owner_label="pbx-b",
                                  captured=captured) as heir:
            taken = await heir.wait_connected(timeout_s=20)
            assert taken.lease is not None and taken.lease.owner_id == "owner-b"
            # Not before pbx-a's lease had expired on the VPS clock.
            assert taken.lease.acquired_at >= held.lease.expires_at
            assert dead_pid not in vps.sshd.session_pids(), "the dead owner's session was fenced"
            assert await round_trip(forward.listen) == b"ping\n"

"""Recovery: after the server drops our session, or when our own stale session still holds a
forwarded port, the keeper comes back by itself with the lease renewed and every forward
proven again."""

from __future__ import annotations

from monitord.remote.tunnel.keeper import TunnelState
from tests.integration.tunnel.conftest import (
    KEEPALIVE_COUNT,
    KEEPALIVE_S,
    Captured,
    EchoServer,
    Vps,
    poll,
    remote_section,
    reverse_to,
    round_trip,
    running_keeper,
)


class TestServerDropsSession:
    """Killing our per-connection sshd leads to a reconnect, a renewed lease and new proofs."""

    async def test_reconnects_renews_the_lease_and_proves_every_forward_again(
        self, vps: Vps, echo: EchoServer, captured: Captured
    ) -> None:
        forwards = (reverse_to(echo, "nats"), reverse_to(echo, "license"))
        config = remote_section(vps, reverse=forwards)
        async with running_keeper(config, captured=captured) as keeper:
            first = await keeper.wait_connected(timeout_s=20)
            assert first.lease is not None
            [session_pid] = [p for p in vps.sshd.session_pids()
                             if p == first.lease.session.sshd_pid]
            vps.sshd.kill_session(session_pid)

            second = await keeper.wait_for(
                lambda s: s.connected and s.reconnects == 2, timeout_s=20
            )
            assert second.lease is not None and second.lease.owner_id == "owner-a"
            assert second.lease.session.sshd_pid != session_pid
            assert [f.state for f in second.forwards] == ["proven", "proven"]
            for forward in forwards:
                assert await round_trip(forward.listen) == b"ping\n"

    async def test_renews_the_lease_while_connected(
        self, vps: Vps, echo: EchoServer, captured: Captured
    ) -> None:
        config = remote_section(vps, reverse=(reverse_to(echo),))
        async with running_keeper(config, captured=captured) as keeper:
            first = await keeper.wait_connected(timeout_s=20)
            assert first.lease is not None
            renewed = await keeper.wait_for(
                lambda s: s.lease is not None and s.lease.renewed_at > first.lease.renewed_at,
                timeout_s=10,
            )
            assert renewed.reconnects == 1 and renewed.connected


class TestStaleOwnSession:
    """Our own session, cut off by a partition, still holds the port on the VPS: it is
    diagnosed, fenced and the tunnel recovers without operator action."""

    async def test_a_black_holed_session_is_fenced_and_the_forward_proven_again(
        self, vps: Vps, echo: EchoServer, captured: Captured
    ) -> None:
        forward = reverse_to(echo)
        config = remote_section(vps, reverse=(forward,))
        async with running_keeper(config, captured=captured) as keeper:
            first = await keeper.wait_connected(timeout_s=20)
            assert first.lease is not None
            stale_pid = first.lease.session.sshd_pid
            vps.proxy.blackhole()  # the old session stays open on the VPS, silent

            recovered = await keeper.wait_for(
                lambda s: s.connected and s.reconnects == 2,
                timeout_s=10 + 4 * KEEPALIVE_S * KEEPALIVE_COUNT,
            )
            assert recovered.fenced_sessions >= 1
            assert stale_pid not in vps.sshd.session_pids(), "the stale session was fenced"
            assert [f.state for f in recovered.forwards] == ["proven"]
            assert await round_trip(forward.listen) == b"ping\n"
        fenced = [e for e in captured.events if e["event"] == "stale_session_fenced"]
        assert fenced and fenced[0]["pid"] == stale_pid

    async def test_a_restarted_keeper_fences_its_predecessors_stale_session(
        self, vps: Vps, echo: EchoServer, captured: Captured
    ) -> None:
        forward = reverse_to(echo)
        config = remote_section(vps, reverse=(forward,))
        async with running_keeper(config, captured=captured) as old:
            status = await old.wait_connected(timeout_s=20)
            assert status.lease is not None
            stale_pid = status.lease.session.sshd_pid
            vps.proxy.blackhole()  # then the old process "dies" inside the partition
        assert stale_pid in vps.sshd.session_pids(), "the VPS still has the stale session"

        async with running_keeper(config, captured=captured) as new:
            recovered = await new.wait_connected(timeout_s=20)
            assert recovered.fenced_sessions == 1
            assert recovered.lease is not None
            assert recovered.lease.session.sshd_pid != stale_pid
            await poll(lambda: stale_pid not in vps.sshd.session_pids(), timeout_s=5,
                       what="stale session gone")
            assert await round_trip(forward.listen) == b"ping\n"
            assert new.status().state is TunnelState.CONNECTED

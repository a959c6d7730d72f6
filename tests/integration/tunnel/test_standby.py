"""The standby connection (real OpenSSH sshd, the fault proxy, the built pyz as the VPS's
tunnel-lease helper): a second connection kept logged in, holding nothing, that a reconnect
after one connection dies takes instead of logging in again — and that never stands in the
way when it is dead too."""

from __future__ import annotations

import time

from monitord.remote.tunnel.keeper import TunnelKeeper
from tests.integration.tunnel.conftest import (
    Captured,
    EchoServer,
    Vps,
    poll,
    remote_section,
    reverse_to,
    round_trip,
    running_keeper,
)


def _our_sessions(vps: Vps) -> set[int]:
    """sshd session pids serving connections that come through our proxy."""
    pids = {vps.sshd.session_pid_for_client_port(p) for p in vps.proxy.upstream_ports()}
    pids.discard(None)
    return {p for p in pids if p is not None}


async def _standby_ready(vps: Vps, keeper: TunnelKeeper) -> int:
    """Wait for the standby's session: ours, alive, not the lease holder's."""
    lease = keeper.status().lease
    assert lease is not None
    holder = lease.session.sshd_pid

    def standby() -> int | None:
        others = _our_sessions(vps) - {holder}
        return next(iter(others)) if len(others) == 1 else None

    pid = await poll(standby, timeout_s=20, what="a standby session")
    await poll(lambda: keeper._standby is not None and keeper._standby._ready is not None,
               timeout_s=20, what="the standby's helper")
    return int(pid)


class TestStandby:
    async def test_a_killed_session_is_replaced_by_the_standby_without_a_new_login(
        self, vps: Vps, echo: EchoServer, captured: Captured
    ) -> None:
        forward = reverse_to(echo)
        async with running_keeper(remote_section(vps, reverse=(forward,)),
                                  captured=captured) as keeper:
            first = await keeper.wait_connected(timeout_s=20)
            assert first.lease is not None
            standby_pid = await _standby_ready(vps, keeper)
            logins = vps.proxy.accepted
            vps.sshd.kill_session(first.lease.session.sshd_pid)
            second = await keeper.wait_for(
                lambda s: s.connected and s.reconnects == 2, timeout_s=20
            )
            assert vps.proxy.accepted == logins  # the reconnect opened no connection
            assert second.lease is not None and second.lease.session.sshd_pid == standby_pid
            assert [f.state for f in second.forwards] == ["proven"]
            assert await round_trip(forward.listen) == b"ping\n"
            # and a new standby is made for the next time
            assert await _standby_ready(vps, keeper) != standby_pid

    async def test_the_standby_holds_no_lease_and_no_forward(
        self, vps: Vps, echo: EchoServer, captured: Captured
    ) -> None:
        forward = reverse_to(echo)
        async with running_keeper(remote_section(vps, reverse=(forward,)),
                                  captured=captured) as keeper:
            await keeper.wait_connected(timeout_s=20)
            standby_pid = await _standby_ready(vps, keeper)
            vps.sshd.kill_session(standby_pid)  # losing it changes nothing that is up
            await poll(lambda: standby_pid not in vps.sshd.session_pids(), timeout_s=10,
                       what="the standby's session to end")
            status = keeper.status()
            assert status.connected and status.reconnects == 1
            assert await round_trip(forward.listen) == b"ping\n"

    async def test_a_dead_standby_costs_at_most_its_promote_timeout(
        self, vps: Vps, echo: EchoServer, captured: Captured
    ) -> None:
        forward = reverse_to(echo)
        async with running_keeper(remote_section(vps, reverse=(forward,)),
                                  captured=captured) as keeper:
            first = await keeper.wait_connected(timeout_s=20)
            assert first.lease is not None
            await _standby_ready(vps, keeper)
            # the standby's flow goes silent, then the active session dies: the attempt
            # tries the standby, gives up on it and logs in afresh
            holder = first.lease.session.sshd_pid
            vps.proxy.blackhole()
            vps.proxy.heal()
            vps.sshd.kill_session(holder)
            second = await keeper.wait_for(
                lambda s: s.connected and s.reconnects == 2, timeout_s=20
            )
            assert second.lease is not None
            assert any(e["event"] == "tunnel_standby_unusable" for e in captured.events)
            assert await round_trip(forward.listen) == b"ping\n"

    async def test_a_standby_stuck_logging_in_is_not_waited_for(
        self, vps: Vps, echo: EchoServer, captured: Captured
    ) -> None:
        """The path dies while the standby is logging in: its login hangs until the connect
        time-out, and the reconnect must not wait for that before logging in afresh."""
        forward = reverse_to(echo)
        config = remote_section(vps, reverse=(forward,))
        async with running_keeper(config, captured=captured) as keeper:
            await keeper.wait_connected(timeout_s=20)
            standby_pid = await _standby_ready(vps, keeper)
            vps.sshd.kill_session(standby_pid)
            await poll(lambda: keeper._standby is not None and keeper._standby._ready is None,
                       timeout_s=10, what="the standby lost")
            # every flow goes silent — the tunnel's and the standby's next login — until the
            # standby's login is under way; then new flows pass again
            accepted = vps.proxy.accepted
            vps.proxy.blackhole(new_too=True)
            await poll(lambda: vps.proxy.accepted > accepted, timeout_s=10,
                       what="the standby's next login")
            login_started = time.monotonic()
            vps.proxy.heal()
            await keeper.wait_for(lambda s: s.connected and s.reconnects == 2, timeout_s=20)
            took = time.monotonic() - login_started
            assert took < config.connect_timeout_s, (
                f"the reconnect came {took:.1f} s after the stuck login began: it waited for it"
            )
            assert await round_trip(forward.listen) == b"ping\n"

    async def test_closing_the_keeper_ends_the_standby_session_too(
        self, vps: Vps, echo: EchoServer, captured: Captured
    ) -> None:
        async with running_keeper(remote_section(vps, reverse=(reverse_to(echo),)),
                                  captured=captured) as keeper:
            await keeper.wait_connected(timeout_s=20)
            await _standby_ready(vps, keeper)
        await poll(lambda: not _our_sessions(vps), timeout_s=10, what="no session of ours")

    async def test_closing_the_keeper_closes_the_standby_helper_before_the_disconnect(
        self, vps: Vps, echo: EchoServer, captured: Captured
    ) -> None:
        """A bare disconnect sends the helper's channel close with it and drops the socket:
        the VPS answers that close into a reset connection. The helper's channel is closed
        and acknowledged first."""
        async with running_keeper(remote_section(vps, reverse=(reverse_to(echo),)),
                                  captured=captured) as keeper:
            await keeper.wait_connected(timeout_s=20)
            await _standby_ready(vps, keeper)
        [goodbye] = [e for e in captured.events if e["event"] == "tunnel_standby_closed"]
        assert (goodbye["closed"], goodbye["left"]) == (1, 0), goodbye

    async def test_it_can_be_switched_off(
        self, vps: Vps, echo: EchoServer, captured: Captured
    ) -> None:
        config = remote_section(vps, reverse=(reverse_to(echo),), standby_connection=False)
        async with running_keeper(config, captured=captured) as keeper:
            await keeper.wait_connected(timeout_s=20)
            assert len(_our_sessions(vps)) == 1
            assert keeper._standby is None

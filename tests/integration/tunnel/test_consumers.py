"""What other parts rely on: local forwards, the live connection only while connected, and
hooks run after every (re)connect."""

from __future__ import annotations

import asyncio
import socket
import sys

import asyncssh
import pytest

from monitord.base.config import ForwardSpec
from orchestrator.errors import MonitordError
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
from tests.support.sshd import free_port


class TestLocalForward:
    """A local forward reaches its VPS target; a target not listening yet is reported as
    target_down without holding the tunnel back."""

    async def test_a_local_forward_round_trips_to_its_vps_target(
        self, vps: Vps, echo: EchoServer, captured: Captured
    ) -> None:
        manager = ForwardSpec(name="console", listen=f"127.0.0.1:{free_port()}",
                              target=f"127.0.0.1:{echo.port}")
        config = remote_section(vps, local=(manager,))
        async with running_keeper(config, captured=captured) as keeper:
            status = await keeper.wait_connected(timeout_s=20)
            assert [(f.name, f.direction, f.state) for f in status.forwards] == [
                ("console", "local", "proven")]
            assert await round_trip(manager.listen) == b"ping\n"

    async def test_a_target_that_is_not_listening_yet_is_target_down(
        self, vps: Vps, captured: Captured
    ) -> None:
        manager = ForwardSpec(name="console", listen=f"127.0.0.1:{free_port()}",
                              target=f"127.0.0.1:{free_port()}")
        config = remote_section(vps, local=(manager,))
        async with running_keeper(config, captured=captured) as keeper:
            status = await keeper.wait_connected(timeout_s=20)
            assert [f.state for f in status.forwards] == ["target_down"]


class TestSessionAndHooks:
    """session() hands out the connection only while connected; hooks run after every
    (re)connect with the new connection."""

    async def test_session_raises_ssh_unreachable_while_down(
        self, vps: Vps, captured: Captured
    ) -> None:
        vps.proxy.refuse(True)
        config = remote_section(vps)
        async with running_keeper(config, captured=captured) as keeper:
            await keeper.wait_for(lambda s: s.last_error is not None, timeout_s=10)
            with pytest.raises(MonitordError) as raised:
                async with keeper.session():
                    pass
            assert raised.value.code == "SSH_UNREACHABLE"

    async def test_hooks_run_after_the_first_connect_and_after_each_reconnect(
        self, vps: Vps, echo: EchoServer, captured: Captured
    ) -> None:
        seen: asyncio.Queue[str] = asyncio.Queue()

        async def on_connect(conn: asyncssh.SSHClientConnection) -> None:
            result = await conn.run("echo $SSH_CONNECTION", check=True)
            await seen.put(str(result.stdout).split()[1])

        config = remote_section(vps, reverse=(reverse_to(echo),))
        async with running_keeper(config, captured=captured,
                                  hooks={"cleanup": on_connect}) as keeper:
            first = await keeper.wait_connected(timeout_s=20)
            first_port = await asyncio.wait_for(seen.get(), 10)
            assert first.lease is not None
            vps.sshd.kill_session(first.lease.session.sshd_pid)
            await keeper.wait_for(lambda s: s.connected and s.reconnects == 2, timeout_s=20)
            second_port = await asyncio.wait_for(seen.get(), 10)
            assert first_port != second_port, "the hook got the new connection"


SHIM = "import runpy\nrunpy.run_module('monitord', run_name='__main__')\n"


class TestBeforeForwards:
    """The VPS preparation step runs on every connect before the forwards; on first contact,
    when monitord is not on the VPS yet, it runs first so that the lease can be taken."""

    async def test_first_contact_provisions_then_takes_the_lease(
        self, vps: Vps, echo: EchoServer, captured: Captured
    ) -> None:
        calls: list[bool] = []
        shim = vps.remote_dir / "run_monitord.py"

        async def provision(conn: asyncssh.SSHClientConnection) -> None:
            calls.append((vps.remote_dir / "tunnel_lease.json").exists())
            shim.write_text(SHIM)

        config = remote_section(
            vps, reverse=(reverse_to(echo),),
            remote_monitord=(sys.executable, "{remote_bin_dir}/run_monitord.py"),
        )
        async with running_keeper(config, captured=captured, before_forwards=provision) as keeper:
            first = await keeper.wait_connected(timeout_s=20)
            assert first.lease is not None
            assert calls == [False], "provisioned before the lease on first contact"
            vps.sshd.kill_session(first.lease.session.sshd_pid)
            await keeper.wait_for(lambda s: s.connected and s.reconnects == 2, timeout_s=20)
            assert calls == [False, True], "later connects provision after taking the lease"
        assert any(e["event"] == "tunnel_bootstrap" for e in captured.events)


class TestClose:
    """close() ends the keeper promptly even while a connect hangs."""

    async def test_close_aborts_a_connect_stuck_on_a_black_hole(
        self, vps: Vps, captured: Captured
    ) -> None:
        vps.proxy.blackhole(new_too=True)  # TCP connects, SSH never answers
        config = remote_section(vps, connect_timeout_s=30.0)
        async with running_keeper(config, captured=captured) as keeper:
            await poll(lambda: vps.proxy.accepted >= 1, timeout_s=5, what="a connect")
            assert keeper.status().state.value == "connecting"
            started = asyncio.get_running_loop().time()
        assert asyncio.get_running_loop().time() - started < 5.0
        assert keeper.status().state.value == "stopped"


def _syn_sent_to(port: int) -> bool:
    """Whether a TCP connect to 127.0.0.1:port is still waiting for its handshake."""
    wanted = f"0100007F:{port:04X}"
    with open("/proc/net/tcp") as table:
        return any(f.split()[2] == wanted and f.split()[3] == "02" for f in list(table)[1:])


class TestTargetConnections:
    """A connection to a reverse forward's target never outlives the SSH connection that
    carried it, even one whose connect was still under way when the tunnel went."""

    async def test_a_target_connect_finishing_after_the_tunnel_dropped_is_closed(
        self, vps: Vps, captured: Captured
    ) -> None:
        # A target whose accept queue is full: the kernel drops the forward's SYN, so its
        # connect stays under way (the SYN is resent after 1 s) until the queue drains.
        target = socket.socket()
        target.bind(("127.0.0.1", 0))
        target.listen(0)
        target_port = target.getsockname()[1]
        filler = socket.create_connection(("127.0.0.1", target_port))
        spec = ForwardSpec(name="nats", listen=f"127.0.0.1:{free_port()}",
                           target=f"127.0.0.1:{target_port}")
        config = remote_section(vps, reverse=(spec,))
        visitor = socket.socket()
        accepted: list[socket.socket] = []
        try:
            async with running_keeper(config, captured=captured) as keeper:
                await keeper.wait_connected(timeout_s=20)
                visitor.connect(("127.0.0.1", int(spec.listen.rpartition(":")[2])))
                await poll(lambda: _syn_sent_to(target_port), timeout_s=5,
                           what="the forward's connect to its target")
                await vps.proxy.cut()
                await keeper.wait_for(lambda s: not s.connected, timeout_s=10)
                target.settimeout(5)
                accepted.append(target.accept()[0])  # the filler: the queue drains
                accepted.append(target.accept()[0])  # the forward's resent SYN lands
                late = accepted[-1]
                late.setblocking(False)
                ended = await poll(lambda: _peer_ended(late), timeout_s=5,
                                   what="the late target connection to be closed")
                assert ended
        finally:
            for sock in (target, filler, visitor, *accepted):
                sock.close()


def _peer_ended(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionError:
        return True

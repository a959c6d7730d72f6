"""The tunnel lease on the VPS (`monitord tunnel-lease` over real SSH exec): atomic under its
flock, never takes a live foreign lease, takes an expired one only once its session is gone
or fenced, and records who holds it and from which sshd session."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import asyncssh

from monitord.remote.tunnel.lease_client import LeaseAnswer, LeaseClient
from tests.integration.tunnel.conftest import Captured, Vps, poll
from tests.support.agent_process import vps_command


@contextlib.asynccontextmanager
async def ssh_session(vps: Vps) -> AsyncIterator[asyncssh.SSHClientConnection]:
    conn = await asyncssh.connect(
        "127.0.0.1", vps.sshd.port, username="root",
        client_keys=[str(vps.sshd.client_key.private_path)],
        known_hosts=str(vps.sshd.known_hosts), agent_path=None, config=[],
    )
    try:
        yield conn
    finally:
        conn.close()
        await conn.wait_closed()


def client(vps: Vps, owner: str, *, ttl_s: float = 30.0) -> LeaseClient:
    return LeaseClient(prefix=tuple(vps_command()), remote_dir=str(vps.remote_dir),
                       owner_id=owner, owner_label=f"{owner}-label", ttl_s=ttl_s)


class TestAcquire:
    """Exactly one owner gets a free lease, and the record names its session."""

    async def test_concurrent_acquires_from_many_sessions_grant_exactly_one(
        self, vps: Vps, captured: Captured
    ) -> None:
        owners = [f"owner-{i}" for i in range(6)]
        async with contextlib.AsyncExitStack() as stack:
            conns = [await stack.enter_async_context(ssh_session(vps)) for _ in owners]
            answers = await asyncio.gather(
                *(client(vps, o).acquire(c) for o, c in zip(owners, conns, strict=True))
            )
        winners = [a for a in answers if a.ok]
        assert len(winners) == 1
        losers = [a for a in answers if not a.ok]
        assert all(a.code == "TUNNEL_LEASE_CONFLICT" for a in losers)
        assert all(a.holder is not None and a.holder.owner_id == winners[0].lease.owner_id
                   for a in losers if a.holder is not None)
        on_disk = json.loads((vps.remote_dir / "tunnel_lease.json").read_text())
        assert on_disk["owner_id"] == winners[0].lease.owner_id

    async def test_the_record_names_owner_label_times_ttl_and_the_sshd_session(
        self, vps: Vps, captured: Captured
    ) -> None:
        async with ssh_session(vps) as conn:
            answer = await client(vps, "owner-a", ttl_s=12.5).acquire(conn)
            env = (await conn.run("echo $SSH_CONNECTION", check=True)).stdout
            assert isinstance(env, str)
            record = answer.lease
            assert record is not None
            assert (record.owner_id, record.owner_label, record.ttl) == (
                "owner-a", "owner-a-label", 12.5)
            assert record.acquired_at == record.renewed_at
            assert record.session.sshd_pid in vps.sshd.session_pids()
            assert record.session.ssh_connection.split()[1] == env.split()[1]


class TestTakeover:
    """A live foreign lease is refused; an expired one is taken once its session is gone,
    or after fencing that session."""

    async def test_a_live_lease_is_refused_and_left_untouched(
        self, vps: Vps, captured: Captured
    ) -> None:
        async with ssh_session(vps) as a, ssh_session(vps) as b:
            first = await client(vps, "owner-a").acquire(a)
            second = await client(vps, "owner-b").acquire(b)
            assert first.ok and not second.ok and second.code == "TUNNEL_LEASE_CONFLICT"
            shown, _ = await client(vps, "owner-b").show(b)
            assert shown == first.lease

    async def test_an_expired_lease_whose_session_is_gone_is_taken(
        self, vps: Vps, captured: Captured
    ) -> None:
        async with ssh_session(vps) as a:
            first = await client(vps, "owner-a", ttl_s=0.2).acquire(a)
        assert first.lease is not None
        gone_pid = first.lease.session.sshd_pid
        await poll(lambda: gone_pid not in vps.sshd.session_pids(), timeout_s=5,
                   what="session a gone")
        async with ssh_session(vps) as b:
            # (the session can be gone within the 0.2 s: asked before expiry, it is refused)
            taken = await _acquire_after_expiry(client(vps, "owner-b"), b, first.lease.expires_at)
        assert taken.ok and taken.fenced_pid is None
        assert taken.holder is not None and taken.holder.owner_id == "owner-a"

    async def test_an_expired_lease_with_a_live_session_is_taken_only_after_fencing_it(
        self, vps: Vps, captured: Captured
    ) -> None:
        async with ssh_session(vps) as a, ssh_session(vps) as b:
            first = await client(vps, "owner-a", ttl_s=0.2).acquire(a)
            assert first.lease is not None
            old_pid = first.lease.session.sshd_pid
            taken = await _acquire_after_expiry(client(vps, "owner-b"), b, first.lease.expires_at)
            assert taken.ok and taken.fenced_pid == old_pid
            assert old_pid not in vps.sshd.session_pids()
            await asyncio.wait_for(a.wait_closed(), 5)

    async def test_renew_from_a_session_that_does_not_hold_the_lease_is_lost(
        self, vps: Vps, captured: Captured
    ) -> None:
        async with ssh_session(vps) as a, ssh_session(vps) as b:
            assert (await client(vps, "owner-a").acquire(a)).ok
            renewed = await client(vps, "owner-a").renew(a)
            assert renewed.ok and renewed.action == "renew"
            lost = await client(vps, "owner-a").renew(b)
            assert not lost.ok and lost.action == "lost"
            foreign = await client(vps, "owner-b").renew(b)
            assert not foreign.ok and foreign.code == "TUNNEL_LEASE_CONFLICT"

    async def test_release_drops_only_our_own_record(self, vps: Vps, captured: Captured) -> None:
        async with ssh_session(vps) as a:
            assert (await client(vps, "owner-a").acquire(a)).ok
            await client(vps, "owner-b").release(a)
            assert (vps.remote_dir / "tunnel_lease.json").exists()
            await client(vps, "owner-a").release(a)
            assert not (vps.remote_dir / "tunnel_lease.json").exists()


async def _acquire_after_expiry(lease: LeaseClient, conn: asyncssh.SSHClientConnection,
                                expires_at: float) -> LeaseAnswer:
    """Ask until the VPS clock has passed expires_at (the first answers are conflicts)."""
    deadline = asyncio.get_running_loop().time() + 10
    while True:
        answer = await lease.acquire(conn)
        if answer.ok or asyncio.get_running_loop().time() > deadline:
            return answer
        assert answer.now < expires_at + 1.0, "refused although expired"

"""An attempt that raises anything at all (a malformed tunnel-lease reply, a bug) never ends
the tunnel keeper or its standby connection: it is counted under the root loops' error
policy, shown as the tunnel's last error, and the next attempt connects
(monitord/base/periodic.py)."""

from __future__ import annotations

from typing import Any

import pytest

from monitord.base.periodic import LoopBook
from monitord.remote.tunnel.keeper import TunnelState
from monitord.remote.tunnel.lease_client import LeaseClient
from tests.integration.tunnel.conftest import (
    Captured,
    EchoServer,
    Vps,
    poll,
    remote_section,
    reverse_to,
    running_keeper,
)

RAISED: dict[str, BaseException] = {
    "ValueError": ValueError("could not convert string to float: 'x'"),
    "KeyError": KeyError("now"),
    "RecursionError": RecursionError("maximum recursion depth exceeded"),
}


class TestAnAttemptThatRaises:
    """The keeper goes on after a back-off; the error is INTERNAL, counted and shown."""

    @pytest.mark.parametrize("kind", sorted(RAISED))
    async def test_the_next_attempt_connects(
        self, kind: str, vps: Vps, echo: EchoServer, captured: Captured
    ) -> None:
        book = LoopBook()
        config = remote_section(vps, reverse=(reverse_to(echo),))
        async with running_keeper(config, captured=captured, loops=book) as keeper:
            client = keeper._lease_client
            original = client.open_session
            raised: list[BaseException] = []

            async def open_session(conn: Any) -> Any:
                if not raised:
                    raised.append(RAISED[kind])
                    raise RAISED[kind]
                return await original(conn)

            client.open_session = open_session  # type: ignore[method-assign]
            status = await keeper.wait_connected(timeout_s=30)
            assert status.state is TunnelState.CONNECTED and status.attempts >= 2
            record = book.to_status()["tunnel keeper"]
            assert record["errors"] == 1 and record["last_error"]["code"] == "INTERNAL"
            assert kind in record["last_error"]["detail"]


class TestAStandbyAttemptThatRaises:
    """The standby goes on too: counted as loop "tunnel standby", then made again."""

    async def test_a_standby_is_made_after_one_attempt_raised(
        self, vps: Vps, echo: EchoServer, captured: Captured, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        original = LeaseClient.open_session
        calls: list[int] = []

        async def open_session(self: LeaseClient, conn: Any) -> Any:
            calls.append(1)
            if len(calls) == 2:  # the first standby's helper (the first call is the tunnel's)
                raise ValueError("could not convert string to float: 'x'")
            return await original(self, conn)

        monkeypatch.setattr(LeaseClient, "open_session", open_session)
        book = LoopBook()
        config = remote_section(vps, reverse=(reverse_to(echo),))
        async with running_keeper(config, captured=captured, loops=book) as keeper:
            await keeper.wait_connected(timeout_s=30)
            await poll(lambda: keeper._standby is not None and keeper._standby._ready is not None,
                       timeout_s=30, what="a standby made after the one that raised")
            record = book.to_status()["tunnel standby"]
            assert record["errors"] == 1 and record["last_error"]["code"] == "INTERNAL"
            assert keeper.status().connected and len(calls) >= 3


class TestAReconnectHookThatRaises:
    """A hook's bug is counted and shown as loop "tunnel hook: NAME"; the tunnel stays up."""

    async def test_it_is_counted_and_the_tunnel_stays_up(
        self, vps: Vps, echo: EchoServer, captured: Captured
    ) -> None:
        async def broken(conn: Any) -> None:
            raise OverflowError("int too large to convert")

        book = LoopBook()
        config = remote_section(vps, reverse=(reverse_to(echo),))
        async with running_keeper(config, captured=captured, loops=book,
                                  hooks={"broken": broken}) as keeper:
            await keeper.wait_connected(timeout_s=30)
            await poll(lambda: "tunnel hook: broken" in book.to_status(), timeout_s=10,
                       what="the hook's failure counted")
            record = book.to_status()["tunnel hook: broken"]
            assert record["errors"] == 1 and record["last_error"]["code"] == "INTERNAL"
            assert "OverflowError" in record["last_error"]["detail"]
            assert keeper.status().connected

"""An attempt that raises anything at all (a malformed tunnel-lease reply, a bug) never ends
the tunnel keeper: it is counted under the root loops' error policy, shown as the tunnel's
last error, and the next attempt connects (monitord/base/periodic.py)."""

from __future__ import annotations

from typing import Any

import pytest

from monitord.base.periodic import LoopBook
from monitord.remote.tunnel.keeper import TunnelState
from tests.integration.tunnel.conftest import (
    Captured,
    EchoServer,
    Vps,
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

"""No reconnect storm: however fast the failures come, attempts per window stay under the cap."""

from __future__ import annotations

import time

from tests.integration.tunnel.conftest import Captured, Vps, poll, remote_section, running_keeper

WINDOW_S = 1.5
CAP = 3


class TestServerDown:
    """With the server down, attempts in any window never exceed reconnect_max_per_minute
    (the window is shortened here; the fake-clock unit test covers a real minute)."""

    async def test_attempts_stay_under_the_cap_in_every_window(
        self, vps: Vps, captured: Captured
    ) -> None:
        vps.proxy.refuse(True)  # accepts and closes at once: the SSH server looks down
        config = remote_section(
            vps, reconnect_backoff_base_s=0.001, reconnect_backoff_cap_s=0.01,
            reconnect_max_per_minute=CAP,
        )
        async with running_keeper(config, captured=captured,
                                  reconnect_window_s=WINDOW_S) as keeper:
            started = time.monotonic()
            await poll(lambda: time.monotonic() - started > 2.5 * WINDOW_S,
                       timeout_s=3 * WINDOW_S, what="the observation period")
            status = keeper.status()
            times = list(keeper.attempt_times)
            accepted = vps.proxy.accepted
        assert status.last_error is not None
        assert status.last_error.code in ("SSH_UNREACHABLE", "SSH_TIMEOUT")
        assert len(times) >= CAP, "the keeper kept trying"
        for i, t in enumerate(times):
            in_window = [u for u in times[i:] if u < t + WINDOW_S]
            assert len(in_window) <= CAP, f"{len(in_window)} attempts within {WINDOW_S}s"
        assert len(times) - 1 <= accepted <= len(times), "one TCP connect per attempt"
        warnings = [e for e in captured.events if e["event"] == "tunnel_error"]
        codes = {e["error_code"] for e in warnings}
        assert len(warnings) == len(codes), "a repeating error is logged once per interval"

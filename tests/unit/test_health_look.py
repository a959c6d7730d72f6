"""The health check looks again exactly when a running destination's window ends."""

from __future__ import annotations

import pytest

from monitord.engine.phase_actions import HEALTH_SLACK_S, POLL_S, _next_health_look


@pytest.mark.parametrize(
    ("uptime", "left", "expected"),
    [
        (0.1, 30.0, 0.4 + HEALTH_SLACK_S),  # running: wait for the rest of the window
        (0.49, 30.0, 0.01 + HEALTH_SLACK_S),
        (None, 30.0, POLL_S),  # not running yet: the poll period
        (0.6, 30.0, POLL_S),  # window over but the probe failed: poll again
        (0.1, 0.05, 0.05),  # never past the deadline
        (None, 0.0, 0.0),
    ],
)
def test_next_look(uptime: float | None, left: float, expected: float) -> None:
    assert _next_health_look(uptime, 0.5, left) == pytest.approx(expected)

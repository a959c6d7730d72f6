"""Hypothesis settings of the fuzz tier, chosen by environment like tests/unit/core.

`MONITORD_FUZZ_PROFILE` selects one explicitly; otherwise CI=true selects "ci" (more
examples, derandomised and without the example database, so a CI run is repeatable) and
anything else "dev". The "ci" counts keep the whole tier under ~60 s on 2 cores.

`demo()` is for the tests that run a property against a deliberately broken implementation
and expect it to fail: the same in both profiles, derandomised, without shrinking (the
failure is what matters, not the smallest example).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings

_COUNTS = {
    "dev": {"config": 100, "api": 100, "agent": 100, "vps": 100},
    "ci": {"config": 600, "api": 500, "agent": 500, "vps": 400},
}

_IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
NAME = os.environ.get("MONITORD_FUZZ_PROFILE", "ci" if _IN_CI else "dev")


def profile(strategy: str) -> settings:
    """The settings of one fuzz strategy ("config", "api", "agent", "vps") under the active
    profile."""
    ci = NAME == "ci"
    return settings(
        max_examples=_COUNTS[NAME][strategy],
        deadline=None,
        derandomize=ci,
        database=None if ci else settings.default.database,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def demo(max_examples: int = 300) -> settings:
    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        print_blob=False,
    )

"""Hypothesis settings for the pure-core tests, chosen by environment.

`ORCHESTRATOR_HYPOTHESIS_PROFILE` selects one explicitly; otherwise CI=true selects "ci"
(1000 examples, 60 steps per stateful run, derandomised so CI runs are repeatable) and
anything else "dev" (60 examples, 40 steps). Applied per test (`@PROFILE`), never loaded
globally, so other suites keep their own hypothesis settings.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_PROFILES = {
    "dev": settings(
        max_examples=60,
        stateful_step_count=40,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    ),
    "ci": settings(
        max_examples=1000,
        stateful_step_count=60,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    ),
}

_IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
NAME = os.environ.get("ORCHESTRATOR_HYPOTHESIS_PROFILE", "ci" if _IN_CI else "dev")
PROFILE = _PROFILES[NAME]

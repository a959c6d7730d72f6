"""Shared settings for the pure-core tests: hypothesis profiles chosen by environment.

`HYPOTHESIS_PROFILE` selects one explicitly; otherwise CI=true selects "ci" (more examples,
derandomised so CI runs are repeatable) and anything else "dev".
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "dev",
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "ci",
    max_examples=1000,
    stateful_step_count=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

_IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if _IN_CI else "dev"))

"""Suite-wide rules: under CI=true a skipped test is a failure (CI runs as root with every
tool installed, so nothing may silently fall out of the run)."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    if IN_CI and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.longrepr = f"skipped under CI=true, which forbids skips: {reason}"


@pytest.fixture(autouse=True)
def _collect_garbage_after_each_test() -> Iterator[None]:
    """Run the garbage collector after every test, so a socket or transport a test leaked is
    reported (ResourceWarning, an error here) against that test and not a random later one."""
    yield
    gc.collect()

"""Suite-wide rules: under CI=true a skipped test is a failure (CI runs as root with every
tool installed, so nothing may silently fall out of the run); an async test that leaves an
asyncio task running fails; garbage is collected after every test (what collection built is
frozen first); in parallel runs (`--dist loadgroup`) a test's xdist_group must reach the
scheduler; temporary directories live under a short root of fixed length."""

from __future__ import annotations

import asyncio
import gc
import inspect
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator

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


OWN_BASETEMP = pytest.StashKey[str]()


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Tests bind the VPS agent's Unix socket deep in their tmp_path, and a socket address
    holds 107 bytes. pytest's own root, /tmp/pytest-of-USER/pytest-N, grows with N (a machine
    past its 100th run made 8 tests fail): a fresh /tmp/mt.XXXXXXXX instead, the same length
    on every run. Removed after a run that passed, kept for a look after one that did not.
    Workers are given their own directory under it by xdist; --basetemp still wins."""
    if config.option.basetemp is None and not hasattr(config, "workerinput"):
        config.option.basetemp = config.stash[OWN_BASETEMP] = tempfile.mkdtemp(prefix="mt.")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    own = session.config.stash.get(OWN_BASETEMP, None)
    if own is not None and exitstatus == pytest.ExitCode.OK:
        shutil.rmtree(own, ignore_errors=True)


GROUP_LOST = pytest.StashKey[str]()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """xdist groups a test by the `@group` its worker appends to the node id. A pytest that
    ignores that rewrite (9.2: pytest-xdist issue 1386, hence the pin in pyproject.toml)
    would silently spread a group, every worker building its expensive fixture: such a test
    fails instead (an error raised here, in a worker, would not be shown)."""
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        if item.get_closest_marker("xdist_group") and "@" not in item.nodeid:
            item.stash[GROUP_LOST] = (f"its xdist_group mark did not reach the scheduler "
                                      f"(pytest {pytest.__version__}, pytest-xdist issue 1386)")


def pytest_runtest_setup(item: pytest.Item) -> None:
    if GROUP_LOST in item.stash:
        pytest.fail(item.stash[GROUP_LOST], pytrace=False)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what collection built (every imported module, hundreds of thousands of objects),
    so the collection after each test walks only what tests made: it halves the unit tests'
    time. A test's leaked socket is made later, and still reported against it."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _collect_garbage_after_each_test() -> Iterator[None]:
    """Run the garbage collector after every test, so a socket or transport a test leaked is
    reported (ResourceWarning, an error here) against that test and not a random later one."""
    yield
    gc.collect()


LEAK_GRACE_S = 0.05  # tasks that are finishing on their own get this long before they count


@pytest.fixture(autouse=True)
async def _fail_on_leaked_tasks(request: pytest.FixtureRequest) -> AsyncIterator[None]:
    """An async test (with its fixtures) must own every task it starts: one still running
    after its teardown fails the test, named, and is cancelled so it cannot hit the next one."""
    if not inspect.iscoroutinefunction(getattr(request.node, "obj", None)):
        yield
        return
    before = asyncio.all_tasks()
    yield
    current = asyncio.current_task()
    leaked = {t for t in asyncio.all_tasks() - before if t is not current and not t.done()}
    if leaked:
        await asyncio.wait(leaked, timeout=LEAK_GRACE_S)
        leaked = {t for t in leaked if not t.done()}
    if not leaked:
        return
    for task in leaked:
        task.cancel()
    await asyncio.gather(*leaked, return_exceptions=True)
    names = ", ".join(sorted(f"{t.get_name()} ({t.get_coro()!r:.80})" for t in leaked))
    pytest.fail(f"the test left {len(leaked)} asyncio task(s) running: {names}", pytrace=False)

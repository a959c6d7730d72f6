"""The suite's own rules (tests/conftest.py) hold in parallel runs too: `make test` runs the
suite under pytest-xdist, where each test runs and is reported in a worker process. A small
suite with this repository's conftest.py is run in a subprocess, with two workers."""

from __future__ import annotations

from pathlib import Path

import pytest

from monitord.base import config

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).parents[1] / "conftest.py"
INI = """
[pytest]
asyncio_mode = auto
asyncio_default_fixture_loop_scope = function
filterwarnings = error
"""


TESTS = """
import asyncio
import socket

import pytest

def test_skips():
    pytest.skip("a missing tool")

@pytest.mark.skip(reason="marked")
def test_marked():
    pass

async def test_leaks():
    asyncio.get_running_loop().create_task(asyncio.sleep(60), name="left-behind")

def test_leaks_a_socket():
    held = {"socket": socket.socket()}
    held["itself"] = held  # a cycle: only the collector finds it, after the test

async def test_owns_its_task():
    task = asyncio.get_running_loop().create_task(asyncio.sleep(60))
    task.cancel()
"""


def test_skips_and_leaked_tasks_fail_in_workers_under_ci(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One run (workers take seconds to start): a skip in the body fails that test, a skip
    mark fails its setup, a task left running fails the test's teardown, and so does a socket
    left in a cycle (the suite freezes what collection built, not what tests make)."""
    monkeypatch.setenv("CI", "true")
    pytester.makeini(INI)
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile(test_rules=TESTS)
    result = pytester.runpytest_subprocess("-n", "2", "-p", "no:cacheprovider", "-q",
                                           timeout=120)
    # test_leaks passes its body and errors at teardown; test_marked errors at setup.
    result.assert_outcomes(passed=3, failed=1, errors=3)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines_random([
        "FAILED test_rules.py::test_skips - skipped under CI=true, which forbids skips: *",
        "ERROR test_rules.py::test_marked - skipped under CI=true, which forbids skips: *",
        "ERROR test_rules.py::test_leaks - *the test left 1 asyncio task(s) running: left-behind*",
        "ERROR test_rules.py::test_leaks_a_socket - *Exception ignored in: <socket.socket*",
    ])


# The deepest Unix socket tests bind: a VPS agent's, in a stack a benchmark builds under a
# test directory whose name pytest cuts at 30 characters (+ "0").
DEEPEST_SOCKET = "/" + "t" * 30 + "0/status/stack/vps/opt/api/agent.sock"


def test_the_temporary_root_leaves_room_for_the_deepest_socket(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A socket address holds 107 bytes: pytest's own /tmp/pytest-of-USER/pytest-N root, past
    N = 100 and under a worker's popen-gwN, did not leave room (tests/conftest.py)."""
    root = tmp_path_factory.getbasetemp()
    worker = "" if root.name.startswith("popen-gw") else "/popen-gw99"
    deepest = f"{root}{worker}{DEEPEST_SOCKET}"
    assert len(deepest.encode()) <= config.MAX_SOCKET_PATH, deepest

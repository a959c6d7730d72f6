"""`python -m benchmarks [NAME_SUBSTRING ...]`: run every benchmarks/bench_*.py module's
`run()` (or only those whose name contains one of the given substrings) and print one JSON
object per figure on stdout. A module that cannot run here (e.g. needs root) reports a
figure with "skipped" and its reason instead of failing the whole suite."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import logging
import sys
from pathlib import Path
from typing import Any


class BenchmarkUnavailable(Exception):
    """Raised by a run() that cannot measure on this machine; the reason is printed."""


# Under `python -m benchmarks` this file runs as `__main__`; without the alias a module's
# `from benchmarks.__main__ import BenchmarkUnavailable` would load a second copy whose class
# this file's `except` does not catch (the skip became an error and exit status 1).
sys.modules.setdefault("benchmarks.__main__", sys.modules[__name__])


def _modules(filters: list[str]) -> list[str]:
    names = sorted(p.stem for p in Path(__file__).parent.glob("bench_*.py"))
    return [n for n in names if not filters or any(f in n for f in filters)]


def _run_one(name: str) -> list[dict[str, Any]]:
    module = importlib.import_module(f"benchmarks.{name}")
    result = module.run()
    if inspect.isawaitable(result):
        result = asyncio.run(_await(result))
    return list(result)


async def _await(awaitable: Any) -> Any:
    return await awaitable


def main(argv: list[str]) -> int:
    from monitord.base import logs

    logs.configure("json", level=logging.WARNING)  # logs to stderr; stdout is figures only
    status = 0
    for name in _modules(argv):
        try:
            figures = _run_one(name)
        except BenchmarkUnavailable as e:
            figures = [{"benchmark": name, "skipped": str(e)}]
        except Exception as e:  # one broken benchmark must not hide the others' figures
            figures = [{"benchmark": name, "error": f"{type(e).__name__}: {e}"}]
            status = 1
        for figure in figures:
            print(json.dumps(figure, sort_keys=True), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

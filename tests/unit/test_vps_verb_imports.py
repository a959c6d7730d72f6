"""What starts once per remote daemon or copy must start fast: the lease guard (one per
daemon start, and its start is part of the area's downtime: the health window counts from
the daemon's own start, which comes after the guard's), the log sink and hub, and the
tree-digest verb (two per copy). None of them may import asyncio, which alone costs each
start about 50 ms here (it pulls in ssl, logging and concurrent.futures)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("asyncio", "ssl", "logging", "concurrent.futures")


@pytest.mark.parametrize(
    "module", ["monitord.vps.lease_guard", "monitord.base.log_sink", "monitord.base.log_hub",
               "monitord.base.tree_digest"]
)
def test_a_per_daemon_verb_does_not_import_asyncio(module: str) -> None:
    probe = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); import {module}; "
             f"import json; print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))")
    # -I: as the VPS runs it (no user site, no PYTHON* environment that could pre-import).
    out = subprocess.run([sys.executable, "-I", "-c", probe], capture_output=True, text=True,
                         check=True, timeout=30).stdout
    assert json.loads(out) == []

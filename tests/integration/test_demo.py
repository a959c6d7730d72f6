"""`monitord demo` — the first command a new user runs — ends with a clean verdict."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


class TestDemo:
    """The demo exits 0 and its verdict line reports zero overlaps and zero orphans."""

    def test_demo_exits_0_with_zero_overlaps(self, tmp_path: Path) -> None:
        result = subprocess.run(
            [sys.executable, "-m", "monitord", "demo", "--dir", str(tmp_path / "demo")],
            capture_output=True, text=True, timeout=240,
        )
        verdict = [line for line in result.stdout.splitlines() if line.startswith("VERDICT:")]
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert len(verdict) == 1
        assert "PASS" in verdict[0] and "overlaps seen 0" in verdict[0]
        assert "data regressions 0" in verdict[0]
        assert "orphans 0" in verdict[0] and "cleanup backlog 0" in verdict[0]
        assert "cutting the SSH link" in result.stdout

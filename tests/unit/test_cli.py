"""The command line: usage errors and config errors exit 2 with one readable line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "monitord", *args], capture_output=True, text=True, timeout=60
    )


class TestUsage:
    """Bad usage exits 2 without a traceback."""

    def test_unknown_verb_exits_2(self) -> None:
        result = run_cli("frobnicate")
        assert result.returncode == 2
        assert "Traceback" not in result.stderr

    def test_version_prints_the_package_version_and_exits_0(self) -> None:
        from monitord import __version__

        result = run_cli("--version")
        assert (result.returncode, result.stdout, result.stderr) == (
            0, f"monitord {__version__}\n", ""
        )

    def test_help_lists_contract_verbs(self) -> None:
        result = run_cli("--help")
        assert result.returncode == 0
        for verb in ("run", "launch", "agent", "status", "place", "retry", "bundle", "demo"):
            assert verb in result.stdout


def test_config_module_names_key(tmp_path: Path) -> None:
    from monitord.base import config

    path = tmp_path / "m.toml"
    path.write_text("[monitord]\nbogus = 1\n")
    try:
        config.load(path)
    except config.ConfigError as e:
        assert "monitord.bogus" in str(e) and str(path) in str(e)
    else:
        raise AssertionError("an unknown key must be rejected")

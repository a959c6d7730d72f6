"""The agent artifact monitord.pyz: same source, same bytes; it runs every verb's --help."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from monitord.base.config import RemoteSection
from monitord.remote import artifact


def run_pyz(pyz: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(pyz), *args], capture_output=True, text=True, timeout=60,
        cwd=pyz.parent,  # not the source tree: the code must come from inside the archive
    )


class TestDeterministicBuild:
    """Building twice from the same source gives byte-identical artifacts."""

    def test_two_builds_have_the_same_sha256(self, tmp_path: Path) -> None:
        first = artifact.build(tmp_path / "one")
        second = artifact.build(tmp_path / "two")
        assert first.sha256 == second.sha256
        assert first.path.read_bytes() == second.path.read_bytes()
        assert first.size == first.path.stat().st_size
        assert first.sha256 == artifact.sha256_file(first.path)

    def test_the_archive_holds_both_packages_and_no_bytecode(self, tmp_path: Path) -> None:
        info = artifact.build(tmp_path)
        names = zipfile.ZipFile(info.path).namelist()
        assert "__main__.py" in names
        assert "monitord/surface/cli.py" in names and "orchestrator/errors.py" in names
        assert not [n for n in names if n.endswith(".pyc") or "__pycache__" in n]
        assert names[0] == "__main__.py" and names[1:] == sorted(names[1:])


class TestArtifactRuns:
    """The pyz runs with this python: top-level help and the agent's help."""

    def test_help_lists_the_verbs(self, tmp_path: Path) -> None:
        result = run_pyz(artifact.build(tmp_path).path, "--help")
        assert result.returncode == 0, result.stderr
        assert "agent-launch" in result.stdout

    def test_agent_help(self, tmp_path: Path) -> None:
        result = run_pyz(artifact.build(tmp_path).path, "agent", "--help")
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("usage: monitord agent")


class TestRemoteCommand:
    """remote_monitord placeholders expand from the remote section."""

    def test_default_runs_the_pushed_pyz_with_the_remote_python(self, tmp_path: Path) -> None:
        remote = RemoteSection(
            host="vps", user="offload", key_file=tmp_path / "k", accept_any_host_key=True,
            remote_bin_dir="/srv/offload", remote_python="/usr/bin/python3.11",
        )
        assert artifact.remote_command(remote) == (
            "/usr/bin/python3.11", "/srv/offload/monitord.pyz"
        )

"""The agent artifact monitord.pyz: same source, same bytes; only the VPS side, which runs
under the system python3 in isolated mode (nothing but the standard library)."""

from __future__ import annotations

import json
import subprocess
import zipfile
from pathlib import Path

from monitord.base.config import RemoteSection
from monitord.remote import artifact
from tests.support.agent_process import SYSTEM_PYTHON


def run_pyz(pyz: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [SYSTEM_PYTHON, "-I", "-S", str(pyz), *args], capture_output=True, text=True, timeout=60,
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

    def test_the_archive_holds_only_the_vps_side_and_no_bytecode(self, tmp_path: Path) -> None:
        info = artifact.build(tmp_path)
        names = zipfile.ZipFile(info.path).namelist()
        assert names[0] == "__main__.py" and names[1:] == sorted(names[1:])
        assert "monitord/vps/server.py" in names and "orchestrator/errors.py" in names
        outside = [n for n in names[1:] if not n.startswith("monitord/vps/")]
        assert sorted(outside) == sorted(artifact.PORTABLE_MODULES)
        for room in ("surface", "engine", "remote", "store", "local", "testing"):
            assert not [n for n in names if n.startswith(f"monitord/{room}/")], room
        assert not [n for n in names if n.endswith(".pyc") or "__pycache__" in n]


class TestArtifactRuns:
    """The pyz runs under the system python3 with -I: every verb's help, and the self-check,
    which imports every module in the archive."""

    def test_help_lists_the_verbs(self, tmp_path: Path) -> None:
        result = run_pyz(artifact.build(tmp_path).path, "--help")
        assert result.returncode == 0, result.stderr
        for verb in ("agent", "agent-launch", "tunnel-lease", "self-check", "log-sink",
                     "log-hub"):
            assert verb in result.stdout

    def test_every_verb_help(self, tmp_path: Path) -> None:
        pyz = artifact.build(tmp_path).path
        for verb in ("agent", "agent-launch", "tunnel-lease", "self-check", "log-sink",
                     "log-hub"):
            result = run_pyz(pyz, verb, "--help")
            assert result.returncode == 0, (verb, result.stderr)
            assert result.stdout.startswith(f"usage: monitord.pyz {verb}"), result.stdout

    def test_self_check_imports_every_module_and_passes(self, tmp_path: Path) -> None:
        pyz = artifact.build(tmp_path).path
        bin_dir = tmp_path / "opt"
        bin_dir.mkdir(mode=0o700)
        result = run_pyz(pyz, "self-check", "--dir", str(bin_dir))
        lines = [json.loads(line) for line in result.stdout.splitlines()]
        assert result.returncode == 0, lines
        checks = {line["check"]: line for line in lines}
        assert set(checks) == {"python", "modules", "bin_dir", "flock", "proc", "ss", "socket",
                               "fence"}
        assert checks["fence"]["ok"]  # no agent ran there: it cannot know
        assert checks["fence"]["detail"].startswith("not known yet: the agent says at its start")
        modules = len([n for n in zipfile.ZipFile(pyz).namelist()[1:] if n.endswith(".py")])
        assert checks["modules"]["detail"] == f"{modules} modules import"

    def test_self_check_fails_on_a_dir_it_cannot_use_and_names_the_fix(
        self, tmp_path: Path
    ) -> None:
        pyz = artifact.build(tmp_path).path
        result = run_pyz(pyz, "self-check", "--dir", str(tmp_path / "missing"))
        lines = {line["check"]: line for line in map(json.loads, result.stdout.splitlines())}
        assert result.returncode == 1
        assert not lines["bin_dir"]["ok"] and "mkdir" in lines["bin_dir"]["fix"]
        assert lines["python"]["ok"]


class TestRemoteCommand:
    """remote_monitord placeholders expand from the remote section."""

    def test_default_runs_the_pushed_pyz_with_the_remote_python(self, tmp_path: Path) -> None:
        remote = RemoteSection(
            host="vps", user="offload", key_file=tmp_path / "k", accept_any_host_key=True,
            remote_bin_dir="/srv/offload", remote_python="/usr/bin/python3.11",
        )
        assert artifact.remote_command(remote) == (
            "/usr/bin/python3.11", "-I", "/srv/offload/monitord.pyz"
        )

    def test_other_braces_are_left_as_written(self, tmp_path: Path) -> None:
        # One expansion for every caller (the tunnel's lease helper too): an argument that
        # holds a brace of its own is neither an error nor changed.
        remote = RemoteSection(
            host="vps", user="offload", key_file=tmp_path / "k", accept_any_host_key=True,
            remote_bin_dir="/srv/offload",
            remote_monitord=("env", "TAG={x}", "{remote_python}", "{remote_bin_dir}/m.pyz"),
        )
        assert artifact.remote_command(remote) == (
            "env", "TAG={x}", "python3", "/srv/offload/m.pyz"
        )

"""The previous release as a named thing: `tests/faults/previous_release.txt` names its commit
and version; `build_venv()` installs that commit's source (git archive) into a venv of its
own, with pip from the local cache, so a test can run it beside the current code."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PREVIOUS_RELEASE_FILE = REPO_ROOT / "tests" / "faults" / "previous_release.txt"


@dataclass(frozen=True)
class Release:
    commit: str
    version: str


def previous() -> Release:
    """The release named by previous_release.txt (`commit HASH`, `version X.Y.Z` lines)."""
    fields: dict[str, str] = {}
    for line in PREVIOUS_RELEASE_FILE.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition(" ")
            fields[key] = value.strip()
    return Release(commit=fields["commit"], version=fields["version"])


def version_at(commit: str) -> str:
    """pyproject.toml's version at `commit` of this repository."""
    text = subprocess.run(["git", "-C", str(REPO_ROOT), "show", f"{commit}:pyproject.toml"],
                          check=True, capture_output=True, text=True).stdout
    return str(tomllib.loads(text)["project"]["version"])


def current_version() -> str:
    return str(tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["version"])


def version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def build_venv(release: Release, dest: Path) -> Path:
    """Install `release` (its source from git archive, then pip into a venv of its own) under
    `dest`; returns that venv's python. The venv's interpreter is this one's base."""
    source, venv = dest / "src", dest / "venv"
    source.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO_ROOT), "archive", release.commit],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive, check=True)
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    result = subprocess.run([str(python), "-m", "pip", "install", "-q", str(source)],
                            capture_output=True, text=True, cwd=dest)
    if result.returncode != 0:
        raise RuntimeError(f"pip install of release {release.version}: {result.stderr[-2000:]}")
    return python

"""The version moves with each release: pyproject.toml and `monitord --version` agree, and the
previous release named in tests/faults/previous_release.txt is an ancestor of this commit
with an older version than this one."""

from __future__ import annotations

import subprocess

import monitord
from tests.support import releases


class TestTheVersionMoves:
    """This code's version is the package's, and newer than the previous release's."""

    def test_pyproject_and_the_package_carry_the_same_version(self) -> None:
        assert releases.current_version() == monitord.__version__

    def test_the_previous_release_is_an_older_version_in_this_history(self) -> None:
        previous = releases.previous()
        assert len(previous.commit) == 40
        assert releases.version_at(previous.commit) == previous.version
        ancestor = subprocess.run(
            ["git", "-C", str(releases.REPO_ROOT), "merge-base", "--is-ancestor",
             previous.commit, "HEAD"], check=False,
        )
        assert ancestor.returncode == 0, f"{previous.commit} is not an ancestor of HEAD"
        assert releases.version_key(previous.version) < releases.version_key(
            monitord.__version__)

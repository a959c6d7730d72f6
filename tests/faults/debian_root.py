"""Minimal Debian roots of the releases a VPS runs, for the fault tier's release matrix.

`debian_root(suite)` returns a directory holding `mmdebstrap --variant=minbase
--include=openssh-server,python3,iproute2,procps,rsync SUITE`: that release's OpenSSH,
python3, `ss`, `ps` and rsync (the by-hand reference of benchmarks/openssh_vps.py), nothing of
ours. A root is built once per machine into ROOTS_DIR (a second run, and `.ci/run`'s warm-up,
reuse it): into a temporary directory beside it, then renamed, under an flock, so a half-built
root is never used and two runs never build the same one twice. A root's directory is named
by its suite and a digest of what was asked of mmdebstrap (`root_name`): a changed package
list builds a new root beside the old one instead of reusing a root that lacks a package (or
deleting one a test on another checkout may be running in).

`RELEASES` names what each suite ships (the matrix asserts it, so a root that is not what it
claims fails loudly); the table in docs/vps-setup.md lists the same releases.

`pbx_root()` is the PBX's release (`PBX_SUITE`) with python3, systemd and openssh-client:
what tests/faults/test_deb_package.py installs the package into (`systemd-analyze` is there).

`python -m tests.faults.debian_root [SUITE ...]` builds the roots ahead of a test run (all of
them, the PBX root too, without arguments).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOTS_DIR = Path(os.environ.get("MONITORD_TEST_ROOTS", "/var/cache/monitord-tests/roots"))
MIRROR = os.environ.get("MONITORD_TEST_MIRROR", "http://deb.debian.org/debian")
PACKAGES = "openssh-server,python3,iproute2,procps,rsync"
VARIANT = "minbase"
BUILD_TIMEOUT_S = 600.0
# The file whose presence marks a finished root (a rename publishes the whole tree).
READY_MARK = "usr/sbin/sshd"
# The PBX's root: the Debian release the package is built for, with systemd for
# `systemd-analyze verify` and the sysusers/tmpfiles tools the package's scripts use, and
# ssh-keygen for docs/install.md's key (a standard Debian install has all three).
PBX_SUITE = "bookworm"
PBX_ROOT_NAME = "bookworm-pbx"
PBX_PACKAGES = "python3,systemd,openssh-client"
PBX_READY_MARK = "usr/bin/ssh-keygen"


@dataclass(frozen=True)
class Release:
    suite: str
    debian: str
    openssh: str  # the upstream version `ssh -V` names, e.g. "OpenSSH_10.0"
    python: str  # "3.13"


RELEASES = {
    "bullseye": Release("bullseye", "11", "OpenSSH_8.4", "3.9"),
    "bookworm": Release("bookworm", "12", "OpenSSH_9.2", "3.11"),
    "trixie": Release("trixie", "13", "OpenSSH_10.0", "3.13"),
}


class RootBuildError(RuntimeError):
    """mmdebstrap failed or is missing (the message carries its output's tail)."""


def root_name(name: str, *, suite: str, packages: str) -> str:
    """The cache directory of a root: `name`, then a digest of the suite, variant and package
    list it is built from (the mirror only decides where the same packages come from)."""
    built_from = f"{suite} {VARIANT} {','.join(sorted(packages.split(',')))}"
    return f"{name}-{hashlib.sha256(built_from.encode()).hexdigest()[:10]}"


def release_of(root: Path) -> Release:
    """The release a root returned by `debian_root()` was built from."""
    return RELEASES[root.name.rsplit("-", 1)[0]]


def can_build_roots() -> bool:
    return shutil.which("mmdebstrap") is not None or all(
        (ROOTS_DIR / root_name(suite, suite=suite, packages=PACKAGES) / READY_MARK).exists()
        for suite in RELEASES
    )


def can_build_pbx_root() -> bool:
    name = root_name(PBX_ROOT_NAME, suite=PBX_SUITE, packages=PBX_PACKAGES)
    return shutil.which("mmdebstrap") is not None or (ROOTS_DIR / name / PBX_READY_MARK).exists()


@contextlib.contextmanager
def _build_lock(suite: str) -> Iterator[None]:
    ROOTS_DIR.mkdir(parents=True, exist_ok=True)
    fd = os.open(ROOTS_DIR / f".{suite}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another run is building it: wait for that one
        yield
    finally:
        os.close(fd)


def debian_root(suite: str) -> Path:
    """The cached root of `suite`, built first if this machine has none."""
    return _root(suite, name=suite, packages=PACKAGES, ready_mark=READY_MARK)


def pbx_root() -> Path:
    """The cached PBX root (PBX_SUITE with python3 and systemd), built first if missing."""
    return _root(PBX_SUITE, name=PBX_ROOT_NAME, packages=PBX_PACKAGES,
                 ready_mark=PBX_READY_MARK)


def _root(suite: str, *, name: str, packages: str, ready_mark: str) -> Path:
    name = root_name(name, suite=suite, packages=packages)
    root = ROOTS_DIR / name
    if (root / ready_mark).exists():
        return root
    with _build_lock(name):
        if (root / ready_mark).exists():
            return root
        if shutil.which("mmdebstrap") is None:
            raise RootBuildError("mmdebstrap is not installed (apt-get install mmdebstrap)")
        scratch = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=ROOTS_DIR))
        target = scratch / "root"
        try:
            done = subprocess.run(
                ["mmdebstrap", f"--variant={VARIANT}", f"--include={packages}", "--quiet",
                 suite, str(target), MIRROR],
                capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False,
            )
            if done.returncode != 0 or not (target / ready_mark).exists():
                raise RootBuildError(
                    f"mmdebstrap {suite} -> {done.returncode}: {done.stderr[-2000:]}")
            if root.exists():  # an unfinished leftover of an older run
                shutil.rmtree(root)
            target.rename(root)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return root


def main(argv: list[str]) -> int:
    for suite in argv or list(RELEASES):
        print(f"{suite}: {debian_root(suite)}", flush=True)
    if not argv:
        print(f"{PBX_ROOT_NAME}: {pbx_root()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The PBX side as one Debian package: `make lock` and `make deb` (docs/install.md).

`lock` resolves pyproject.toml's runtime dependencies for the package's target (CPython 3.11,
the python3 of Debian 12, on x86_64 glibc: `TARGET_PIP_ARGS`) and writes requirements.lock:
every package pinned to one version with the sha256 of the one file the build installs, in
name order, nothing else (no date, no host): the same resolution writes the same file, and
the file is checked in. Run it to move to newer dependencies, then review the diff.

`build` makes dist/monitord_VERSION_amd64.deb with dpkg-deb alone (no debhelper):

- /usr/lib/monitord/: the locked dependencies, installed with `pip install --target
  --require-hashes --no-deps --only-binary=:all:` (a file whose hash differs from the lock
  fails the build), and the project's own packages (the files git tracks under monitord/
  and orchestrator/). Byte-compiled by the postinst with the installed python3, removed
  again by the prerm;
- /usr/bin/monitord: `python3 -I` on that directory (no user site, no PYTHONPATH, no cwd);
- /lib/systemd/system/monitord.service: systemd/monitord.service as it is in the repo;
- /usr/lib/sysusers.d/monitord.conf (the monitord user and group) and
  /usr/lib/tmpfiles.d/monitord.conf (work_dir and spool_dir), applied by the postinst
  (with useradd and install(1) where systemd's tools are missing, e.g. a container);
- /etc/monitord/monitord.toml, a conffile: config/monitord.toml with its [remote] section
  commented out with `#~ ` (every area runs on the PBX until a VPS is set up; docs/install.md
  uncomments it), so `monitord check` passes on a fresh install;
- /usr/share/doc/monitord/: README.md, docs/*.md (the unit's Documentation= points there),
  examples/ (the full config, custom_config.json, the VPS's sshd snippet and agent unit).

No logrotate file: monitord logs to the journal under systemd, and the files it writes
itself (monitord.log under `monitord launch`, the areas' logs) are bounded by monitord.

The wheels tie the package to CPython 3.11: Depends: python3 (>= 3.11), python3 (<< 3.12).
Every file's mtime is the last commit's time (SOURCE_DATE_EPOCH, which dpkg-deb also uses),
owners are root:root (--root-owner-group).

Usage: python scripts/deb.py lock | build [--out DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "requirements.lock"
PACKAGE = "monitord"
ARCH = "amd64"
LIB_DIR = "usr/lib/monitord"
UNIT_DIR = "lib/systemd/system"
DEPENDS = "python3 (>= 3.11), python3 (<< 3.12)"
# CPython 3.11 on x86_64 with Debian 12's glibc (2.36): the wheels pip may choose.
TARGET_PIP_ARGS = [
    "--only-binary=:all:", "--implementation", "cp", "--python-version", "3.11",
    "--abi", "cp311", "--abi", "abi3", "--abi", "none",
    *[arg for minor in range(36, 4, -1) for arg in ("--platform", f"manylinux_2_{minor}_x86_64")],
    "--platform", "manylinux2014_x86_64", "--platform", "manylinux2010_x86_64",
    "--platform", "manylinux1_x86_64", "--platform", "linux_x86_64",
]
LOCK_HEADER = """\
# requirements.lock: monitord's runtime dependencies for its Debian package (CPython 3.11,
# x86_64), one version each with the sha256 of the file installed. Written by
# `make lock` (scripts/deb.py lock) from pyproject.toml; `make deb` installs exactly these.
"""
REMOTE_OFF = "#~ "

LAUNCHER = f"""\
#!/usr/bin/python3 -I
# monitord, installed by the Debian package: the project and its locked dependencies live in
# /{LIB_DIR}, on this interpreter only (python3 -I: no user site, no PYTHONPATH).
import sys

sys.path.insert(0, "/{LIB_DIR}")
from monitord.surface.cli import main  # noqa: E402

sys.exit(main())
"""

SYSUSERS = """\
# The user monitord.service runs as (docs/operations.md, "Users and hardening").
u monitord - "monitord daemon" /var/lib/monitord
"""

TMPFILES = """\
# monitord's work_dir (state.db, logs, archive) and spool_dir (custom_config.json), as in
# /etc/monitord/monitord.toml; the unit's StateDirectory= creates work_dir as well.
d /var/lib/monitord 0750 monitord monitord -
d /var/spool/monitord 0750 monitord monitord -
"""

POSTINST = f"""\
#!/bin/sh
set -e
if [ "$1" = configure ]; then
    if command -v systemd-sysusers >/dev/null 2>&1; then
        systemd-sysusers monitord.conf
    else
        getent group monitord >/dev/null || groupadd --system monitord
        getent passwd monitord >/dev/null || useradd --system --gid monitord \\
            --home-dir /var/lib/monitord --no-create-home --shell /usr/sbin/nologin monitord
    fi
    # systemd-tmpfiles refuses to run without /proc (a chroot, as image builders install):
    # as in Debian's own snippets that is no failure, and install(1) makes what it did not.
    if command -v systemd-tmpfiles >/dev/null 2>&1; then
        systemd-tmpfiles --create monitord.conf || true
    fi
    for dir in /var/lib/monitord /var/spool/monitord; do
        [ -d "$dir" ] || install -d -m 0750 -o monitord -g monitord "$dir"
    done
    # /etc/monitord holds the SSH key: readable by the monitord group, not by everyone.
    chown root:monitord /etc/monitord
    chmod 0750 /etc/monitord
    python3 -m compileall -q -j 0 /{LIB_DIR} >/dev/null
    if [ -d /run/systemd/system ]; then
        systemctl daemon-reload
        # An upgrade restarts a running monitord: the next one adopts the running areas.
        # A first install starts nothing: configure, `monitord check`, then enable it.
        if [ -n "$2" ]; then
            systemctl try-restart monitord.service || true
        fi
    fi
fi
exit 0
"""

PRERM = f"""\
#!/bin/sh
set -e
if [ "$1" = remove ] && [ -d /run/systemd/system ]; then
    systemctl stop monitord.service || true
fi
find /{LIB_DIR} -name __pycache__ -type d -prune -exec rm -rf {{}} + 2>/dev/null || true
exit 0
"""

POSTRM = """\
#!/bin/sh
set -e
if [ "$1" = purge ]; then
    # `remove` keeps an administrator's `systemctl enable` (a reinstall finds it as it was);
    # `purge` forgets it: no link is left pointing at a unit that is gone.
    rm -f /etc/systemd/system/*.wants/monitord.service
fi
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload || true
fi
exit 0
"""


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="scripts/deb.py")
    verbs = parser.add_subparsers(dest="verb", required=True)
    verbs.add_parser("lock", help="write requirements.lock from pyproject.toml")
    build_p = verbs.add_parser("build", help="build the .deb from requirements.lock")
    build_p.add_argument("--out", type=Path, default=REPO / "dist")
    args = parser.parse_args(argv)
    if args.verb == "lock":
        LOCK.write_text(lock_text())
        print(f"wrote {LOCK.relative_to(REPO)}")
        return 0
    print(build(args.out))
    return 0


def project() -> dict[str, object]:
    data: dict[str, object] = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return data


def lock_text() -> str:
    """Resolve the runtime dependencies for the target and pin each with its file's hash."""
    requirements = [str(r) for r in project()["dependencies"]]  # type: ignore[attr-defined]
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.json"
        _pip("install", "--dry-run", "--ignore-installed", "--quiet", *TARGET_PIP_ARGS,
             "--target", str(Path(scratch) / "target"), "--report", str(report),
             *requirements)
        resolved = json.loads(report.read_text())["install"]
    lines = [LOCK_HEADER]
    for item in sorted(resolved, key=lambda i: _normal(i["metadata"]["name"])):
        sha256 = item["download_info"]["archive_info"]["hashes"]["sha256"]
        name, version = _normal(item["metadata"]["name"]), item["metadata"]["version"]
        lines.append(f"{name}=={version} \\\n    --hash=sha256:{sha256}\n")
    return "".join(lines)


def _normal(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def build(out: Path) -> Path:
    version = str(project()["version"])
    epoch = int(os.environ.get("SOURCE_DATE_EPOCH") or _git("log", "-1", "--format=%ct"))
    out.mkdir(parents=True, exist_ok=True)
    deb = out / f"{PACKAGE}_{version}_{ARCH}.deb"
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch) / "root"
        lib = root / LIB_DIR
        _pip("install", "--quiet", "--no-compile", "--require-hashes", "--no-deps",
             *TARGET_PIP_ARGS, "--target", str(lib), "-r", str(LOCK))
        shutil.rmtree(lib / "bin", ignore_errors=True)  # console scripts of the dependencies
        for name in _git("ls-files", "--", "monitord", "orchestrator").splitlines():
            _put(root / LIB_DIR / name, (REPO / name).read_bytes())
        _put(root / "usr/bin/monitord", LAUNCHER.encode(), mode=0o755)
        _put(root / UNIT_DIR / "monitord.service",
             (REPO / "systemd/monitord.service").read_bytes())
        _put(root / "usr/lib/sysusers.d/monitord.conf", SYSUSERS.encode())
        _put(root / "usr/lib/tmpfiles.d/monitord.conf", TMPFILES.encode())
        _put(root / "etc/monitord/monitord.toml",
             packaged_config((REPO / "config/monitord.toml").read_text()).encode())
        doc = root / "usr/share/doc/monitord"
        _put(doc / "README.md", (REPO / "README.md").read_bytes())
        for page in sorted((REPO / "docs").glob("*.md")):
            _put(doc / page.name, page.read_bytes())
        for example in ("config/monitord.toml", "config/custom_config.json",
                        "config/sshd_config.monitord", "systemd/monitord-agent.service"):
            _put(doc / "examples" / Path(example).name, (REPO / example).read_bytes())
        control = root / "DEBIAN"
        _put(control / "control", _control(version, root).encode())
        _put(control / "conffiles", b"/etc/monitord/monitord.toml\n")
        for script, text in (("postinst", POSTINST), ("prerm", PRERM), ("postrm", POSTRM)):
            _put(control / script, text.encode(), mode=0o755)
        _put(control / "md5sums", _md5sums(root).encode())
        for path in [root, *root.rglob("*")]:
            if path.is_dir() or path.stat().st_mode & 0o111:
                path.chmod(0o755)
            else:
                path.chmod(0o644)
            os.utime(path, (epoch, epoch), follow_symlinks=False)
        subprocess.run(["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", str(root),
                        str(deb)], check=True, stdout=subprocess.DEVNULL,
                       env={**os.environ, "SOURCE_DATE_EPOCH": str(epoch)})
    return deb


def packaged_config(text: str) -> str:
    """config/monitord.toml with its [remote] section's lines behind `#~ ` (uncommented by
    `sed -i 's/^#~ //' /etc/monitord/monitord.toml`, docs/install.md)."""
    lines, in_remote = [], False
    for line in text.splitlines(keepends=True):
        stripped = line.strip()
        if stripped.startswith("[") and not stripped.startswith("[["):
            in_remote = stripped == "[remote]" or stripped.startswith("[remote.")
        if in_remote and stripped and not stripped.startswith("#"):
            line = REMOTE_OFF + line
        lines.append(line)
    return "".join(lines)


def _control(version: str, root: Path) -> str:
    size_kib = sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) // 1024 + 1
    summary = str(project()["description"])
    return (
        f"Package: {PACKAGE}\n"
        f"Version: {version}\n"
        f"Architecture: {ARCH}\n"
        "Maintainer: monitord maintainers <root@localhost>\n"
        f"Installed-Size: {size_kib}\n"
        f"Depends: {DEPENDS}\n"
        "Section: net\n"
        "Priority: optional\n"
        f"Description: {summary}\n"
        " monitord is the one process on a PBX that owns the SSH tunnel to an offload VPS and\n"
        " decides where every messenger area runs, moving areas between the PBX and the VPS\n"
        " with durable per-area transactions. The VPS side needs only sshd and python3.\n"
    )


def _md5sums(root: Path) -> str:
    rows = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if path.is_file() and rel.parts[0] != "DEBIAN":
            rows.append(f"{hashlib.md5(path.read_bytes()).hexdigest()}  {rel}\n")
    return "".join(rows)


def _put(path: Path, data: bytes, *, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    path.chmod(mode)


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True,
                          text=True).stdout


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

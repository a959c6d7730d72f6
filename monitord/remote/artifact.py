"""The agent artifact: `monitord.pyz`, one file that runs every monitord verb on the VPS.

A zipapp of the VPS side only — `monitord/vps/` and the few portable modules it imports
(`PORTABLE_MODULES`) — with a `__main__` that calls `monitord.vps.entry.main`. All of it
imports nothing but the standard library of Python 3.9+, so a bare system `python3 -I`
runs it (docs/vps-setup.md); `make lint` holds it there (import-linter, ruff's per-file
target version and vermin over exactly these files).

The bytes are deterministic: files in sorted order, fixed timestamps and permissions, no
`__pycache__`, so the same source always gives the same SHA-256 — that hash is the
artifact's version, compared by provisioning and preflight.

`remote_command(remote)` expands `remote.remote_monitord` into the argv prefix that runs a
monitord verb on the VPS. Called by monitord.remote.provisioning,
monitord.remote.preflight, monitord.remote.tunnel.keeper, monitord.surface.wiring and the
sides that start daemons on the VPS (monitord.engine.remote_side, monitord.engine.area_side).
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import monitord
from monitord.base.config import RemoteSection

PYZ_NAME = "monitord.pyz"
# A name provisioning may give a file in remote_bin_dir, matched whole (fullmatch).
NAME_RE = re.compile(r"[A-Za-z0-9_+-][A-Za-z0-9._+-]*")
SHEBANG = b"#!/usr/bin/env python3\n"
# Besides the monitord/vps/ package: what the VPS side imports from the shared rooms.
PORTABLE_MODULES = (
    "monitord/__init__.py",
    "monitord/base/__init__.py",
    "monitord/base/atomic_file.py",
    "monitord/base/bounded_json.py",
    "monitord/base/cgroup_fence.py",
    "monitord/base/group_stop.py",
    "monitord/base/hostport.py",
    "monitord/base/journal_native.py",
    "monitord/base/log_hub.py",
    "monitord/base/log_sink.py",
    "monitord/base/log_tail.py",
    "monitord/base/proc_identity.py",
    "monitord/base/run_as.py",
    "monitord/base/singleton.py",
    "monitord/base/tree_digest.py",
    "orchestrator/__init__.py",
    "orchestrator/block_delta.py",
    "orchestrator/errors.py",
    "orchestrator/names.py",
    "orchestrator/sshd_session.py",
    "orchestrator/text_enum.py",
    "orchestrator/tunnel_lease.py",
)
VPS_PACKAGE = "monitord/vps"
_EPOCH = (1980, 1, 1, 0, 0, 0)  # the earliest time a zip entry can carry
_SKIP_DIRS = {"__pycache__"}
_SKIP_SUFFIXES = (".pyc", ".pyo")
_MAIN = b'''"""Entry point of monitord.pyz: the VPS verbs (monitord.vps.entry)."""

import sys

from monitord.vps.entry import main

sys.exit(main())
'''


@dataclass(frozen=True, slots=True, kw_only=True)
class ArtifactInfo:
    """A built artifact: where it is, its SHA-256 (hex) and its size in bytes."""

    path: Path
    sha256: str
    size: int


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def source_root() -> Path:
    """The directory holding the `monitord` and `orchestrator` packages."""
    return Path(monitord.__file__ or "").parent.parent


def source_files() -> list[tuple[str, Path]]:
    """(name inside the archive, file on disk) for every file that goes in, sorted by name."""
    root = source_root()
    files = [(name, root / name) for name in PORTABLE_MODULES if (root / name).is_file()]
    vps = root / VPS_PACKAGE
    for dirpath, dirnames, filenames in os.walk(vps):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for filename in filenames:
            if filename.endswith(_SKIP_SUFFIXES):
                continue
            path = Path(dirpath) / filename
            files.append((path.relative_to(root).as_posix(), path))
    return sorted(files)


def build_bytes() -> bytes:
    """The artifact's exact bytes: shebang line + a zip archive with fixed metadata."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        _add(archive, "__main__.py", _MAIN)
        for arcname, path in source_files():
            _add(archive, arcname, path.read_bytes())
    return SHEBANG + buffer.getvalue()


def build(dest: Path) -> ArtifactInfo:
    """Write `dest/monitord.pyz` atomically (temp file, fsync, rename) and describe it."""
    dest.mkdir(parents=True, exist_ok=True)
    data = build_bytes()
    target = dest / PYZ_NAME
    fd, tmp_name = tempfile.mkstemp(dir=dest, prefix=f".{PYZ_NAME}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp_name, 0o755)
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return ArtifactInfo(path=target, sha256=hashlib.sha256(data).hexdigest(), size=len(data))


def remote_command(remote: RemoteSection) -> tuple[str, ...]:
    """`remote.remote_monitord` with {remote_python} and {remote_bin_dir} filled in; any
    other brace is left as written (an argument may hold one)."""
    return tuple(
        part.replace("{remote_python}", remote.remote_python)
        .replace("{remote_bin_dir}", remote.remote_bin_dir)
        for part in remote.remote_monitord
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class LocalArtifact:
    """A local file to place in remote_bin_dir under `name`, with its expected hash and mode."""

    path: Path
    name: str
    sha256: str
    size: int
    mode: int = 0o755

    @classmethod
    def from_path(cls, path: Path, *, name: str | None = None, mode: int = 0o755) -> LocalArtifact:
        """Describe a local file (hashing it now); the remote name defaults to its file name."""
        remote_name = name or path.name
        if not NAME_RE.fullmatch(remote_name):
            raise ValueError(f"artifact name {remote_name!r} must be a plain file name")
        return cls(
            path=path,
            name=remote_name,
            sha256=sha256_file(path),
            size=path.stat().st_size,
            mode=mode,
        )

    @classmethod
    def from_info(cls, info: ArtifactInfo) -> LocalArtifact:
        """The built agent artifact (monitord.pyz), mode 0644: it runs through the python."""
        return cls(path=info.path, name=info.path.name, sha256=info.sha256, size=info.size,
                   mode=0o644)


def local_artifacts(remote: RemoteSection, *, agent: ArtifactInfo) -> list[LocalArtifact]:
    """The agent artifact plus every configured service binary (`remote.artifacts`)."""
    return [LocalArtifact.from_info(agent)] + [
        LocalArtifact.from_path(path) for path in remote.artifacts
    ]


def _add(archive: zipfile.ZipFile, arcname: str, data: bytes) -> None:
    info = zipfile.ZipInfo(arcname, date_time=_EPOCH)
    info.compress_type = zipfile.ZIP_DEFLATED
    info.create_system = 3  # unix, so the mode below is meaningful
    info.external_attr = (0o100644 & 0xFFFF) << 16
    archive.writestr(info, data, compresslevel=9)

"""File changes that a stat comparison could miss, for the digest cache's tests."""

from __future__ import annotations

import os
import time
from pathlib import Path

from monitord.base import tree_digest


def aged(*paths: Path) -> None:
    """Wait until the filesystem clock has moved past each path's last change: only then
    may a hash of it be cached (monitord.base.tree_digest's racy rule)."""
    for path in paths:
        changed = max(path.stat().st_mtime_ns, path.stat().st_ctime_ns)
        while tree_digest.epoch_ns(path.parent) <= changed:
            time.sleep(0.002)


def stealthy_rewrite(path: Path, data: bytes) -> None:
    """Rewrite path with data of the same size and put its mtime back: only ctime tells."""
    before = path.stat()
    assert len(data) == before.st_size
    path.write_bytes(data)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_mtime_ns == before.st_mtime_ns

"""Whether an area's data fits where it is going: the space arithmetic of a move.

A copy writes the area's files into a staging dir beside the destination data dir and
renames it into place (monitord/remote/copy), so the file system that will hold the data
dir must have room for the whole area once more — in bytes and in inodes — while the
copy runs. Preflight measures that file system (on the VPS for a move out, on the PBX for
a move home or a copy back) and asks `shortage()` before anything stops.

- `footprint(sizes, dirs=)`: what a tree takes once written: every file rounded up to a
  4 KiB block, plus a block per directory (the copy writes files whole; a sparse or tiny
  file still takes its blocks), and one inode per file and directory;
- `needed(usage)`: that footprint plus the margin, max(MARGIN_MIN_BYTES, MARGIN_FRACTION of
  it) in bytes and max(MARGIN_MIN_INODES, MARGIN_FRACTION) in inodes: the daemons of other
  areas keep writing there, and a file system that is left with nothing free stops them;
- `shortage(side=, path=, usage=, free=)`: None when the area fits, else a `Shortage`
  naming the side, the path, and the bytes (or inodes) needed and free — the detail of
  PREFLIGHT_DISK_SPACE (and, during a copy, of REMOTE_DISK_FULL / LOCAL_DISK_FULL).

A file system that reports no inode count (btrfs, some network file systems: `total_inodes`
0) is judged on bytes alone. docs/design.md, "Free space for a move", explains the margin.
Pure: called by monitord/remote/preflight.py, monitord/engine/local_side.py,
monitord/engine/phase_actions.py and monitord/remote/copy/transfer.py.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

BLOCK_BYTES = 4096
MIB = 1024 * 1024
MARGIN_MIN_BYTES = 64 * MIB
MARGIN_MIN_INODES = 1024
MARGIN_FRACTION = 0.05


@dataclass(frozen=True, slots=True)
class Usage:
    """What an area's tree takes (or will take) on a file system: `bytes` and `inodes` as
    written (blocks rounded up); `content_bytes`, what its files hold (what a copy sends),
    when it is known."""

    bytes: int
    inodes: int = 0
    content_bytes: int | None = None

    @property
    def size(self) -> int:
        """The area's size as a copy is judged by: its content where known, else its
        footprint (an upper bound)."""
        return self.bytes if self.content_bytes is None else self.content_bytes


@dataclass(frozen=True, slots=True)
class Free:
    """What a file system has free for an unprivileged writer (statvfs f_bavail, f_favail)."""

    bytes: int
    inodes: int | None = None  # None: not reported
    total_inodes: int | None = None  # 0: the file system does not count inodes


@dataclass(frozen=True, slots=True)
class Shortage:
    """The area does not fit: on `side`, under `path`, `needed` of `unit` but `free` left."""

    side: str  # "VPS" or "PBX"
    path: str
    unit: str  # "bytes" or "inodes"
    needed: int
    free: int
    with_margin: bool = True  # False: `needed` is what was still to be written, no margin

    @property
    def missing(self) -> int:
        return self.needed - self.free

    def detail(self) -> str:
        """The sentence the status and the CLI show: both numbers, and what is missing."""
        if self.unit == "bytes":
            return (f"{self.side}: {self.path} has {self.free} bytes free ({mib_text(self.free)})"
                    f", {self._needs} {self.needed} bytes ({mib_text(self.needed)}{self._margin})"
                    f": {mib_text(self.missing)} missing")
        return (f"{self.side}: {self.path} has {self.free} inodes free, {self._needs}"
                f" {self.needed}{self._margin}: {self.missing} missing")

    @property
    def _needs(self) -> str:
        return "the area needs" if self.with_margin else "the copy still needed"

    @property
    def _margin(self) -> str:
        return ", margin included" if self.with_margin else ""

    def facts(self) -> dict[str, object]:
        """The numbers as fields of the service's last error (status API)."""
        return {"side": self.side, "path": self.path, "unit": self.unit,
                f"needed_{self.unit}": self.needed, f"free_{self.unit}": self.free}


def mib_text(value: int) -> str:
    """`16.0 MiB`: how a preflight's detail shows an amount of bytes."""
    return f"{value / MIB:.1f} MiB"


def rounded(size: int) -> int:
    """A file of `size` bytes as blocks on disk (an empty file takes none)."""
    return -(-max(size, 0) // BLOCK_BYTES) * BLOCK_BYTES


def footprint(sizes: Iterable[int], *, dirs: int = 0) -> Usage:
    """What files of `sizes` and `dirs` directories take once written."""
    total = content = files = 0
    for size in sizes:
        total += rounded(size)
        content += size
        files += 1
    return Usage(bytes=total + dirs * BLOCK_BYTES, inodes=files + dirs, content_bytes=content)


def margin(amount: int, *, floor: int) -> int:
    return max(floor, int(amount * MARGIN_FRACTION))


def needed(usage: Usage) -> Usage:
    """`usage` plus the margin (module doc)."""
    return Usage(bytes=usage.bytes + margin(usage.bytes, floor=MARGIN_MIN_BYTES),
                 inodes=usage.inodes + margin(usage.inodes, floor=MARGIN_MIN_INODES))


def shortage(*, side: str, path: str, usage: Usage, free: Free) -> Shortage | None:
    """None when `usage` (margin added here) fits in `free`; else what is short, bytes
    first."""
    want = needed(usage)
    if free.bytes < want.bytes:
        return Shortage(side=side, path=path, unit="bytes", needed=want.bytes, free=free.bytes)
    counts_inodes = free.inodes is not None and free.total_inodes != 0
    if counts_inodes and free.inodes is not None and free.inodes < want.inodes:
        return Shortage(side=side, path=path, unit="inodes", needed=want.inodes,
                        free=free.inodes)
    return None


def ran_out(*, side: str, path: str, remaining: Usage, free: Free) -> Shortage | None:
    """After a write failed mid-copy with no cause given (SFTP's bare "Failure"): the file
    system is what ran out when what was still to be written (`remaining`, no margin) does
    not fit in what is free now. None: the cause was something else."""
    if free.bytes < remaining.bytes:
        return Shortage(side=side, path=path, unit="bytes", needed=remaining.bytes,
                        free=free.bytes, with_margin=False)
    if free.inodes is not None and free.total_inodes != 0 and free.inodes < remaining.inodes:
        return Shortage(side=side, path=path, unit="inodes", needed=remaining.inodes,
                        free=free.inodes, with_margin=False)
    return None

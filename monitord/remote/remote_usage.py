"""What an area's data dir on the VPS takes, asked with one `find` over the SSH session.

The answer is judged like any other from the VPS (docs/design.md, "Bad input stays in its
box"): three decimal numbers of at most 20 digits, or nothing is known.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from monitord.remote import remote_exec
from orchestrator import disk_space

if TYPE_CHECKING:
    import asyncssh

# "$1" = the data dir: its footprint as orchestrator/disk_space.footprint counts it (files
# rounded up to 4 KiB blocks, a block per directory), its inode count and its files' bytes.
_SCRIPT = r"""
if [ -d "$1" ]; then
  find "$1" -xdev \( -type f -printf 'f %s\n' \) -o \( -type d -printf 'd 0\n' \) |
    awk '{ n++; if ($1 == "f") { b += int(($2 + 4095) / 4096) * 4096; c += $2 } else b += 4096 }
         END { printf "%.0f %.0f %.0f\n", b, n, c }'
else
  echo "0 0 0"
fi
"""


async def area_usage(
    conn: asyncssh.SSHClientConnection, data_dir: str, *, timeout_s: float
) -> disk_space.Usage | None:
    """The data dir's usage, or None when the VPS's answer is not three plain numbers."""
    result = await remote_exec.run_script(conn, _SCRIPT, args=[data_dir], timeout_s=timeout_s)
    fields = result.text.split()
    if result.exit_status != 0 or len(fields) != 3 or not all(
            f.isascii() and f.isdigit() and len(f) <= 20 for f in fields):
        return None
    footprint, inodes, content = (int(f) for f in fields)
    return disk_space.Usage(bytes=footprint, inodes=inodes, content_bytes=content)

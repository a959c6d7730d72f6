"""`make lint`: what runs on the VPS needs nothing newer than Python 3.9.

vermin reads the files that go into monitord.pyz (monitord/vps/ and
monitord.remote.artifact.PORTABLE_MODULES) and knows, for every standard-library module,
function and argument, the release that brought it; any use newer than 3.9 fails the lint.
(ruff's per-file target version catches newer syntax; import-linter keeps third-party
packages out.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from monitord.remote import artifact

MIN_PYTHON = "3.9"


def main() -> int:
    root = artifact.source_root()
    files = [str(root / name) for name, _ in artifact.source_files()]
    result = subprocess.run(
        [str(Path(sys.executable).with_name("vermin")), f"--target={MIN_PYTHON}-", "--violations",
         "--no-tips", "--eval-annotations", *files],
        capture_output=True, text=True,
    )
    if result.returncode != 0:
        sys.stdout.write(result.stdout + result.stderr)
        print(f"check_vps_portable: the VPS side must run on Python {MIN_PYTHON}", file=sys.stderr)
        return 1
    print(f"check_vps_portable: {len(files)} files run on Python >= {MIN_PYTHON}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The test stack's last sweep kills what names its directory, never its own ancestors.

`timeout 300 monitord demo --dir D` names D in timeout's command line; the sweep once
SIGKILLed timeout (and a CI shell running the demo) at the demo's very end.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SWEEP = "from pathlib import Path; from monitord.testing.stack import kill_processes_under; " \
        "print(kill_processes_under(Path({root!r})))"


def test_the_sweep_spares_the_shell_that_names_the_directory_but_kills_a_stray(
        tmp_path: Path) -> None:
    root = tmp_path / "stack"
    root.mkdir()
    stray = subprocess.Popen(["sleep", "60"], env={"STACK_ROOT": str(root)})
    try:
        # The shell's own command line names `root`, as `timeout ... --dir root` does.
        shell = subprocess.run(
            ["sh", "-c", f'{sys.executable} -c "$1"; echo shell-survived # {root}', "sh",
             SWEEP.format(root=str(root))],
            capture_output=True, text=True, timeout=60,
        )
        assert shell.returncode == 0, shell.stderr
        assert shell.stdout.split() == ["1", "shell-survived"]
        assert stray.wait(timeout=10) == -9
    finally:
        stray.kill()
        stray.wait()

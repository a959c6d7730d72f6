"""The fake daemon started the ways a PBX's messenger daemons often are: through a script
with a `#!` line, found through PATH, or through a wrapper that execs it. The kernel's argv of
such a process is not its configured command (`[interpreter, script, args…]`, or the final
program's argv after the exec), which is what adoption after a restart must see through.

`write(kind, directory)` writes the script and returns the command head to put before the
fake daemon's arguments, with the environment the command needs."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

# A Python script: the fake daemon's main, run by whatever interpreter the `#!` line names.
_PYTHON_BODY = (
    "import sys\nfrom monitord.testing import fake_daemon\nsys.exit(fake_daemon.main())\n"
)
_MODULE = f'{sys.executable} -m monitord.testing.fake_daemon "$@"'
# As setproctitle does: the memory that held the environment is overwritten (the process
# keeps its own copy), so /proc/PID/environ no longer shows the spawner's markers.
_REWRITE_ENVIRON = (
    "fields = open('/proc/self/stat').read().rsplit(')', 1)[1].split()\n"
    "env_start, env_end = int(fields[47]), int(fields[48])\n"
    "with open('/proc/self/mem', 'r+b', buffering=0) as mem:\n"
    "    mem.seek(env_start)\n"
    "    mem.write(bytes(env_end - env_start))\n"
)

KINDS = (
    "python_shebang",  # #!/path/to/python
    "sh_shebang",  # #!/bin/sh, which runs the daemon as its child
    "env_shebang",  # #!/usr/bin/env python3, python3 found through PATH
    "exec_wrapper",  # #!/bin/sh that execs the daemon: its argv replaces the wrapper's
    "path_lookup",  # a #! script named without a directory, found through PATH
    "environ_rewritten",  # a #! python script that overwrites its environment's memory
)


@dataclass(frozen=True)
class ScriptDaemon:
    """The command head that starts the fake daemon through a script, and its environment."""

    head: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)


def write(kind: str, directory: Path, *, name: str = "tg-daemon") -> ScriptDaemon:
    """Write the `kind` script (one of KINDS) into `directory` and say how to run it."""
    directory.mkdir(parents=True, exist_ok=True)
    python_dir = str(Path(sys.executable).parent)  # its python3 imports monitord
    path = directory / name
    head: tuple[str, ...] = (str(path),)
    env: dict[str, str] = {}
    if kind == "python_shebang":
        text = f"#!{sys.executable}\n{_PYTHON_BODY}"
    elif kind == "sh_shebang":
        text = f"#!/bin/sh\n{_MODULE}\n"
    elif kind == "env_shebang":
        text = f"#!/usr/bin/env python3\n{_PYTHON_BODY}"
        env = {"PATH": f"{python_dir}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}"}
    elif kind == "exec_wrapper":
        text = f"#!/bin/sh\numask 077\nexec {_MODULE}\n"
    elif kind == "path_lookup":
        text = f"#!{sys.executable}\n{_PYTHON_BODY}"
        head = (name,)
        env = {"PATH": f"{directory}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}"}
    elif kind == "environ_rewritten":
        text = f"#!{sys.executable}\n{_REWRITE_ENVIRON}{_PYTHON_BODY}"
    else:
        raise ValueError(f"unknown kind of script daemon: {kind}")
    path.write_text(text)
    path.chmod(0o755)
    return ScriptDaemon(head=head, env=env)

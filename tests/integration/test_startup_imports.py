"""What `monitord run` loads before it is ready: not the SSH side (asyncssh and the modules
built on it, monitord/remote/ssh_side.py), not rich and not tarfile, with a `[remote]` section and
areas configured. The tunnel keeper loads the SSH side once running, and still attempts
its connection. Checked in a fresh interpreter: the daemon of `monitord run`, with a
notifier that looks at `sys.modules` at the moment it is told READY=1 (right after
`/readyz` turns 200, docs/lifecycle.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from monitord.remote import ssh_side
from monitord.testing.ports import free_port
from tests.support.daemon_process import write_config

# tarfile: only a diagnostic bundle needs it (monitord.surface.bundle), at ~19 ms an import.
WATCHED = ("rich", "tarfile", *ssh_side.MODULES)

_SCRIPT = """
import asyncio, json, sys, time
from pathlib import Path

from monitord.base import config as config_module, logs
from monitord.surface.daemon import Daemon
from monitord.surface.sdnotify import Notifier

WATCHED = json.loads(sys.argv[2])


def loaded():
    return [name for name in WATCHED if name in sys.modules]


class Watching(Notifier):
    def __init__(self):
        super().__init__(None)
        self.at_ready = None

    def ready(self, status=""):
        self.at_ready = loaded()
        return super().ready(status)


async def main():
    logs.configure("json")
    notifier = Watching()
    daemon = Daemon(config_module.load(Path(sys.argv[1])), notifier=notifier)
    serving = asyncio.create_task(daemon.serve())
    deadline = time.monotonic() + 60
    attempts = 0
    while time.monotonic() < deadline and not serving.done():
        started = daemon._started
        if started:
            attempts = started[0].link.keeper.status().attempts
            if attempts >= 1:
                break
        await asyncio.sleep(0.02)  # poll interval of a deadline loop
    after = loaded()
    daemon.request_stop("test")
    code = await serving
    print(json.dumps({"at_ready": notifier.at_ready, "attempts": attempts,
                      "after_attempt": after, "exit": code}))


asyncio.run(main())
"""


def _remote_toml(root: Path) -> str:
    key = root / "id_ed25519"
    key.write_text("")  # never read: nothing answers on the VPS port
    key.chmod(0o600)
    known_hosts = root / "known_hosts"
    known_hosts.write_text("")
    return (
        "[remote]\n"
        'host = "127.0.0.1"\n'
        f"port = {free_port()}\n"  # nothing listens: every connection is refused
        'user = "offload"\n'
        f'key_file = "{key}"\n'
        f'known_hosts = "{known_hosts}"\n'
        f'remote_bin_dir = "{root / "vps"}"\n'
        "connect_timeout_s = 2.0\n"
    )


class TestWhatReadinessLoads:
    """`monitord run` is ready before the SSH side is loaded; the keeper loads it after."""

    def test_no_ssh_module_no_rich_no_tarfile_at_readiness_then_the_keeper_loads_and_attempts(
        self, tmp_path: Path
    ) -> None:
        root = tmp_path / "pbx"
        root.mkdir()
        config = write_config(root, drain_timeout_s=1.0, extra_toml=_remote_toml(root))
        spool = root / "spool"
        spool.mkdir(exist_ok=True)
        areas = [{"uuid": f"00000000-0000-4000-8000-00000000000{i}", "service": "tg",
                  "location": "remote", "generation": 1} for i in range(3)]
        (spool / "custom_config.json").write_text(json.dumps({"custom_daemons": areas}))
        done = subprocess.run(
            [sys.executable, "-c", _SCRIPT, str(config), json.dumps(WATCHED)],
            capture_output=True, text=True, timeout=120, check=False,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        result = json.loads(done.stdout.strip().splitlines()[-1])
        assert result["at_ready"] == [], result
        assert result["attempts"] >= 1, result
        assert result["after_attempt"] == list(ssh_side.MODULES), result
        assert result["exit"] == 0, result

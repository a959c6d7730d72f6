"""The PBX root booted with systemd as PID 1 (systemd-nspawn), for the tests that run the
installed package under a real systemd (test_unit_under_systemd.py,
test_install_to_the_first_move.py).

`booted_pbx(tmp, stage=..., private_network=...)` boots a fresh copy (an overlay in `tmp`) of
the cached PBX root (debian_root.pbx_root: Debian 12 with systemd 252) with `systemd-nspawn
-b`, cgroup v2 only as Debian 12 boots, in a mount namespace of its own (the overlay and
nspawn's runtime files vanish with it): `stage` puts files into the copy first. With
`private_network` the container has only `lo`; without, it shares this machine's network
namespace (it reaches a namespace VPS over its veth). `Container.sh(script)` runs `sh -ec
script` inside, with `nsenter` into the container's init. Powered off (SIGTERM to nspawn),
killed if that takes too long, at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.faults import debian_root

CONFIG = "/etc/monitord/monitord.toml"

# A daemon for the containers: any service command the tests configure.
FAKE_MSGD = """#!/usr/bin/python3
# A stand-in messenger daemon: a line on stdout now and then (through the log hub), exit 0
# on SIGTERM.
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
print("fake-msgd started", sys.argv[1:], flush=True)
while True:
    time.sleep(2)
    print("fake-msgd alive", flush=True)
"""

BOOT_TIMEOUT_S = 60.0
COMMAND_TIMEOUT_S = 60.0

# The unit's processes as {pid: argv}, read inside the container.
UNIT_PROCESSES = """python3 - <<'EOF'
import json
procs = {}
with open("/sys/fs/cgroup/system.slice/monitord.service/cgroup.procs") as f:
    for pid in f.read().split():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as c:
                procs[pid] = [a.decode() for a in c.read().split(b"\\0") if a]
        except FileNotFoundError:
            pass
print(json.dumps(procs))
EOF"""


class Container:
    """A booted systemd-nspawn container; `sh(script)` runs `sh -ec script` inside it."""

    def __init__(self, nspawn: subprocess.Popen[bytes], console: Path) -> None:
        self.nspawn = nspawn
        self.console = console
        self.leader = 0

    def console_tail(self) -> str:
        return self.console.read_text(errors="replace")[-3000:]

    def find_leader(self) -> int:
        """The container's PID 1 as this machine sees it (nspawn's child)."""
        children = Path(f"/proc/{self.nspawn.pid}/task/{self.nspawn.pid}/children")
        with contextlib.suppress(FileNotFoundError):
            pids = children.read_text().split()
            if pids:
                return int(pids[0])
        return 0

    def sh(self, script: str, *, check: bool = True,
           timeout_s: float = COMMAND_TIMEOUT_S) -> str:
        done = subprocess.run(["nsenter", "-t", str(self.leader), "-a", "sh", "-ec", script],
                              capture_output=True, text=True, timeout=timeout_s,
                              check=False)
        if check:
            assert done.returncode == 0, (
                f"{script}\n-> {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
        return done.stdout

    def show(self, *props: str) -> dict[str, str]:
        out = self.sh("systemctl show " + " ".join(f"-p {p}" for p in props)
                      + " monitord.service")
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def areas(self) -> dict[str, dict[str, Any]]:
        rows = json.loads(self.sh(f"monitord areas --json -c {CONFIG}"))
        return {row["uuid"]: row for row in rows}

    def unit_processes(self) -> dict[int, list[str]]:
        return {int(pid): argv for pid, argv in json.loads(self.sh(UNIT_PROCESSES)).items()}

    def journal(self) -> list[str]:
        """The unit's journal, one message a line: systemd's lines about it and monitord's."""
        return self.sh("journalctl -q -u monitord.service -o cat --no-pager").splitlines()


@contextlib.contextmanager
def booted_pbx(tmp: Path, *, stage: dict[str, bytes],
               private_network: bool = True) -> Iterator[Container]:
    """A fresh copy of the PBX root with `stage` ({absolute path: content}) in it, booted."""
    lower = debian_root.pbx_root()
    for name in ("upper", "work", "merged"):
        (tmp / name).mkdir(parents=True)
    for path, content in stage.items():
        staged = tmp / "upper" / path.lstrip("/")
        staged.parent.mkdir(parents=True, exist_ok=True)
        staged.write_bytes(content)
    merged = tmp / "merged"
    machine = f"monitord-test-{uuid.uuid4().hex[:8]}"
    # A cgroup v2 group of its own, below this process's: nspawn (--keep-unit, as where no
    # systemd runs this machine) puts the container in "payload" under the group it was
    # started in, and two containers sharing one would manage each other's units' groups.
    group = own_cgroup2() / machine
    group.mkdir()
    outer = (
        f"echo $$ > {group}/cgroup.procs && "
        f"mount -t overlay overlay -o lowerdir={lower},upperdir={tmp / 'upper'},"
        f"workdir={tmp / 'work'} {merged} && "
        "mkdir -p /run/systemd/nspawn && mount -t tmpfs tmpfs /run/systemd/nspawn && "
        f"exec systemd-nspawn --boot --directory={merged} --machine={machine} "
        "--register=no --keep-unit" + (" --private-network" if private_network else "")
    )
    console = tmp / "console.log"
    with console.open("wb") as out:
        nspawn = subprocess.Popen(
            ["unshare", "--mount", "sh", "-c", outer], stdin=subprocess.DEVNULL,
            stdout=out, stderr=subprocess.STDOUT,
            # cgroup v2 only inside, as Debian 12 boots, also on a host that mounts v1 too
            env={**os.environ, "SYSTEMD_NSPAWN_UNIFIED_HIERARCHY": "1"})
    box = Container(nspawn, console)
    try:
        box.leader = wait_for_boot(box)
        yield box
    finally:
        nspawn.send_signal(signal.SIGTERM)  # nspawn: an orderly poweroff of the container
        try:
            nspawn.wait(timeout=30)
        except subprocess.TimeoutExpired:
            nspawn.kill()
            nspawn.wait(timeout=10)
        remove_cgroup(group)


def own_cgroup2() -> Path:
    """This process's group in the cgroup v2 hierarchy, as a directory."""
    mount = next(line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()
                 if line.split(" - ")[1].split()[0] == "cgroup2")
    path = next(line[3:] for line in Path("/proc/self/cgroup").read_text().splitlines()
                if line.startswith("0::"))
    return Path(mount) / path.lstrip("/")


def remove_cgroup(group: Path) -> None:
    """Remove `group` and the groups below it (empty once the container is gone)."""
    for sub in sorted((d for d in group.rglob("*") if d.is_dir()),
                      key=lambda d: len(d.parts), reverse=True):
        with contextlib.suppress(OSError):
            sub.rmdir()
    group.rmdir()


def wait_for_boot(box: Container) -> int:
    deadline = time.monotonic() + BOOT_TIMEOUT_S
    while True:
        assert box.nspawn.poll() is None, f"systemd-nspawn exited:\n{box.console_tail()}"
        leader = box.find_leader()
        if leader and Path(f"/proc/{leader}/comm").read_text().strip() == "systemd":
            done = subprocess.run(
                ["nsenter", "-t", str(leader), "-a", "systemctl", "is-system-running", "--wait"],
                capture_output=True, text=True, timeout=BOOT_TIMEOUT_S, check=False)
            state = done.stdout.strip()
            if state in ("running", "degraded"):
                return leader
        assert time.monotonic() < deadline, f"no boot:\n{box.console_tail()}"
        time.sleep(0.3)

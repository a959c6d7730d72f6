"""monitord.service under a real systemd as PID 1: the daemons outlive a restart inside the
unit and are adopted, a daemon killed with SIGKILL is restarted while the unit stays up.

The package (conftest's `deb`) is installed into a fresh copy (an overlay) of the cached PBX
root (tests/faults/debian_root.pbx_root: Debian 12 with systemd 252), which is booted with
`systemd-nspawn -b` (a private network: only `lo`; cgroup v2 only, as Debian 12 boots). Two
areas of one service run locally through a stand-in messenger daemon (a python3 script named
`fake-msgd`, so `comm` tells it apart from monitord's own processes). Commands run inside with
`nsenter` into the container's init.

What is proven here, and what docs/operations.md ("systemd and the daemons") says:
- `systemctl restart monitord` gives a new main process; each area keeps its daemon (same
  pid), the new monitord adopts it (`survivor_adopted`) and no second copy starts;
- systemd's "Found left-over process" lines at that start name exactly the adopted daemons
  and the side's log hub (nothing else lives in the unit's control group);
- a daemon killed with SIGKILL (what the OOM killer sends), adopted or a child of the running
  monitord, is restarted by the supervisor; the unit stays active with the same main process;
- systemd itself reports `OOMPolicy=continue` and `KillMode=process` for the installed unit.
Not proven here: systemd's own reaction to a kernel OOM kill (it learns of one from the
cgroup v2 memory controller's `memory.events`, which a container gets only where the host
gives cgroup v2 that controller).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.faults import debian_root

pytestmark = pytest.mark.xdist_group("deb-package")

CONFIG = "/etc/monitord/monitord.toml"
STAGE = "/var/tmp/monitord-test"  # in the container (its /tmp is a fresh tmpfs)
BOOT_TIMEOUT_S = 60.0
COMMAND_TIMEOUT_S = 60.0
SETTLE_TIMEOUT_S = 45.0
AREAS = {"5b1d6c2e-8f0a-4c1e-9a57-3d2f1b0c9e11": "one",
         "0f6a9d34-2b7c-4e58-a1d0-6c3e8b5f2a90": "two"}

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

MONITORD_TOML = """[monitord]
work_dir = "/var/lib/monitord"
spool_dir = "/var/spool/monitord"
owner_label = "pbx-under-systemd"

[http]
listen = "127.0.0.1:8224"

[services.tg]
command = ["/usr/local/bin/fake-msgd", "--area", "{area}", "--data", "{data_dir}"]
local_data_dir = "/var/lib/cti/tg/{area}"
remote_data_dir = "/opt/offload/data/tg/{area}"
min_uptime_s = 1
"""

CUSTOM_CONFIG = json.dumps({"custom_daemons": [
    {"uuid": area, "service": "tg", "location": "local", "generation": 1, "title": title}
    for area, title in AREAS.items()]}, indent=1) + "\n"

SETUP = f"""
dpkg -i {STAGE}/monitord.deb >{STAGE}/dpkg.log
install -m 0755 {STAGE}/fake-msgd /usr/local/bin/fake-msgd
install -m 0640 -o root -g monitord {STAGE}/monitord.toml {CONFIG}
install -d -o monitord -g monitord -m 0750 /var/lib/cti
install -m 0640 -o monitord -g monitord {STAGE}/custom_config.json \\
    /var/spool/monitord/custom_config.json
runuser -u monitord -- monitord check -c {CONFIG}
systemctl start monitord.service
"""

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

    def sh(self, script: str, *, check: bool = True) -> str:
        done = subprocess.run(["nsenter", "-t", str(self.leader), "-a", "sh", "-ec", script],
                              capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S,
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


def wait_for(what: str, probe: Callable[[], Any], container: Container,
             timeout_s: float = SETTLE_TIMEOUT_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        got = probe()
        if got:
            return got
        if time.monotonic() > deadline:
            status = container.sh("systemctl status --no-pager monitord.service; "
                                  "journalctl -q -u monitord.service -o cat --no-pager"
                                  " | tail -n 30", check=False)
            pytest.fail(f"timed out waiting for {what}\n{status}")
        time.sleep(0.3)


@pytest.fixture
def container(tmp_path: Path, deb: Path) -> Iterator[Container]:
    """A fresh PBX root (an overlay on the cached one) with the package and this test's files
    staged, booted with systemd-nspawn in a mount namespace of its own (the overlay and
    nspawn's runtime files vanish with it). Powered off and killed at the end."""
    for tool in ("systemd-nspawn", "nsenter", "unshare"):
        if shutil.which(tool) is None:  # .ci/run installs systemd-container
            pytest.fail(f"{tool} is missing")
    if not debian_root.can_build_pbx_root():  # .ci/run installs mmdebstrap
        pytest.skip("needs mmdebstrap or a built PBX root")
    lower = debian_root.pbx_root()
    for name in ("upper", "work", "merged"):
        (tmp_path / name).mkdir()
    stage = tmp_path / "upper" / STAGE.lstrip("/")
    stage.mkdir(parents=True)
    shutil.copy(deb, stage / "monitord.deb")
    (stage / "fake-msgd").write_text(FAKE_MSGD)
    (stage / "monitord.toml").write_text(MONITORD_TOML)
    (stage / "custom_config.json").write_text(CUSTOM_CONFIG)
    merged = tmp_path / "merged"
    machine = f"monitord-test-{uuid.uuid4().hex[:8]}"
    # A cgroup v2 group of its own, below this process's: nspawn (--keep-unit, as where no
    # systemd runs this machine) puts the container in "payload" under the group it was
    # started in, and two containers sharing one would manage each other's units' groups.
    group = own_cgroup2() / machine
    group.mkdir()
    outer = (
        f"echo $$ > {group}/cgroup.procs && "
        f"mount -t overlay overlay -o lowerdir={lower},upperdir={tmp_path / 'upper'},"
        f"workdir={tmp_path / 'work'} {merged} && "
        "mkdir -p /run/systemd/nspawn && mount -t tmpfs tmpfs /run/systemd/nspawn && "
        f"exec systemd-nspawn --boot --directory={merged} --machine={machine} "
        "--register=no --keep-unit --private-network"
    )
    console = tmp_path / "console.log"
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


def daemons_by_area(processes: dict[int, list[str]]) -> dict[str, list[int]]:
    """{area: [pid, …]} of the fake-msgd processes in the unit."""
    found: dict[str, list[int]] = {}
    for pid, argv in processes.items():
        if len(argv) > 3 and argv[1].endswith("/fake-msgd"):
            found.setdefault(argv[argv.index("--area") + 1], []).append(pid)
    return found


def all_up(box: Container) -> dict[str, dict[str, Any]] | None:
    areas = box.areas()
    if set(areas) == set(AREAS) and all(a["health"] == "up" and a["pid"] for a in areas.values()):
        return areas
    return None


def test_restart_adopts_the_daemons_and_a_killed_daemon_is_restarted(
        container: Container) -> None:
    box = container
    box.sh(SETUP)
    before = wait_for("both areas up", lambda: all_up(box), box)
    first = box.show("MainPID", "ActiveState")
    assert first["ActiveState"] == "active", first
    processes = box.unit_processes()
    daemons = daemons_by_area(processes)
    assert daemons == {area: [row["pid"]] for area, row in before.items()}, processes
    hubs = {pid for pid, argv in processes.items() if "log-hub" in argv}
    assert len(hubs) == 1, processes  # one for every area of the side

    # (1) a restart of the unit: a new monitord, the same daemons, adopted, no second copy
    journal_at = len(box.journal())
    box.sh("systemctl restart monitord.service")
    second = box.show("MainPID", "ActiveState", "NRestarts")
    assert second["ActiveState"] == "active", second
    assert second["MainPID"] != first["MainPID"], (first, second)
    after = wait_for("both areas up after the restart", lambda: all_up(box), box)
    assert {a: r["pid"] for a, r in after.items()} == {a: r["pid"] for a, r in before.items()}
    assert all(r["restarts"] == 0 for r in after.values()), after
    processes = box.unit_processes()
    assert daemons_by_area(processes) == daemons, processes  # no second copy
    assert int(second["MainPID"]) in processes
    assert int(first["MainPID"]) not in processes
    restart_log = box.journal()[journal_at:]
    adopted = {json.loads(line)["area"] for line in restart_log
               if line.startswith("{") and json.loads(line).get("event") == "survivor_adopted"}
    assert adopted == set(AREAS), restart_log
    # systemd names each process it found in the group, at the stop (info) and at the start
    # (two warnings each): the adopted daemons and the log hub, nothing else
    # (docs/operations.md, "systemd and the daemons")
    survivors = {pid for pids in daemons.values() for pid in pids} | hubs
    at_stop = [int(m.group(1)) for line in restart_log
               if (m := re.search(r"Unit process (\d+) .* remains running after unit stopped",
                                  line))]
    at_start = [int(m.group(1)) for line in restart_log
                if (m := re.search(r"Found left-over process (\d+) ", line))]
    usually = [line for line in restart_log if line.startswith("This usually indicates")]
    assert sorted(at_stop) == sorted(at_start) == sorted(survivors), "\n".join(restart_log)
    assert len(usually) == len(survivors), "\n".join(restart_log)

    # (2) SIGKILL to an adopted daemon (not monitord's child), then to the one monitord
    # started in its place (its child): each time the supervisor starts a new one, the unit
    # stays active with the same main process and the other area is untouched
    victim, other = list(AREAS)
    for kill in (1, 2):
        old_pid = after[victim]["pid"]
        box.sh(f"kill -KILL {old_pid}")

        def restarted(old_pid: int = old_pid, kill: int = kill) -> dict[str, Any] | None:
            areas = box.areas()
            row = areas[victim]
            if row["health"] == "up" and row["pid"] not in (None, old_pid) \
                    and row["restarts"] == kill:
                return areas
            return None

        after = wait_for(f"{victim} restarted after SIGKILL #{kill}", restarted, box)
        assert after[other]["pid"] == before[other]["pid"], after
        state = box.show("MainPID", "ActiveState", "NRestarts")
        assert state == second, (second, state)
        assert daemons_by_area(box.unit_processes()) == {
            victim: [after[victim]["pid"]], other: [before[other]["pid"]]}

    # (3) what systemd itself applies to the installed unit
    assert box.show("OOMPolicy", "KillMode") == {"OOMPolicy": "continue",
                                                  "KillMode": "process"}

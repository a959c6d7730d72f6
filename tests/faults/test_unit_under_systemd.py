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
- systemd itself reports `OOMPolicy=continue` and `KillMode=process` for the installed unit;
- `monitord check` says the areas are fenced by process group only, and why: the unit's
  `ProtectControlGroups=yes` (a cgroup fence needs it off: test_cgroup_fence_under_systemd.py).
Not proven here: systemd's own reaction to a kernel OOM kill (it learns of one from the
cgroup v2 memory controller's `memory.events`, which a container gets only where the host
gives cgroup v2 that controller).
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.faults import debian_root
from tests.faults.nspawn_pbx import CONFIG, FAKE_MSGD, Container, booted_pbx

pytestmark = pytest.mark.xdist_group("deb-package")

STAGE = "/var/tmp/monitord-test"  # in the container (its /tmp is a fresh tmpfs)
SETTLE_TIMEOUT_S = 45.0
AREAS = {"5b1d6c2e-8f0a-4c1e-9a57-3d2f1b0c9e11": "one",
         "0f6a9d34-2b7c-4e58-a1d0-6c3e8b5f2a90": "two"}

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
    """A fresh PBX root with the package and this test's files staged, booted (private
    network: only `lo`)."""
    for tool in ("systemd-nspawn", "nsenter", "unshare"):
        if shutil.which(tool) is None:  # .ci/run installs systemd-container
            pytest.fail(f"{tool} is missing")
    if not debian_root.can_build_pbx_root():  # .ci/run installs mmdebstrap
        pytest.skip("needs mmdebstrap or a built PBX root")
    stage = {f"{STAGE}/monitord.deb": deb.read_bytes(), f"{STAGE}/fake-msgd": FAKE_MSGD.encode(),
             f"{STAGE}/monitord.toml": MONITORD_TOML.encode(),
             f"{STAGE}/custom_config.json": CUSTOM_CONFIG.encode()}
    with booted_pbx(tmp_path, stage=stage) as box:
        yield box


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
    check = box.sh(f"runuser -u monitord -- monitord check -c {CONFIG}")
    assert ("fence: local areas are fenced by process group only: cgroup v2 (/sys/fs/cgroup) is"
            " mounted read-only for monitord (systemd's ProtectControlGroups=yes): a daemon's"
            " child that calls setsid() escapes the fence\n") in check, check

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

"""monitord.service under systemd 252 with its control group delegated (`Delegate=yes`, as
shipped) and writable (`ProtectControlGroups=no` in a drop-in): areas are fenced by cgroup.

The package is installed into a fresh copy of the cached PBX root booted with `systemd-nspawn
-b` (tests/faults/nspawn_pbx.py), with two local areas of a stand-in daemon that leaves a
child behind in a session of its own (setsid(), as a daemon that daemonizes does).

What is proven here, and what docs/operations.md ("systemd and the daemons") says:
- `monitord check` says local areas are fenced by cgroup, in the unit's own control group;
- each daemon and its escaped child run in `monitord.service/areas-…/{area}@1`;
- `systemctl restart monitord` adopts both daemons (their escaped children live on with
  them), and systemd's "left-over process" lines name each process in the unit's groups,
  escaped children included, as they name the daemons without a cgroup of their own;
- an area that leaves custom_config.json is stopped with its escaped child, and its cgroup is
  removed; the other area runs on.
The shipped unit alone (ProtectControlGroups=yes) is test_unit_under_systemd.py's: there
`monitord check` says areas are fenced by process group only, and why.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults import debian_root
from tests.faults.nspawn_pbx import CONFIG, Container, booted_pbx
from tests.faults.test_unit_under_systemd import (
    MONITORD_TOML,
    SETTLE_TIMEOUT_S,
    STAGE,
    wait_for,
)

pytestmark = pytest.mark.xdist_group("deb-package")

AREAS = {"6c2e5b1d-8f0a-4c1e-9a57-3d2f1b0c9e21": "one",
         "2b0f6a9d-34c7-4e58-a1d0-6c3e8b5f2a91": "two"}
DROP_IN = "/etc/systemd/system/monitord.service.d/cgroup-fence.conf"
UNIT_GROUP = "/sys/fs/cgroup/system.slice/monitord.service"

# The stand-in daemon, leaving a child in a session of its own: its pid in escaped.pid.
ESCAPING_MSGD = """#!/usr/bin/python3
import os, signal, sys, time
data = sys.argv[sys.argv.index("--data") + 1]
if os.fork() == 0:
    os.setsid()
    with open(os.path.join(data, "escaped.pid"), "w") as f:
        f.write(str(os.getpid()))
    while True:
        signal.pause()
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
print("fake-msgd started", sys.argv[1:], flush=True)
while True:
    time.sleep(2)
"""


def custom_config(areas: dict[str, str]) -> str:
    return json.dumps({"custom_daemons": [
        {"uuid": area, "service": "tg", "location": "local", "generation": 1, "title": title}
        for area, title in areas.items()]}, indent=1) + "\n"


SETUP = f"""
dpkg -i {STAGE}/monitord.deb >{STAGE}/dpkg.log
install -m 0755 {STAGE}/fake-msgd /usr/local/bin/fake-msgd
install -m 0640 -o root -g monitord {STAGE}/monitord.toml {CONFIG}
install -d -o monitord -g monitord -m 0750 /var/lib/cti
install -m 0640 -o monitord -g monitord {STAGE}/custom_config.json \\
    /var/spool/monitord/custom_config.json
systemctl daemon-reload
systemctl start monitord.service
"""


@pytest.fixture
def container(tmp_path: Path, deb: Path) -> Iterator[Container]:
    for tool in ("systemd-nspawn", "nsenter", "unshare"):
        if shutil.which(tool) is None:  # .ci/run installs systemd-container
            pytest.fail(f"{tool} is missing")
    if not debian_root.can_build_pbx_root():  # .ci/run installs mmdebstrap
        pytest.skip("needs mmdebstrap or a built PBX root")
    stage = {f"{STAGE}/monitord.deb": deb.read_bytes(),
             f"{STAGE}/fake-msgd": ESCAPING_MSGD.encode(),
             f"{STAGE}/monitord.toml": MONITORD_TOML.encode(),
             f"{STAGE}/custom_config.json": custom_config(AREAS).encode(),
             DROP_IN: b"[Service]\nProtectControlGroups=no\n"}
    with booted_pbx(tmp_path, stage=stage) as box:
        yield box


def up(box: Container, areas: dict[str, str]) -> dict[str, dict[str, object]] | None:
    rows = box.areas()
    if set(rows) == set(areas) and all(r["health"] == "up" and r["pid"] for r in rows.values()):
        return rows
    return None


def escaped(box: Container, area: str) -> int | None:
    out = box.sh(f"cat /var/lib/cti/tg/{area}/escaped.pid 2>/dev/null || true").strip()
    return int(out) if out else None


def alive(box: Container, pid: int) -> bool:
    return box.sh(f"kill -0 {pid} 2>/dev/null && echo yes || true").strip() == "yes"


def cgroup_of(box: Container, pid: int) -> str:
    return box.sh(f"sed -n 's/^0:://p' /proc/{pid}/cgroup").strip()


def test_with_its_group_writable_monitord_fences_each_area_by_cgroup(
        container: Container) -> None:
    box = container
    box.sh(SETUP)
    before = wait_for("both areas up", lambda: up(box, AREAS), box)
    children = {area: wait_for(f"the escaped child of {area}", lambda a=area: escaped(box, a),
                               box) for area in AREAS}
    check = box.sh(f"runuser -u monitord -- monitord check -c {CONFIG}")
    [fence] = [line for line in check.splitlines() if line.startswith("fence: ")]
    assert re.fullmatch(r"fence: local areas are fenced by cgroup"
                        rf" \({UNIT_GROUP}/areas-[0-9a-f]{{12}}\): a daemon's child that calls"
                        r" setsid\(\) is stopped with its daemon", fence), fence
    for area, row in before.items():
        daemon_group = cgroup_of(box, int(str(row["pid"])))
        assert re.fullmatch(rf"/system\.slice/monitord\.service/areas-[0-9a-f]{{12}}/{area}@1",
                            daemon_group), daemon_group
        assert cgroup_of(box, children[area]) == daemon_group  # left the session, not this

    # a restart: both daemons adopted, their escaped children with them; systemd names every
    # process in the unit's groups at the stop and at the start, as without cgroups
    journal_at = len(box.journal())
    box.sh("systemctl restart monitord.service")
    after = wait_for("both areas up after the restart", lambda: up(box, AREAS), box,
                     timeout_s=SETTLE_TIMEOUT_S)
    assert {a: r["pid"] for a, r in after.items()} == {a: r["pid"] for a, r in before.items()}
    assert all(alive(box, pid) for pid in children.values())
    restart_log = box.journal()[journal_at:]
    adopted = {json.loads(line)["area"] for line in restart_log
               if line.startswith("{") and json.loads(line).get("event") == "survivor_adopted"}
    assert adopted == set(AREAS), restart_log
    at_stop = {int(m.group(1)) for line in restart_log
               if (m := re.search(r"Unit process (\d+) .* remains running", line))}
    at_start = {int(m.group(1)) for line in restart_log
                if (m := re.search(r"Found left-over process (\d+) ", line))}
    named = {int(str(row["pid"])) for row in before.values()} | set(children.values())
    assert named <= at_stop and at_stop == at_start, "\n".join(restart_log)

    # an area that leaves custom_config.json stops, its escaped child with it
    gone, kept = list(AREAS)
    group = cgroup_of(box, children[gone])
    box.sh(f"cat > /var/spool/monitord/custom_config.json <<'EOF'\n"
           f"{custom_config({kept: AREAS[kept]})}EOF")
    wait_for(f"{gone} stopped", lambda: up(box, {kept: AREAS[kept]}), box)
    wait_for(f"the escaped child of {gone} killed", lambda: not alive(box, children[gone]),
             box)
    assert box.sh(f"test -d /sys/fs/cgroup{group} && echo left || true").strip() == ""
    assert alive(box, children[kept])
    assert box.areas()[kept]["pid"] == before[kept]["pid"]

"""docs/install.md from a fresh PBX and a fresh VPS to the first move, its commands as written.

Where each part runs:
- the PBX: a fresh copy of the cached PBX root (Debian 12 with systemd 252) booted with
  systemd as PID 1 (tests/faults/nspawn_pbx.py), sharing this machine's network so that it
  reaches the VPS over the namespace VPS's veth. There, as written: the `pbx-install` block
  (`dpkg -i` of `make deb`'s package, staged under its own file name, and the tunnel's key),
  then, after the administrator's configuration, the `pbx-start` block (`systemctl enable
  --now monitord`), and section 4's `first-move` blocks (`ssh-keyscan`, the `sed` turning
  `[remote]` on, `check --remote` as the service's user, `systemctl restart monitord`,
  `monitord place … --wait`);
- the VPS: a fresh copy of the cached Debian 12 VPS root (openssh-server, python3) whose own
  sshd, with the distribution's /etc/ssh/sshd_config and host keys, serves a network
  namespace (netns_vps.running_distribution_vps). Section 3's `vps-install` blocks run
  there as root at its console (`nsenter` into sshd's mounts, root and network).

What the test supplies, because the docs leave it to the administrator:
- the two placeholders of the `authorized_keys` line: `ssh-ed25519 AAAA… monitord@pbx`
  becomes the PBX's /etc/monitord/id_ed25519.pub, `203.0.113.10` the PBX's address as the
  VPS sees it (the veth's PBX end);
- the copy of the package's examples/sshd_config.monitord from the PBX to the VPS's
  /etc/ssh/sshd_config.d/10-monitord.conf (the docs say it in prose);
- the name `vps.example.net` (the shipped `[remote] host` and the `ssh-keyscan` argument),
  resolved through the PBX's /etc/hosts, as DNS would for a real VPS;
- the configuration the docs describe in prose: one `[services.tg]` section (a stand-in
  messenger daemon, pushed to the VPS as an artifact), one area in custom_config.json, the
  HTTP API on a free port (the PBX shares this machine's loopback with other tests);
- `systemctl` on the VPS: the root has no systemd as PID 1, so a stand-in at
  /usr/local/sbin/systemctl knows only `reload ssh` and runs the distribution's own
  ssh.service `ExecReload=` lines (`sshd -t`, `kill -HUP $MAINPID`) with $MAINPID the
  listening sshd. The SIGHUP makes that sshd re-execute itself and read its configuration
  again, exactly as under systemd.

Checked on the way: after `dpkg -i` monitord.service is disabled and inactive; the drop-in
is the configuration the running sshd uses (its `AllowStreamLocalForwarding local` refuses
the login a remote Unix-socket forward that the distribution's default allows);
`ssh-keygen -lf` shows the VPS's host key; `check --remote` fails no check; after the move
the area's stand-in daemon runs on the VPS as `offload`, and no longer on the PBX. Then
the package again (`dpkg -i`, an upgrade to its maintainer scripts): it restarts the running
monitord (a new main process; the area stays on the VPS); the postinst of an upgrade leaves a
stopped one stopped.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import time
from pathlib import Path
from typing import Any

import asyncssh
import pytest

from monitord.testing import ports
from tests.faults import debian_root
from tests.faults.netns_vps import NetnsVps, running_distribution_vps
from tests.faults.nspawn_pbx import CONFIG, FAKE_MSGD, Container, booted_pbx
from tests.support import ssh_keys

pytestmark = pytest.mark.xdist_group("deb-package")

REPO = Path(__file__).resolve().parents[2]
INSTALL_DOC = REPO / "docs" / "install.md"
VPS_SUITE = "bookworm"
STAGE = "/root"  # where the administrator copied the package (`dpkg -i NAME.deb` runs here)
LOGIN = "offload"  # the login user docs/install.md creates on the VPS
VPS_HOST = "vps.example.net"  # the shipped [remote] host and section 4's ssh-keyscan argument
# The placeholders of section 3's authorized_keys line.
KEY_PLACEHOLDER = "ssh-ed25519 AAAA… monitord@pbx"
ADDRESS_PLACEHOLDER = "203.0.113.10"
AREA = "7c0e5a9b-3d41-4f2a-8e6b-1a9d2c4f5e70"
# The lines of `check --remote` docs/install.md says need the daemon's first connect.
NOT_CHECKED_BEFORE_THE_FIRST_CONNECT = {
    "agent", "artifacts", "tunnel_owner", "forwards", "remote_config", "memory"}
SETTLE_TIMEOUT_S = 45.0
MOVE_TIMEOUT_S = 180.0

# What the administrator puts in place of the shipped [services.*] sections.
SERVICES = """[services.tg]
command = ["/usr/local/bin/fake-msgd", "--area", "{area}", "--data", "{data_dir}"]
local_data_dir = "/var/lib/cti/tg/{area}"
remote_data_dir = "{remote_bin_dir}/data/tg/{area}"
remote_command = ["{remote_bin_dir}/fake-msgd", "--area", "{area}", "--data", "{data_dir}"]
min_uptime_s = 1
"""

CUSTOM_CONFIG = json.dumps({"custom_daemons": [
    {"uuid": AREA, "service": "tg", "location": "local", "generation": 1, "title": "one"}],
}, indent=1) + "\n"

# The administrator's configuration after `dpkg -i` (docs/install.md section 2, in prose).
CONFIGURE = f"""
install -m 0755 {STAGE}/fake-msgd /usr/local/bin/fake-msgd
sed -i '/^\\[services\\.tg\\]/,$d' {CONFIG}
cat {STAGE}/services.toml >> {CONFIG}
sed -i 's/^listen = "127.0.0.1:8224"$/listen = "127.0.0.1:{{port}}"/' {CONFIG}
install -d -o monitord -g monitord -m 0750 /var/lib/cti
install -m 0640 -o monitord -g monitord {STAGE}/custom_config.json \\
    /var/spool/monitord/custom_config.json
"""

# ... and of [remote] once section 4's sed turned it on: the stand-in daemon is pushed along.
CONFIGURE_REMOTE = (
    f"sed -i 's|^# artifacts = .*|artifacts = [\"/usr/local/bin/fake-msgd\"]|' {CONFIG}\n"
    f"grep -q '^artifacts = ' {CONFIG}\n"
)

# systemctl on the VPS root, which has no systemd as PID 1: only `reload ssh`, by the
# distribution's ssh.service's own ExecReload= lines, $MAINPID being the listening sshd.
SYSTEMCTL_STAND_IN = """#!/bin/sh
# Test stand-in for systemctl (no systemd runs this root): `reload ssh` runs ssh.service's
# ExecReload= lines with MAINPID the listening sshd's pid; anything else fails.
set -e
if [ "$*" != "reload ssh" ]; then
    echo "systemctl stand-in: only 'reload ssh'" >&2
    exit 1
fi
MAINPID=$(cat /run/sshd.pid)
sed -n 's/^ExecReload=//p' /lib/systemd/system/ssh.service | while read -r line; do
    eval "$line"
done
"""


def doc_blocks(marker: str) -> list[str]:
    """The ```sh blocks of docs/install.md between `<!-- MARKER:begin -->` and its end."""
    text = INSTALL_DOC.read_text()
    found = re.search(rf"<!-- {marker}:begin -->(.*?)<!-- {marker}:end -->", text, re.S)
    assert found, f"docs/install.md has no {marker} block"
    blocks = re.findall(r"```sh\n(.*?)```", found.group(1), re.S)
    assert blocks, f"the {marker} block has no commands"
    return blocks


def authorized_key_block(block: str, *, public_line: str, pbx_address: str) -> str:
    """Section 3's first block with its two placeholders filled in (and nothing else)."""
    assert block.count(KEY_PLACEHOLDER) == 1, block
    assert block.count(ADDRESS_PLACEHOLDER) == 1, block
    return block.replace(KEY_PLACEHOLDER, public_line).replace(ADDRESS_PLACEHOLDER,
                                                               pbx_address)


def areas(pbx: Container) -> dict[str, dict[str, Any]]:
    rows = json.loads(pbx.sh(f"monitord areas --json -c {CONFIG}"))
    return {row["uuid"]: row for row in rows}


async def wait_area(pbx: Container, side: str, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        row = (await asyncio.to_thread(areas, pbx)).get(AREA)
        if row and row["side"] == side and row["health"] == "up":
            return row
        if time.monotonic() > deadline:
            status = pbx.sh("systemctl status --no-pager monitord.service; journalctl -q "
                            "-u monitord.service -o cat --no-pager | tail -n 40", check=False)
            pytest.fail(f"the area is not up on the {side} side: {row}\n{status}")
        await asyncio.sleep(0.3)  # poll interval of a deadline loop


def fake_msgd_users(vps: NetnsVps) -> set[int]:
    """The uids of the VPS's processes running the stand-in daemon for AREA."""
    found = set()
    for pid in vps.pids():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        uid = re.search(r"^Uid:\s+(\d+)", status, re.M)
        if uid and any(a.endswith(b"/fake-msgd") for a in argv) and AREA.encode() in argv:
            found.add(int(uid.group(1)))
    return found


async def sshd_reloaded(vps: NetnsVps, listening_before: int) -> None:
    """Until the SIGHUPed sshd has started listening again (its second "Server listening")."""
    deadline = time.monotonic() + 10.0
    while vps.log_text().count("Server listening on 0.0.0.0") <= listening_before:
        assert time.monotonic() < deadline, f"sshd did not reload:\n{vps.log_text()}"
        await asyncio.sleep(0.05)  # poll interval of a deadline loop


async def remote_socket_forward_refused(vps: NetnsVps, path: str) -> bool:
    """Does the running sshd refuse `offload` a remote Unix-socket forward (the drop-in's
    `AllowStreamLocalForwarding local`; the distribution's default allows it)?"""
    async with asyncio.timeout(30):
        async with asyncssh.connect(
                vps.vps_address, username=LOGIN, client_keys=[str(vps.client_key.private_path)],
                known_hosts=str(vps.known_hosts), agent_path=None) as conn:
            try:
                listener = await conn.forward_remote_path(path, "/dev/null")
            except asyncssh.ChannelListenError:
                return True
            listener.close()
            return False


async def test_a_fresh_pbx_and_a_fresh_vps_reach_the_first_move_by_the_install_doc(
        tmp_path: Path, deb: Path) -> None:
    for tool in ("systemd-nspawn", "nsenter", "unshare"):
        if shutil.which(tool) is None:  # .ci/run installs systemd-container
            pytest.fail(f"{tool} is missing")
    if not (debian_root.can_build_pbx_root() and debian_root.can_build_roots()):
        pytest.skip("needs mmdebstrap or built roots")  # .ci/run installs mmdebstrap
    vps_root = await asyncio.to_thread(debian_root.debian_root, VPS_SUITE)
    await asyncio.to_thread(debian_root.pbx_root)
    stage = {f"{STAGE}/{deb.name}": deb.read_bytes(), f"{STAGE}/fake-msgd": FAKE_MSGD.encode(),
             f"{STAGE}/services.toml": SERVICES.encode(),
             f"{STAGE}/custom_config.json": CUSTOM_CONFIG.encode()}
    started = time.monotonic()
    with booted_pbx(tmp_path / "pbx", stage=stage, private_network=False) as pbx:
        booted = time.monotonic()
        # -- 2. the PBX: the package and the tunnel's key, as written ----------------------
        (install,) = doc_blocks("pbx-install")
        assert f"dpkg -i {deb.name}\n" in install, f"docs/install.md does not install {deb.name}"
        pbx.sh(f"cd {STAGE}\n{install}")
        # the package starts nothing and enables nothing (docs/install.md says so)
        state = pbx.sh("systemctl is-enabled monitord.service || true; "
                       "systemctl is-active monitord.service || true").split()
        assert state == ["disabled", "inactive"], state
        pbx.sh(CONFIGURE.format(port=ports.free_port()))
        (start,) = doc_blocks("pbx-start")
        pbx.sh(start)
        await wait_area(pbx, "local", SETTLE_TIMEOUT_S)
        running = time.monotonic()

        # -- 3. the VPS, as written, with the PBX's key and address in the placeholders --
        upper = tmp_path / "pbx" / "upper"
        public_line = pbx.sh("cat /etc/monitord/id_ed25519.pub").strip()
        assert public_line.endswith(" monitord@pbx"), public_line
        pbx_key = ssh_keys.KeyPair(upper / "etc/monitord/id_ed25519", public_line)
        drop_in = pbx.sh("cat /usr/share/doc/monitord/examples/sshd_config.monitord")
        async with running_distribution_vps(
                tmp_path / "vps", debian_root=vps_root, client_key=pbx_key, login=LOGIN,
                stage={"/usr/local/sbin/systemctl": (SYSTEMCTL_STAND_IN, 0o755)}) as vps:
            keys, sshd_and_dir = doc_blocks("vps-install")
            done = vps.at_console(authorized_key_block(
                keys, public_line=public_line, pbx_address=vps.pbx_address))
            assert done.returncode == 0, done.stderr
            # the distribution's sshd lets the new login forward a remote Unix socket ...
            assert not await remote_socket_forward_refused(vps, "/tmp/before.sock")
            # "copy examples/sshd_config.monitord from the PBX to ..."
            done = vps.at_console("cat > /etc/ssh/sshd_config.d/10-monitord.conf",
                                  stdin=drop_in)
            assert done.returncode == 0, done.stderr
            listening = vps.log_text().count("Server listening on 0.0.0.0")
            done = vps.at_console(sshd_and_dir)
            assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
            assert re.fullmatch(r"\(3, (9|1\d), \d+\)\n", done.stdout), done.stdout
            await sshd_reloaded(vps, listening)
            # ... and after the reload it does not: the drop-in is in force for `offload`
            assert await remote_socket_forward_refused(vps, "/tmp/after.sock")

            # -- 4. the PBX: host key, [remote], check, restart, the first move ------------
            pbx.sh(f"echo '{vps.vps_address} {VPS_HOST}' >> /etc/hosts")
            keyscan, move = doc_blocks("first-move")
            fingerprints = pbx.sh(keyscan)
            own = asyncssh.import_public_key(vps.host_key.public_line).get_fingerprint()
            assert own in fingerprints and VPS_HOST in fingerprints, fingerprints
            pbx.sh(CONFIGURE_REMOTE)
            configured = time.monotonic()
            out = await asyncio.to_thread(pbx.sh, move, timeout_s=MOVE_TIMEOUT_S)
            moved = time.monotonic()
            # check --remote before the first connect: what docs/install.md says it leaves
            # to the daemon is all it does not check, and nothing fails
            lines = out.splitlines()
            assert not any(line.startswith("✘") for line in lines), out
            assert {line.split()[1] for line in lines if line.startswith("– ")} \
                == NOT_CHECKED_BEFORE_THE_FIRST_CONNECT, out
            assert {"auth", "sftp", "bin_dir", "write_test"} <= {
                line.split()[1] for line in lines if line.startswith("✔ ")}, out
            row = await wait_area(pbx, "remote", SETTLE_TIMEOUT_S)
            offload_uid = int(vps.at_console(f"id -u {LOGIN}").stdout)
            assert fake_msgd_users(vps) == {offload_uid}, row
            processes = pbx.sh("for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' <$f; echo; done",
                               check=False)
            assert "/fake-msgd" not in processes, "the PBX's copy still runs"

            # -- upgrades: the package restarts a running monitord, never a stopped one ---
            before = pbx.show("MainPID", "ActiveState")
            assert before["ActiveState"] == "active", before
            pbx.sh(f"dpkg -i {STAGE}/{deb.name}")
            after = pbx.show("MainPID", "ActiveState")
            assert after["ActiveState"] == "active" and after["MainPID"] != before["MainPID"], \
                (before, after)
            await wait_area(pbx, "remote", SETTLE_TIMEOUT_S)  # adopted, still on the VPS
            # a stopped one: what decides is the postinst an upgrade runs (`configure` with
            # the version it replaces), run here alone (a whole `dpkg -i` takes seconds)
            pbx.sh("systemctl stop monitord.service")
            version = pbx.sh("dpkg-query -W -f='${Version}' monitord")
            pbx.sh(f"/var/lib/dpkg/info/monitord.postinst configure {version}")
            assert pbx.show("ActiveState") == {"ActiveState": "inactive"}
            print(f"PBX booted {booted - started:.1f} s, package to a running monitord"
                  f" {running - booted:.1f} s, the VPS and section 4's keys"
                  f" {configured - running:.1f} s, check + restart + move"
                  f" {moved - configured:.1f} s, the upgrades {time.monotonic() - moved:.1f} s")


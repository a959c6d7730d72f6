"""A real OpenSSH "VPS" in its own network namespace, and the partitions the fault tier cuts.

`running_netns_vps(tmp)` builds, for one test:

- a network namespace `mtd-<hex>` with its loopback up;
- a veth pair `mtd<hex>p` (PBX side, 10.231.N.1/30, in the root namespace) and
  `mtd<hex>v` (VPS side, 10.231.N.2/30, inside the namespace);
- OpenSSH `sshd -D -e -f CONFIG` started with `ip netns exec`, listening on 10.231.N.2:22,
  root logins by a client key generated at run time, authorised as docs/vps-setup.md says
  (`restrict,port-forwarding`); CONFIG is the test's own lines with forwarding off for
  everyone, then the documented config/sshd_config.monitord with its `Match User` naming
  root (`documented_sshd_config`): only that block lets the login forward, and a
  black-holed session and its forwards stay until sshd's ClientAlive probes (45 s) or a
  fence end them.

Everything the agent starts over SSH inherits the namespace, so processes "on the VPS" see
only the VPS network: 127.0.0.1 there is the VPS's own loopback, and the PBX is reachable only
through the tunnel's reverse forwards or at 10.231.N.1 over the veth. Files live in `tmp`
(same filesystem as the PBX side; only the network is separated).

The VPS's processes see the files through a mount namespace of their own (sshd's, which
`ip netns exec` made): `mount_tmpfs(path, size_bytes=)` gives a path there a small file
system of its own (a full VPS disk), `in_mounts(argv)` runs a command as the VPS sees its
files (`nsenter` into sshd's mounts and root), `fs_usage(path)` reads that file system's
used and free bytes. The mount dies with the namespace's last process.

Faults (`NetnsVps`): `link_down()` / `link_up()` (`ip link set … down`: both ends see the
carrier go), `black_hole()` / `heal()` (an nft table inside the namespace drops every SSH
packet both ways: no reset, no FIN — only keepalives can tell the peer is gone), `reboot()`
(SIGKILL every process in the namespace, then start sshd again with the same host key).

Teardown, also after a failure: SIGKILL every process in the namespace, reap sshd, delete the
namespace (its nft table goes with it) and the PBX-side veth.

`running_distribution_vps(tmp, debian_root=..., client_key=..., login=...)` is a fresh VPS
as its distribution ships it, for the install docs' own commands: the root's sshd with the
root's own /etc/ssh/sshd_config and host keys, on a copy (an overlay) of the root, with no
login set up; `NetnsVps.at_console(script)` runs a script there as root (nsenter into sshd's
mounts, root and network).

`running_jump_host(tmp, vps)` puts a jump host in front of a running VPS: a second namespace
with its own sshd (port 2222, the same client key), a veth pair from it into the VPS's
namespace, and an nft table there that refuses SSH arriving over the PBX's veth (`JumpHost`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from monitord.testing import fake_daemon, ports
from monitord.testing.stack import ExternalVps
from tests.support import ssh_keys, sshd
from tests.support.wan_link import PROFILES, LinkProfile, Wire, start_wire

SSHD_BINARY = Path("/usr/sbin/sshd")
IP_BINARY = "ip"
NFT_BINARY = "nft"
NSENTER_BINARY = "nsenter"
ETHTOOL_BINARY = "ethtool"
SSH_PORT = 22
COMMAND_TIMEOUT_S = 10.0
START_TIMEOUT_S = 10.0
CONSOLE_TIMEOUT_S = 60.0
ROOT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # root's, on Debian
FAULT_TABLE = "mtd_fault"
# What docs/vps-setup.md tells a VPS to run with: its sshd lines and its authorized_keys options.
DOCUMENTED_SSHD_CONFIG = Path(__file__).parents[2] / "config" / "sshd_config.monitord"
AUTHORIZED_KEY_OPTIONS = "restrict,port-forwarding"
DOCUMENTED_USER = "offload"  # the login user the documented block's `Match User` names
LOGIN_UID = 2000  # of a non-root login added to a Debian root
FAKE_DAEMON = Path(fake_daemon.__file__)
_FORWARDING_OFF = {
    "allowtcpforwarding": "AllowTcpForwarding no",
    "allowstreamlocalforwarding": "AllowStreamLocalForwarding no",
}
# $1 the Debian root, $2 the shared directory, $3 a directory of passwd, group and shadow
# files to use instead of the root's ("-": the root's own), $4 a directory with `upper`,
# `work` and `merged` in which the root is mounted as the lower layer of an overlay, so that
# the VPS changes its own copy ("-": the root itself), then sshd's argv.
CHROOT_SCRIPT = r"""
set -e
root="$1"; shared="$2"; accounts="$3"; overlay="$4"; shift 4
if [ "$overlay" != "-" ]; then
    mount -t overlay overlay \
        -o "lowerdir=$root,upperdir=$overlay/upper,workdir=$overlay/work" "$overlay/merged"
    root="$overlay/merged"
fi
if [ "$accounts" != "-" ]; then
    for f in passwd group shadow; do mount --bind "$accounts/$f" "$root/etc/$f"; done
fi
mount -t proc proc "$root/proc"
mount --rbind /dev "$root/dev"
mount -t tmpfs -o mode=0755 tmpfs "$root/run"
mkdir -p "$root/run/sshd"
mount -t tmpfs -o mode=1777 tmpfs "$root/tmp"
if [ "$shared" != "-" ]; then
    mkdir -p "$root$shared"
    mount --bind "$shared" "$root$shared"
fi
exec chroot "$root" "$@"
"""


class NetnsError(RuntimeError):
    """A namespace, link or firewall command failed (the message carries its stderr)."""


def can_build_netns() -> bool:
    """Root, iproute2, nft and sshd: everything a namespace VPS needs."""
    return (
        os.geteuid() == 0
        and SSHD_BINARY.exists()
        and shutil.which(IP_BINARY) is not None
        and shutil.which(NFT_BINARY) is not None
    )


def run_command(argv: Sequence[str], *, stdin: str | None = None) -> str:
    """Run a short administrative command; its stdout, or NetnsError naming its stderr."""
    try:
        done = subprocess.run(
            list(argv), input=stdin, capture_output=True, text=True,
            timeout=COMMAND_TIMEOUT_S, check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NetnsError(f"{' '.join(argv)}: {e}") from e
    if done.returncode != 0:
        raise NetnsError(f"{' '.join(argv)} -> {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def _used_subnets() -> str:
    return run_command([IP_BINARY, "-4", "-o", "addr", "show"])


SUBNET_SLOTS = 16  # the /30s of 10.231.0.0/16, dealt round-robin to parallel test workers


def _pick_subnet() -> tuple[str, str]:
    """(PBX address, VPS address) of a /30 in 10.231.0.0/16 that no interface uses. Each
    pytest-xdist worker picks among its own /30s (`ports.worker_slot`), so two workers
    building namespaces at the same moment cannot both take one that is still free."""
    used = _used_subnets()
    slot = ports.worker_slot() % SUBNET_SLOTS
    for _ in range(100):
        block = (secrets.randbelow(16384 // SUBNET_SLOTS) * SUBNET_SLOTS + slot) * 4
        base = f"10.231.{block // 256}.{block % 256}"
        prefix = base.rsplit(".", 1)[0] + "."
        pbx, vps = f"{prefix}{block % 256 + 1}", f"{prefix}{block % 256 + 2}"
        if f" {pbx}/" not in used and f" {vps}/" not in used:
            return pbx, vps
    raise NetnsError("no free /30 in 10.231.0.0/16")


@dataclass
class NetnsVps:
    """A live namespace VPS: its addresses, the client's key and known_hosts, fault controls."""

    name: str
    pbx_dev: str
    vps_dev: str
    pbx_address: str
    vps_address: str
    root: Path
    host_key: ssh_keys.KeyPair
    client_key: ssh_keys.KeyPair
    known_hosts: Path
    config_path: Path
    log_path: Path
    sshd: asyncio.subprocess.Process | None = None
    spawned: list[asyncio.subprocess.Process] = field(default_factory=list)
    user: str = "root"
    port: int = SSH_PORT
    # A Debian root (tests/faults/debian_root.py) sshd runs chrooted into, and the directory
    # the tests share with it (bind-mounted at the same path); None: this machine's sshd.
    debian_root: Path | None = None
    shared: Path | None = None
    accounts: Path | None = None  # passwd, group, shadow with the login user added
    # `running_distribution_vps`: sshd runs on a copy (an overlay in this directory) of
    # `debian_root` with that root's own /etc/ssh/sshd_config and host keys.
    overlay: Path | None = None
    # The link between the PBX and the VPS (tests/support/wan_link.py); other than `lan`, a
    # namespace of its own (`wire_ns`) between the two veths runs the wire.
    link: LinkProfile = PROFILES["lan"]
    wire: Wire | None = None

    @property
    def wire_ns(self) -> str:
        return f"{self.name}-w"

    @property
    def remote_bin_dir(self) -> Path:
        return self.root / "opt"

    # -- processes in the namespace ----------------------------------------------------

    def netns_argv(self, argv: Sequence[str]) -> list[str]:
        return [IP_BINARY, "netns", "exec", self.name, *argv]

    async def spawn(
        self, argv: Sequence[str], *, stdin: int | None = asyncio.subprocess.DEVNULL,
        stdout: int | None = asyncio.subprocess.DEVNULL,
    ) -> asyncio.subprocess.Process:
        """Start `argv` inside the namespace (killed at teardown if still running)."""
        process = await asyncio.create_subprocess_exec(
            *self.netns_argv(argv), stdin=stdin, stdout=stdout,
            stderr=asyncio.subprocess.DEVNULL,
        )
        self.spawned.append(process)
        return process

    def pids(self) -> list[int]:
        """Every process whose network namespace is this VPS's."""
        try:
            out = run_command([IP_BINARY, "netns", "pids", self.name])
        except NetnsError:
            return []
        return [int(p) for p in out.split() if p.isdigit()]

    async def kill_all(self) -> None:
        """SIGKILL every process in the namespace until none is left (or NetnsError)."""
        deadline = time.monotonic() + COMMAND_TIMEOUT_S
        while pids := self.pids():
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            for process in [self.sshd, *self.spawned]:
                if process is not None and process.returncode is None and process.pid in pids:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(process.wait(), 1.0)
            if time.monotonic() > deadline:
                raise NetnsError(f"processes outlive SIGKILL in {self.name}: {pids}")
            await asyncio.sleep(0.05)  # poll interval of a deadline loop

    # -- sshd ----------------------------------------------------------------------------

    def sshd_argv(self) -> list[str]:
        """This machine's sshd, or (with `debian_root`) that release's, chrooted into its root
        in a mount namespace of its own: /proc, /dev, a fresh /run and /tmp, and `shared` at
        its own path. The mounts die with the namespace's last process."""
        sshd_argv = [str(SSHD_BINARY), "-D", "-e"]
        if self.overlay is None:
            sshd_argv += ["-f", str(self.config_path)]
        if self.debian_root is None:
            return self.netns_argv(sshd_argv)
        assert self.shared is not None or self.overlay is not None
        return self.netns_argv([
            "unshare", "--mount", "--propagation", "private", "/bin/sh", "-c", CHROOT_SCRIPT,
            "chroot-sshd", str(self.debian_root), str(self.shared or "-"),
            str(self.accounts or "-"), str(self.overlay or "-"), *sshd_argv,
        ])

    async def start_sshd(self) -> None:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # privilege separation dir
        with self.log_path.open("ab") as log_file:
            self.sshd = await asyncio.create_subprocess_exec(
                *self.sshd_argv(),
                stdin=asyncio.subprocess.DEVNULL, stdout=log_file, stderr=log_file,
            )
        await self._wait_accepting()

    async def _wait_accepting(self) -> None:
        """Until an SSH banner comes back from the VPS address (through the veth)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert self.sshd is not None
            if self.sshd.returncode is not None:
                raise NetnsError(f"sshd exited with {self.sshd.returncode}:\n{self.log_text()}")
            with contextlib.suppress(OSError, TimeoutError):
                async with asyncio.timeout(1.0):
                    reader, writer = await asyncio.open_connection(self.vps_address, self.port)
                    banner = await reader.readline()
                    writer.close()
                    if banner.startswith(b"SSH-2.0-"):
                        return
            if time.monotonic() > deadline:
                raise NetnsError(f"sshd did not answer on {self.vps_address}:{self.port}")
            await asyncio.sleep(0.05)  # poll interval of a deadline loop

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    # -- the VPS's own mounts -------------------------------------------------------------

    def in_mounts(self, argv: Sequence[str]) -> str:
        """Run `argv` in sshd's mount namespace and root (as the VPS sees its files)."""
        assert self.sshd is not None and self.sshd.returncode is None
        return run_command([NSENTER_BINARY, "--target", str(self.sshd.pid), "--mount",
                            "--root", *argv])

    def at_console(self, script: str, *,
                   stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        """`sh -e` running `script` as root on the VPS (its mounts, root and network, root's
        PATH), as an administrator at its console runs it."""
        assert self.sshd is not None and self.sshd.returncode is None
        return subprocess.run(
            [NSENTER_BINARY, "--target", str(self.sshd.pid), "--mount", "--net", "--root",
             "/bin/sh", "-ec", script], input=stdin,
            capture_output=True, text=True, timeout=CONSOLE_TIMEOUT_S, check=False,
            env={"PATH": ROOT_PATH, "HOME": "/root", "LANG": "C.UTF-8"}, cwd="/",
        )

    def mount_tmpfs(self, path: Path, *, size_bytes: int) -> None:
        """A tmpfs of `size_bytes` at `path`, seen by every process the VPS starts from now."""
        path.mkdir(parents=True, exist_ok=True)
        self.in_mounts(["mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=0755",
                        "tmpfs", str(path)])

    def fs_usage(self, path: Path) -> tuple[int, int]:
        """(used, free) bytes of the file system holding `path`, as the VPS sees it."""
        out = self.in_mounts(["stat", "-f", "-c", "%b %f %a %S", str(path)])
        total, free, avail, block = (int(v) for v in out.split())
        return (total - free) * block, avail * block

    # -- faults --------------------------------------------------------------------------

    def link_down(self) -> None:
        """Take the PBX end of the veth down: the VPS is off the network (both see it)."""
        run_command([IP_BINARY, "link", "set", self.pbx_dev, "down"])

    def link_up(self) -> None:
        run_command([IP_BINARY, "link", "set", self.pbx_dev, "up"])

    def black_hole(self) -> None:
        """Drop every SSH packet to and from the VPS's sshd, silently, in both directions."""
        rules = (
            f"table inet {FAULT_TABLE} {{\n"
            f"  chain input {{ type filter hook input priority -10; policy accept;\n"
            f"    tcp dport {self.port} drop\n  }}\n"
            f"  chain output {{ type filter hook output priority -10; policy accept;\n"
            f"    tcp sport {self.port} drop\n  }}\n"
            "}\n"
        )
        run_command(self.netns_argv([NFT_BINARY, "-f", "-"]), stdin=rules)

    def black_hole_client(self, client_port: int) -> None:
        """Drop every packet of the one SSH connection from `client_port`, both ways,
        silently: that session goes stale on the VPS while new connections still work."""
        rules = (
            f"table inet {FAULT_TABLE} {{\n"
            f"  chain input {{ type filter hook input priority -10; policy accept;\n"
            f"    tcp dport {self.port} tcp sport {client_port} drop\n  }}\n"
            f"  chain output {{ type filter hook output priority -10; policy accept;\n"
            f"    tcp sport {self.port} tcp dport {client_port} drop\n  }}\n"
            "}\n"
        )
        run_command(self.netns_argv([NFT_BINARY, "-f", "-"]), stdin=rules)

    def black_hole_new_connections(self) -> None:
        """Let the packets of connections already open through (what a black hole held back
        arrives, as when a link heals) while a new SSH connection's SYN is still dropped, so
        the PBX cannot reconnect: what the VPS then does comes only from old connections."""
        if self.black_holed():
            self.heal()
        rules = (
            f"table inet {FAULT_TABLE} {{\n"
            f"  chain input {{ type filter hook input priority -10; policy accept;\n"
            f"    tcp dport {self.port} tcp flags & (syn | ack) == syn drop\n  }}\n"
            "}\n"
        )
        run_command(self.netns_argv([NFT_BINARY, "-f", "-"]), stdin=rules)

    def heal(self) -> None:
        """Remove the black hole (SSH packets flow again)."""
        run_command(self.netns_argv([NFT_BINARY, "delete", "table", "inet", FAULT_TABLE]))

    def black_holed(self) -> bool:
        out = run_command(self.netns_argv([NFT_BINARY, "list", "tables"]))
        return FAULT_TABLE in out

    async def reboot(self) -> None:
        """A VPS reboot: every process in the namespace dies, then sshd starts again."""
        await self.kill_all()
        if self.sshd is not None:
            await asyncio.wait_for(self.sshd.wait(), COMMAND_TIMEOUT_S)
        await self.start_sshd()


def _add_login(debian_root: Path, accounts: Path, *, login: str, home: Path) -> None:
    """The root's account files plus `login` (no password, not locked: key only)."""
    accounts.mkdir()
    lines = {
        "passwd": f"{login}:x:{LOGIN_UID}:{LOGIN_UID}::{home}:/bin/sh\n",
        "group": f"{login}:x:{LOGIN_UID}:\n",
        "shadow": f"{login}:*:20000:0:99999:7:::\n",
    }
    for name, line in lines.items():
        (accounts / name).write_text((debian_root / "etc" / name).read_text() + line)
    (accounts / "shadow").chmod(0o640)


def _build(tmp: Path, *, debian_root: Path | None = None, shared: Path | None = None,
           match_user: str = "root", login: str = "root") -> NetnsVps:
    token = secrets.token_hex(3)
    name, pbx_dev, vps_dev = f"mtd-{token}", f"mtd{token}p", f"mtd{token}v"
    tmp.mkdir(parents=True, exist_ok=True)
    host_key = ssh_keys.generate(tmp / "ssh_host_ed25519_key", comment="vps-host")
    client_key = ssh_keys.generate(tmp / "client" / "id_ed25519", comment="pbx-client")
    authorized = tmp / "authorized_keys"
    authorized.write_text(f"{AUTHORIZED_KEY_OPTIONS} {client_key.public_line}\n")
    pbx_address, vps_address = _pick_subnet()
    config_path = tmp / "sshd_config"
    config_path.write_text(documented_sshd_config(sshd.config_text(
        port=SSH_PORT, listen=vps_address, host_key=host_key.private_path,
        authorized=authorized, pid_file=tmp / "sshd.pid",
    ), user=match_user))
    known_hosts = tmp / "known_hosts"
    known_hosts.write_text(ssh_keys.known_hosts_line(
        host=vps_address, port=SSH_PORT, host_public_line=host_key.public_line
    ))
    accounts = None
    if login != "root":
        # As docs/vps-setup.md sets the VPS up: a login user owning remote_bin_dir (0700),
        # who may traverse the test's directory to reach it.
        assert debian_root is not None and shared is not None
        accounts = tmp / "accounts"
        _add_login(debian_root, accounts, login=login, home=tmp)
        shared.chmod(0o755)
        bin_dir = tmp / "opt"
        bin_dir.mkdir(mode=0o700)
        os.chown(bin_dir, LOGIN_UID, LOGIN_UID)
    return NetnsVps(
        name=name, pbx_dev=pbx_dev, vps_dev=vps_dev, pbx_address=pbx_address,
        vps_address=vps_address, root=tmp, host_key=host_key, client_key=client_key,
        known_hosts=known_hosts, config_path=config_path, log_path=tmp / "sshd.log",
        debian_root=debian_root, shared=shared, accounts=accounts, user=login,
    )


def documented_sshd_config(test_lines: str, *, user: str) -> str:
    """The test's own lines as the global settings, with forwarding off for everyone (as on a
    VPS whose other accounts get none), then the documented block with its `Match User`
    naming `user`: only that block lets monitord's login forward."""
    own = [line for line in test_lines.splitlines()
           if line.strip() and line.split()[0].lower() not in _FORWARDING_OFF]
    documented = DOCUMENTED_SSHD_CONFIG.read_text()
    match_line = f"Match User {DOCUMENTED_USER}\n"
    assert match_line in documented, f"{DOCUMENTED_SSHD_CONFIG} has no {match_line!r}"
    return ("\n".join([*own, *_FORWARDING_OFF.values()]) + "\n"
            + documented.replace(match_line, f"Match User {user}\n"))


def _create_network(vps: NetnsVps) -> None:
    ns = vps.netns_argv
    run_command([IP_BINARY, "netns", "add", vps.name])
    run_command(ns([IP_BINARY, "link", "set", "lo", "up"]))
    if vps.link.wired:
        _create_wired_pair(vps)
    else:
        run_command([IP_BINARY, "link", "add", vps.pbx_dev, "type", "veth", "peer", "name",
                     vps.vps_dev])
        run_command([IP_BINARY, "link", "set", vps.vps_dev, "netns", vps.name])
    run_command([IP_BINARY, "addr", "add", f"{vps.pbx_address}/30", "dev", vps.pbx_dev])
    run_command([IP_BINARY, "link", "set", vps.pbx_dev, "up"])
    run_command(ns([IP_BINARY, "addr", "add", f"{vps.vps_address}/30", "dev", vps.vps_dev]))
    run_command(ns([IP_BINARY, "link", "set", vps.vps_dev, "up"]))


def _wire_devs(vps: NetnsVps) -> tuple[str, str]:
    """The wire namespace's ends: (the PBX veth's peer, the VPS veth's peer)."""
    return vps.pbx_dev[:-1] + "a", vps.pbx_dev[:-1] + "b"


def _create_wired_pair(vps: NetnsVps) -> None:
    """PBX veth <-> [wire namespace: a | wire | b] <-> VPS veth. The wire reads whole frames,
    so the offloads that would hand it 64 KiB segments with unfinished checksums are off on
    every end (wan_wire.py)."""
    if shutil.which(ETHTOOL_BINARY) is None:
        raise NetnsError("a WAN link needs ethtool (apt install ethtool) to turn offloads off")
    a, b = _wire_devs(vps)
    wire = [IP_BINARY, "netns", "exec", vps.wire_ns]
    run_command([IP_BINARY, "netns", "add", vps.wire_ns])
    run_command([*wire, "sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1"])
    run_command([*wire, "sysctl", "-q", "-w", "net.ipv6.conf.default.disable_ipv6=1"])
    run_command([IP_BINARY, "link", "add", vps.pbx_dev, "type", "veth", "peer", "name", a])
    run_command([IP_BINARY, "link", "set", a, "netns", vps.wire_ns])
    run_command([IP_BINARY, "link", "add", vps.vps_dev, "type", "veth", "peer", "name", b])
    run_command([IP_BINARY, "link", "set", b, "netns", vps.wire_ns])
    run_command([IP_BINARY, "link", "set", vps.vps_dev, "netns", vps.name])
    offloads = ["tso", "off", "gso", "off", "gro", "off", "tx", "off", "rx", "off"]
    run_command([ETHTOOL_BINARY, "-K", vps.pbx_dev, *offloads])
    run_command(vps.netns_argv([ETHTOOL_BINARY, "-K", vps.vps_dev, *offloads]))
    for dev in (a, b):
        run_command([*wire, ETHTOOL_BINARY, "-K", dev, *offloads])
        run_command([*wire, IP_BINARY, "link", "set", dev, "promisc", "on", "up"])


async def _start_wire(vps: NetnsVps) -> None:
    a, b = _wire_devs(vps)
    vps.wire = await start_wire([IP_BINARY, "netns", "exec", vps.wire_ns], a=a, b=b,
                                link=vps.link)


def _delete_network(vps: NetnsVps) -> None:
    with contextlib.suppress(NetnsError):
        run_command([IP_BINARY, "netns", "delete", vps.name])
    if vps.link.wired:
        with contextlib.suppress(NetnsError):
            run_command([IP_BINARY, "netns", "delete", vps.wire_ns])
    # Deleting the namespace destroys the pair, asynchronously; make sure it is gone.
    with contextlib.suppress(NetnsError):
        run_command([IP_BINARY, "link", "delete", vps.pbx_dev])


@contextlib.asynccontextmanager
async def running_netns_vps(
    tmp: Path, *, debian_root: Path | None = None, shared: Path | None = None,
    match_user: str | None = None, login: str = "root", link: LinkProfile = PROFILES["lan"],
) -> AsyncIterator[NetnsVps]:
    """Build the namespace, veth and sshd; always tear all of it down on exit. With
    `debian_root`, the VPS runs that root's sshd and python3 (`shared`: the directory the
    tests and the VPS both see, at the same path; it must hold `tmp`). `match_user`: whom
    the documented `Match User` block names (default: the login; another user: the login
    gets no forwarding). `login` (with `debian_root`): the user monitord logs in as; other
    than root, it is added to the root's accounts and owns `remote_bin_dir`. `link`: what
    lies between the PBX and the VPS (tests/support/wan_link.py; `lan`: the bare veth)."""
    vps = _build(tmp, debian_root=debian_root, shared=shared,
                 match_user=login if match_user is None else match_user, login=login)
    vps.link = link
    async with _serving(vps) as served:
        yield served


@contextlib.asynccontextmanager
async def running_distribution_vps(
    tmp: Path, *, debian_root: Path, client_key: ssh_keys.KeyPair, login: str,
    stage: dict[str, tuple[str, int]] | None = None,
) -> AsyncIterator[NetnsVps]:
    """A fresh VPS as its distribution ships it, for an install by the docs: sshd runs on a
    copy of `debian_root` (an overlay in `tmp`, mounted in sshd's own mount namespace, so
    it goes with it) with that root's own /etc/ssh/sshd_config (which includes
    /etc/ssh/sshd_config.d/*.conf) and host keys, in a namespace and behind a veth as
    `running_netns_vps` builds them. Nothing is set up for a login: the test does that as
    root at the VPS's console (`NetnsVps.at_console`). `client_key` is the key that will log
    in as `login` (the PBX's); `known_hosts` names the root's ed25519 host key at the VPS
    address. `stage`: files put into the copy before sshd starts, {path: (text, mode)}."""
    token = secrets.token_hex(3)
    tmp.mkdir(parents=True, exist_ok=True)
    overlay = tmp / "overlay"
    for name in ("upper", "work", "merged"):
        (overlay / name).mkdir(parents=True)
    for path, (text, mode) in (stage or {}).items():
        staged = overlay / "upper" / path.lstrip("/")
        staged.parent.mkdir(parents=True, exist_ok=True)
        staged.write_text(text)
        staged.chmod(mode)
    host_public = (debian_root / "etc/ssh/ssh_host_ed25519_key.pub").read_text().strip()
    pbx_address, vps_address = _pick_subnet()
    known_hosts = tmp / "known_hosts"
    known_hosts.write_text(ssh_keys.known_hosts_line(
        host=vps_address, port=SSH_PORT, host_public_line=host_public))
    vps = NetnsVps(
        name=f"mtd-{token}", pbx_dev=f"mtd{token}p", vps_dev=f"mtd{token}v",
        pbx_address=pbx_address, vps_address=vps_address, root=tmp,
        host_key=ssh_keys.KeyPair(debian_root / "etc/ssh/ssh_host_ed25519_key", host_public),
        client_key=client_key, known_hosts=known_hosts,
        config_path=Path("/etc/ssh/sshd_config"),  # the VPS's own, as it sees its files
        log_path=tmp / "sshd.log", debian_root=debian_root, overlay=overlay, user=login,
    )
    async with _serving(vps) as served:
        yield served


@contextlib.asynccontextmanager
async def _serving(vps: NetnsVps) -> AsyncIterator[NetnsVps]:
    """The VPS's network and sshd up; on exit every process in it stopped and the network
    gone, whatever happened."""
    try:
        _create_network(vps)
        if vps.link.wired:
            await _start_wire(vps)
        await vps.start_sshd()
        yield vps
    finally:
        try:
            await _stop_namespace_processes(vps)
        finally:
            try:
                if vps.wire is not None:
                    await vps.wire.stop()
            finally:
                _delete_network(vps)


def external_vps(vps: NetnsVps) -> ExternalVps:
    """The stack's view of the VPS. On a Debian root the fake daemons run under that
    release's python3, from a copy of their one stdlib-only file the VPS can see
    (`fake_daemon_copy`)."""
    daemon_argv: tuple[str, ...] = ()
    if vps.debian_root is not None:
        daemon_argv = ("python3", str(fake_daemon_copy(vps)))
    return ExternalVps(
        host=vps.vps_address, port=vps.port, user=vps.user,
        key_file=vps.client_key.private_path, known_hosts=vps.known_hosts,
        remote_bin_dir=vps.remote_bin_dir, observer_host=vps.pbx_address,
        remote_daemon_argv=daemon_argv,
    )


def fake_daemon_copy(vps: NetnsVps) -> Path:
    """A copy of the fake daemon's one stdlib-only file where the VPS sees it."""
    copy = vps.root / "fake_daemon.py"
    shutil.copyfile(FAKE_DAEMON, copy)
    return copy


# -- a jump host in front of the VPS -------------------------------------------------------

JUMP_SSH_PORT = 2222  # not 22, so a hop's port is parsed and used
JUMP_ONLY_TABLE = "mtd_jump_only"  # not FAULT_TABLE: heal() must leave it in place


@dataclass
class JumpHost:
    """A second namespace with its own sshd: from the PBX, the only way to the VPS's sshd.

    `ns` is the jump's namespace as a `NetnsVps` (its veth to the PBX, sshd, processes): the
    PBX reaches the jump at `ns.vps_address:JUMP_SSH_PORT`. A second veth pair links the jump
    (`inner_jump_address`) to the VPS namespace (`inner_vps_address`), with a route there to
    the VPS's own address, and an nft table in the VPS namespace refuses SSH arriving over
    the PBX's veth. The jump accepts the VPS's client key; `known_hosts` names both hosts."""

    ns: NetnsVps
    vps: NetnsVps
    inner_jump_dev: str
    inner_vps_dev: str
    inner_jump_address: str
    inner_vps_address: str
    known_hosts: Path

    @property
    def proxy_jump(self) -> str:
        """The hop as `remote.proxy_jump` names it."""
        return f"{self.ns.user}@{self.ns.vps_address}:{self.ns.port}"


def _build_jump(tmp: Path, vps: NetnsVps) -> NetnsVps:
    token = secrets.token_hex(3)
    tmp.mkdir(parents=True, exist_ok=True)
    host_key = ssh_keys.generate(tmp / "ssh_host_ed25519_key", comment="jump-host")
    authorized = tmp / "authorized_keys"
    authorized.write_text(vps.client_key.public_line + "\n")  # one key_file for every hop
    pbx_address, jump_address = _pick_subnet()
    config_path = tmp / "sshd_config"
    config_path.write_text(sshd.config_text(
        port=JUMP_SSH_PORT, listen=jump_address, host_key=host_key.private_path,
        authorized=authorized, pid_file=tmp / "sshd.pid",
    ))
    known_hosts = tmp / "known_hosts"
    known_hosts.write_text(vps.known_hosts.read_text() + ssh_keys.known_hosts_line(
        host=jump_address, port=JUMP_SSH_PORT, host_public_line=host_key.public_line
    ))
    return NetnsVps(
        name=f"mtj-{token}", pbx_dev=f"mtj{token}p", vps_dev=f"mtj{token}j",
        pbx_address=pbx_address, vps_address=jump_address, root=tmp, host_key=host_key,
        client_key=vps.client_key, known_hosts=known_hosts, config_path=config_path,
        log_path=tmp / "sshd.log", port=JUMP_SSH_PORT,
    )


def _inner_devs(ns: NetnsVps) -> tuple[str, str]:
    """Names of the jump <-> VPS veth pair: (jump side, VPS side)."""
    stem = ns.name.replace("-", "")
    return f"{stem}i", f"{stem}w"


def _link_jump_to_vps(ns: NetnsVps, vps: NetnsVps) -> JumpHost:
    """The jump <-> VPS veth pair and route, then SSH over the PBX's veth refused."""
    jump_dev, vps_dev = _inner_devs(ns)
    jump_address, vps_address = _pick_subnet()
    run_command([IP_BINARY, "link", "add", jump_dev, "type", "veth", "peer", "name", vps_dev])
    run_command([IP_BINARY, "link", "set", jump_dev, "netns", ns.name])
    run_command([IP_BINARY, "link", "set", vps_dev, "netns", vps.name])
    run_command(ns.netns_argv([IP_BINARY, "addr", "add", f"{jump_address}/30", "dev", jump_dev]))
    run_command(ns.netns_argv([IP_BINARY, "link", "set", jump_dev, "up"]))
    run_command(vps.netns_argv([IP_BINARY, "addr", "add", f"{vps_address}/30", "dev", vps_dev]))
    run_command(vps.netns_argv([IP_BINARY, "link", "set", vps_dev, "up"]))
    # The jump reaches the VPS at the address its known_hosts line names.
    run_command(ns.netns_argv(
        [IP_BINARY, "route", "add", f"{vps.vps_address}/32", "via", vps_address]))
    rules = (
        f"table inet {JUMP_ONLY_TABLE} {{\n"
        f"  chain input {{ type filter hook input priority -20; policy accept;\n"
        f'    iifname "{vps.vps_dev}" tcp dport {vps.port} reject with tcp reset\n  }}\n'
        "}\n"
    )
    run_command(vps.netns_argv([NFT_BINARY, "-f", "-"]), stdin=rules)
    return JumpHost(
        ns=ns, vps=vps, inner_jump_dev=jump_dev, inner_vps_dev=vps_dev,
        inner_jump_address=jump_address, inner_vps_address=vps_address,
        known_hosts=ns.known_hosts,
    )


async def _stop_namespace_processes(ns: NetnsVps) -> None:
    await ns.kill_all()
    for process in [ns.sshd, *ns.spawned]:
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await asyncio.wait_for(process.wait(), COMMAND_TIMEOUT_S)


@contextlib.asynccontextmanager
async def running_jump_host(tmp: Path, vps: NetnsVps) -> AsyncIterator[JumpHost]:
    """Put a jump host in front of a running namespace VPS; on exit remove all of it (the
    VPS's SSH port is open to the PBX's veth again). `vps.reboot()` cannot be used meanwhile:
    it waits for sshd over the PBX's veth."""
    ns = _build_jump(tmp, vps)
    try:
        _create_network(ns)
        jump = _link_jump_to_vps(ns, vps)
        await ns.start_sshd()
        yield jump
    finally:
        try:
            await _stop_namespace_processes(ns)
        finally:
            with contextlib.suppress(NetnsError):
                run_command(vps.netns_argv(
                    [NFT_BINARY, "delete", "table", "inet", JUMP_ONLY_TABLE]))
            _delete_network(ns)  # the inner pair goes with the jump's namespace
            with contextlib.suppress(NetnsError):  # unless it never got there
                run_command([IP_BINARY, "link", "delete", _inner_devs(ns)[0]])

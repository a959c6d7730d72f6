"""A real OpenSSH sshd for tests: `/usr/sbin/sshd -D -e -f CONFIG` on a free loopback port.

Everything it needs (host key, sshd_config, authorized_keys, pid file) is generated under a
temp dir at run time. `running_sshd()` is an async context manager that yields an `Sshd`
and always kills and reaps the server and every session process it forked. Needs root
(the suite marks such tests `root`). Used by the tunnel, provisioning and fault tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from monitord.testing.ports import free_port
from orchestrator import sshd_session
from tests.support import ssh_keys

SSHD_BINARY = Path("/usr/sbin/sshd")
START_TIMEOUT_S = 10.0


def can_run_sshd() -> bool:
    return os.geteuid() == 0 and SSHD_BINARY.exists()


@dataclass
class Sshd:
    """A running sshd and the files a client needs to reach it."""

    host: str
    port: int
    host_key: ssh_keys.KeyPair
    client_key: ssh_keys.KeyPair
    known_hosts: Path
    config_path: Path
    log_path: Path
    process: asyncio.subprocess.Process
    user: str = "root"
    extra_authorized: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.process.pid

    def session_pids(self) -> list[int]:
        """PIDs of every sshd process serving a connection: the listener's descendants named
        `sshd` (OpenSSH <= 9.7) or `sshd-session` (>= 9.8; orchestrator/sshd_session.py)."""
        return [pid for pid in _descendants(self.pid)
                if _comm(pid) in sshd_session.SSHD_COMMANDS]

    def session_pid_for_client_port(self, client_port: int) -> int | None:
        """The per-connection sshd whose TCP peer is 127.0.0.1:client_port, if any."""
        for pid in self.session_pids():
            for peer_port in _peer_ports_of(pid, self.port):
                if peer_port == client_port:
                    return pid
        return None

    def kill_session(self, pid: int) -> None:
        """Terminate one per-connection sshd: the server drops that client's session."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    def known_hosts_for_port(self, port: int) -> Path:
        """A known_hosts file naming this sshd's host key at 127.0.0.1:port (e.g. a proxy)."""
        path = self.known_hosts.with_name(f"known_hosts_{port}")
        path.write_text(
            ssh_keys.known_hosts_line(
                host=self.host, port=port, host_public_line=self.host_key.public_line
            )
        )
        return path

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _children(pid: int) -> list[int]:
    found: list[int] = []
    task_dir = Path(f"/proc/{pid}/task")
    try:
        tasks = list(task_dir.iterdir())
    except OSError:
        return found
    for task in tasks:
        with contextlib.suppress(OSError):
            found.extend(int(p) for p in (task / "children").read_text().split())
    return found


def _descendants(pid: int) -> list[int]:
    result: list[int] = []
    stack = _children(pid)
    while stack:
        child = stack.pop()
        result.append(child)
        stack.extend(_children(child))
    return result


def _socket_inodes(pid: int) -> set[str]:
    inodes: set[str] = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    with contextlib.suppress(OSError):
        for fd in fd_dir.iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    return inodes


def _peer_ports_of(pid: int, local_port: int) -> list[int]:
    """Remote ports of established IPv4 TCP sockets of `pid` whose local port is local_port."""
    inodes = _socket_inodes(pid)
    ports: list[int] = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            cols = line.split()
            local, remote, state, inode = cols[1], cols[2], cols[3], cols[9]
            if state == "01" and inode in inodes and int(local.split(":")[1], 16) == local_port:
                ports.append(int(remote.split(":")[1], 16))
    return ports


def config_text(
    *, port: int, host_key: Path, authorized: Path, pid_file: Path, listen: str = "127.0.0.1"
) -> str:
    """The sshd_config of every test VPS: root by key only, forwarding on, no keepalive."""
    return "\n".join(
        [
            f"Port {port}",
            f"ListenAddress {listen}",
            f"HostKey {host_key}",
            f"PidFile {pid_file}",
            f"AuthorizedKeysFile {authorized}",
            "PermitRootLogin prohibit-password",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "StrictModes no",
            "UsePAM no",
            "AllowTcpForwarding yes",
            "GatewayPorts no",
            "ClientAliveInterval 0",
            "MaxStartups 100:30:200",
            "MaxSessions 50",
            "LogLevel VERBOSE",
            "PrintMotd no",
            "Subsystem sftp internal-sftp",
            "",
        ]
    )


async def _wait_accepting(host: str, port: int, process: asyncio.subprocess.Process) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.returncode is not None:
            raise RuntimeError(f"sshd exited with {process.returncode} before accepting")
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 1.0)
        except (OSError, TimeoutError):
            await asyncio.sleep(0.02)  # poll interval of a deadline loop, not a wait
            continue
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return
    raise RuntimeError(f"sshd did not accept on {host}:{port} within {START_TIMEOUT_S}s")


@dataclass(frozen=True)
class _Files:
    port: int
    host_key: ssh_keys.KeyPair
    client_key: ssh_keys.KeyPair
    authorized: Path
    config_path: Path
    known_hosts: Path
    log_path: Path


def _prepare_files(tmp: Path, *, host_key: ssh_keys.KeyPair | None) -> _Files:
    tmp.mkdir(parents=True, exist_ok=True)
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # privilege separation dir
    host_key = host_key or ssh_keys.generate(tmp / "ssh_host_ed25519_key", comment="host")
    client_key = ssh_keys.generate(tmp / "client" / "id_ed25519", comment="client")
    authorized = tmp / "authorized_keys"
    authorized.write_text(client_key.public_line + "\n")
    port = free_port()
    config_path = tmp / "sshd_config"
    config_path.write_text(
        config_text(
            port=port, host_key=host_key.private_path, authorized=authorized,
            pid_file=tmp / "sshd.pid",
        )
    )
    known_hosts = tmp / "known_hosts"
    known_hosts.write_text(
        ssh_keys.known_hosts_line(
            host="127.0.0.1", port=port, host_public_line=host_key.public_line
        )
    )
    return _Files(
        port=port, host_key=host_key, client_key=client_key, authorized=authorized,
        config_path=config_path, known_hosts=known_hosts, log_path=tmp / "sshd.log",
    )


@contextlib.asynccontextmanager
async def running_sshd(
    tmp: Path,
    *,
    host_key: ssh_keys.KeyPair | None = None,
    extra_authorized: tuple[str, ...] = (),
) -> AsyncIterator[Sshd]:
    """Start sshd under `tmp` and yield it; on exit kill the server and all its sessions.

    A given `host_key` lets a test restart "the same VPS"; leave it None for a fresh one."""
    prepared = _prepare_files(tmp, host_key=host_key)
    port, config_path, known_hosts, log_path = (
        prepared.port, prepared.config_path, prepared.known_hosts, prepared.log_path
    )
    host_key, client_key = prepared.host_key, prepared.client_key
    extra = list(extra_authorized)
    if extra:
        with prepared.authorized.open("a") as f:
            f.write("\n".join(extra) + "\n")
    log_file = log_path.open("ab")
    process = await asyncio.create_subprocess_exec(
        str(SSHD_BINARY), "-D", "-e", "-f", str(config_path),
        stdin=asyncio.subprocess.DEVNULL, stdout=log_file, stderr=log_file,
    )
    sshd = Sshd(
        host="127.0.0.1", port=port, host_key=host_key, client_key=client_key,
        known_hosts=known_hosts, config_path=config_path, log_path=log_path, process=process,
        extra_authorized=extra,
    )
    try:
        await _wait_accepting("127.0.0.1", port, process)
        yield sshd
    finally:
        sessions = sshd.session_pids()
        if process.returncode is None:
            process.kill()
        for pid in sessions:
            sshd.kill_session(pid)
        await asyncio.wait_for(process.wait(), 10)
        log_file.close()

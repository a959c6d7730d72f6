"""One recognition of an SSH session process (orchestrator/sshd_session.py), used the same way by
the VPS side's lease identity, liveness and fence (monitord/vps/tunnel_lease.py, on a fake /proc
tree) and by the PBX side's port-holder diagnosis (monitord/remote/tunnel/port_holder.py, on
the probe's text), for both OpenSSH generations: `sshd` per connection (<= 9.7) and
`sshd-session` (>= 9.8, with `sshd-auth` before authentication in 10.x)."""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from monitord.remote.tunnel.port_holder import parse_probe
from monitord.vps import tunnel_lease
from orchestrator.forward_diagnosis import HolderKind
from orchestrator.sshd_session import ProcessFacts, Role, role
from orchestrator.tunnel_lease import SessionIdentity

SSH_PORT = 22
SSH_CONNECTION = f"10.0.0.1 50104 10.0.0.2 {SSH_PORT}"
LISTENER_INODE = "31337"


class TestTheRecognition:
    """A session is `sshd-session`, or an `sshd` under another sshd; never the listener."""

    @pytest.mark.parametrize(("comm", "parent", "listens", "expected"), [
        ("sshd", "systemd", None, Role.LISTENER),          # every generation's listener
        ("sshd", "init", False, Role.LISTENER),
        ("sshd", "", None, Role.LISTENER),                 # parent unreadable: not a session
        ("sshd", "sshd", None, Role.SESSION),              # <= 9.7, root or [priv]'s child
        ("sshd", "sshd", True, Role.LISTENER),             # a listener started from a session
        ("sshd-session", "sshd", None, Role.SESSION),      # >= 9.8 monitor
        ("sshd-session", "sshd-session", None, Role.SESSION),  # >= 9.8 the user's child
        ("sshd-session", "systemd", None, Role.SESSION),   # orphaned by an sshd restart
        ("sshd-session", "sshd", True, Role.LISTENER),
        ("sshd-auth", "sshd-session", None, Role.PRE_AUTH),
        ("python3", "sshd-session", None, Role.NOT_SSHD),
        ("nats-server", "systemd", True, Role.NOT_SSHD),
    ])
    def test_role_by_structure(self, comm: str, parent: str, listens: bool | None,
                               expected: Role) -> None:
        assert role(ProcessFacts(comm=comm, parent_comm=parent,
                                 listens_on_ssh_port=listens)) is expected


# -- a fake /proc -------------------------------------------------------------------------
@dataclass
class FakeProc:
    """A /proc tree on disk: stat files, socket descriptors and the net tables."""

    root: Path
    ticks: dict[int, int] = field(default_factory=dict)
    killed: list[tuple[int, int]] = field(default_factory=list)

    def add(self, pid: int, comm: str, ppid: int, *, listen_inode: str | None = None) -> None:
        directory = self.root / str(pid)
        (directory / "fd").mkdir(parents=True)
        self.ticks[pid] = 1000 + pid
        fields = ["S", str(ppid), str(pid), str(pid), *["0"] * 15, str(self.ticks[pid]), "0"]
        (directory / "stat").write_text(f"{pid} ({comm}) {' '.join(fields)}\n")
        (directory / "fd" / "0").symlink_to("/dev/null")
        if listen_inode is not None:
            (directory / "fd" / "3").symlink_to(f"socket:[{listen_inode}]")

    def remove(self, pid: int) -> None:
        for path in sorted((self.root / str(pid)).rglob("*"), reverse=True):
            path.unlink() if path.is_symlink() or path.is_file() else path.rmdir()
        (self.root / str(pid)).rmdir()

    def identity(self, pid: int) -> SessionIdentity:
        return SessionIdentity(sshd_pid=pid, sshd_start_ticks=self.ticks[pid],
                               ssh_connection=SSH_CONNECTION)


def _tcp_table(port: int, inode: str) -> str:
    header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid" \
             "  timeout inode\n"
    address = f"{int.from_bytes(socket.inet_aton('0.0.0.0'), 'little'):08X}:{port:04X}"
    return header + f"   0: {address} 00000000:0000 0A 00000000:00000000 00:00000000 00000000" \
                    f"     0        0 {inode} 1 0000000000000000 100 0 0 10 0\n"


@pytest.fixture
def fake_proc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeProc]:
    proc = FakeProc(root=tmp_path / "proc")
    (proc.root / "net").mkdir(parents=True)
    (proc.root / "net" / "tcp").write_text(_tcp_table(SSH_PORT, LISTENER_INODE))
    monkeypatch.setattr(tunnel_lease, "PROC_ROOT", proc.root)
    monkeypatch.setenv("SSH_CONNECTION", SSH_CONNECTION)

    def fake_kill(pid: int, sig: int) -> None:
        proc.killed.append((pid, sig))
        if (proc.root / str(pid)).exists():
            proc.remove(pid)

    monkeypatch.setattr(tunnel_lease.os, "kill", fake_kill)
    yield proc


def _tree(proc: FakeProc, generation: str, *, caller_parent: int) -> None:
    """systemd -> sshd listener -> the connection's processes -> sh (caller_parent).

    The connection: `old` = OpenSSH <= 9.7 with a privileged monitor (`sshd [priv]` 450) and
    the user's `sshd` 500; `new` = >= 9.8 `sshd-session` 450 -> `sshd-session` 500, and a
    second connection still authenticating (`sshd-session` 460 -> `sshd-auth` 461)."""
    proc.add(1, "systemd", 0)
    proc.add(400, "sshd", 1, listen_inode=LISTENER_INODE)
    name = "sshd" if generation == "old" else "sshd-session"
    proc.add(450, name, 400)
    proc.add(500, name, 450)
    if generation == "new":
        proc.add(460, "sshd-session", 400)
        proc.add(461, "sshd-auth", 460)
    proc.add(caller_parent, "sh", 500)


GENERATIONS = ["old", "new"]


@pytest.mark.parametrize("generation", GENERATIONS)
class TestTheVpsSideOnAFakeProcTree:
    """The lease names the nearest session process, sees it die, and fences only sessions."""

    def test_the_lease_identity_is_the_connections_own_process_not_the_listener(
        self, fake_proc: FakeProc, generation: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        _tree(fake_proc, generation, caller_parent=600)
        monkeypatch.setattr(tunnel_lease.os, "getppid", lambda: 600)
        session = tunnel_lease._caller_session()
        assert (session.sshd_pid, session.sshd_start_ticks) == (500, fake_proc.ticks[500])

    def test_a_session_is_alive_until_its_process_goes_and_the_listener_never_is_one(
        self, fake_proc: FakeProc, generation: str
    ) -> None:
        _tree(fake_proc, generation, caller_parent=600)
        assert tunnel_lease._session_alive(fake_proc.identity(500))
        assert not tunnel_lease._session_alive(fake_proc.identity(400))
        fake_proc.remove(600)
        fake_proc.remove(500)
        assert not tunnel_lease._session_alive(fake_proc.identity(500))

    def test_a_fence_ends_a_stale_session_of_another_connection(
        self, fake_proc: FakeProc, generation: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        _tree(fake_proc, generation, caller_parent=600)
        fake_proc.add(700, "sshd" if generation == "old" else "sshd-session", 400)  # ours
        monkeypatch.setattr(tunnel_lease.os, "getpid", lambda: 700)
        assert tunnel_lease._fence(500, fake_proc.ticks[500])
        assert fake_proc.killed == [(500, signal.SIGTERM)]

    def test_a_fence_aimed_at_the_listener_is_refused_and_sends_nothing(
        self, fake_proc: FakeProc, generation: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        _tree(fake_proc, generation, caller_parent=600)
        monkeypatch.setattr(tunnel_lease.os, "getpid", lambda: 999)
        assert not tunnel_lease._fence(400, fake_proc.ticks[400])
        assert tunnel_lease._fence_op(400, fake_proc.ticks[400])["ok"] is False
        assert fake_proc.killed == []

    def test_a_fence_at_a_listener_under_an_sshd_is_refused_by_its_listening_socket(
        self, fake_proc: FakeProc, generation: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A second sshd started from inside a session has an sshd parent: its socket on
        the SSH port still names it a listener."""
        _tree(fake_proc, generation, caller_parent=600)
        fake_proc.add(800, "sshd", 500, listen_inode=LISTENER_INODE)
        monkeypatch.setattr(tunnel_lease.os, "getpid", lambda: 999)
        assert not tunnel_lease._fence(800, fake_proc.ticks[800])
        assert fake_proc.killed == []

    def test_our_own_session_and_a_reused_pid_are_never_fenced(
        self, fake_proc: FakeProc, generation: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        _tree(fake_proc, generation, caller_parent=600)
        fake_proc.add(601, "python3", 600)
        monkeypatch.setattr(tunnel_lease.os, "getpid", lambda: 601)
        assert not tunnel_lease._fence(500, fake_proc.ticks[500])
        assert not tunnel_lease._fence(450, fake_proc.ticks[450] + 1)
        assert fake_proc.killed == []


class TestANonRootLogin:
    """A login that may not read the listener's descriptors still tells sessions from it."""

    @pytest.mark.parametrize("generation", GENERATIONS)
    def test_the_parent_rule_alone_keeps_the_listener_out(
        self, fake_proc: FakeProc, generation: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        _tree(fake_proc, generation, caller_parent=600)
        real_listdir = os.listdir

        def listdir(path: str | os.PathLike[str]) -> list[str]:
            if str(path).endswith("/fd"):
                raise PermissionError(13, "Permission denied", str(path))
            return real_listdir(path)

        monkeypatch.setattr(tunnel_lease.os, "listdir", listdir)
        monkeypatch.setattr(tunnel_lease.os, "getppid", lambda: 600)
        monkeypatch.setattr(tunnel_lease.os, "getpid", lambda: 999)
        assert tunnel_lease._caller_session().sshd_pid == 500
        assert not tunnel_lease._fence(400, fake_proc.ticks[400])
        assert fake_proc.killed == []


class TestTheVpsSideOnOpenSsh10:
    def test_a_pre_auth_helper_is_never_a_session_nor_fenced(
        self, fake_proc: FakeProc, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        _tree(fake_proc, "new", caller_parent=600)
        monkeypatch.setattr(tunnel_lease.os, "getpid", lambda: 999)
        assert not tunnel_lease._session_alive(fake_proc.identity(461))
        assert not tunnel_lease._fence(461, fake_proc.ticks[461])
        assert fake_proc.killed == []


# -- the PBX side: the probe's text ------------------------------------------------------
def _probe(holder: str, pid: int, *, parent: str, ssh_listener_pid: int = 700) -> str:
    return (
        f'LISTEN 0 128 127.0.0.1:4222 0.0.0.0:* users:(("{holder}",pid={pid},fd=5))\n'
        f"@@stat\n{pid} ({holder}) S 6196 6196 6196 0 -1 4194560 7 0 0 0 1 2 0 0 20 0 1 0 98765"
        " 1 2 3\n"
        f"@@parent\n6196 ({parent}) S 1 6196 6196 0 -1 4194560 7 0 0 0 1 2 0 0 20 0 1 0 9876"
        " 1 2 3\n"
        f'@@sshd_listen\nLISTEN 0 128 0.0.0.0:22 0.0.0.0:* users:(("sshd",pid={ssh_listener_pid}'
        ",fd=3))\n"
        "@@estab\n"
        f'0 0 10.0.0.2:22 10.0.0.1:50200 users:(("{holder}",pid={pid},fd=4)) lastrcv:9000\n'
        "@@self\n10.0.0.1 50104 10.0.0.2 22\n"
    )


class TestThePbxSideDiagnosis:
    """The port holder is an SSH session exactly when the VPS side would call it one."""

    @pytest.mark.parametrize(("holder", "parent"), [
        ("sshd", "sshd"), ("sshd-session", "sshd-session"), ("sshd-session", "sshd"),
    ])
    def test_a_session_of_either_generation_holds_the_port(self, holder: str,
                                                          parent: str) -> None:
        observed = parse_probe(_probe(holder, 6200, parent=parent), port=4222)
        assert observed.holder.kind is HolderKind.SSHD
        assert (observed.holder.pid, observed.holder.lastrcv_s) == (6200, 9.0)
        assert observed.start_ticks == 98765

    def test_the_listener_holding_the_port_is_foreign_never_a_session(self) -> None:
        by_parent = parse_probe(_probe("sshd", 700, parent="systemd"), port=4222).holder
        by_socket = parse_probe(_probe("sshd", 700, parent="sshd-session"), port=4222).holder
        for holder in (by_parent, by_socket):
            assert holder.kind is HolderKind.OTHER
            assert "listener" in holder.command

    def test_without_the_listeners_pid_in_ss_the_parent_decides(self) -> None:
        """A non-root login's `ss -p` names no process of root's listener."""
        def unnamed(text: str) -> str:
            return text.replace('users:(("sshd",pid=700,fd=3))', "")

        session = parse_probe(unnamed(_probe("sshd", 6200, parent="sshd")), port=4222).holder
        listener = parse_probe(unnamed(_probe("sshd", 700, parent="systemd")), port=4222).holder
        assert (session.kind, listener.kind) == (HolderKind.SSHD, HolderKind.OTHER)

    def test_a_pre_auth_helper_or_another_program_is_foreign(self) -> None:
        for name in ("sshd-auth", "python3"):
            holder = parse_probe(_probe(name, 6200, parent="sshd-session"), port=4222).holder
            assert (holder.kind, holder.pid) == (HolderKind.OTHER, 6200)
            assert holder.command.startswith(name)


def test_the_fake_tree_is_not_the_real_proc(fake_proc: FakeProc) -> None:
    """The seam is honoured: nothing here reads the machine's own processes."""
    assert tunnel_lease._stat(os.getpid()) is None

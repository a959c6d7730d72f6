"""Which process on the VPS is an SSH session: one recognition for both sides, pure.

OpenSSH runs one listener and, per connection, its own processes:

| OpenSSH          | listener | per connection (owns forwards, parent of commands) | pre-auth   |
|------------------|----------|----------------------------------------------------|------------|
| <= 9.7           | `sshd`   | `sshd` (forked by the listener; `[priv]` above it)  | -          |
| 9.8, 9.9         | `sshd`   | `sshd-session` (exec'd by the listener)            | -          |
| >= 10.0          | `sshd`   | `sshd-session`                                     | `sshd-auth` |

A *session process* is therefore recognised by structure, not by one name:
- `sshd-auth` is never one (it has not authenticated anybody);
- a process that listens on the SSH port is the listener, never one;
- `sshd-session` is one (only per-connection processes carry that name);
- `sshd` is one only as the child of another sshd process: the listener is an `sshd`
  whose parent is something else (init, systemd, a container runtime, a test harness).

Callers: the VPS side (monitord/vps/tunnel_lease.py: the lease's session identity, its
liveness and the fence, from /proc) and the PBX side (monitord/remote/tunnel/port_holder.py:
who holds a forwarded port, from `ss` and /proc over SSH). Both read the facts their way and
ask `role()`; a fence is only ever aimed at a `Role.SESSION`. Ships in monitord.pyz: Python
3.9, standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.text_enum import TextEnum

LISTENER_COMMAND = "sshd"
SESSION_COMMAND = "sshd-session"  # OpenSSH >= 9.8
PRE_AUTH_COMMAND = "sshd-auth"  # OpenSSH >= 10.0
SSHD_COMMANDS = frozenset({LISTENER_COMMAND, SESSION_COMMAND})


class Role(TextEnum):
    SESSION = "session"
    LISTENER = "listener"
    PRE_AUTH = "pre_auth"
    NOT_SSHD = "not_sshd"


@dataclass(frozen=True)
class ProcessFacts:
    """What a recognition needs to know of one process.

    `comm` and `parent_comm` are kernel command names (/proc/PID/stat's second field, as
    `ss -p` shows them too); `parent_comm` is "" when the parent could not be read.
    `listens_on_ssh_port` is None when that could not be checked (another user's sockets)."""

    comm: str
    parent_comm: str
    listens_on_ssh_port: bool | None = None


def role(facts: ProcessFacts) -> Role:
    """The role of one process, by the module table."""
    if facts.comm == PRE_AUTH_COMMAND:
        return Role.PRE_AUTH
    if facts.comm not in SSHD_COMMANDS:
        return Role.NOT_SSHD
    if facts.listens_on_ssh_port:
        return Role.LISTENER
    if facts.comm == SESSION_COMMAND:
        return Role.SESSION
    return Role.SESSION if facts.parent_comm in SSHD_COMMANDS else Role.LISTENER


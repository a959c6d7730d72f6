"""Who holds a TCP port on the VPS, observed with `ss` over the keeper's own connection.

One exec runs a fixed /bin/sh script (the port travels as "$1", never as script text):
1. `ss -Htlnp 'sport = :PORT'` — the listener and its process
   (`users:(("sshd-session",pid=P,…))`, `("sshd",…)` up to OpenSSH 9.7);
2. for that PID: /proc/P/stat (its start time, field 22, so a fence can never hit a reused
   PID) and its parent's /proc/PPID/stat (the parent's command name);
3. `ss -Htlnp 'sport = :SSHD_PORT'` — who listens on the SSH port itself (the listener);
4. `ss -HtnpiO state established '( sport = :SSHD_PORT )'` — the sessions' client sockets
   with `lastrcv:` (ms since the client last sent anything), SSHD_PORT taken from our own
   $SSH_CONNECTION.
The text is parsed here into an orchestrator `PortHolder`: the holder is an SSH session
(`HolderKind.SSHD`) only if orchestrator/sshd_session.py recognises it as one — the
recognition the VPS side's lease and fence use — so the listener, a pre-auth helper or any
other program is foreign. forwards.py asks orchestrator/forward_diagnosis.py what it means.
Fencing itself goes through `monitord tunnel-lease fence` (lease_client.py), which re-checks
the identity on the VPS.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import asyncssh

from monitord.base import outside_text
from monitord.remote import remote_exec
from orchestrator import sshd_session
from orchestrator.errors import ErrorCode, TransientError
from orchestrator.forward_diagnosis import HolderKind, PortHolder

PROBE_SCRIPT = r"""
port="$1"
ss -Htlnp "sport = :$port" 2>&1
echo '@@stat'
pid=$(ss -Htlnp "sport = :$port" | sed -n 's/.*pid=\([0-9][0-9]*\),.*/\1/p' | head -n 1)
[ -n "$pid" ] && cat "/proc/$pid/stat" 2>/dev/null
echo '@@parent'
ppid=$( [ -n "$pid" ] && sed 's/.*) //' "/proc/$pid/stat" 2>/dev/null | cut -d' ' -f2)
[ -n "$ppid" ] && cat "/proc/$ppid/stat" 2>/dev/null
sshd_port="${SSH_CONNECTION##* }"
echo '@@sshd_listen'
ss -Htlnp "sport = :$sshd_port" 2>&1
echo '@@estab'
ss -HtnpiO state established "( sport = :$sshd_port )" 2>&1
echo '@@self'
echo "$SSH_CONNECTION"
"""

# Numbers in `ss` output are ASCII digits of bounded length (`\d` also matches "١", and
# int() of 5000 digits raises): a PID that is not one names no process.
_USERS = re.compile(r'users:\(\("(?P<name>[^"]{0,64})",pid=(?P<pid>[0-9]{1,10}),', re.ASCII)
_LASTRCV = re.compile(r"\blastrcv:([0-9]{1,15})\b", re.ASCII)
MAX_PROBE_BYTES = 256 * 1024
_ROLE_NOTE = {
    sshd_session.Role.LISTENER: ": the VPS's sshd listener itself",
    sshd_session.Role.PRE_AUTH: ": an unauthenticated connection's helper",
}


@dataclass(frozen=True)
class HolderObservation:
    """A parsed probe: the holder, its start ticks (for fencing) and our own connection."""

    holder: PortHolder
    start_ticks: int | None
    our_ssh_connection: str


async def observe(
    conn: asyncssh.SSHClientConnection, port: int, *, timeout_s: float
) -> HolderObservation:
    """Run the probe script on the VPS and parse it."""
    result = await remote_exec.run_script(conn, PROBE_SCRIPT, args=[str(port)],
                                          timeout_s=timeout_s, max_stdout=MAX_PROBE_BYTES)
    if result.stdout_truncated:
        raise TransientError(
            ErrorCode.VPS_REPLY_INVALID,
            f"port {port} on the VPS: more than {MAX_PROBE_BYTES} bytes of `ss` output",
        )
    if not result.ok:
        raise TransientError(
            ErrorCode.FORWARD_DENIED,
            f"could not inspect port {port} on the VPS: {result.stderr_tail()}",
        )
    return parse_probe(result.text, port=port)


def _sections(text: str) -> dict[str, list[str]]:
    sections: dict[str, list[str]] = {"listen": []}
    current = "listen"
    for line in text.splitlines():
        if line.startswith("@@"):
            current = line[2:].strip()
            sections[current] = []
        elif line.strip():
            sections[current].append(line.strip())
    return sections


def parse_probe(text: str, *, port: int) -> HolderObservation:
    """Turn the probe script's output into a HolderObservation (pure; unit-testable)."""
    sections = _sections(text)
    ours = (sections.get("self") or [""])[0]
    listener = next((line for line in sections["listen"] if _USERS.search(line)), None)
    if listener is None:
        # Either nobody listens any more, or ss could not name the process.
        kind = HolderKind.OTHER if sections["listen"] else HolderKind.NONE
        return HolderObservation(
            holder=PortHolder(port=port, kind=kind, command="unknown (ss showed no process)"),
            start_ticks=None,
            our_ssh_connection=ours,
        )
    users = _USERS.search(listener)
    assert users is not None
    pid = int(users["pid"])
    name = outside_text.clean(users["name"], limit=64)  # the VPS's words, shown in details
    start_ticks = _start_ticks(sections.get("stat", []))
    role = sshd_session.role(sshd_session.ProcessFacts(
        comm=name, parent_comm=_comm(sections.get("parent", [])),
        listens_on_ssh_port=_listens_on_ssh_port(sections.get("sshd_listen", []), pid),
    ))
    if role is not sshd_session.Role.SESSION:
        command = name + _ROLE_NOTE.get(role, "")
        holder = PortHolder(port=port, kind=HolderKind.OTHER, pid=pid, command=command)
        return HolderObservation(holder=holder, start_ticks=start_ticks, our_ssh_connection=ours)
    lastrcv_s: float | None = None
    client = ""
    for line in sections.get("estab", []):
        if f"pid={pid}," not in line:
            continue
        match = _LASTRCV.search(line)
        cols = line.split()
        client = cols[3] if len(cols) > 3 else ""
        # No lastrcv field means nothing was ever received: count it as silent since start.
        lastrcv_s = int(match.group(1)) / 1000.0 if match else float("inf")
        break
    holder = PortHolder(
        port=port, kind=HolderKind.SSHD, pid=pid, command=name, lastrcv_s=lastrcv_s,
        client=client,
    )
    return HolderObservation(holder=holder, start_ticks=start_ticks, our_ssh_connection=ours)


def _comm(lines: list[str]) -> str:
    """The command name in a /proc/PID/stat line ("" if there is none)."""
    if not lines or "(" not in lines[0] or ")" not in lines[0]:
        return ""
    raw = lines[0]
    return raw[raw.index("(") + 1 : raw.rindex(")")]


def _listens_on_ssh_port(lines: list[str], pid: int) -> bool | None:
    """Is `pid` among the processes listening on the SSH port? None when `ss` named no
    process there (another user's sockets: not ours to see)."""
    named = [line for line in lines if _USERS.search(line)]
    if not named:
        return None
    return any(f"pid={pid}," in line for line in named)


def _start_ticks(lines: list[str]) -> int | None:
    if not lines:
        return None
    raw = lines[0]
    try:
        field = raw[raw.rindex(")") + 2 :].split()[19]
    except (ValueError, IndexError):
        return None
    return int(field) if re.fullmatch(r"[0-9]{1,19}", field, re.ASCII) else None

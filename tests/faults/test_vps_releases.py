"""The promises that depend on the VPS's release, proven on each Debian a VPS runs today
(tests/faults/debian_root.py: 11 with OpenSSH 8.4 and Python 3.9, 12 with 9.2 and 3.11, 13 with
10.0 and 3.13): that root's sshd serves the tunnel, its python3 runs the agent, the lease
verb, the log sink and the fake daemons.

Checked on each: that python3 runs the VPS side and the daemons; the session the lease names
is the connection's own process (`sshd` up to 9.7, `sshd-session` since 9.8), never the
listener; a monitord that dies while its SSH session goes stale is followed by one that
fences that session and serves again (not PORT_OCCUPIED); the area moves to the VPS and
back; a fence aimed at the VPS's sshd listener is refused. (The foreign port holder runs on
each release in test_vps_faults.py.)
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from monitord.testing.stack import Stack
from tests.faults.conftest import RELEASE_MATRIX, FaultStackFactory
from tests.faults.debian_root import Release, release_of
from tests.faults.netns_vps import NetnsVps

# The per-connection process that owns the forwards, by generation (`ssh -V` of the root).
SHELLS = {"bash", "dash", "sh"}
SESSION_COMMAND = {"OpenSSH_8.4": "sshd", "OpenSSH_9.2": "sshd", "OpenSSH_10.0": "sshd-session"}


def _comm(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def _start_ticks(pid: int) -> int:
    raw = Path(f"/proc/{pid}/stat").read_text()
    return int(raw[raw.rindex(")") + 2 :].split()[19])


def _lease(vps: NetnsVps) -> dict[str, Any]:
    record = json.loads((vps.remote_bin_dir / "tunnel_lease.json").read_text())
    assert isinstance(record, dict)
    return record


def _release(vps: NetnsVps) -> Release:
    assert vps.debian_root is not None
    return release_of(vps.debian_root)


def _interpreters(vps: NetnsVps, marker: bytes) -> set[str]:
    """The interpreter (its file name, e.g. python3.9) of every process on the VPS whose
    command line holds `marker`, but for the login shells that run such a command line."""
    found: set[str] = set()
    for pid in vps.pids():
        try:
            if marker in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.add(Path(os.readlink(f"/proc/{pid}/exe")).name)
        except OSError:
            continue
    return found - SHELLS


async def _tunnel(stack: Stack) -> dict[str, Any]:
    state = (await stack.status())["tunnel"]
    assert isinstance(state, dict)
    return state


async def _ssh(vps: NetnsVps, *argv: str) -> tuple[int, str]:
    """Run a command on the VPS over a fresh SSH connection (OpenSSH's own client)."""
    process = await asyncio.create_subprocess_exec(
        "ssh", "-i", str(vps.client_key.private_path), "-o", "BatchMode=yes",
        "-o", f"UserKnownHostsFile={vps.known_hosts}", "-o", "StrictHostKeyChecking=yes",
        "-p", str(vps.port), f"{vps.user}@{vps.vps_address}", "--", *argv,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode is not None
    return process.returncode, out.decode(errors="replace")


@pytest.mark.parametrize("netns_vps", RELEASE_MATRIX, indirect=True)
class TestAStaleSessionAfterACrash:
    """The next monitord fences its dead predecessor's stale session and serves again."""

    async def test_the_next_monitord_recovers_the_tunnel_and_the_area_moves_there_and_back(
        self, fault_stack: FaultStackFactory, netns_vps: NetnsVps
    ) -> None:
        stack = await fault_stack(services={"tg": 1})
        (area,) = stack.areas["tg"]
        await stack.place("tg", "remote")
        await stack.wait_settled(expect={"tg": "remote"}, timeout_s=90)

        # The lease names the connection's own process of this release, never the listener.
        session = _lease(netns_vps)["session"]
        stale_pid, client_port = session["sshd_pid"], int(session["ssh_connection"].split()[1])
        assert netns_vps.sshd is not None and stale_pid != netns_vps.sshd.pid
        release = _release(netns_vps)
        assert _comm(stale_pid) == SESSION_COMMAND[release.openssh]
        # That release's python3 runs the VPS side (agent, lease verb, lease guards with
        # their log sink) and the daemons: 3.9 on Debian 11.
        python = f"python{release.python}"
        assert _interpreters(netns_vps, b"monitord.pyz") == {python}
        assert _interpreters(netns_vps, b"fake_daemon.py") == {python}
        code, version = await _ssh(netns_vps, "ssh", "-V")
        assert code == 0 and version.startswith(release.openssh), version

        # monitord dies while its SSH session goes stale: the VPS never hears of either.
        netns_vps.black_hole_client(client_port)
        assert stack.daemon is not None
        stack.daemon.kill()
        assert await stack.wait_monitord_exit(timeout_s=30) == -signal.SIGKILL
        assert _comm(stale_pid) is not None, "the VPS still has the stale session"
        before = len(stack.log_lines)

        started = time.monotonic()
        await stack.start_monitord()

        async def connected() -> bool:
            return bool((await _tunnel(stack))["connected"])

        await stack.wait_until(connected, timeout_s=60, what="the tunnel back")
        print(f"Debian {release.debian}: tunnel back {time.monotonic() - started:.2f} s after"
              " the next monitord started")
        tunnel = await _tunnel(stack)
        assert tunnel["fenced_sessions"] >= 1, tunnel
        assert _comm(stale_pid) is None, "the stale session was fenced"
        assert not any("PORT_OCCUPIED" in line for line in stack.log_lines[before:])
        await stack.wait_settled(expect={"tg": "remote"}, timeout_s=90)
        assert [k.side for k in stack.detector.alive(area)] == ["remote"]

        # ... and back home.
        await stack.place("tg", "local")
        await stack.wait_settled(expect={"tg": "local"}, timeout_s=90)
        assert [k.side for k in stack.detector.alive(area)] == ["local"]


@pytest.mark.parametrize("netns_vps", RELEASE_MATRIX, indirect=True)
class TestNoFenceHitsTheListener:
    """The lease verb's fence, aimed at the VPS's own sshd listener, refuses and sends nothing."""

    async def test_a_fence_at_the_listener_is_refused_and_sshd_keeps_serving(
        self, fault_stack: FaultStackFactory, netns_vps: NetnsVps
    ) -> None:
        stack = await fault_stack(services={"tg": 1})
        await stack.wait_settled(expect={"tg": "local"}, timeout_s=90)  # provisioned
        assert netns_vps.sshd is not None
        listener = netns_vps.sshd.pid
        assert _comm(listener) == "sshd"
        bin_dir = str(netns_vps.remote_bin_dir)
        code, out = await _ssh(
            netns_vps, "python3", "-I", f"{bin_dir}/monitord.pyz", "tunnel-lease", "--dir",
            bin_dir, "fence", "--pid", str(listener), "--start-ticks",
            str(_start_ticks(listener)),
        )
        assert code == 0, out
        assert json.loads(out.splitlines()[-1])["ok"] is False, out
        assert netns_vps.sshd.returncode is None and _comm(listener) == "sshd"
        assert (await _ssh(netns_vps, "true"))[0] == 0  # still accepting

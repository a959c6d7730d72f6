"""The promises that depend on the VPS's release, proven on each Debian a VPS runs today
(tests/faults/debian_root.py: 11 with OpenSSH 8.4, Python 3.9 and SQLite 3.34.1, 12 with 9.2,
3.11 and 3.40.1, 13 with 10.0, 3.13 and 3.46.1): that root's sshd serves the tunnel, its
python3 runs the agent, the lease verb, the log sink and the fake daemons.

Checked on each: that python3 runs the VPS side and the daemons; the session the lease names
is the connection's own process (`sshd` up to 9.7, `sshd-session` since 9.8), never the
listener; a monitord that dies while its SSH session goes stale is followed by one that
fences that session and serves again (not PORT_OCCUPIED); the area moves to the VPS and
back by the blocks that changed, that python3 digesting them (the agent's `copy/staging`
action `blocks` for what a cut copy left in the staging dir, which the move out resumes from;
its `copy/blocks` for the data dir, which the move home fetches against the PBX's archive);
a fence aimed at the VPS's sshd listener is refused; an area moved there is warm-copied while
its daemon commits to a SQLite store in WAL mode, the agent's snapshot (monitord.vps.
warm_snapshot: SQLite's backup API, read-only through /proc/self/fd) by that python3 and its
SQLite, each copy one whole file that holds what was committed on the VPS. (The foreign port
holder runs on each release in test_vps_faults.py.)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from monitord.base import tree_digest
from monitord.testing.stack import Stack
from orchestrator.block_delta import BLOCK_BYTES as PAGE
from tests.faults.conftest import RELEASE_MATRIX, FaultStackFactory
from tests.faults.debian_root import Release, release_of
from tests.faults.netns_vps import NetnsVps

# The per-connection process that owns the forwards, by generation (`ssh -V` of the root).
SHELLS = {"bash", "dash", "sh"}
SESSION_COMMAND = {"OpenSSH_8.4": "sshd", "OpenSSH_9.2": "sshd", "OpenSSH_10.0": "sshd-session"}
# The area's store (`media.bin`, which its fake daemon never writes): large enough that a
# file fetched whole stands out of the few pages that change.
STORE_PAGES = 256
STORE = "media.bin"
# Warm copies of the area's SQLite store (the fake daemon's `--store sqlite`), every second.
SQLITE_DB = "session.sqlite"
WARM = {"warm_copy": "sqlite", "warm_copy_databases": [SQLITE_DB], "warm_copy_interval_s": 1.0}
SQLITE_STORE = ("--store", "sqlite")


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


async def _warm_copy(stack: Stack, area: str) -> dict[str, Any] | None:
    """The area's newest warm copy as the status shows it, None until one is taken."""
    [row] = [a for a in (await stack.status())["services"]["tg"]["areas"] if a["uuid"] == area]
    copy = row["warm_copy"]
    return copy if copy and copy["taken_at"] is not None else None


def _records(db: Path, *, journal_mode: str | None = None) -> int:
    """The records of the SQLite store `db`, opened by the PBX's sqlite3, once it checks whole
    (and is in `journal_mode`, if given)."""
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        if journal_mode is not None:
            assert conn.execute("PRAGMA journal_mode").fetchone() == (journal_mode,)
        return int(conn.execute("SELECT count(*) FROM records").fetchone()[0])


def _remote_records(stack: Stack, area: str) -> int:
    """The most records a daemon of the area on the VPS has reported to the detector."""
    return max(life.records for life in stack.detector.lives(area) if life.key.side == "remote")


def _rewrite_pages(data: bytes, *indexes: int) -> bytes:
    """`data` with those 4 KiB pages rewritten, as an account's SQLite store changes."""
    changed = bytearray(data)
    for index in indexes:
        changed[index * PAGE:(index + 1) * PAGE] = os.urandom(PAGE)
    return bytes(changed)


async def _logged(stack: Stack, name: str, *, since: int) -> dict[str, Any]:
    """The last `name` event the stack's monitord logged after line `since`."""
    def found() -> list[dict[str, Any]]:
        return [e for e in map(_json_or_none, stack.log_lines[since:])
                if isinstance(e, dict) and e.get("event") == name]

    await stack.wait_until(found, timeout_s=10, what=f"{name} logged")
    return found()[-1]


def _copy_facts(event: dict[str, Any]) -> dict[str, Any]:
    """What a copy's event says it moved (for a failed assertion's message)."""
    return {k: event[k] for k in ("event", "from_side", "files", "bytes", "reused",
                                  "sent_bytes", "resumed_bytes") if k in event}


def _json_or_none(line: str) -> Any:
    try:
        return json.loads(line)
    except ValueError:
        return None


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
        # Every move pre-copies (not by the adaptive rule's measurements): the events below
        # are each move's.
        stack = await fault_stack(services={"tg": 1}, data_bytes=STORE_PAGES * PAGE,
                                  remote_overrides={"pre_copy_min_bytes": 0})
        (area,) = stack.areas["tg"]
        store = (stack.root / "pbx" / "tg" / area / STORE).read_bytes()
        size = len(store)
        remote_dir = netns_vps.remote_bin_dir / "data" / "tg" / area
        # A copy cut by the link left three quarters of the store in the VPS's staging dir,
        # two of its pages since changed on the PBX: the move out resumes from it, by the
        # blocks the agent digests there (`copy/staging` action `blocks`).
        staging = tree_digest.staging_dir(remote_dir)
        staging.mkdir(parents=True)
        left = STORE_PAGES * 3 // 4 * PAGE
        (staging / STORE).write_bytes(_rewrite_pages(store[:left], 3, 100))
        since = len(stack.log_lines)
        await stack.place("tg", "remote")
        await stack.wait_settled(expect={"tg": "remote"}, timeout_s=90)
        out = await _logged(stack, "area_pre_copied", since=since)
        # (the session DB is sent whole)
        assert out["resumed_bytes"] == left - 2 * PAGE, _copy_facts(out)
        assert out["bytes"] < size // 2, _copy_facts(out)
        assert (remote_dir / STORE).read_bytes() == store
        release = _release(netns_vps)
        print(f"Debian {release.debian}: the move out resumed {out['resumed_bytes']} bytes of"
              f" the staged store, sent {out['bytes']}")

        # The lease names the connection's own process of this release, never the listener.
        session = _lease(netns_vps)["session"]
        stale_pid, client_port = session["sshd_pid"], int(session["ssh_connection"].split()[1])
        assert netns_vps.sshd is not None and stale_pid != netns_vps.sshd.pid
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

        # ... and back home, where the PBX has the store only in its archive of the move out:
        # the account changed two pages of it on the VPS, and the move home fetches those
        # (the agent digests the VPS's files, `copy/blocks`), not the store.
        local_dir = stack.root / "pbx" / "tg" / area
        assert not local_dir.exists()
        (archive,) = (stack.root / "work" / "archive" / "tg").glob(f"{area}-g*")
        assert (archive / STORE).read_bytes() == store
        changed = _rewrite_pages(store, 7, 130)
        (remote_dir / STORE).write_bytes(changed)
        session_db = (remote_dir / "session.db").read_bytes()  # the daemon appends to it
        since = len(stack.log_lines)
        await stack.place("tg", "local")
        await stack.wait_settled(expect={"tg": "local"}, timeout_s=90)
        assert [k.side for k in stack.detector.alive(area)] == ["local"]
        pre_copied = await _logged(stack, "area_pre_copied", since=since)
        copied = await _logged(stack, "area_copied", since=since)
        assert copied["from_side"] == "remote" and copied["bytes"] > size, _copy_facts(copied)
        assert 2 * PAGE <= pre_copied["bytes"] < size // 8, _copy_facts(pre_copied)
        assert copied["sent_bytes"] < size // 8, _copy_facts(copied)
        print(f"Debian {release.debian}: the move home's pre-copy sent {pre_copied['bytes']}"
              f" bytes, its copy after the stop {copied['sent_bytes']}, of {copied['bytes']}")
        # What the VPS had, byte for byte (the session DB's records as the daemon there wrote
        # them; the detector holds the local daemon to having started on all of them).
        assert (local_dir / STORE).read_bytes() == changed
        assert (local_dir / "session.db").read_bytes().startswith(session_db)


@pytest.mark.parametrize("netns_vps", RELEASE_MATRIX, indirect=True)
class TestTheListenerUnfencedAndTheStoreWarmCopied:
    """The lease verb's fence, aimed at the VPS's own sshd listener, refuses and sends nothing;
    an area moved there is warm-copied, its SQLite store whole, by that release's python3."""

    async def test_a_fence_at_the_listener_is_refused_and_the_moved_area_is_warm_copied(
        self, fault_stack: FaultStackFactory, netns_vps: NetnsVps
    ) -> None:
        # (one stack for both, to keep the matrix fast: the fence leaves it as it was; a warm
        # copy in the other test would race its move home's byte counts, which diffs against it)
        stack = await fault_stack(services={"tg": 1}, service_overrides=WARM,
                                  local_daemon_args=SQLITE_STORE,
                                  remote_daemon_args=SQLITE_STORE)
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

        # The area on the VPS, its daemon (that python3) committing records to a WAL store the
        # agent snapshots by SQLite's backup API, read-only through /proc/self/fd: SQLite
        # 3.34.1 on Debian 11, 3.40.1 on 12, 3.46.1 on 13.
        (area,) = stack.areas["tg"]
        await stack.place("tg", "remote")
        await stack.wait_settled(expect={"tg": "remote"}, timeout_s=90)
        python = f"python{_release(netns_vps).python}"
        assert _interpreters(netns_vps, b"fake_daemon.py") == {python}
        remote_dir = netns_vps.remote_bin_dir / "data" / "tg" / area
        assert (remote_dir / f"{SQLITE_DB}-wal").exists()  # a live WAL, not a closed store
        # What the store held when it moved (its daemon stopped: all of it in the main file,
        # which a copy of that file alone would show too).
        (archive,) = (stack.work_dir / "archive" / "tg").glob(f"{area}-g*")
        moved = _records(archive / SQLITE_DB)
        first = await stack.wait_until(lambda: _warm_copy(stack, area), timeout_s=30,
                                       what="a first warm copy")
        await stack.wait_until(lambda: _remote_records(stack, area) > moved, timeout_s=30,
                               what="records committed on the VPS")
        since = max(time.time(), first["taken_at"])

        async def newer() -> dict[str, Any] | None:
            row = await _warm_copy(stack, area)
            return row if row and row["taken_at"] > since else None

        later = await stack.wait_until(newer, timeout_s=30, what="a newer warm copy")
        assert later["error"] is None, later
        copy = stack.work_dir / "warm" / "tg" / area / SQLITE_DB
        # one self-contained file (its header back to the rollback journal), and in it the
        # records the VPS's daemon committed to its WAL before the copy
        held = _records(copy, journal_mode="delete")
        assert not copy.with_name(f"{SQLITE_DB}-wal").exists()
        assert moved < held <= _remote_records(stack, area), (moved, held)
        print(f"Debian {_release(netns_vps).debian}: warm copies {first['taken_at']:.2f},"
              f" {later['taken_at']:.2f}, the second of {held} records ({moved} moved out)")

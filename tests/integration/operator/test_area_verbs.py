"""The verbs an operator reaches for: `monitord areas` lists each area (title, side, health,
pid, uptime, restarts, the downtime of its last move); `monitord logs AREA [-f]` shows a local
area's log, or a remote one's through the daemon and the agent; `monitord bundle --offline`
writes a bundle with no daemon, reading state.db read-only.

Each test runs a whole installation (a real `monitord run`, the SSH VPS with the real agent,
fake daemons) and the CLI as a subprocess.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import signal
import sys
import tarfile
from pathlib import Path

from monitord.testing.stack import Stack
from tests.integration.operator.conftest import StackFactory, run_cli

TITLE = "Sales [bold]hotline[/bold]"  # markup-looking on purpose: shown as written
NAME = "Support desk"


def set_titles(stack: Stack, titles: dict[str, tuple[str, str]]) -> None:
    """Give custom_config.json entries a `title` or `name` field (uuid -> (field, text)), as
    the PBX's web UI would, replacing the file atomically."""
    path = stack.root / "spool" / "custom_config.json"
    document = json.loads(path.read_text())
    for entry in document["custom_daemons"]:
        if entry["uuid"] in titles:
            field, text = titles[entry["uuid"]]
            entry[field] = text
    temp = path.with_suffix(".tmp")
    temp.write_text(json.dumps(document))
    os.replace(temp, path)


async def follow(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "monitord", "logs", "-f", *args,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        # A shell gives a foreground command the default SIGINT disposition; so do we (a
        # suite started in the background, `nohup make test &`, hands its children SIGINT
        # ignored, and Ctrl-C would never reach the follower).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


async def read_until(proc: asyncio.subprocess.Process, marker: bytes, *, seen: bytearray,
                     timeout_s: float = 30) -> None:
    assert proc.stdout is not None
    async with asyncio.timeout(timeout_s):
        while marker not in seen:
            chunk = await proc.stdout.read(65536)
            assert chunk, f"the follower ended before {marker!r}: {bytes(seen)!r}"
            seen.extend(chunk)


async def interrupt(proc: asyncio.subprocess.Process) -> int:
    proc.send_signal(signal.SIGINT)
    return await asyncio.wait_for(proc.wait(), 20)


def bundle_members(path: Path) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(path.read_bytes()), mode="r:gz") as tar:
        return {m.name.removeprefix("monitord-bundle/"): tar.extractfile(m).read()  # type: ignore[union-attr]
                for m in tar.getmembers()}


class TestAreasVerb:
    """`monitord areas` lists every area with its title, side, health and last downtime."""

    async def test_each_area_with_title_side_health_and_last_downtime(
        self, stack_factory: StackFactory
    ) -> None:
        stack = await stack_factory(services={"tg": 2})
        await stack.wait_settled(expect={"tg": "local"}, timeout_s=60)
        moved, stayed = sorted(stack.areas["tg"])
        set_titles(stack, {moved: ("title", TITLE), stayed: ("name", NAME)})

        async def titled() -> bool:
            views = (await stack.status())["services"]["tg"]["areas"]
            return {v["uuid"]: v.get("title") for v in views} == {moved: TITLE, stayed: NAME}
        await stack.wait_until(titled, timeout_s=30, what="the titles in the status")

        placed = await run_cli("place", "-c", str(stack.config_path), "tg", "remote",
                               "--area", moved, "--wait", "--timeout", "90")
        assert placed.code == 0, placed.stderr
        listed = await run_cli("areas", "-c", str(stack.config_path), "--json")
        assert listed.code == 0, listed.stderr
        rows = {row["uuid"]: row for row in json.loads(listed.stdout)}
        assert set(rows) == {moved, stayed}
        remote, local = rows[moved], rows[stayed]
        assert (remote["service"], remote["title"], remote["side"], remote["health"]) == (
            "tg", TITLE, "remote", "up")
        assert isinstance(remote["pid"], int) and remote["uptime_s"] >= 0
        assert isinstance(remote["last_downtime_s"], float) and remote["last_downtime_s"] > 0
        assert (local["title"], local["side"], local["health"], local["last_downtime_s"]) == (
            NAME, "local", "up", None)
        [alive] = stack.detector.alive(stayed)
        assert local["pid"] == alive.pid and local["restarts_1h"] == 0

        shown = await run_cli("areas", "-c", str(stack.config_path), "tg",
                              env={"COLUMNS": "200"})
        assert shown.code == 0, shown.stderr
        assert TITLE in shown.stdout and NAME in shown.stdout  # markup shown as written
        assert moved in shown.stdout and f"{remote['last_downtime_s']:.2f} s" in shown.stdout
        unknown = await run_cli("areas", "-c", str(stack.config_path), "nope")
        assert unknown.code == 2 and "UNKNOWN_SERVICE" in unknown.stderr

        # the title stays out of the diagnostic bundle (the operator's text, redacted)
        code, _ = await stack.request("GET", "/v1/status")
        assert code == 200
        written = stack.root / "bundle.tar.gz"
        made = await run_cli("bundle", "-c", str(stack.config_path), "-o", str(written))
        assert made.code == 0, made.stderr
        members = bundle_members(written)
        status = json.loads(members["status.json"])
        last_move = status["services"]["tg"]["last_move"]
        assert last_move["area_downtime_s"] == {moved: remote["last_downtime_s"]}
        assert not any(TITLE.encode() in data or NAME.encode() in data
                       for data in members.values())


class TestLogsVerb:
    """`monitord logs` shows and follows an area's log on either side."""

    async def test_a_remote_areas_log_comes_through_the_agent_and_is_followed(
        self, stack_factory: StackFactory
    ) -> None:
        stack = await stack_factory(services={"tg": 1})
        await stack.wait_settled(expect={"tg": "local"}, timeout_s=60)
        (area,) = stack.areas["tg"]
        placed = await run_cli("place", "-c", str(stack.config_path), "tg", "remote", "--wait",
                               "--timeout", "90")
        assert placed.code == 0, placed.stderr
        vps_log = stack.vps_dir / "logs" / f"{area}.log"
        shown = await run_cli("logs", "-c", str(stack.config_path), area, "-n", "3")
        assert shown.code == 0, shown.stderr
        lines = vps_log.read_text().splitlines(keepends=True)
        assert shown.stdout == "".join(lines[-3:])  # exactly the VPS file's last lines
        assert '"started"' in vps_log.read_text()  # the lease guard's line is in it

        follower = await follow("-c", str(stack.config_path), area, "-n", "1")
        seen = bytearray()
        try:
            await read_until(follower, lines[-1].encode(), seen=seen)
            with vps_log.open("a") as f:
                f.write("marker-one\n")
            await read_until(follower, b"marker-one\n", seen=seen)
            # a rotation under the follower: the old file's rest, then the new file
            with vps_log.open("a") as f:
                f.write("marker-two\n")
            os.replace(vps_log, vps_log.with_name(vps_log.name + ".1"))
            vps_log.write_text("marker-three\n")
            await read_until(follower, b"marker-three\n", seen=seen)
        finally:
            code = await interrupt(follower)
        assert code == 0
        text = bytes(seen).decode()
        assert text.index("marker-one") < text.index("marker-two") < text.index("marker-three")
        assert text.count("marker-two") == 1

        code, answer = await stack.request("GET", f"/v1/areas/{area}/logs?lines=2")
        assert code == 200 and answer["side"] == "remote" and answer["area"] == area
        assert answer["data"] == "marker-two\nmarker-three\n"  # topped up from the rotated one
        for query, wanted in (("lines=0", 400), ("lines=x", 400), ("side=vps", 400),
                              ("file=3", 400), ("bogus=1", 400),
                              ("offset=" + "9" * 5000, 400), ("lines=%C2%B2", 400)):
            code, answer = await stack.request("GET", f"/v1/areas/{area}/logs?{query}")
            assert (code, answer["error"]["code"]) == (wanted, "BAD_REQUEST"), query
        code, answer = await stack.request("GET", "/v1/areas/no-such-area/logs")
        assert (code, answer["error"]["code"]) == (404, "UNKNOWN_AREA")
        code, answer = await stack.request("GET", "/v1/areas/no-such-area/logs?side=remote")
        assert (code, answer["error"]["code"]) == (404, "NOT_FOUND")

    async def test_a_local_areas_log_with_and_without_the_daemon_and_an_offline_bundle(
        self, stack_factory: StackFactory
    ) -> None:
        stack = await stack_factory(services={"tg": 2})
        await stack.wait_settled(expect={"tg": "local"}, timeout_s=60)
        moved, stayed = sorted(stack.areas["tg"])
        placed = await run_cli("place", "-c", str(stack.config_path), "tg", "remote",
                               "--area", moved, "--wait", "--timeout", "90")
        assert placed.code == 0, placed.stderr
        local_log = stack.work_dir / "supervisor" / "logs" / f"{stayed}.log"
        with local_log.open("a") as f:
            f.write("".join(f"local line {i}\n" for i in range(20)))
        shown = await run_cli("logs", "-c", str(stack.config_path), stayed, "-n", "2")
        assert (shown.code, shown.stdout) == (0, "local line 18\nlocal line 19\n"), shown.stderr

        follower = await follow("-c", str(stack.config_path), stayed, "-n", "1")
        seen = bytearray()
        try:
            await read_until(follower, b"local line 19\n", seen=seen)
            with local_log.open("a") as f:
                f.write("local marker\n")
            await read_until(follower, b"local marker\n", seen=seen)
        finally:
            assert await interrupt(follower) == 0

        assert await stack.stop_monitord() == 0
        state_db = stack.work_dir / "state.db"
        before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                  for p in stack.work_dir.glob("state.db*")}

        # no daemon: a local area's log is read here; a remote one cannot be
        direct = await run_cli("logs", "-c", str(stack.config_path), stayed, "-n", "1")
        assert (direct.code, direct.stdout) == (0, "local marker\n"), direct.stderr
        assert "DAEMON_UNREACHABLE" in direct.stderr and str(local_log) in direct.stderr
        remote = await run_cli("logs", "-c", str(stack.config_path), moved)
        assert remote.code == 1 and "DAEMON_UNREACHABLE" in remote.stderr

        online = await run_cli("bundle", "-c", str(stack.config_path), "-o",
                               str(stack.root / "online.tar.gz"))
        assert online.code == 1 and "--offline" in online.stderr
        written = stack.root / "offline.tar.gz"
        made = await run_cli("bundle", "--offline", "-c", str(stack.config_path), "-o",
                             str(written))
        assert made.code == 0, made.stderr
        assert written.stat().st_mode & 0o777 == 0o600
        members = bundle_members(written)
        assert list(members)[0] == "version.json"
        assert {"README.txt", "transactions.json", "cleanup.json", "events.json",
                "lineage.json", "config.json", "custom_config.json", "remote_state.json",
                f"logs/areas/{stayed}.log"} <= set(members)
        assert b"DAEMON_UNREACHABLE" in members["README.txt"]
        transactions = json.loads(members["transactions.json"])
        assert [t["area"] for t in transactions] == [moved]
        assert transactions[0]["phase"] == "DONE"
        assert any(e["event"] == "area_downtime" for e in json.loads(members["events.json"]))
        config = json.loads(members["config.json"])
        assert config["services"]["tg"]["command"] == "<redacted>"
        assert config["remote"]["key_file"]  # the key's path, never its content
        entries = json.loads(members["custom_config.json"])["custom_daemons"]
        assert {e["uuid"]: e["location"] for e in entries} == {moved: "remote",
                                                                stayed: "local"}
        assert members[f"logs/areas/{stayed}.log"].endswith(b"local marker\n")
        key = Path(config["remote"]["key_file"]).read_bytes()
        for name, data in members.items():
            assert b"PRIVATE KEY" not in data and key not in data, name

        after = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                 for p in stack.work_dir.glob("state.db*")}
        assert after == before and state_db.exists()  # read-only: not one byte changed

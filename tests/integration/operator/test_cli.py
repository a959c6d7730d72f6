"""The operator's CLI verbs against a running installation: status, place --wait,
retry and bundle, and what each says when the daemon is not running."""

from __future__ import annotations

import json
import stat
import tarfile
from pathlib import Path

import pytest

from monitord.testing.ports import free_port
from monitord.testing.stack import Stack
from orchestrator import errors
from tests.integration.operator.conftest import StackFactory, run_cli

BUNDLE_SECTIONS = {
    "status.json", "transactions.json", "cleanup.json", "events.json", "local_inventory.json",
    "remote_inventory.json", "tunnel.json", "config.json", "custom_config.json",
    "remote_state.json",
}


async def park(stack: Stack, service: str) -> None:
    async def parked() -> bool:
        return (await stack.status())["services"][service]["state"] == "parked"

    await stack.wait_until(parked, timeout_s=30, what=f"{service} parked")


def key_fragments(key_file: Path) -> list[bytes]:
    """The private key file's whole content and each of its base64 body lines."""
    content = key_file.read_bytes()
    lines = [line.strip() for line in content.splitlines()]
    body = [line for line in lines if line and not line.startswith(b"-----")]
    assert body, "the test key has no body to look for"
    return [content.strip(), *body]


class TestStatus:
    """`monitord status` prints a readable table; `--json` prints the API's document."""

    async def test_status_prints_tunnel_counts_and_one_row_per_service(
        self, stack_factory: StackFactory
    ) -> None:
        stack = await stack_factory(services={"tg": 2, "chats": 1})
        await stack.place("chats", "remote")
        await stack.wait_settled(expect={"tg": "local", "chats": "remote"}, timeout_s=60)
        await stack.wait_seen_up()  # a remote area's daemon is the agent's next inventory
        result = await run_cli("status", "-c", str(stack.config_path))
        assert result.code == 0, result.stderr
        lines = result.stdout.splitlines()
        assert "tunnel: connected, attempts 1" in lines
        assert "areas: local 2, remote 1, migrating 0, orphan 0" in lines
        split = lines.index(next(line for line in lines if line.strip() == "areas"))
        table = [[c.strip() for c in line.strip("│┃ ").split("│")] for line in lines
                 if line.startswith("│")]
        services = [[c.strip() for c in line.strip("│┃ ").split("│")]
                    for line in lines[:split] if line.startswith("│")]
        rows = {cells[0]: cells for cells in services}
        assert rows["tg"][:8] == ["tg", "local", "idle", "", "2", "0", "0", "0"]
        assert rows["chats"][:8] == ["chats", "remote", "idle", "", "0", "1", "0", "0"]
        # then one row per area: where it runs and how its daemon does there
        areas = [cells for cells in table[len(services):]]
        assert sorted((cells[0], cells[2], cells[3]) for cells in areas) == [
            ("chats", "remote", "up"), ("tg", "local", "up"), ("tg", "local", "up")]

    async def test_status_json_is_the_api_document(self, stack_factory: StackFactory) -> None:
        stack = await stack_factory(services={"tg": 1})
        result = await run_cli("status", "-c", str(stack.config_path), "--json")
        assert result.code == 0, result.stderr
        document = json.loads(result.stdout)
        live = await stack.status()
        assert set(document) == set(live)
        assert document["services"].keys() == {"tg"}
        assert [a["uuid"] for a in document["services"]["tg"]["areas"]] == stack.areas["tg"]

    async def test_an_unknown_service_is_bad_usage_with_its_code(
        self, stack_factory: StackFactory
    ) -> None:
        stack = await stack_factory(services={"tg": 1})
        result = await run_cli("place", "-c", str(stack.config_path), "nope", "remote")
        assert result.code == 2
        assert result.stderr.startswith("monitord: UNKNOWN_SERVICE:")
        assert len(result.stderr.splitlines()) == 1


class TestPlace:
    """`monitord place` says in one line what it started (`--json`: the API's answer);
    `--wait` shows progress and ends 0 when converged, 1 with the code when the service parks;
    with `--area` it waits for that area only."""

    async def test_place_wait_shows_progress_and_exits_0_once_converged(
        self, stack_factory: StackFactory
    ) -> None:
        stack = await stack_factory(services={"tg": 2})
        await stack.wait_settled(expect={"tg": "local"}, timeout_s=60)
        result = await run_cli("place", "-c", str(stack.config_path), "tg", "remote", "--wait",
                               "--timeout", "60", "--json")
        assert result.code == 0, result.stderr
        accepted = json.loads(result.stdout)
        assert accepted["location"] == "remote" and len(accepted["transaction_ids"]) == 2
        progress = result.stderr.splitlines()
        assert progress[0].startswith("tg -> remote: 0/2 areas there")
        assert progress[-1] == "tg -> remote: converged"
        assert all(e["location"] == "remote" for e in stack.committed().values())
        await stack.wait_settled(expect={"tg": "remote"}, timeout_s=60)

    async def test_place_wait_exits_1_with_the_error_code_when_the_service_parks(
        self, stack_factory: StackFactory
    ) -> None:
        stack = await stack_factory(services={"tg": 2}, park_after_failures=1)
        await stack.wait_settled(expect={"tg": "local"}, timeout_s=60)
        await stack.partition()
        result = await run_cli("place", "-c", str(stack.config_path), "tg", "remote", "--wait",
                               "--timeout", "60")
        assert result.code == 1
        code = (await stack.status())["services"]["tg"]["last_error"]["code"]
        errors.lookup(code)
        assert result.stderr.splitlines()[-1].startswith(f"tg -> remote: failed: {code} ")
        assert all(e.get("location", "local") == "local" for e in stack.committed().values())

    async def test_place_prints_one_line_naming_the_transactions_it_started(
        self, stack_factory: StackFactory
    ) -> None:
        stack = await stack_factory(services={"tg": 2})
        await stack.wait_settled(expect={"tg": "local"}, timeout_s=60)
        result = await run_cli("place", "-c", str(stack.config_path), "tg", "remote")
        assert result.code == 0, result.stderr
        ids = [t["transaction_id"] for t in (await stack.status())["transactions"]]
        assert sorted(ids) == sorted(result.stdout.strip().split(": ", 2)[2].split(", "))
        assert result.stdout.startswith("tg -> remote: 2 transactions started (2 areas): ")
        assert len(result.stdout.splitlines()) == 1
        await stack.wait_settled(expect={"tg": "remote"}, timeout_s=60)
        again = await run_cli("place", "-c", str(stack.config_path), "tg", "remote")
        assert again.stdout == "tg -> remote: nothing to move, every area is already there\n"

    async def test_place_area_wait_follows_that_area_only(
        self, stack_factory: StackFactory
    ) -> None:
        # Moves back to the PBX stop at a hold point until released: the other area's move
        # keeps the service busy for as long as the test wants.
        stack = await stack_factory(
            services={"tg": 2}, extra_env={"MONITORD_HOLD_AT": "remote_to_local:SUPPRESS_SOURCE"}
        )
        moved, busy = stack.areas["tg"]
        await stack.wait_settled(expect={"tg": "local"}, timeout_s=60)
        assert (await stack.request("PUT", f"/v1/areas/{busy}/placement",
                                    {"location": "remote"}))[0] == 202
        await stack.wait_settled(timeout_s=60)
        assert (await stack.request("PUT", f"/v1/areas/{busy}/placement",
                                    {"location": "local"}))[0] == 202
        await stack.wait_event("hold_point", timeout_s=30)

        result = await run_cli("place", "-c", str(stack.config_path), "tg", "remote",
                               "--area", moved, "--wait", "--timeout", "60")
        assert result.code == 0, result.stderr
        assert result.stdout.startswith(f"tg area {moved} -> remote: 1 transaction started"
                                        " (1 area): ")
        progress = result.stderr.splitlines()
        label = f"tg/{moved[:8]} -> remote"
        assert all(line.startswith(label + ": ") for line in progress), progress
        assert progress[-1] == f"{label}: converged"
        status = await stack.status()
        assert status["services"]["tg"]["state"] == "suppressing_source", "still busy"
        assert stack.committed()[moved]["location"] == "remote"
        stack.release_hold()
        await stack.wait_settled(timeout_s=60)
        assert stack.committed()[busy].get("location", "local") == "local"


class TestRetry:
    """`monitord retry` takes a parked service out of PARKED (202)."""

    async def test_retry_after_the_vps_is_back_moves_the_parked_service_on(
        self, stack_factory: StackFactory
    ) -> None:
        stack = await stack_factory(services={"tg": 1}, park_after_failures=1)
        await stack.wait_settled(expect={"tg": "local"}, timeout_s=60)
        await stack.partition()
        parked_ids = await stack.place("tg", "remote")
        await park(stack, "tg")
        await stack.heal()

        async def tunnel_up() -> bool:
            return bool((await stack.status())["tunnel"]["connected"])

        # The operator retries once the cause is fixed; a retry before the tunnel is back
        # would only park again.
        await stack.wait_until(tunnel_up, timeout_s=30, what="tunnel back")
        assert (await stack.status())["services"]["tg"]["state"] == "parked"
        result = await run_cli("retry", "-c", str(stack.config_path), "tg", "--json")
        assert result.code == 0, result.stderr
        assert json.loads(result.stdout) == {"service": "tg", "transaction_ids": parked_ids}
        await stack.wait_settled(expect={"tg": "remote"}, timeout_s=60)
        again = await run_cli("retry", "-c", str(stack.config_path), "tg")
        assert again.code == 0, again.stderr
        assert again.stdout == "tg: nothing was parked, nothing to retry\n"


class TestBundle:
    """`monitord bundle` writes every section, readable only by its owner, with no key."""

    async def test_bundle_has_every_section_and_no_private_key_material(
        self, stack_factory: StackFactory, tmp_path: Path
    ) -> None:
        stack = await stack_factory(services={"tg": 1})
        await stack.wait_settled(expect={"tg": "local"}, timeout_s=60)
        await stack.place("tg", "remote")
        await stack.wait_settled(expect={"tg": "remote"}, timeout_s=60)
        await stack.wait_seen_up()  # the bundle's remote inventory is the agent's last answer
        output = tmp_path / "out.tar.gz"
        result = await run_cli("bundle", "-c", str(stack.config_path), "-o", str(output))
        assert result.code == 0, result.stderr
        assert stat.S_IMODE(output.stat().st_mode) == 0o600

        with tarfile.open(output, "r:gz") as tar:
            members = {
                Path(m.name).name: tar.extractfile(m).read()  # type: ignore[union-attr]
                for m in tar.getmembers()
            }
        assert BUNDLE_SECTIONS <= set(members)
        status = json.loads(members["status.json"])
        assert status["services"]["tg"]["counts"]["remote"] == 1
        transactions = json.loads(members["transactions.json"])
        assert "DONE" in [t["phase"] for t in transactions]
        assert {t["area"] for t in transactions} == set(stack.areas["tg"])
        assert json.loads(members["events.json"]), "recent events are empty"
        remote_inventory = json.dumps(json.loads(members["remote_inventory.json"]))
        assert stack.areas["tg"][0] in remote_inventory
        assert isinstance(json.loads(members["local_inventory.json"]), list)
        assert json.loads(members["config.json"])["remote"]["key_file"] == str(
            stack.vps.key_file if stack.vps else ""
        )  # the path, never the content

        assert stack.vps is not None
        fragments = [b"PRIVATE KEY", *key_fragments(stack.vps.key_file)]
        for name, data in members.items():
            for fragment in fragments:
                assert fragment not in data, f"{name} carries private key material"
        logged = "\n".join(stack.log_lines).encode()
        api = json.dumps(await stack.status()).encode()
        for fragment in fragments:
            assert fragment not in logged and fragment not in api


class TestDaemonNotRunning:
    """Every verb says in one line on stderr, with its code, that the daemon is not answering,
    and exits 1 — no traceback, no asyncio warning."""

    @pytest.mark.parametrize("verb", [
        ["status"], ["status", "--json"], ["place", "tg", "remote"], ["retry", "tg"],
        ["bundle", "-o", "{tmp}/out.tar.gz"],
    ], ids=" ".join)
    async def test_verb_reports_the_daemon_is_not_answering(
        self, verb: list[str], tmp_path: Path
    ) -> None:
        config = tmp_path / "monitord.toml"
        config.write_text(
            f'[monitord]\nwork_dir = "{tmp_path}/work"\nspool_dir = "{tmp_path}/spool"\n'
            f'[http]\nlisten = "127.0.0.1:{free_port()}"\n'
        )
        args = [a.replace("{tmp}", str(tmp_path)) for a in verb]
        result = await run_cli(args[0], "-c", str(config), *args[1:])
        assert result.code == 1
        assert result.stdout == ""
        assert len(result.stderr.splitlines()) == 1
        assert result.stderr.startswith(
            "monitord: DAEMON_UNREACHABLE: monitord is not answering at http://127.0.0.1:"
        )
        assert not (tmp_path / "out.tar.gz").exists()

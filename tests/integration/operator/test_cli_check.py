"""`monitord status --check` against real daemons: one line on stdout, the plugin exit code
(0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN) — what an Icinga/Nagios check command runs."""

from __future__ import annotations

import json
from pathlib import Path

from monitord.testing.ports import free_port
from tests.integration.operator.conftest import CliResult, StackFactory, run_cli
from tests.integration.operator.test_cli import park
from tests.support import daemon_process

VALID_AREA = "5b0c6f1e-8d2a-4c1b-9e77-0a1b2c3d4e5f"


def spool_file(root: Path, content: str) -> None:
    """custom_config.json in the spool dir of `daemon_process.write_config(root)`."""
    spool = root / "spool"
    spool.mkdir(parents=True, exist_ok=True)
    (spool / "custom_config.json").write_text(content)


async def check(config: Path) -> CliResult:
    result = await run_cli("status", "--check", "-c", str(config))
    assert len(result.stdout.splitlines()) == 1, result.stdout
    assert result.stderr == "", result.stderr
    return result


class TestCheckWithoutRemote:
    """A daemon with no VPS configured: OK, or what its authoritative file says."""

    async def test_a_healthy_daemon_is_ok_with_perfdata(self, tmp_path: Path) -> None:
        spool_file(tmp_path, json.dumps({"custom_daemons": []}))
        async with daemon_process.running_daemon(tmp_path) as daemon:
            result = await check(daemon.config_path)
        assert result.code == 0
        assert result.stdout.startswith(
            "MONITORD OK - 1 service, areas local 0 remote 0 migrating 0; tunnel not_configured"
            " | areas_local=0 "
        )

    async def test_a_corrupt_custom_config_is_critical(self, tmp_path: Path) -> None:
        spool_file(tmp_path, '{"custom_daemons": [{"uuid": ')
        async with daemon_process.running_daemon(tmp_path) as daemon:
            result = await check(daemon.config_path)
        assert result.code == 2
        assert result.stdout.startswith("MONITORD CRITICAL - config_error CONFIG_CORRUPT: ")

    async def test_a_quarantined_entry_is_a_warning(self, tmp_path: Path) -> None:
        # Both entries are invalid, so nothing is ever started (nothing outlives the test).
        spool_file(tmp_path, json.dumps({"custom_daemons": [
            {"uuid": "../escape", "service": "tg", "location": "local"},
            {"uuid": VALID_AREA, "service": "tg", "location": "moon"},
        ]}))
        async with daemon_process.running_daemon(tmp_path) as daemon:
            result = await check(daemon.config_path)
        assert result.code == 1
        assert result.stdout.startswith(
            "MONITORD WARNING - 2 quarantined custom_config.json entries"
            " (AREA_ENTRY_INVALID, AREA_ID_INVALID)"
        )
        assert result.stdout.rstrip().endswith("quarantined=2")


class TestCheckCannotTell:
    """No daemon, or no usable config: UNKNOWN (3), still one line on stdout."""

    async def test_an_unreachable_daemon_is_unknown(self, tmp_path: Path) -> None:
        port = free_port()
        config = daemon_process.write_config(tmp_path, port=port)
        result = await check(config)
        assert result.code == 3
        assert result.stdout.startswith(
            f"MONITORD UNKNOWN - DAEMON_UNREACHABLE: monitord is not answering at"
            f" http://127.0.0.1:{port}"
        )

    async def test_a_missing_config_is_unknown(self, tmp_path: Path) -> None:
        result = await check(tmp_path / "nowhere.toml")
        assert result.code == 3
        assert result.stdout.startswith("MONITORD UNKNOWN - CONFIG_INVALID: ")


class TestCheckWithTheVps:
    """A parked service is CRITICAL and the line names it with its error code."""

    async def test_a_parked_service_is_critical(self, stack_factory: StackFactory) -> None:
        stack = await stack_factory(services={"tg": 1, "chats": 1}, park_after_failures=1)
        await stack.wait_settled(expect={"tg": "local", "chats": "local"}, timeout_s=60)
        assert (await check(stack.config_path)).code == 0
        await stack.partition()
        await stack.place("tg", "remote")
        await park(stack, "tg")
        code = (await stack.status())["services"]["tg"]["last_error"]["code"]
        result = await check(stack.config_path)
        assert result.code == 2
        assert result.stdout.startswith(f"MONITORD CRITICAL - tg parked ({code})")
        assert "chats" not in result.stdout.split(" | ")[0]
        await stack.heal()

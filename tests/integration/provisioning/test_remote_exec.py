"""remote_exec: argv reaches the VPS intact, and failures become typed errors with stable codes."""

from __future__ import annotations

import asyncio

import asyncssh
import pytest

from monitord.remote import remote_exec
from monitord.testing.vps_server import VpsServer
from orchestrator.errors import ErrorCode, MonitordError, TransientError

TIMEOUT = 30.0


class TestArgvQuoting:
    """Arguments arrive exactly as given: the remote shell never splits, globs or expands them."""

    async def test_awkward_arguments_arrive_unchanged(
        self, conn: asyncssh.SSHClientConnection
    ) -> None:
        awkward = ["two words", "$HOME", "*", "it's", "a;b|c", "`id`", ""]
        result = await remote_exec.run(
            conn, ["/usr/bin/printf", "%s\\n", *awkward], timeout_s=TIMEOUT
        )
        assert result.text.split("\n")[:-1] == awkward

    async def test_script_arguments_are_positional_parameters(
        self, conn: asyncssh.SSHClientConnection
    ) -> None:
        result = await remote_exec.run_script(
            conn, 'printf "%s|" "$@"', args=["a b", "$(id)"], timeout_s=TIMEOUT
        )
        assert result.text == "a b|$(id)|"

    async def test_stdin_carries_bytes_that_never_touch_the_command_line(
        self, vps: VpsServer, conn: asyncssh.SSHClientConnection
    ) -> None:
        result = await remote_exec.run(conn, ["/bin/cat"], timeout_s=TIMEOUT, input=b"s3cret")
        assert result.stdout == b"s3cret"
        assert "s3cret" not in "".join(vps.command_log)


class TestEveryOutputIsBounded:
    """A VPS that floods stdout or stderr costs at most the bound in memory, whatever the
    caller passed (the default bound applies to every remote command)."""

    async def test_a_flood_on_stdout_and_stderr_keeps_at_most_the_bounds(
        self, conn: asyncssh.SSHClientConnection
    ) -> None:
        flood = 3 * remote_exec.DEFAULT_MAX_STDOUT
        result = await remote_exec.run_script(
            conn, 'head -c "$1" /dev/zero; head -c "$1" /dev/zero >&2', args=[str(flood)],
            timeout_s=TIMEOUT,
        )
        assert result.ok
        assert len(result.stdout) == remote_exec.DEFAULT_MAX_STDOUT
        assert result.stdout_truncated
        assert len(result.stderr) <= 64 * 1024


class TestExitStatus:
    """A failing command is a result, not an exception, until the caller names its code."""

    async def test_non_zero_status_is_returned_and_raised_only_on_request(
        self, conn: asyncssh.SSHClientConnection
    ) -> None:
        result = await remote_exec.run_script(
            conn, "echo broken >&2; exit 4", timeout_s=TIMEOUT
        )
        assert (result.ok, result.exit_status) == (False, 4)
        with pytest.raises(MonitordError) as failed:
            result.raise_for_status(ErrorCode.PROVISION_FAILED)
        assert failed.value.code is ErrorCode.PROVISION_FAILED
        assert "broken" in failed.value.detail


class TestTransportFailures:
    """Timeouts and lost connections become SSH_TIMEOUT and SSH_UNREACHABLE."""

    async def test_a_command_that_outlives_its_timeout_is_ssh_timeout(
        self, vps: VpsServer, conn: asyncssh.SSHClientConnection
    ) -> None:
        with pytest.raises(TransientError) as slow:
            await remote_exec.run(conn, ["/bin/sleep", "30"], timeout_s=0.3)
        assert slow.value.code is ErrorCode.SSH_TIMEOUT
        async with asyncio.timeout(TIMEOUT):  # the channel was closed, so the command ends
            while vps.running_commands:  # noqa: ASYNC110 - polling an outside condition
                await asyncio.sleep(0.02)

    async def test_a_dropped_connection_is_ssh_unreachable(
        self, vps: VpsServer, conn: asyncssh.SSHClientConnection
    ) -> None:
        vps.drop_all_sessions()
        await asyncio.wait_for(conn.wait_closed(), TIMEOUT)
        with pytest.raises(TransientError) as dropped:
            await remote_exec.run(conn, ["/bin/true"], timeout_s=TIMEOUT)
        assert dropped.value.code is ErrorCode.SSH_UNREACHABLE

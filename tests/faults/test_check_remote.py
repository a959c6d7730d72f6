"""`monitord check --remote` against a real OpenSSH VPS of each Debian release set up as
docs/vps-setup.md says (the login user `offload` owning remote_bin_dir, the documented
sshd_config block verbatim, that release's python3): every check it can make passes, the
`vps:` line names that release's OpenSSH and Python, no warning
says it is outside the tested releases, and it changes nothing there. Where the documented
`Match User` block names another user than the login, the login has no forwarding: the
refused direct-streamlocal channel fails the `agent` check."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest

from tests.faults.conftest import (
    RELEASE_MATRIX,
    RELEASE_MATRIX_AS_LOGIN_USER,
    FaultStackFactory,
    external_vps,
)
from tests.faults.debian_root import debian_root, release_of
from tests.faults.nats_server import NatsServer
from tests.faults.netns_vps import NetnsVps, running_netns_vps
from tests.support import stacks

NEWEST = RELEASE_MATRIX[-1]


async def run_check(config_path: Path) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "monitord", "check", "-c", str(config_path), "--remote",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode is not None
    return process.returncode, out.decode() + err.decode()


@pytest.mark.parametrize("netns_vps", RELEASE_MATRIX_AS_LOGIN_USER, indirect=True)
class TestCheckRemote:
    async def test_a_documented_vps_passes_every_check_and_nothing_moves(
        self, fault_stack: FaultStackFactory, netns_vps: NetnsVps
    ) -> None:
        assert netns_vps.debian_root is not None
        release = release_of(netns_vps.debian_root)
        stack = await fault_stack(services={"tg": 1})
        await stack.wait_settled(expect={"tg": "local"}, timeout_s=90)  # provisioned
        committed = stack.committed()
        started = time.monotonic()
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "monitord", "check", "-c", str(stack.config_path), "--remote",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(process.communicate(), 120)
        elapsed = time.monotonic() - started
        text = out.decode()
        assert process.returncode == 0, text + err.decode()
        lines = text.splitlines()
        assert any(line.startswith("✔ agent") for line in lines), text
        assert not any(line.startswith("✘") for line in lines), text
        assert f"cpython {release.python}." in text  # the VPS's own python3 ran the self-check
        (vps_line,) = [line for line in lines if line.startswith("vps: ")]
        assert f"python3 -I is {release.python}." in vps_line, vps_line
        assert f"SSH server {release.openssh}" in vps_line, vps_line
        assert not any(line.startswith("warning: ") for line in lines), text
        assert stack.committed() == committed
        print(f"monitord check --remote against Debian {release.debian}: {elapsed:.2f} s")


class TestAMatchBlockForAnotherUser:
    """The documented block left naming `offload` while monitord logs in as another user: sshd
    refuses the agent's channel, and check --remote says so before the first move."""

    async def test_the_refused_stream_local_channel_fails_the_agent_check(
        self, tmp_path: Path, nats: NatsServer
    ) -> None:
        root = await asyncio.to_thread(debian_root, NEWEST)
        async with running_netns_vps(tmp_path / "vps", debian_root=root, shared=tmp_path,
                                     match_user="offload") as vps, stacks.stack_factory(
                tmp_path, external_vps=external_vps(vps), nats_target=nats.address) as make:
            stack = await make(services={"tg": 1})
            code, text = await run_check(stack.config_path)
        assert code == 1, text
        failed = [line for line in text.splitlines() if line.startswith("✘")]
        assert len(failed) == 1 and failed[0].startswith("✘ agent"), text
        assert "sshd refuses direct-streamlocal channels (the agent's): " in failed[0]
        assert "AllowStreamLocalForwarding" in failed[0]

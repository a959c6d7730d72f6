"""`monitord check --remote` against a real OpenSSH VPS of each Debian release (the documented
sshd_config, that release's python3): every check it can make passes on a VPS set up as
docs/vps-setup.md says, the `vps:` line names that release's OpenSSH and Python, no warning
says it is outside the tested releases, and it changes nothing there."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest

from tests.faults.conftest import RELEASE_MATRIX, FaultStackFactory
from tests.faults.debian_root import RELEASES
from tests.faults.netns_vps import NetnsVps


@pytest.mark.parametrize("netns_vps", RELEASE_MATRIX, indirect=True)
class TestCheckRemote:
    async def test_a_documented_vps_passes_every_check_and_nothing_moves(
        self, fault_stack: FaultStackFactory, netns_vps: NetnsVps
    ) -> None:
        assert netns_vps.debian_root is not None
        release = RELEASES[netns_vps.debian_root.name]
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

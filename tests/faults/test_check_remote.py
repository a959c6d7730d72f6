"""`monitord check --remote` against the real OpenSSH VPS (the documented sshd_config, the
system python3 there): every check it can make passes on a VPS set up as docs/vps-setup.md
says, and it changes nothing there."""

from __future__ import annotations

import asyncio
import sys
import time

from tests.faults.conftest import FaultStackFactory
from tests.faults.netns_vps import NetnsVps


class TestCheckRemote:
    async def test_a_documented_vps_passes_every_check_and_nothing_moves(
        self, fault_stack: FaultStackFactory, netns_vps: NetnsVps
    ) -> None:
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
        assert "cpython 3." in text  # the VPS's own python3 ran the self-check
        assert stack.committed() == committed
        print(f"monitord check --remote against the namespace VPS: {elapsed:.2f} s")

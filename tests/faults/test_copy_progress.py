"""A copy over a slow link shows how far it is, everywhere an operator looks: `/v1/status`
(the transaction's and the area's `copy`), `monitord status`, the page in a real chromium, and
`monitord place --wait` on a real terminal (a pty), all while the pre-copy crosses the wire
to the namespace VPS (real OpenSSH, the real agent). No timing is judged: what is checked is
that the bytes count up to the area's size, that a rate and an ETA are shown while bytes
move, and that every surface says the same copy."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pty
import sys
from pathlib import Path
from typing import Any

from monitord.testing.stack import Stack, StackOptions
from tests.faults.netns_vps import external_vps, running_netns_vps
from tests.integration.operator.conftest import CHROMIUM, Browser, run_cli
from tests.integration.operator.rendered_page import parse
from tests.support.wan_link import LinkProfile

MIB = 1 << 20
LINK = "delay=10ms,rate=4mbit"  # 4 MiB take some 8 s: time to look from every side
WAIT_S = 120.0


class _Terminal:
    """`monitord place --wait` with its stderr on a pty, as an operator's terminal; what it
    wrote, read as it comes."""

    def __init__(self) -> None:
        self.master, self._slave = pty.openpty()
        self.written = bytearray()

    async def run(self, *args: str) -> int:
        loop = asyncio.get_running_loop()
        loop.add_reader(self.master, self._read)
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "monitord", *args, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL, stderr=self._slave,
                env={**os.environ, "COLUMNS": "200", "TERM": "xterm"})
            os.close(self._slave)
            code = await asyncio.wait_for(proc.wait(), WAIT_S)
            await asyncio.sleep(0.2)  # the last bytes in the pty
            return code
        finally:
            loop.remove_reader(self.master)
            os.close(self.master)

    def _read(self) -> None:
        with contextlib.suppress(OSError):  # EIO once the writer is gone
            self.written += os.read(self.master, 65536)


async def _copies(stack: Stack, area: str, seen: list[dict[str, Any]]) -> None:
    """Every `copy` the status shows for `area`, the transaction's and the area row's."""
    while True:
        status = await stack.status()
        [row] = [a for a in status["services"]["tg"]["areas"] if a["uuid"] == area]
        txn = next((t for t in status["transactions"] if t["area"] == area), None)
        if txn is not None and txn["copy"] is not None:
            assert row["copy"] == txn["copy"], (row, txn)
            seen.append(txn["copy"])
        await asyncio.sleep(0.2)


class TestCopyProgress:
    async def test_a_pre_copy_over_a_slow_link_shows_its_bytes_rate_and_eta_everywhere(
        self, tmp_path: Path
    ) -> None:
        assert CHROMIUM is not None, "chromium is needed (CI installs it)"
        browser = Browser(CHROMIUM, tmp_path / "chromium-profile")
        async with running_netns_vps(tmp_path / "vps", link=LinkProfile.parse(LINK)) as vps:
            options = StackOptions(services={"tg": 1}, data_bytes=4 * MIB,
                                   external_vps=external_vps(vps))
            async with Stack(tmp_path / "stack", options) as stack:
                await stack.wait_settled(expect={"tg": "local"}, timeout_s=90)
                [area] = stack.areas["tg"]
                total = sum(p.stat().st_size for p in (stack.root / "pbx" / "tg" / area).rglob(
                    "*") if p.is_file())
                seen: list[dict[str, Any]] = []
                watcher = asyncio.ensure_future(_copies(stack, area, seen))
                terminal = _Terminal()
                placing = asyncio.ensure_future(terminal.run(
                    "place", "-c", str(stack.config_path), "tg", "remote", "--wait",
                    "--timeout", str(WAIT_S)))
                try:
                    async def moving() -> bool:
                        return any(c["stage"] == "pre_copy" and 0 < c["bytes_done"] < total
                                   and c["rate_bytes_s"] for c in seen)

                    await stack.wait_until(moving, timeout_s=60, what="the pre-copy moving")
                    shown, page = await asyncio.gather(
                        run_cli("status", "-c", str(stack.config_path)),
                        browser.dump_dom(f"http://127.0.0.1:{stack.http_port}/"))
                    placed = await placing
                    await stack.wait_settled(expect={"tg": "remote"}, timeout_s=60)
                finally:
                    watcher.cancel()
                    await asyncio.gather(watcher, placing, return_exceptions=True)
                after = await stack.status()

        pre = [c for c in seen if c["stage"] == "pre_copy" and c["bytes_total"] is not None]
        # one listing's total: the area as the pre-copy found it (its daemon keeps writing)
        [listed] = {c["bytes_total"] for c in pre}
        assert 4 * MIB <= listed <= total + MIB, (listed, total)
        total = listed
        done = [c["bytes_done"] for c in pre]
        assert done == sorted(done) and done[0] < total, done
        moving_views = [c for c in pre if c["rate_bytes_s"]]
        assert moving_views and all(c["eta_s"] is not None and c["eta_s"] >= 0
                                    for c in moving_views), pre
        assert all(c["from"] == "local" for c in seen)
        assert after["transactions"] == []  # nothing left in flight once it is there
        assert all(a["copy"] is None for a in after["services"]["tg"]["areas"])

        # `monitord status`: the transaction's line says the copy
        assert shown.code == 0, shown.stderr
        [line] = [x for x in shown.stdout.splitlines() if x.startswith("  tx ")]
        assert "pre-copy " in line and " of 4.0 MiB" in line, line

        # the page: the transaction's row has the copy's bar and words
        dom = parse(page)
        [row] = [r for r in dom.by_id("transactions").find_all("tr")
                 if "data-transaction" in r.attrs]
        cell = row.one("td", cls="copy")
        bar = cell.one("progress")
        assert bar.attrs.get("max") == str(total) and "hidden" not in bar.attrs, bar.attrs
        assert 0 < int(bar.attrs["value"]) <= total
        assert cell.one("span", cls="copy-words").text.startswith("pre-copy "), cell.text

        # `place --wait` on a terminal: one line rewritten in place, then the outcome
        assert placed == 0, terminal.written.decode(errors="replace")
        written = terminal.written.decode(errors="replace")
        assert "\r\x1b[2K" in written and "pre-copy " in written, written
        assert written.rstrip().endswith("tg -> remote: converged"), written

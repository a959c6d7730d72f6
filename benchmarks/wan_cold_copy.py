"""A cold copy across a WAN: how much of the line rate monitord's copy uses, against
`rsync -e ssh` by hand on the same link and VPS in the same run. Needs root (the fault tier's
namespace VPS, tests/faults/netns_vps.py, behind its WAN link).

    python -m benchmarks.wan_cold_copy [--link wan|far|SPEC] [--mib 100] [--cut-s 10]

One still area of `--mib` MiB (random bytes: nothing compresses) moved to the VPS, where
nothing of it is yet (its pre-copy is the cold copy), then home with the PBX's own copy of it
removed first (nothing to diff against: the pre-copy home is cold too). The reference is
`rsync -a -e ssh` of the same tree to an empty directory on the VPS and back to an empty one
on the PBX, run by hand just before. One figure per direction, `wan_cold_copy_up` /
`wan_cold_copy_down`:

- `copy_s` (the pre-copy's send time, `area_pre_copied`'s `send_seconds`) and
  `throughput_mbit_s`, `line_share` (÷ the link's rate), `reference_s` and
  `reference_line_share` (rsync's wall time), `ratio` (monitord's time ÷ rsync's);
- `wire_bytes` (both ways, the wire's own count over the move) ÷ the area's size.

Then `wan_cold_copy_cut_at_half`: the same area moved out again from scratch on a stack of
its own, the link cut (`ip link` down at the wire) for `--cut-s` seconds once half of it has
crossed: `wire_per_area_byte` (what crossed in all ÷ its size: a copy resumed from what
arrived stays near 1), `resumed_bytes` (what the next try's pre-copy did not send again),
the failed tries, and the move's wall and downtime.

Prints one JSON object per figure; not part of `python -m benchmarks`, nothing pass/fail.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.wan_live_store import logged_events
from tests.support.wan_link import LinkError, LinkProfile

if TYPE_CHECKING:
    from tests.faults.netns_vps import NetnsVps

SERVICE = "tg"
MIB = 1 << 20
MOVE_TIMEOUT_S = 1800.0
RSYNC_TIMEOUT_S = 1800.0
USAGE = ("usage: python -m benchmarks.wan_cold_copy [--link wan|far|SPEC] [--mib N] "
         "[--cut-s S]")
CUT_POLL_S = 0.05
EVENTS = ("area_pre_copied", "area_pre_copy_skipped", "area_copied", "area_downtime",
          "area_pre_copy_failed")


def _ssh_command(vps: NetnsVps) -> str:
    return shlex.join([
        "ssh", "-i", str(vps.client_key.private_path), "-p", str(vps.port),
        "-o", f"UserKnownHostsFile={vps.known_hosts}", "-o", "StrictHostKeyChecking=yes",
        "-o", "BatchMode=yes", "-o", "Compression=no",
    ])


async def _rsync(vps: NetnsVps, source: str, target: str) -> float:
    """Seconds `rsync -a -e ssh source target` takes (raises on a failed copy)."""
    started = time.monotonic()
    process = await asyncio.create_subprocess_exec(
        "rsync", "-a", "-e", _ssh_command(vps), source, target,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(process.communicate(), RSYNC_TIMEOUT_S)
    if process.returncode:
        raise RuntimeError(f"rsync {source} {target}: {err.decode(errors='replace').strip()}")
    return time.monotonic() - started


async def _by_hand(vps: NetnsVps, tmp: Path, *, data_bytes: int) -> dict[str, float]:
    """rsync's seconds for the same bytes to an empty dir on the VPS and back to an empty one."""
    tree = tmp / "tree"
    tree.mkdir(parents=True)
    (tree / "media.bin").write_bytes(os.urandom(data_bytes))
    remote = f"{vps.remote_bin_dir.parent}/rsync-reference"
    where = f"{vps.user}@{vps.vps_address}"
    up = await _rsync(vps, f"{tree}/", f"{where}:{remote}/")
    down = await _rsync(vps, f"{where}:{remote}/", f"{tmp / 'back'}/")
    shutil.rmtree(tmp, ignore_errors=True)
    return {"up": up, "down": down}


async def _moves(vps: NetnsVps, root: Path, *, data_bytes: int) -> dict[str, dict[str, Any]]:
    """The area moved out, then home with the PBX's archive of it removed."""
    from monitord.testing.stack import Stack, StackOptions
    from tests.faults.netns_vps import external_vps

    options = StackOptions(services={SERVICE: 1}, data_bytes=data_bytes,
                           external_vps=external_vps(vps))
    moves: dict[str, dict[str, Any]] = {}
    async with Stack(root, options) as stack:
        await stack.wait_settled(expect={SERVICE: "local"}, timeout_s=90)
        for side, name in (("remote", "up"), ("local", "down")):
            if side == "local":
                shutil.rmtree(stack.work_dir / "archive" / SERVICE)  # a cold copy home
            assert vps.wire is not None
            before = await vps.wire.counters()
            since = len(stack.log_lines)
            await stack.place(SERVICE, side)
            await stack.wait_settled(expect={SERVICE: side}, timeout_s=MOVE_TIMEOUT_S)
            logged = await logged_events(stack, since, EVENTS)
            after = await vps.wire.counters()
            logged["wire_bytes"] = sum(after[d]["bytes"] - before[d]["bytes"]
                                       for d in ("a_to_b", "b_to_a"))
            moves[name] = logged
    return moves


async def _cut_at_half(vps: NetnsVps, root: Path, *, link: LinkProfile, data_bytes: int,
                       cut_s: float) -> dict[str, Any]:
    """The area moved out cold, the link cut for `cut_s` once half of it crossed."""
    from monitord.testing.stack import Stack, StackOptions
    from tests.faults.netns_vps import external_vps

    options = StackOptions(services={SERVICE: 1}, data_bytes=data_bytes,
                           external_vps=external_vps(vps))
    async with Stack(root, options) as stack:
        await stack.wait_settled(expect={SERVICE: "local"}, timeout_s=90)
        assert vps.wire is not None
        before = await vps.wire.counters()
        since = len(stack.log_lines)
        started = time.monotonic()
        await stack.place(SERVICE, "remote")
        while (await vps.wire.counters())["a_to_b"]["bytes"] - before["a_to_b"]["bytes"] \
                < data_bytes // 2:
            if time.monotonic() - started > MOVE_TIMEOUT_S:
                raise RuntimeError("half of the area never crossed")
            await asyncio.sleep(CUT_POLL_S)
        vps.link_down()
        await asyncio.sleep(cut_s)
        vps.link_up()
        await stack.wait_settled(expect={SERVICE: "remote"}, timeout_s=MOVE_TIMEOUT_S)
        wall_s = time.monotonic() - started
        logged = await logged_events(stack, since, EVENTS)
        after = await vps.wire.counters()
        failed = sum('"area_pre_copy_failed"' in line for line in stack.log_lines[since:])
    wire = sum(after[d]["bytes"] - before[d]["bytes"] for d in ("a_to_b", "b_to_a"))
    return {
        "benchmark": "wan_cold_copy_cut_at_half",
        "link": {"name": link.name, "delay_ms_each_way": link.delay_ms,
                 "rate_mbit_s": link.rate_bit_s / 1e6 or None, "loss_pct": link.loss_pct},
        "area_bytes": data_bytes, "cut_s": cut_s, "wall_s": round(wall_s, 2),
        "pre_copies_failed": failed,
        "resumed_bytes": logged.get("area_pre_copied", {}).get("resumed_bytes"),
        "final_copy_sent_bytes": logged.get("area_copied", {}).get("sent_bytes"),
        "downtime_s": logged["area_downtime"]["downtime_s"],
        "wire_bytes": wire, "wire_per_area_byte": round(wire / data_bytes, 3),
        "reference": "the area's size (a copy started over: about 1.5)",
    }


def _figure(name: str, link: LinkProfile, move: dict[str, Any], reference_s: float, *,
            data_bytes: int) -> dict[str, Any]:
    pre_copied = move.get("area_pre_copied")
    if pre_copied is None:
        return {"benchmark": f"wan_cold_copy_{name}", "error": "no pre-copy was made",
                "skipped_because": move.get("area_pre_copy_skipped")}
    copy_s = float(pre_copied["send_seconds"])
    line = link.rate_bit_s or None

    def share(seconds: float) -> float | None:
        return round(data_bytes * 8 / seconds / line, 3) if line and seconds else None

    return {
        "benchmark": f"wan_cold_copy_{name}",
        "link": {"name": link.name, "delay_ms_each_way": link.delay_ms,
                 "rate_mbit_s": link.rate_bit_s / 1e6 or None, "loss_pct": link.loss_pct},
        "area_bytes": data_bytes, "sent_bytes": pre_copied["bytes"],
        "copy_s": round(copy_s, 2), "pre_copy_wall_s": pre_copied["seconds"],
        "throughput_mbit_s": round(data_bytes * 8 / copy_s / 1e6, 2),
        "line_share": share(copy_s),
        "reference": "rsync -a -e ssh by hand, the same bytes, VPS and link, same run",
        "reference_s": round(reference_s, 2), "reference_line_share": share(reference_s),
        "ratio": round(copy_s / reference_s, 2),
        "downtime_s": move["area_downtime"]["downtime_s"],
        "wire_bytes": move["wire_bytes"],
        "wire_per_area_byte": round(move["wire_bytes"] / data_bytes, 3),
    }


async def measure(tmp: Path, *, link: LinkProfile, data_bytes: int,
                  cut_s: float | None = 10.0) -> list[dict[str, Any]]:
    """The two cold copies' figures, then (unless `cut_s` is None) the cut one's."""
    from tests.faults.netns_vps import running_netns_vps

    async with running_netns_vps(tmp / "vps", link=link) as vps:
        reference = await _by_hand(vps, tmp / "by-hand", data_bytes=data_bytes)
        moves = await _moves(vps, tmp / "moves", data_bytes=data_bytes)
        cut = None if cut_s is None else await _cut_at_half(
            vps, tmp / "cut", link=link, data_bytes=data_bytes, cut_s=cut_s)
    figures = [_figure(name, link, moves[name], reference[name], data_bytes=data_bytes)
               for name in ("up", "down")]
    return figures if cut is None else [*figures, cut]


def _arguments(argv: list[str]) -> tuple[LinkProfile, int, float]:
    values = {"--link": "wan", "--mib": "100", "--cut-s": "10"}
    if len(argv) % 2 or any(flag not in values for flag in argv[::2]):
        sys.exit(USAGE)
    values.update(zip(argv[::2], argv[1::2], strict=True))
    try:
        return (LinkProfile.parse(values["--link"]), int(float(values["--mib"]) * MIB),
                float(values["--cut-s"]))
    except (LinkError, ValueError) as e:
        sys.exit(f"{e}\n{USAGE}")


def _main(argv: list[str]) -> int:
    import logging

    from monitord.base import logs
    from tests.faults.netns_vps import can_build_netns

    link, data_bytes, cut_s = _arguments(argv)
    logs.configure("json", level=logging.WARNING)  # stdout is figures only
    if not can_build_netns() or shutil.which("rsync") is None:
        print(json.dumps({"benchmark": "wan_cold_copy", "skipped": "needs root, ip, nft, "
                          "sshd and rsync (the fault tier's namespace VPS)"}), flush=True)
        return 0
    with tempfile.TemporaryDirectory(prefix="bc-") as tmp:
        for figure in asyncio.run(measure(Path(tmp), link=link, data_bytes=data_bytes,
                                          cut_s=cut_s)):
            print(json.dumps(figure, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))

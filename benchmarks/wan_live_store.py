"""A live store moved across a WAN: what the copy after the stop sends and how long the area
is down, against a small still area moved over the same link in the same run. Needs root
(the fault tier's namespace VPS, tests/faults/netns_vps.py, behind its WAN link).

    python -m benchmarks.wan_live_store [--link wan|far|SPEC] [--mib 24] [--pages-per-s 4]

One area of `--mib` MiB whose `media.bin` has `--pages-per-s` random 4 KiB pages rewritten
every second wherever it runs (the fake daemon's `--churn-pages-per-s`, as a live SQLite
session store does), moved to the VPS and home again, each move on its own; the reference is
one small area (the fake daemon's session DB alone, unchanged pages) moved the same two ways
on the same VPS and link just before. One figure per direction,
`wan_live_store_local_to_remote` / `_remote_to_local`:

- `downtime_s` and `reference_downtime_s` (monitord's `area_downtime`), `ratio` between them
  and `extra_s` (what the store's size and its changes add to a small area's window);
  `round_trips` and `reference_round_trips`, those the moves waited for while down;
- `area_bytes`, `final_copy_sent_bytes` (what crossed after the stop: `area_copied`'s
  `sent_bytes`), `pre_copied_bytes`;
- `wire_bytes` (both ways, the wire's own count over the move) and `wire_per_area_byte`.

Prints one JSON object per figure; not part of `python -m benchmarks`, nothing pass/fail.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.support.wan_link import LinkError, LinkProfile

if TYPE_CHECKING:
    from monitord.testing.stack import Stack
    from tests.faults.netns_vps import NetnsVps

SERVICE = "tg"
MIB = 1 << 20
MOVE_TIMEOUT_S = 600.0
USAGE = ("usage: python -m benchmarks.wan_live_store [--link wan|far|SPEC] [--mib N] "
         "[--pages-per-s N]")
EVENTS = ("area_pre_copied", "area_pre_copy_skipped", "area_copied", "area_downtime")


async def _moves(vps: NetnsVps, root: Path, *, data_bytes: int,
                 daemon_args: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """One area of `data_bytes` moved out and home; per direction what the move logged."""
    from monitord.testing.stack import Stack, StackOptions
    from tests.faults.netns_vps import external_vps

    options = StackOptions(services={SERVICE: 1}, data_bytes=data_bytes,
                           external_vps=external_vps(vps), local_daemon_args=daemon_args,
                           remote_daemon_args=daemon_args)
    moves: dict[str, dict[str, Any]] = {}
    async with Stack(root, options) as stack:
        await stack.wait_settled(expect={SERVICE: "local"}, timeout_s=90)
        for side, name in (("remote", "local_to_remote"), ("local", "remote_to_local")):
            assert vps.wire is not None
            before = await vps.wire.counters()
            since = len(stack.log_lines)
            await stack.place(SERVICE, side)
            await stack.wait_settled(expect={SERVICE: side}, timeout_s=MOVE_TIMEOUT_S)
            logged = await logged_events(stack, since)
            after = await vps.wire.counters()
            logged["wire_bytes"] = sum(after[d]["bytes"] - before[d]["bytes"]
                                       for d in ("a_to_b", "b_to_a"))
            moves[name] = logged
    return moves


async def logged_events(stack: Stack, since: int,
                        events: tuple[str, ...] = EVENTS) -> dict[str, Any]:
    """The last of each of `events` the stack logged after line `since` (waiting for the
    move's downtime, logged at its end)."""
    async def downtime_logged() -> bool:
        return any('"area_downtime"' in line for line in stack.log_lines[since:])

    await stack.wait_until(downtime_logged, timeout_s=30, what="the area's downtime")
    found: dict[str, Any] = {}
    for line in stack.log_lines[since:]:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") in events:
            found[event["event"]] = event
    return found


def _figure(name: str, link: LinkProfile, move: dict[str, Any], small: dict[str, Any], *,
            pages_per_s: float) -> dict[str, Any]:
    downtime = float(move["area_downtime"]["downtime_s"])
    reference = float(small["area_downtime"]["downtime_s"])
    copied = move.get("area_copied", {})
    area_bytes = int(copied.get("bytes") or 0)
    return {
        "benchmark": f"wan_live_store_{name}",
        "link": {"name": link.name, "delay_ms_each_way": link.delay_ms,
                 "rate_mbit_s": link.rate_bit_s / 1e6 or None, "loss_pct": link.loss_pct},
        "area_bytes": area_bytes, "pages_per_s": pages_per_s,
        "downtime_s": round(downtime, 3),
        "reference": "one small still area, the same move, same VPS and link, same run",
        "reference_downtime_s": round(reference, 3),
        "ratio": round(downtime / reference, 2),
        "round_trips": move["area_downtime"].get("round_trips"),
        "reference_round_trips": small["area_downtime"].get("round_trips"),
        "extra_s": round(downtime - reference, 3),
        "pre_copied_bytes": move.get("area_pre_copied", {}).get("bytes"),
        "final_copy_sent_bytes": copied.get("sent_bytes"),
        "wire_bytes": move["wire_bytes"],
        "wire_per_area_byte": round(move["wire_bytes"] / area_bytes, 2) if area_bytes else None,
    }


async def measure(tmp: Path, *, link: LinkProfile, data_bytes: int,
                  pages_per_s: float) -> list[dict[str, Any]]:
    from tests.faults.netns_vps import running_netns_vps

    async with running_netns_vps(tmp / "vps", link=link) as vps:
        small = await _moves(vps, tmp / "small", data_bytes=0, daemon_args=())
        live = await _moves(vps, tmp / "live", data_bytes=data_bytes,
                            daemon_args=("--churn-pages-per-s", str(pages_per_s)))
    return [_figure(name, link, live[name], small[name], pages_per_s=pages_per_s)
            for name in ("local_to_remote", "remote_to_local")]


def _arguments(argv: list[str]) -> tuple[LinkProfile, int, float]:
    values = {"--link": "wan", "--mib": "24", "--pages-per-s": "4"}
    if len(argv) % 2 or any(flag not in values for flag in argv[::2]):
        sys.exit(USAGE)
    values.update(zip(argv[::2], argv[1::2], strict=True))
    try:
        return (LinkProfile.parse(values["--link"]), int(float(values["--mib"]) * MIB),
                float(values["--pages-per-s"]))
    except (LinkError, ValueError) as e:
        sys.exit(f"{e}\n{USAGE}")


def _main(argv: list[str]) -> int:
    import logging

    from monitord.base import logs
    from tests.faults.netns_vps import can_build_netns

    link, data_bytes, pages_per_s = _arguments(argv)
    logs.configure("json", level=logging.WARNING)  # stdout is figures only
    if not can_build_netns():
        print(json.dumps({"benchmark": "wan_live_store", "skipped": "needs root, ip, nft "
                          "and sshd (the fault tier's namespace VPS)"}), flush=True)
        return 0
    with tempfile.TemporaryDirectory(prefix="bw-") as tmp:
        for figure in asyncio.run(measure(Path(tmp), link=link, data_bytes=data_bytes,
                                          pages_per_s=pages_per_s)):
            print(json.dumps(figure, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))

"""Warm copies across a WAN: how old each remote area's copy on the PBX gets, what the copies
cost the link and the VPS, and what a give-up of a lost VPS then loses. Needs root (the fault
tier's namespace VPS, tests/faults/netns_vps.py, behind its WAN link).

    python -m benchmarks.warm_copies [--link wan|far|lan|SPEC] [--areas 20] [--interval 5]
                                     [--seconds 60] [--row-bytes 4096]

`--areas` areas of one service with `warm_copy = "sqlite"`, `warm_copy_databases =
["session.sqlite"]` and `warm_copy_interval_s = --interval`; their fake daemons keep their
records in SQLite (`--store sqlite`), one committed row a second, each padded to
`--row-bytes` (the fake daemon's `--sqlite-pad-bytes`) so that the store grows as an
account's does. Moved to the VPS, they run for `--seconds` while the status is sampled every
0.5 s; then SSH to the VPS is black-holed for good (its daemons still reach the split-brain
detector over the veth) and the service given up as soon as monitord allows it. Figures:

- `warm_copy_age`: each area's copy age (now − `warm_copy.taken_at`) at every sample, over
  every area: `p50_s`, `p99_s`, `max_s`, `interval_s`, `p99_over_interval` (the target:
  at most 2 with 20 areas on `wan`); `copies` taken in the window and `copies_due` (areas ×
  seconds ÷ interval); each copy's `took_s` (monitord's `warm_copy_taken`) p50/max and
  `pass_s_p50` (one pass of the copier over every area: areas ÷ the copies it takes at
  once × one copy's time).
- `warm_copy_cost`: `bytes_changed`, the 4 KiB pages in which each area's consecutive warm
  copies differ (read from the copies on the PBX: the least a page delta must send), and
  `row_bytes`, the records written between them; `uplink_bytes`, the sum of the same
  copies' `sent_bytes` (the blocks sent, as the status shows each copy), and
  `uplink_per_changed_byte` (the target: at most 1.2); `uplink_bytes_logged`, the
  `warm_copy_taken` lines' over the window;
  `wire_vps_to_pbx_bytes`, the wire's own count of the same window VPS → PBX (everything:
  heartbeats of every area twice every 100 ms, leases, the copies' listings, digests, SSH)
  and its ratio; `vps_cpu_s_per_snapshot` p50/max (the agent's `area_warm_snapshot`, its
  `cpu_s`: the snapshot alone) and `vps_agent_cpu_s_per_copy` (the agent process's CPU over
  the window ÷ copies: the snapshot and serving its download).
- `give_up`: `allowed_s` (black hole to the first give-up monitord accepts, asked every
  0.2 s, VPS_NOT_FENCED until then), `all_home_s` (black hole to every area seen running on
  the PBX by the detector) and `all_home_after_allowed_s`, `first_home_s` and `home_p50_s`
  (the same for the first area and the median one; `parallelism` moves at a time), against
  `lease_bound_s` (the area lease and its margin) and `bound_s` (that + 5 s); `loss_p50_s`,
  `loss_max_s` (the `remote_data_abandoned` events' `kept_copy_age_s`: the copy's age when
  given up, the VPS having run the area until it was fenced), `copy_age_at_cut_p50_s` and
  `_max_s` (the same copies' age at the black hole), `kept_warm` (areas that started on
  their warm copy) of `areas`; `overlaps` (the detector's: 0 or the run is wrong).

Prints one JSON object per figure; not part of `python -m benchmarks`, nothing pass/fail.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import math
import os
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from monitord.engine.warm_copier import COPIES_AT_ONCE
from tests.support.wan_link import LinkError, LinkProfile

if TYPE_CHECKING:
    from monitord.testing.stack import Stack
    from tests.faults.netns_vps import NetnsVps

SERVICE = "tg"
DATABASE = "session.sqlite"
PAGE_BYTES = 4096
SAMPLE_S = 0.5
PARALLELISM = 4  # the Stack's: moves of one service at a time
AREA_LEASE_TTL_S = 3.0  # the Stack's default, and its lease margin
LEASE_MARGIN_S = 0.5
BOUND_EXTRA_S = 5.0
MOVE_TIMEOUT_S = 900.0
GIVE_UP_TIMEOUT_S = 120.0
USAGE = ("usage: python -m benchmarks.warm_copies [--link wan|far|lan|SPEC] [--areas N] "
         "[--interval S] [--seconds S] [--row-bytes N]")
DEFAULTS = {"--link": "wan", "--areas": "20", "--interval": "5", "--seconds": "60",
            "--row-bytes": "4096"}


@dataclass(frozen=True)
class Run:
    link: LinkProfile
    areas: int
    interval_s: float
    seconds: float
    row_bytes: int


@dataclass
class _Copies:
    """What the sampler saw of one area's warm copies on the PBX."""

    taken_at: float | None = None
    pages: list[bytes] = field(default_factory=list)  # each page's digest, the newest copy
    records: int = 0  # the newest copy's last record number
    changed_bytes: int = 0
    row_bytes: int = 0
    sent_bytes: int = 0  # the status's `sent_bytes` of each copy read after the first
    copies: int = 0


def _read_copy(path: Path, scratch: Path) -> tuple[list[bytes], int, int]:
    """(page digests, last record number, bytes of every record) of a warm copy's database,
    read from a private copy of it (nothing may be added beside the PBX's warm copy: a
    give-up checks its files against their listing)."""
    shutil.copyfile(path, scratch)
    data = scratch.read_bytes()
    pages = [hashlib.blake2b(data[i:i + PAGE_BYTES], digest_size=16).digest()
             for i in range(0, len(data), PAGE_BYTES)]
    with sqlite3.connect(f"file:{scratch}?mode=ro&immutable=1", uri=True) as db:
        last, = db.execute("SELECT coalesce(max(n), 0) FROM records").fetchone()
    db.close()
    return pages, int(last), len(data)


def _rows_after(path: Path, after: int) -> int:
    """Bytes of the records numbered above `after` in a database read as `_read_copy` did."""
    with sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True) as db:
        total, = db.execute("SELECT coalesce(sum(length(prev) + length(hash) + length(payload)),"
                            " 0) FROM records WHERE n > ?", (after,)).fetchone()
    db.close()
    return int(total)


def _observe_copy(copies: _Copies, path: Path, scratch: Path, *, first: bool) -> None:
    pages, last, _ = _read_copy(path, scratch)
    if not first:
        old = copies.pages
        copies.changed_bytes += PAGE_BYTES * sum(
            1 for i, page in enumerate(pages) if i >= len(old) or old[i] != page)
        copies.row_bytes += _rows_after(scratch, copies.records)
        copies.copies += 1
    copies.pages, copies.records = pages, last


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _rounded(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def _agent_cpu_s(stack: Stack) -> float | None:
    """The agent process's user + system CPU seconds so far (None: not found)."""
    try:
        pid = int((stack.vps_dir / "agent.pid").read_text().split()[0])
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, ValueError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _agent_snapshots(vps: NetnsVps, since: float) -> list[dict[str, Any]]:
    """The agent's `area_warm_snapshot` lines logged after `since` (wall clock)."""
    found = []
    for path in sorted((vps.remote_bin_dir / "logs").glob("agent.log*")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") == "area_warm_snapshot" and \
                    _epoch(event.get("timestamp")) >= since:
                found.append(event)
    return found


def _epoch(stamp: Any) -> float:
    from datetime import datetime

    try:
        return datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def _logged(stack: Stack, since: int, event: str) -> list[dict[str, Any]]:
    found = []
    for line in stack.log_lines[since:]:
        try:
            parsed = json.loads(line)
        except ValueError:
            continue
        if isinstance(parsed, dict) and parsed.get("event") == event:
            found.append(parsed)
    return found


async def _warm_rows(stack: Stack) -> dict[str, dict[str, Any]]:
    return {row["uuid"]: row["warm_copy"] or {}
            for row in (await stack.status())["services"][SERVICE]["areas"]}


async def _run_window(stack: Stack, vps: NetnsVps, run: Run, scratch: Path
                      ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Sample for `run.seconds`; the age and the cost figures' numbers."""
    areas = stack.areas[SERVICE]
    seen = {area: _Copies() for area in areas}

    async def every_area_copied() -> bool:
        rows = await _warm_rows(stack)
        return all(rows.get(area, {}).get("taken_at") for area in areas)

    await stack.wait_until(every_area_copied, timeout_s=60 + 10 * run.areas,
                           what="a first warm copy of every area")
    for area, row in (await _warm_rows(stack)).items():
        await asyncio.to_thread(_observe_copy, seen[area], _warm_db(stack, area), scratch,
                                first=True)
        seen[area].taken_at = row["taken_at"]
    wire_before = None if vps.wire is None else await vps.wire.counters()  # (lan: no wire)
    cpu_before = _agent_cpu_s(stack)
    since_line, started = len(stack.log_lines), time.time()
    ages: list[float] = []
    deadline = time.monotonic() + run.seconds
    while time.monotonic() < deadline:
        now = time.time()
        for area, row in (await _warm_rows(stack)).items():
            taken_at = row.get("taken_at")
            if taken_at is None:
                continue
            ages.append(max(0.0, now - taken_at))
            if taken_at != seen[area].taken_at:
                await asyncio.to_thread(_observe_copy, seen[area], _warm_db(stack, area),
                                        scratch, first=False)
                seen[area].taken_at = taken_at
                seen[area].sent_bytes += int(row.get("sent_bytes") or 0)
        await asyncio.sleep(max(0.0, SAMPLE_S - (time.time() - now)))
    ended = time.time()
    wire_after = None if vps.wire is None else await vps.wire.counters()
    cpu_after = _agent_cpu_s(stack)
    taken = _logged(stack, since_line, "warm_copy_taken")
    failed = _logged(stack, since_line, "warm_copy_failed")
    yielded = _logged(stack, since_line, "warm_copy_yielded")
    snapshots = _agent_snapshots(vps, started)
    took = [float(t["took_s"]) for t in taken]
    copies = sum(c.copies for c in seen.values())
    changed = sum(c.changed_bytes for c in seen.values())
    rows = sum(c.row_bytes for c in seen.values())
    uplink = sum(c.sent_bytes for c in seen.values())
    wire_up, wire_down = (None, None) if wire_before is None or wire_after is None else (
        int(wire_after[d]["bytes"] - wire_before[d]["bytes"]) for d in ("b_to_a", "a_to_b"))
    cpu = [float(s["cpu_s"]) for s in snapshots if "cpu_s" in s]
    p99 = _percentile(ages, 0.99)
    age = {
        "samples": len(ages), "p50_s": _rounded(_percentile(ages, 0.5)),
        "p99_s": _rounded(p99), "max_s": _rounded(max(ages, default=None)),
        "interval_s": run.interval_s,
        "p99_over_interval": _rounded(None if p99 is None else p99 / run.interval_s, 2),
        "copies": len(taken), "copies_due": round(run.areas * (ended - started)
                                                  / run.interval_s),
        "failed": len(failed), "yielded": len(yielded),
        "took_s_p50": _rounded(_percentile(took, 0.5)),
        "took_s_max": _rounded(max(took, default=None)),
        "pass_s_p50": _rounded(None if not took else statistics.median(took)
                               * math.ceil(run.areas / COPIES_AT_ONCE)),
    }
    cost = {
        "window_s": round(ended - started, 1), "copies_read": copies,
        "bytes_changed": changed, "row_bytes": rows, "uplink_bytes": uplink,
        "uplink_bytes_logged": sum(int(t["sent_bytes"]) for t in taken),
        "uplink_per_changed_byte": _rounded(uplink / changed if changed else None, 2),
        "uplink_per_row_byte": _rounded(uplink / rows if rows else None, 2),
        "wire_vps_to_pbx_bytes": wire_up, "wire_pbx_to_vps_bytes": wire_down,
        "wire_vps_to_pbx_per_changed_byte": _rounded(
            wire_up / changed if changed and wire_up is not None else None, 2),
        "vps_snapshots": len(snapshots),
        "vps_cpu_s_per_snapshot_p50": _rounded(_percentile(cpu, 0.5), 4),
        "vps_cpu_s_per_snapshot_max": _rounded(max(cpu, default=None), 4),
        "vps_snapshot_took_s_p50": _rounded(_percentile(
            [float(s["took_s"]) for s in snapshots], 0.5), 4),
        "vps_agent_cpu_s_per_copy": _rounded(
            (cpu_after - cpu_before) / len(taken)
            if cpu_before is not None and cpu_after is not None and taken else None, 4),
    }
    return age, cost


def _warm_db(stack: Stack, area: str) -> Path:
    return stack.work_dir / "warm" / SERVICE / area / DATABASE


async def _give_up(stack: Stack, vps: NetnsVps) -> dict[str, Any]:
    areas = stack.areas[SERVICE]
    since_line = len(stack.log_lines)
    stack.accepted_data_loss.update(areas)  # the operator's explicit choice
    vps.black_hole()
    lost_at = time.time()
    refused, allowed_at_said = 0, None
    deadline = time.monotonic() + GIVE_UP_TIMEOUT_S
    while True:
        code, body = await stack.request("POST", f"/v1/services/{SERVICE}/give-up", {})
        if code == 202:
            break
        if code != 409 or body["error"]["code"] != "VPS_NOT_FENCED" \
                or time.monotonic() > deadline:
            raise AssertionError(f"give-up -> {code} {body}")
        refused += 1
        allowed_at_said = allowed_at_said or body.get("allowed_at")
        await asyncio.sleep(0.2)
    allowed_at = time.time()

    def home() -> bool:
        return all(any(k.side == "local" for k in stack.detector.alive(a)) for a in areas)

    await stack.wait_until(home, timeout_s=GIVE_UP_TIMEOUT_S, what="every area on the PBX")
    home_at = time.time()
    abandoned = _logged(stack, since_line, "remote_data_abandoned")
    loss = [float(e["kept_copy_age_s"]) for e in abandoned
            if e.get("kept_copy_age_s") is not None]
    homes = sorted(min(life.first_seen for life in stack.detector.lives(a)
                       if life.key.side == "local" and life.first_seen >= lost_at) - lost_at
                   for a in areas)
    at_cut = [lost_at - float(e["warm_copy_taken_at"]) for e in abandoned
              if e.get("warm_copy_taken_at") is not None]
    lease_bound = AREA_LEASE_TTL_S + LEASE_MARGIN_S
    return {
        "areas": len(areas), "refused": refused,
        "allowed_s": round(allowed_at - lost_at, 2),
        "allowed_at_said_s": _rounded(None if allowed_at_said is None
                                      else float(allowed_at_said) - lost_at, 2),
        "all_home_s": round(home_at - lost_at, 2),
        "all_home_after_allowed_s": round(home_at - allowed_at, 2),
        "first_home_s": round(homes[0], 2), "home_p50_s": round(homes[len(homes) // 2], 2),
        "parallelism": PARALLELISM,
        "lease_bound_s": lease_bound, "bound_s": lease_bound + BOUND_EXTRA_S,
        "loss_p50_s": _rounded(_percentile(loss, 0.5), 2),
        "loss_max_s": _rounded(max(loss, default=None), 2),
        "copy_age_at_cut_p50_s": _rounded(_percentile(at_cut, 0.5), 2),
        "copy_age_at_cut_max_s": _rounded(max(at_cut, default=None), 2),
        "kept_warm": sum(1 for e in abandoned if e.get("kept_copy") == "warm"),
        "abandoned": len(abandoned),
        "overlaps": len(stack.detector.overlaps()),
    }


def _link(link: LinkProfile) -> dict[str, Any]:
    return {"name": link.name, "delay_ms_each_way": link.delay_ms,
            "rate_mbit_s": link.rate_bit_s / 1e6 or None, "loss_pct": link.loss_pct}


async def measure(tmp: Path, run: Run) -> list[dict[str, Any]]:
    from monitord.testing.stack import Stack, StackOptions
    from tests.faults.netns_vps import external_vps, fake_daemon_copy, running_netns_vps

    daemon_args = ("--store", "sqlite", "--sqlite-pad-bytes", str(run.row_bytes))
    warm = {"warm_copy": "sqlite", "warm_copy_databases": [DATABASE],
            "warm_copy_interval_s": run.interval_s}
    async with running_netns_vps(tmp / "vps", link=run.link) as vps:
        # The VPS runs this tree's fake daemon from a copy of its one file, whatever is
        # installed where the login's python finds packages.
        external = dataclasses.replace(
            external_vps(vps), remote_daemon_argv=(sys.executable, str(fake_daemon_copy(vps))))
        options = StackOptions(services={SERVICE: run.areas}, external_vps=external,
                               area_lease_ttl_s=AREA_LEASE_TTL_S, parallelism=PARALLELISM,
                               service_overrides=warm,
                               local_daemon_args=daemon_args, remote_daemon_args=daemon_args)
        async with Stack(tmp / "stack", options) as stack:
            await stack.wait_settled(expect={SERVICE: "local"}, timeout_s=120)
            await stack.place(SERVICE, "remote")
            await stack.wait_settled(expect={SERVICE: "remote"}, timeout_s=MOVE_TIMEOUT_S)
            age, cost = await _run_window(stack, vps, run, tmp / "scratch.sqlite")
            given_up = await _give_up(stack, vps)
    common = {"link": _link(run.link), "areas": run.areas, "row_bytes": run.row_bytes}
    return [{"benchmark": "warm_copy_age", **common, **age},
            {"benchmark": "warm_copy_cost", **common, "interval_s": run.interval_s, **cost},
            {"benchmark": "give_up", **common, "interval_s": run.interval_s, **given_up}]


def _arguments(argv: list[str]) -> Run:
    values = dict(DEFAULTS)
    if len(argv) % 2 or any(flag not in values for flag in argv[::2]):
        sys.exit(USAGE)
    values.update(zip(argv[::2], argv[1::2], strict=True))
    try:
        run = Run(link=LinkProfile.parse(values["--link"]), areas=int(values["--areas"]),
                  interval_s=float(values["--interval"]), seconds=float(values["--seconds"]),
                  row_bytes=int(values["--row-bytes"]))
    except (LinkError, ValueError) as e:
        sys.exit(f"{e}\n{USAGE}")
    if run.areas < 1 or run.interval_s < 1 or run.seconds <= 0 or run.row_bytes < 0:
        sys.exit(USAGE)
    return run


def _main(argv: list[str]) -> int:
    import logging

    from monitord.base import logs
    from tests.faults.netns_vps import can_build_netns

    run = _arguments(argv)
    logs.configure("json", level=logging.WARNING)  # stdout is figures only
    if not can_build_netns():
        print(json.dumps({"benchmark": "warm_copies", "skipped": "needs root, ip, nft "
                          "and sshd (the fault tier's namespace VPS)"}), flush=True)
        return 0
    with tempfile.TemporaryDirectory(prefix="bw-") as tmp:
        for figure in asyncio.run(measure(Path(tmp), run)):
            print(json.dumps(figure, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))

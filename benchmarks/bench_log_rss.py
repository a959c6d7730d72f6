"""Log path RSS figure: resident memory of N supervised areas, daemons and everything that
carries their output into `logs/{area}.log`, against the same N daemons alone, measured in
the same run, at 1, 10 and 100 areas, on both sides.

The daemon: `/bin/sh` printing a line every second (a tiny sleeping daemon; its `sleep`
child counts as part of it). The reference: the same N daemons started directly with their
output thrown away. The PBX path: a real LocalSupervisor (monitord/local/supervisor.py)
starting the N areas — their output goes through the log hub (monitord/base/log_hub.py).
The VPS path: the agent's AreaRunner (monitord/vps/area_runner.py) spawning N lease guards,
each starting its daemon — also through the hub. RSS is VmRSS summed over every process
(shared pages count in each, as `ps` shows them).

Figures per side and size: `rss_per_area_mib` = (path - reference) / N, what one more area
costs beyond its daemon; `ratio` = path / reference. On the VPS the lease guard (a Python
process per area, not part of the log path, forked from the agent's fork server, which counts
in it) is in the path too: `guard_rss_per_area_mib` names it, `guard_pss_per_area_mib` is the
guards' and the fork server's proportional set size per area (a page shared by the guards
counts once in all, not once in each: what the VPS pays), and `log_rss_per_area_mib` is the
log path's share alone (the hub / N). The `one_log_sink_mib` field is one per-daemon log
sink (`monitord log-sink`, what each area cost before the hub) measured in the same run.
Not a test: nothing here is pass/fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.waiting import until

SIZES = (1, 10, 100)
SETTLE_S = 1.5  # after every daemon runs: each has printed a line, the hub has read them
DAEMON = ("/bin/sh", "-c", "while :; do echo tick; sleep 1; done")
REPO_ROOT = Path(__file__).resolve().parents[1]


def _rss_kib(pid: int) -> int:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _pss_kib(pid: int) -> int:
    """Proportional set size: each shared page divided among the processes that map it (what
    the machine pays for a process, where VmRSS counts a shared page in each)."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    return 0


def _groups_rss_kib(pgids: set[int]) -> int:
    """VmRSS of every process in these process groups."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[2]) in pgids:  # pgrp
                total += _rss_kib(int(entry.name))
    return total


def _log_processes(logs_dir: Path) -> list[int]:
    """Hubs and sinks writing into `logs_dir` (by their command line)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            cmdline = (entry / "cmdline").read_bytes()
            if (b"log-hub" in cmdline or b"log-sink" in cmdline) \
                    and str(logs_dir).encode() in cmdline:
                found.append(int(entry.name))
    return found


def _kill_groups(pgids: set[int]) -> None:
    for pgid in pgids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


def _start_bare(areas: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen(DAEMON, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
            for _ in range(areas)]


async def _reference(areas: int) -> int:
    """RSS of `areas` bare daemons, output thrown away."""
    procs = _start_bare(areas)
    try:
        await asyncio.sleep(SETTLE_S)  # same settling time as the paths: not a wait for a state
        return _groups_rss_kib({p.pid for p in procs})
    finally:
        _kill_groups({p.pid for p in procs})
        for proc in procs:
            await asyncio.to_thread(proc.wait)


def _area(index: int) -> str:
    return f"b0000000-0000-4000-8000-{index:012d}"


async def _pbx_path(root: Path, areas: int) -> dict[str, int]:
    from monitord.local.supervisor import AreaRun, LocalSupervisor

    supervisor = LocalSupervisor(state_dir=root / "state", stop_grace_s=1.0)
    runs = {_area(i): AreaRun(service="bench", area=_area(i), generation=1, command=DAEMON,
                              data_dir=str(root / "data" / str(i))) for i in range(areas)}
    supervisor.set_desired(runs)
    await supervisor.start()
    pgids: set[int] = set()
    try:
        await until(lambda: all(v.state == "running" for v in supervisor.inventory())
                     and len(supervisor.inventory()) == areas, timeout_s=120,
                     what=f"{areas} areas running")
        await until(lambda: len(_log_processes(supervisor.logs_dir)) == 1, timeout_s=30,
                     what="the log hub")
        await asyncio.sleep(SETTLE_S)  # every daemon has printed and been read
        pgids = {v.pid for v in supervisor.inventory() if v.pid is not None}
        daemons = _groups_rss_kib(pgids)
        logging = sum(_rss_kib(pid) for pid in _log_processes(supervisor.logs_dir))
        return {"total_kib": daemons + logging, "log_kib": logging, "guard_kib": 0}
    finally:
        await supervisor.close()
        await supervisor.stop_all(grace_s=1.0)


async def _vps_path(root: Path, areas: int) -> dict[str, int]:
    from monitord.vps.area_runner import AreaRunner
    from monitord.vps.lease_table import AreaSpec

    runner = AreaRunner(base_dir=root / "vps", stop_grace_s=1.0, fence_grace_s=0.3)
    handles = []
    try:
        # as in the agent, which starts it long before its first area
        runner.ensure_forkserver()
        await until(runner.forkserver_socket.exists, timeout_s=30, what="the fork server")
        for i in range(areas):
            spec = AreaSpec(area=_area(i), service="bench", generation=1, owner_id="bench",
                            command=DAEMON, data_dir=str(root / "vps" / "data" / str(i)))
            runner.grant(spec, ttl_s=600.0)
            handles.append(runner.spawn(spec))

        def all_started() -> bool:
            runner.learn_daemons(handles)
            return all(h.daemon is not None for h in handles)

        await until(all_started, timeout_s=120, what=f"{areas} guarded daemons running")
        await until(lambda: len(_log_processes(runner.logs_dir)) == 1, timeout_s=30,
                     what="the log hub")
        await asyncio.sleep(SETTLE_S)
        server = runner.forkserver_pid()
        guards = sum(_rss_kib(pid) for pid in (*(h.pid for h in handles), server) if pid)
        guards_pss = sum(_pss_kib(pid) for pid in (*(h.pid for h in handles), server) if pid)
        daemons = _groups_rss_kib({h.daemon.pid for h in handles if h.daemon is not None})
        logging = sum(_rss_kib(pid) for pid in _log_processes(runner.logs_dir))
        return {"total_kib": guards + daemons + logging, "log_kib": logging,
                "guard_kib": guards, "guard_pss_kib": guards_pss,
                "forked": sum(1 for h in handles if h.popen is None)}
    finally:
        await asyncio.gather(*(runner.stop(h, fence=False) for h in handles))
        for handle in handles:
            if handle.popen is not None:
                await asyncio.to_thread(handle.popen.wait)
        runner.close()


def _start_sink(root: Path) -> tuple[subprocess.Popen[bytes], int]:
    """One per-daemon log sink and the write end of its pipe."""
    from monitord.base import log_sink

    root.mkdir(parents=True, exist_ok=True)
    read_end, write_end = os.pipe()
    sink = subprocess.Popen(
        [sys.executable, "-m", "monitord", "log-sink",
         *log_sink.arguments(path=root / "one.log", max_bytes=log_sink.DEFAULT_MAX_BYTES,
                             keep=log_sink.DEFAULT_KEEP)],
        stdin=read_end, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/",
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, start_new_session=True)
    os.close(read_end)
    return sink, write_end


async def _one_sink_kib(root: Path) -> int:
    """RSS of one per-daemon log sink (the cost per area before the hub)."""
    sink, write_end = _start_sink(root)
    try:
        os.write(write_end, b"tick\n")
        await until(lambda: (root / "one.log").exists(), timeout_s=30, what="the sink's file")
        await asyncio.sleep(SETTLE_S)
        return _rss_kib(sink.pid)
    finally:
        os.close(write_end)
        await asyncio.to_thread(sink.wait)


async def measure(tmp: Path, *, sizes: tuple[int, ...] = SIZES) -> list[dict[str, Any]]:
    figures: list[dict[str, Any]] = []
    one_sink = await _one_sink_kib(tmp / "sink")
    for areas in sizes:
        reference = await _reference(areas)
        for side, path in (("pbx", _pbx_path), ("vps", _vps_path)):
            got = await path(tmp / f"{side}-{areas}", areas)
            figures.append({
                "benchmark": f"log_rss_{side}",
                "areas": areas,
                "rss_mib": round(got["total_kib"] / 1024, 1),
                "reference": "the same daemons alone, output to /dev/null, same run",
                "reference_rss_mib": round(reference / 1024, 1),
                "ratio": round(got["total_kib"] / reference, 3),
                "rss_per_area_mib": round((got["total_kib"] - reference) / areas / 1024, 2),
                "log_rss_mib": round(got["log_kib"] / 1024, 1),
                "log_rss_per_area_mib": round(got["log_kib"] / areas / 1024, 2),
                "guard_rss_per_area_mib": round(got["guard_kib"] / areas / 1024, 2),
                **({} if "guard_pss_kib" not in got else {
                    "guard_pss_per_area_mib": round(got["guard_pss_kib"] / areas / 1024, 2),
                    "guards_forked": got["forked"]}),
                "one_log_sink_mib": round(one_sink / 1024, 1),
            })
    return figures


def run() -> list[dict[str, Any]]:
    if not os.path.isdir("/proc/self"):
        from benchmarks.__main__ import BenchmarkUnavailable

        raise BenchmarkUnavailable("needs /proc to read VmRSS")
    with tempfile.TemporaryDirectory(prefix="bench-log-rss-") as tmp:
        return asyncio.run(measure(Path(tmp)))

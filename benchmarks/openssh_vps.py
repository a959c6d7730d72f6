"""Migration figures on the VPS users meet: real OpenSSH, not the in-process SSH server of
`make bench`. Needs root (`make bench-openssh`; docs/benchmarks.md says what it needs).

The VPS is the fault tier's namespace VPS (tests/faults/netns_vps.py): a network namespace
behind a veth pair, with the sshd of a minimal Debian root (tests/faults/debian_root.py,
`SUITE`) chrooted into it, configured as docs/vps-setup.md says, and monitord logging in as
the documented login user (`offload`, whose shell is a plain /bin/sh: nothing printed at
login, so rsync's protocol is not disturbed). Its python3 runs the agent and the fake daemons.

For each size (1, 10, 100 areas of `DATA_BYTES`), on a fresh VPS and a fresh installation
(`monitord.testing.stack.Stack`, real `monitord run`), three moves of the same areas' data
local -> remote, in this order, each with the service's default parallelism (4):

1. the floor, as `benchmarks/bench_migration.py` defines it, over the real sshd: stop a
   running daemon (SIGTERM, reap), upload its files over SFTP on one connection (one SFTP
   session per area), start the daemon on the copy and keep it up for the health window;
   nothing that makes a move safe (that module's `run_floor`, on copies of the data);
2. by hand, what an operator would do for each area with OpenSSH's own tools: stop the
   daemon (on the PBX, where the area runs before the move), `rsync -a --delete DATA/
   offload@vps:DATA/`, then `ssh offload@vps 'start the daemon'` (detached), and the same
   health window. Each rsync and each ssh is a new SSH connection with OpenSSH's defaults (no
   connection sharing); `ssh_connect_p50_s`, the median of a few `ssh vps true` before the
   clock, is what one such connection costs here;
3. monitord: `PUT /v1/services/tg/placement {"location": "remote"}`, until every area is
   committed remote and its transaction DONE (as bench_migration measures it).

Two figures per size, like bench_migration's: `openssh_migration_local_to_remote` (wall time;
`ratio` against the floor, `ratio_by_hand` against the by-hand wall) and
`openssh_area_downtime_local_to_remote` (each area's downtime from monitord's `area_downtime`
events: p50/p99/max; `ratio` = p99 against the floor's p99, `ratio_by_hand_p50/p99` against
the by-hand moves' downtimes, each from its stop to the end of its health window). The by-hand
steps' medians (`by_hand_stop_p50_s`, `by_hand_rsync_p50_s`, `by_hand_start_p50_s`) and
monitord's stretches (as bench_migration's) say where the time went, with the CPU seconds
`monitord run` and the VPS's agent used during the move (`monitord_cpu_s`, `agent_cpu_s`;
`cpu_share_of_wall`: their sum over the wall time, of the machine's 2 or more cores);
`load_avg_1m` is the machine's load average at the start and the end of the size.

`python -m benchmarks.openssh_vps [--link wan] [AREAS ...]` prints each size's figures as soon as
it is done (default 1 10 100); it is not part of `python -m benchmarks`. `--link` puts a WAN
between the PBX and the VPS (tests/support/wan_link.py: `lan` the bare veth, `wan` 40 ms each
way at 20 Mbit/s, `far` 150 ms, 5 Mbit/s and 1 % loss, or a spec such as
`delay=40ms,rate=20mbit`); every way of moving (the floor, by hand, monitord) crosses it, and
each figure says which link (`link`) and, with a delay, how many round trips the median
downtime spans (`p50_round_trips`, `by_hand_p50_round_trips`). The fault tier runs the smallest
size end to end (tests/faults/test_openssh_benchmark.py). Not a test: nothing here is
pass/fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks import bench_migration as bm
from tests.support.wan_link import PROFILES, LinkError, LinkProfile

if TYPE_CHECKING:
    from monitord.testing.stack import Stack
    from tests.faults.netns_vps import NetnsVps

SIZES = (1, 10, 100)
DATA_BYTES = 256 * 1024
SUITE = "trixie"  # the newest Debian release the fault tier runs
SERVICE = "tg"
MIN_UPTIME_S = bm.MIN_UPTIME_S
SSH_CONNECT_SAMPLES = 5
COMMAND_TIMEOUT_S = 60.0
FAKE_DAEMON_ARGS = ("--side", "remote", "--generation", "1")


def unavailable_reason() -> str | None:
    """Why this machine cannot run the benchmark, or None."""
    from tests.faults import debian_root
    from tests.faults.netns_vps import can_build_netns

    if not can_build_netns():
        return "needs root, ip, nft and sshd (the fault tier's namespace VPS)"
    if shutil.which("rsync") is None or shutil.which("ssh") is None:
        return "needs rsync and ssh on this machine (apt-get install rsync openssh-client)"
    if not debian_root.can_build_roots():
        return "needs mmdebstrap or built roots (python -m tests.faults.debian_root)"
    return None


# -- OpenSSH's own tools --------------------------------------------------------------------


def _ssh_argv(vps: NetnsVps) -> list[str]:
    """`ssh` with the VPS's key and known_hosts only: no user config, no agent, no prompt."""
    return ["ssh", "-F", "/dev/null", "-i", str(vps.client_key.private_path),
            "-o", "IdentitiesOnly=yes", "-o", "IdentityAgent=none",
            "-o", f"UserKnownHostsFile={vps.known_hosts}", "-o", "StrictHostKeyChecking=yes",
            "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-p", str(vps.port)]


async def _command(argv: list[str], *, timeout_s: float = COMMAND_TIMEOUT_S) -> str:
    """Run argv to its end; its stdout, or RuntimeError naming its stderr."""
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError as e:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise TimeoutError(f"{shlex.join(argv)[-300:]}: not done in {timeout_s:g} s") from e
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[0]} -> {proc.returncode}: {err.decode()[-500:]}")
    return out.decode()


async def _ssh_connect_p50(vps: NetnsVps) -> float:
    """Median wall time of `ssh vps true`: one connection, login and command."""
    spans = []
    for _ in range(SSH_CONNECT_SAMPLES):
        clock = time.perf_counter()
        await _command([*_ssh_argv(vps), f"{vps.user}@{vps.vps_address}", "true"])
        spans.append(time.perf_counter() - clock)
    return statistics.median(spans)


def _cpu_s(pid: int | None) -> float:
    """User + system CPU seconds a live process has used so far (0.0 if it is gone)."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _agent_pid(stack: Stack) -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int((stack.vps_dir / "agent.pid").read_text().split()[0])
    return None


def _alive(pid: int) -> bool:
    """The VPS shares this machine's process IDs (only its network and mounts are its own)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].startswith("Z")


async def _by_hand(vps: NetnsVps, areas: list[dict[str, str]], *, daemon_file: Path,
                   parallelism: int, heartbeat: str) -> dict[str, Any]:
    """Each area moved as an operator would, `parallelism` at a time: stop, rsync, ssh start,
    health window. {wall_s, downtimes_s, stop_s, rsync_s, start_s} (per-area lists)."""
    sources = {
        a["area"]: await bm._spawn_daemon(area=a["area"], data=Path(a["src"]), side="local",
                                          heartbeat=heartbeat)
        for a in areas
    }
    started: list[int] = []
    steps: dict[str, list[float]] = {"downtimes_s": [], "stop_s": [], "rsync_s": [],
                                     "start_s": []}
    ssh = _ssh_argv(vps)
    login = f"{vps.user}@{vps.vps_address}"
    try:
        for a in areas:
            await bm._until_started(Path(a["src"]), timeout_s=60)
        slots = asyncio.Semaphore(parallelism)

        async def move(a: dict[str, str]) -> None:
            async with slots:
                source = sources[a["area"]]
                stopped = time.perf_counter()  # the area's downtime starts
                source.send_signal(signal.SIGTERM)
                await asyncio.wait_for(source.wait(), 30)
                copying = time.perf_counter()
                await _command(["rsync", "-a", "--delete", "-e", shlex.join(ssh),
                                f"{a['src']}/", f"{login}:{a['dst']}/"])
                starting = time.perf_counter()
                start = shlex.join(["python3", str(daemon_file), "--area", a["area"],
                                    "--data", a["dst"], *FAKE_DAEMON_ARGS,
                                    "--heartbeat", heartbeat])
                out = await _command([*ssh, login,
                                      f"setsid {start} </dev/null >/dev/null 2>&1 & echo $!"])
                pid = int(out.split()[-1])
                started.append(pid)
                window = time.perf_counter()
                await asyncio.sleep(MIN_UPTIME_S)  # the health window itself
                if not _alive(pid):
                    raise RuntimeError(f"the by-hand daemon of {a['area']} exited")
                end = time.perf_counter()
                steps["downtimes_s"].append(end - stopped)
                steps["stop_s"].append(copying - stopped)
                steps["rsync_s"].append(starting - copying)
                steps["start_s"].append(window - starting)

        clock = time.perf_counter()
        await asyncio.gather(*(move(a) for a in areas))
        wall_s = time.perf_counter() - clock
    finally:
        for proc in sources.values():
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        for pid in started:  # not children of ours: their sshd's session reaps them
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return {"wall_s": wall_s, **steps}


# -- one size --------------------------------------------------------------------------------


def _copies(stack: Stack, case: Path, vps: NetnsVps, name: str) -> list[dict[str, str]]:
    """Copies of the areas' data on the PBX (`src`) and where they go on the VPS (`dst`)."""
    areas = []
    for area in stack.areas[SERVICE]:
        src = case / name / area
        shutil.copytree(stack.root / "pbx" / SERVICE / area, src)
        areas.append({"area": f"{name}-{area}", "src": str(src),
                      "dst": str(vps.remote_bin_dir / name / area)})
    return areas


def _p(values: list[float], pct: int) -> float:
    return bm._percentile(values, pct)


async def _one_case(case: Path, root: Path, *, areas: int, data_bytes: int,
                    link: LinkProfile) -> list[dict[str, Any]]:
    from monitord.base.config import ServiceSection
    from monitord.testing.stack import Stack, StackOptions
    from tests.faults.debian_root import release_of
    from tests.faults.netns_vps import (
        DOCUMENTED_USER,
        LOGIN_UID,
        external_vps,
        fake_daemon_copy,
        running_netns_vps,
    )

    load_start = os.getloadavg()[0]
    parallelism = ServiceSection.model_fields["parallelism"].default
    copy_allowance_s = areas * data_bytes / bm.MIB / bm.COPY_FLOOR_MIB_PER_S
    async with running_netns_vps(case / "vps", debian_root=root, shared=case,
                                 login=DOCUMENTED_USER, link=link) as vps:
        options = StackOptions(services={SERVICE: areas}, data_bytes=data_bytes,
                               min_uptime_s=MIN_UPTIME_S, parallelism=parallelism,
                               external_vps=external_vps(vps))
        async with Stack(case / "stack", options) as stack:
            await stack.wait_settled(expect={SERVICE: "local"}, timeout_s=90 + areas)
            ssh_connect_s = await _ssh_connect_p50(vps)
            floor = await bm.run_floor({
                "host": vps.vps_address, "port": vps.port, "user": vps.user,
                "key_file": str(vps.client_key.private_path),
                "known_hosts": str(vps.known_hosts),
                "areas": _copies(stack, case, vps, "floor"), "parallelism": parallelism,
                "min_uptime_s": MIN_UPTIME_S, "heartbeat": bm._closed_port(),
            }, timeout_s=600 + copy_allowance_s)
            hand_dir = vps.remote_bin_dir / "hand"
            hand_dir.mkdir()
            os.chown(hand_dir, LOGIN_UID, LOGIN_UID)
            hand = await _by_hand(vps, _copies(stack, case, vps, "hand"),
                                  daemon_file=fake_daemon_copy(vps),
                                  parallelism=parallelism, heartbeat=bm._closed_port())
            since = len(stack.log_lines)
            assert stack.daemon is not None
            monitord_pid, agent_pid = stack.daemon.pid, _agent_pid(stack)
            cpu = _cpu_s(monitord_pid), _cpu_s(agent_pid)
            clock = time.perf_counter()
            await stack.place(SERVICE, "remote")
            await bm._all_done(stack, timeout_s=120 + 10 * areas + copy_allowance_s)
            wall_s = time.perf_counter() - clock
            monitord_cpu_s = _cpu_s(monitord_pid) - cpu[0]
            agent_cpu_s = _cpu_s(agent_pid) - cpu[1]
            downtimes = await bm._all_downtimes(stack, since, areas=areas)
            stretches = bm._stretches(stack, since)
            wall_stretches = bm._stretches(stack, since, bm.WALL_STRETCHES)
            last_move = (await stack.status())["services"][SERVICE]["last_move"]
            committed_remote = sum(1 for e in stack.committed().values()
                                   if e.get("location") == "remote")
            started = bm._count(stack, since, "transaction_started")
            rollbacks = bm._count(stack, since, "transaction_phase", phase="ROLLED_BACK")
            step_retries = bm._count(stack, since, "step_retry")
            overlaps = len(stack.detector.overlaps())
            regressions = len(stack.detector.regressions())
    release = release_of(root)
    common = {
        "vps": f"Debian {release.debian} ({release.suite}), {release.openssh}, login "
               f"{DOCUMENTED_USER}, network namespace",
        "areas": areas, "data_bytes_per_area": data_bytes, "parallelism": parallelism,
        "min_uptime_s": MIN_UPTIME_S,
        "load_avg_1m": [round(load_start, 2), round(os.getloadavg()[0], 2)],
        "link": _link_figure(link),
    }
    by_hand_text = ("by hand per area: stop, rsync -a --delete over ssh, ssh start, health "
                    "window; same parallelism, same data, same sshd")
    wall = {
        "benchmark": "openssh_migration_local_to_remote", **common,
        "wall_s": round(wall_s, 3),
        "reference": "floor: stop + SFTP upload of the same bytes + start + health window, "
                     "same parallelism, same real sshd",
        "reference_s": round(floor["wall_s"], 3),
        "ratio": round(wall_s / floor["wall_s"], 2),
        "by_hand_reference": by_hand_text,
        "by_hand_s": round(hand["wall_s"], 3),
        "ratio_by_hand": round(wall_s / hand["wall_s"], 2),
        "per_area_s": round(wall_s / areas, 3),
        "ssh_connect_p50_s": round(ssh_connect_s, 3),
        "monitord_cpu_s": round(monitord_cpu_s, 2),
        "agent_cpu_s": round(agent_cpu_s, 2),
        "cpu_share_of_wall": round((monitord_cpu_s + agent_cpu_s) / wall_s, 2),
        "committed_remote": committed_remote,
        "transactions_started": started, "rollbacks": rollbacks,
        "step_retries": step_retries, "split_brain_overlaps": overlaps,
        "data_regressions": regressions,
        **wall_stretches,
    }
    downtime = bm._downtime_figure(
        areas=areas, data_bytes=data_bytes, parallelism=parallelism, measured=downtimes,
        floor=floor["downtimes_s"], last_move=last_move, stretches=stretches,
    )
    p50, p99 = _p(downtimes, 50), _p(downtimes, 99)
    hand_p50, hand_p99 = _p(hand["downtimes_s"], 50), _p(hand["downtimes_s"], 99)
    downtime.update({
        "benchmark": "openssh_area_downtime_local_to_remote", **common,
        "reference": "floor per area: SIGTERM + reap, SFTP upload of the same bytes, start, "
                     "health window; same parallelism, same real sshd, same run",
        "by_hand_reference": by_hand_text,
        "by_hand_p50_s": round(hand_p50, 3),
        "by_hand_p99_s": round(hand_p99, 3),
        "ratio_by_hand_p50": round(p50 / hand_p50, 2),
        "ratio_by_hand_p99": round(p99 / hand_p99, 2),
        "by_hand_stop_p50_s": round(statistics.median(hand["stop_s"]), 3),
        "by_hand_rsync_p50_s": round(statistics.median(hand["rsync_s"]), 3),
        "by_hand_start_p50_s": round(statistics.median(hand["start_s"]), 3),
        "rollbacks": rollbacks, "split_brain_overlaps": overlaps,
    })
    if link.rtt_s:
        # What the window costs in the link's own unit: how many round trips it spans.
        downtime["p50_round_trips"] = round(p50 / link.rtt_s, 1)
        downtime["by_hand_p50_round_trips"] = round(hand_p50 / link.rtt_s, 1)
    return [wall, downtime]


def _link_figure(link: LinkProfile) -> dict[str, Any]:
    return {"name": link.name, "delay_ms_each_way": link.delay_ms,
            "rate_mbit_s": link.rate_bit_s / 1e6 if link.rate_bit_s else None,
            "loss_pct_each_way": link.loss_pct, "queue_ms": link.queue_ms if link.wired else None}


async def measure_case(tmp: Path, *, areas: int, data_bytes: int = DATA_BYTES,
                       suite: str = SUITE, link: LinkProfile | None = None,
                       keep_files: bool = False) -> list[dict[str, Any]]:
    """The two figures of one size, on its own VPS and installation under `tmp/oN` (removed
    afterwards unless `keep_files`: the VPS's files stay at `tmp/oN/vps`, the stack's at
    `tmp/oN/stack`). A size that fails reports its error in both figures."""
    from tests.faults import debian_root

    case = tmp / f"o{areas}"
    try:
        root = await asyncio.to_thread(debian_root.debian_root, suite)
        return await _one_case(case, root, areas=areas, data_bytes=data_bytes,
                               link=link or PROFILES["lan"])
    except (TimeoutError, RuntimeError, AssertionError, OSError) as e:
        where = traceback.extract_tb(e.__traceback__)[-1]
        return [{"benchmark": name, "areas": areas, "data_bytes_per_area": data_bytes,
                 "error": f"{type(e).__name__}: {str(e)[:300]} (at "
                          f"{Path(where.filename).name}:{where.lineno})"}
                for name in ("openssh_migration_local_to_remote",
                             "openssh_area_downtime_local_to_remote")]
    finally:
        if not keep_files:
            await asyncio.to_thread(shutil.rmtree, case, True)


async def measure(tmp: Path, *, sizes: tuple[int, ...] = SIZES,
                  link: LinkProfile | None = None) -> list[dict[str, Any]]:
    figures: list[dict[str, Any]] = []
    for areas in sizes:
        figures.extend(await measure_case(tmp, areas=areas, link=link))
    return figures


USAGE = ("usage: python -m benchmarks.openssh_vps [--link lan|wan|far|SPEC] [AREAS ...]  "
         "(default: lan; 1 10 100)")


def _arguments(argv: list[str]) -> tuple[LinkProfile, list[int]]:
    link = PROFILES["lan"]
    if argv[:1] == ["--link"]:
        if len(argv) < 2:
            sys.exit(USAGE)
        try:
            link = LinkProfile.parse(argv[1])
        except LinkError as e:
            sys.exit(f"{e}\n{USAGE}")
        argv = argv[2:]
    if not all(a.isdigit() and int(a) > 0 for a in argv):
        sys.exit(USAGE)
    return link, [int(a) for a in argv] or list(SIZES)


def _main(argv: list[str]) -> int:
    import logging

    from monitord.base import logs

    link, sizes = _arguments(argv)
    logs.configure("json", level=logging.WARNING)  # stdout is figures only
    reason = unavailable_reason()
    if reason is not None:
        print(json.dumps({"benchmark": "openssh_migration_local_to_remote",
                          "skipped": reason}), flush=True)
        return 0
    status = 0
    # Short names: the paths under it are short enough for every Unix socket on both sides.
    with tempfile.TemporaryDirectory(prefix="bo-") as tmp:
        for areas in sizes:
            for figure in asyncio.run(measure_case(Path(tmp), areas=areas, link=link)):
                status = 1 if "error" in figure else status
                print(json.dumps(figure, sort_keys=True), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))

"""Migration wall time figures: moving 1, 10 and 100 areas local -> remote on a
whole installation (`monitord.testing.stack.Stack`: real `monitord run`, the in-process SSH
VPS, the real agent, fake daemons), against the FLOOR measured in the same run on the same
stack.

The migration: every area holds `DATA_BYTES` of data (plus the fake daemon's small session
DB); `PUT /v1/services/tg/placement {"location": "remote"}` starts the clock, which stops
when every area is committed remote in custom_config.json and no transaction is active
(every one reached DONE). Parallelism is the service default (`services.<name>.parallelism`,
4), the health window is `min_uptime_s` = `MIN_UPTIME_S`.

The floor: what the move costs at the least, done for the same number of areas with the same
parallelism, by a separate process (as monitord is one): stop a running daemon (SIGTERM,
reap), upload the same files over SFTP on ONE asyncssh connection to the same VPS server
(one SFTP session per area, as the COPY phase opens), start the daemon on the uploaded copy
and keep it up for the health window. The floor skips everything that makes the migration
safe: preflight, the durable record of each phase, the remote hash check and atomic rename,
the agent, the area lease and its guard process, the commit write and the source cleanup.
`ratio` = migration wall time / floor wall time.

Each figure also says how many transactions were retried or rolled back on the way, and how
many split-brain overlaps the detector saw, so an odd figure explains itself; the wall figure
gives the median of each stretch around the downtime too (`preflight_p50_s`: preflight and
pre-copy; `commit_p50_s`; `cleanup_p50_s`: the source's archive).

The same run gives a second figure, `area_downtime_local_to_remote`: each area's downtime as
monitord recorded it (its `area_downtime` events: from the moment the source may no longer run
to the destination's health check passing) — p50, p99 and max over the areas — against the
floor's per-area downtime in the same run (from its SIGTERM to the end of the health window
after the copy: stop + copy of the bytes while stopped + start + health window). `ratio` is
the p99 one. The status document's `last_move.downtime_s` is read back beside it, and the
median of each stretch of the downtime (`stop`, `copy`, `create`, `healthcheck`: from entering
one phase to entering the next, in monitord's `transaction_phase` events) says where it went.

Cases are (areas, bytes per area): `CASES` by default (1, 10, 100 areas at 256 KiB; 1 and 10
at 16 MiB; 1 at 128 MiB), `FULL_CASES` with `--full` (every combination of 1, 10, 100 areas
and 256 KiB, 16 MiB, 128 MiB). A case whose data would not fit comfortably on the disk
(about four copies of it: the source, the floor's two, the destination) reports "skipped".

Run as `python -m benchmarks.bench_migration [--full]` it prints the figures; as
`python -m benchmarks.bench_migration --floor SPEC_JSON` it is that floor process. Called by
`python -m benchmarks` (the default cases); the unit smoke test calls `measure()` with one area
of 256 KiB. Not a test: nothing here is pass/fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from monitord.testing.stack import Stack

SIZES = (1, 10, 100)
DATA_BYTES = 256 * 1024
MIB = 2**20
CASES = ((1, DATA_BYTES), (10, DATA_BYTES), (1, 16 * MIB), (10, 16 * MIB), (1, 128 * MIB),
         (100, DATA_BYTES))
FULL_CASES = tuple((areas, size) for size in (DATA_BYTES, 16 * MIB, 128 * MIB)
                   for areas in SIZES)
DISK_COPIES = 4  # source, the floor's source copy and upload, the destination
COPY_FLOOR_MIB_PER_S = 5.0  # only for time-outs: a copy slower than this is a failure
MIN_UPTIME_S = 0.5
SERVICE = "tg"
POLL_S = 0.02
FAKE_DAEMON = (sys.executable, "-m", "monitord.testing.fake_daemon")
PROJECT_ROOT = Path(__file__).resolve().parent.parent


# -- the floor (runs in its own process) --------------------------------------------------


async def _spawn_daemon(*, area: str, data: Path, side: str, heartbeat: str
                        ) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        *FAKE_DAEMON, "--area", area, "--data", str(data), "--side", side,
        "--generation", "1", "--heartbeat", heartbeat,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL, start_new_session=True,
    )


async def _until_started(data: Path, *, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not (data / "session.db").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the floor daemon in {data} did not start in {timeout_s} s")
        await asyncio.sleep(POLL_S)  # poll interval of a deadline loop


def _files(src: Path) -> list[tuple[Path, str, int]]:
    """(path, relative POSIX path, size) of every regular file under src, sorted."""
    return [(path, path.relative_to(src).as_posix(), path.stat().st_size)
            for path in sorted(src.rglob("*")) if path.is_file()]


async def _floor(spec: dict[str, Any]) -> dict[str, Any]:
    """Stop + SFTP upload + start + health window for every area, `parallelism` at a time."""
    import asyncssh

    from monitord.remote.tunnel import ssh_connect

    areas: list[dict[str, str]] = spec["areas"]
    heartbeat = spec["heartbeat"]
    sources = {
        a["area"]: await _spawn_daemon(area=a["area"], data=Path(a["src"]), side="local",
                                       heartbeat=heartbeat)
        for a in areas
    }
    started: list[asyncio.subprocess.Process] = []
    try:
        for a in areas:
            await _until_started(Path(a["src"]), timeout_s=60)
        # Files are listed before the clock starts; a session DB still grows until its daemon
        # stops, so `bytes` counts the listed sizes (short by a few records at most).
        files = {a["area"]: _files(Path(a["src"])) for a in areas}
        async with asyncssh.connect(
            spec["host"], spec["port"], username=spec["user"], client_keys=[spec["key_file"]],
            known_hosts=spec["known_hosts"], agent_path=None, config=None,
            encryption_algs=ssh_connect.cipher_preference(),  # what monitord pays
        ) as conn:
            slots = asyncio.Semaphore(spec["parallelism"])
            moved = [0]
            downtimes: list[float] = []

            async def move(a: dict[str, str]) -> None:
                async with slots:
                    source = sources[a["area"]]
                    stopped = time.perf_counter()  # the area's downtime starts
                    source.send_signal(signal.SIGTERM)
                    await asyncio.wait_for(source.wait(), 30)
                    dst = PurePosixPath(a["dst"])
                    async with conn.start_sftp_client() as sftp:
                        await sftp.makedirs(str(dst), exist_ok=True)
                        for path, rel, size in files[a["area"]]:
                            await sftp.put(str(path), str(dst / rel))
                            moved[0] += size
                    daemon = await _spawn_daemon(area=a["area"], data=Path(a["dst"]),
                                                 side="remote", heartbeat=heartbeat)
                    started.append(daemon)
                    await asyncio.sleep(spec["min_uptime_s"])  # the health window itself
                    if daemon.returncode is not None:
                        raise RuntimeError(f"floor daemon exited with {daemon.returncode}")
                    downtimes.append(time.perf_counter() - stopped)

            clock = time.perf_counter()
            await asyncio.gather(*(move(a) for a in areas))
            wall_s = time.perf_counter() - clock
    finally:
        for proc in (*sources.values(), *started):
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    return {"wall_s": wall_s, "bytes": moved[0], "downtimes_s": downtimes}


# -- the migration (the benchmark process drives a Stack) ---------------------------------


def _closed_port() -> str:
    from monitord.testing.ports import free_port

    return f"127.0.0.1:{free_port()}"


async def _measure_floor(stack: Stack, *, parallelism: int, timeout_s: float
                         ) -> dict[str, Any]:
    """Run the floor process against the stack's VPS with copies of the areas' data."""
    assert stack.vps is not None
    floor_root = stack.root / "floor"
    areas = []
    for area in stack.areas[SERVICE]:
        src = floor_root / "pbx" / area
        shutil.copytree(stack.root / "pbx" / SERVICE / area, src)
        areas.append({"area": f"floor-{area}", "src": str(src),
                      "dst": str(floor_root / "vps" / area)})
    spec = {
        "host": stack.vps.host, "port": stack.vps.port, "user": stack.vps.username,
        "key_file": str(stack.vps.key_file), "known_hosts": str(stack.vps.known_hosts),
        "areas": areas, "parallelism": parallelism, "min_uptime_s": MIN_UPTIME_S,
        "heartbeat": _closed_port(),
    }
    return await run_floor(spec, timeout_s=timeout_s)


async def run_floor(spec: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
    """The floor process (`_floor`) run on `spec`: host, port, user, key_file, known_hosts of
    the VPS's SSH server; areas ({area, src, dst}); parallelism, min_uptime_s, heartbeat.
    Its {wall_s, bytes, downtimes_s}."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "benchmarks.bench_migration", "--floor", json.dumps(spec),
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, cwd=str(PROJECT_ROOT),
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"floor process failed ({proc.returncode}): {err.decode()[-800:]}")
    result: dict[str, Any] = json.loads(out)
    return result


async def _all_done(stack: Stack, *, timeout_s: float) -> None:
    """Poll (cheaply: the file first) until every area is committed remote and DONE."""
    areas = stack.areas[SERVICE]
    deadline = time.monotonic() + timeout_s

    def committed_remote() -> bool:
        with contextlib.suppress(OSError, ValueError):
            placed = stack.committed()
            return all(placed[a].get("location") == "remote" for a in areas)
        return False

    async def no_transaction() -> bool:
        code, body = await stack.request("GET", "/v1/status")
        return code == 200 and not body["transactions"]

    while not committed_remote() or not await no_transaction():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(areas)} areas not all migrated within {timeout_s} s")
        await asyncio.sleep(POLL_S)  # poll interval of a deadline loop


def _count(stack: Stack, since: int, event: str, **match: str) -> int:
    found = 0
    for line in stack.log_lines[since:]:
        if f'"{event}"' not in line:
            continue
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if record.get("event") == event and all(record.get(k) == v
                                                     for k, v in match.items()):
                found += 1
    return found


def _downtimes(stack: Stack, since: int, *, outcome: str) -> list[float]:
    """monitord's per-area downtimes of this migration that ended with `outcome` (its
    `area_downtime` events)."""
    found = []
    for line in stack.log_lines[since:]:
        if '"area_downtime"' not in line:
            continue
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if record.get("event") == "area_downtime" and record.get("outcome") == outcome:
                found.append(float(record["downtime_s"]))
    return found


async def _all_downtimes(stack: Stack, since: int, *, areas: int) -> list[float]:
    """Every area's downtime event of its move that reached DONE (logged as the transaction
    ends; read from stderr)."""
    deadline = time.monotonic() + 30
    while len(found := _downtimes(stack, since, outcome="done")) < areas:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(found)} of {areas} area_downtime events")
        await asyncio.sleep(POLL_S)  # poll interval of a deadline loop
    return found


# What each stretch of an area's downtime is: from entering one phase to entering the next.
DOWNTIME_STRETCHES = (
    ("stop", "SUPPRESS_SOURCE", "COPY"),
    ("copy", "COPY", "CREATE_DESTINATION"),
    ("create", "CREATE_DESTINATION", "HEALTHCHECK_DESTINATION"),
    ("healthcheck", "HEALTHCHECK_DESTINATION", "COMMIT_LOCATION"),
)
# The rest of one transaction's wall time, around the downtime (the wall figure's stretches).
WALL_STRETCHES = (
    ("preflight", "PREFLIGHT", "SUPPRESS_SOURCE"),  # preflight and the pre-copy
    ("commit", "COMMIT_LOCATION", "CLEANUP_SOURCE"),
    ("cleanup", "CLEANUP_SOURCE", "DONE"),
)


def _stretches(
    stack: Stack, since: int, table: tuple[tuple[str, str, str], ...] = DOWNTIME_STRETCHES
) -> dict[str, float]:
    """p50 over the areas of each stretch in `table`, from monitord's phase events."""
    entered: dict[str, dict[str, float]] = {}
    for line in stack.log_lines[since:]:
        if '"transaction_phase"' not in line and '"transaction_started"' not in line:
            continue
        with contextlib.suppress(ValueError, KeyError, TypeError):
            record = json.loads(line)
            event = record.get("event")
            if event not in ("transaction_phase", "transaction_started"):
                continue
            phase = "PREFLIGHT" if event == "transaction_started" else record["phase"]
            at = datetime.fromisoformat(record["timestamp"]).timestamp()
            entered.setdefault(record["transaction_id"], {}).setdefault(phase, at)
    result = {}
    for name, start, end in table:
        spans = [phases[end] - phases[start] for phases in entered.values()
                 if start in phases and end in phases]
        if spans:
            result[f"{name}_p50_s"] = round(statistics.median(spans), 3)
    return result


def _percentile(values: list[float], pct: int) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[pct - 1]


def _downtime_figure(
    *, areas: int, data_bytes: int, parallelism: int, measured: list[float],
    floor: list[float], last_move: dict[str, Any] | None, stretches: dict[str, float],
) -> dict[str, Any]:
    p50, p99 = _percentile(measured, 50), _percentile(measured, 99)
    floor_p50, floor_p99 = _percentile(floor, 50), _percentile(floor, 99)
    status = (last_move or {}).get("downtime_s") or {}
    return {
        "benchmark": "area_downtime_local_to_remote",
        "areas": areas,
        "data_bytes_per_area": data_bytes,
        "parallelism": parallelism,
        "min_uptime_s": MIN_UPTIME_S,
        "p50_s": round(p50, 3),
        "p99_s": round(p99, 3),
        "max_s": round(max(measured), 3),
        "reference": "floor per area: SIGTERM + reap, SFTP upload of the same bytes, start,"
                     " health window; same parallelism, same VPS server, same run",
        "reference_p50_s": round(floor_p50, 3),
        "reference_p99_s": round(floor_p99, 3),
        "ratio_p50": round(p50 / floor_p50, 2),
        "ratio_p99": round(p99 / floor_p99, 2),
        "ratio": round(p99 / floor_p99, 2),
        "status_last_move_p50_s": status.get("p50"),
        "status_last_move_max_s": status.get("max"),
        "measured_areas": len(measured),
        **stretches,
    }


def _skip_reason(root: Path, *, areas: int, data_bytes: int) -> str | None:
    needed = DISK_COPIES * areas * data_bytes
    root.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(root).free
    if needed > free // 2:
        return (f"needs about {needed / 2**30:.1f} GiB of disk ({DISK_COPIES} copies of"
                f" {areas} x {data_bytes // MIB} MiB), only {free / 2**30:.1f} GiB free")
    return None


async def _one_case(root: Path, *, areas: int, data_bytes: int) -> list[dict[str, Any]]:
    from monitord.base.config import ServiceSection
    from monitord.testing.stack import Stack, StackOptions

    skipped = _skip_reason(root, areas=areas, data_bytes=data_bytes)
    if skipped is not None:
        return [{"benchmark": name, "areas": areas, "data_bytes_per_area": data_bytes,
                 "skipped": skipped}
                for name in ("migration_local_to_remote", "area_downtime_local_to_remote")]
    parallelism = ServiceSection.model_fields["parallelism"].default
    options = StackOptions(services={SERVICE: areas}, data_bytes=data_bytes,
                           min_uptime_s=MIN_UPTIME_S, parallelism=parallelism)
    copy_allowance_s = areas * data_bytes / MIB / COPY_FLOOR_MIB_PER_S
    async with Stack(root, options) as stack:
        await stack.wait_settled(expect={SERVICE: "local"}, timeout_s=60 + areas)
        floor = await _measure_floor(stack, parallelism=parallelism,
                                     timeout_s=600 + copy_allowance_s)
        since = len(stack.log_lines)
        clock = time.perf_counter()
        await stack.place(SERVICE, "remote")
        await _all_done(stack, timeout_s=120 + 10 * areas + copy_allowance_s)
        wall_s = time.perf_counter() - clock
        downtimes = await _all_downtimes(stack, since, areas=areas)
        stretches = _stretches(stack, since)
        wall_stretches = _stretches(stack, since, WALL_STRETCHES)
        rolled_back = _downtimes(stack, since, outcome="rolled_back")
        last_move = (await stack.status())["services"][SERVICE]["last_move"]
        started = _count(stack, since, "transaction_started")
        rollbacks = _count(stack, since, "transaction_phase", phase="ROLLED_BACK")
        step_retries = _count(stack, since, "step_retry")
        overlaps = len(stack.detector.overlaps())
    total_bytes = floor["bytes"]
    wall = {
        "benchmark": "migration_local_to_remote",
        "areas": areas,
        "data_bytes_per_area": data_bytes,
        "parallelism": parallelism,
        "min_uptime_s": MIN_UPTIME_S,
        "wall_s": round(wall_s, 3),
        "reference": "floor: stop + SFTP upload of the same bytes + start + health window, "
                     "same parallelism, same VPS server",
        "reference_s": round(floor["wall_s"], 3),
        "ratio": round(wall_s / floor["wall_s"], 2),
        "per_area_s": round(wall_s / areas, 3),
        "areas_per_s": round(areas / wall_s, 2),
        "data_mib_per_s": round(total_bytes / wall_s / 2**20, 2),
        "transactions_started": started,
        "rollbacks": rollbacks,
        "step_retries": step_retries,
        "split_brain_overlaps": overlaps,
        **wall_stretches,
    }
    downtime = _downtime_figure(
        areas=areas, data_bytes=data_bytes, parallelism=parallelism, measured=downtimes,
        floor=floor["downtimes_s"], last_move=last_move, stretches=stretches,
    )
    # An area rolled back on the way was down twice (until its source ran again, then in the
    # move that succeeded): the figure is over the moves that reached DONE, these beside it.
    rollback_downtime = {"rollback_downtime_max_s": round(max(rolled_back), 3)} \
        if rolled_back else {}
    return [wall, {**downtime, **rollback_downtime, "split_brain_overlaps": overlaps,
                   "rollbacks": rollbacks}]


async def measure_case(tmp: Path, *, areas: int, data_bytes: int) -> list[dict[str, Any]]:
    """Two figures (wall time, per-area downtime) of one case on its own fresh stack, whose
    directory is removed afterwards (large cases fill the disk). A case that fails reports
    its error in both figures, so the other cases' figures still come out."""
    # Short names: the VPS side's Unix socket path under the stack must fit 107 bytes.
    root = tmp / (f"m{areas}" if data_bytes == DATA_BYTES else f"m{areas}b{data_bytes // MIB}")
    try:
        return await _one_case(root, areas=areas, data_bytes=data_bytes)
    except (TimeoutError, RuntimeError, AssertionError) as e:
        return [{"benchmark": name, "areas": areas, "data_bytes_per_area": data_bytes,
                 "error": f"{type(e).__name__}: {str(e)[:300]}"}
                for name in ("migration_local_to_remote", "area_downtime_local_to_remote")]
    finally:
        await asyncio.to_thread(shutil.rmtree, root, True)


async def measure(
    tmp: Path, *, cases: tuple[tuple[int, int], ...] = CASES
) -> list[dict[str, Any]]:
    """`measure_case()` for each case, in order."""
    figures: list[dict[str, Any]] = []
    for areas, data_bytes in cases:
        figures.extend(await measure_case(tmp, areas=areas, data_bytes=data_bytes))
    return figures


def run(*, full: bool = False) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="bench-migration-") as tmp:
        return asyncio.run(measure(Path(tmp), cases=FULL_CASES if full else CASES))


def _print_each_case(*, full: bool) -> None:
    """The module run by hand: each case's figures as soon as it is done."""
    with tempfile.TemporaryDirectory(prefix="bench-migration-") as tmp:
        for areas, data_bytes in FULL_CASES if full else CASES:
            for figure in asyncio.run(measure_case(Path(tmp), areas=areas,
                                                   data_bytes=data_bytes)):
                print(json.dumps(figure, sort_keys=True), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--floor"] and len(sys.argv) == 3:
        print(json.dumps(asyncio.run(_floor(json.loads(sys.argv[2])))))
        sys.stdout.flush()
        os._exit(0)
    if sys.argv[1:] not in ([], ["--full"]):
        sys.exit("usage: python -m benchmarks.bench_migration [--full | --floor SPEC_JSON]")
    import logging

    from monitord.base import logs

    logs.configure("json", level=logging.WARNING)  # stdout is figures only
    _print_each_case(full=sys.argv[1:] == ["--full"])

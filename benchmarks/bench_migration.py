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
many split-brain overlaps the detector saw, so an odd figure explains itself.

Run as `python -m benchmarks.bench_migration --floor SPEC_JSON` it is that floor process.
Called by `python -m benchmarks`; the unit smoke test calls `measure()` with one area.
Not a test: nothing here is pass/fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from monitord.testing.stack import Stack

SIZES = (1, 10, 100)
DATA_BYTES = 256 * 1024
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
        ) as conn:
            slots = asyncio.Semaphore(spec["parallelism"])
            moved = [0]

            async def move(a: dict[str, str]) -> None:
                async with slots:
                    source = sources[a["area"]]
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

            clock = time.perf_counter()
            await asyncio.gather(*(move(a) for a in areas))
            wall_s = time.perf_counter() - clock
    finally:
        for proc in (*sources.values(), *started):
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    return {"wall_s": wall_s, "bytes": moved[0]}


# -- the migration (the benchmark process drives a Stack) ---------------------------------


def _closed_port() -> str:
    from monitord.testing.stack import free_port

    return f"127.0.0.1:{free_port()}"


async def _measure_floor(stack: Stack, *, parallelism: int) -> dict[str, Any]:
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
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "benchmarks.bench_migration", "--floor", json.dumps(spec),
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, cwd=str(PROJECT_ROOT),
    )
    out, err = await asyncio.wait_for(proc.communicate(), 600)
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


async def _one_size(root: Path, *, areas: int, data_bytes: int) -> dict[str, Any]:
    from monitord.base.config import ServiceSection
    from monitord.testing.stack import Stack, StackOptions

    parallelism = ServiceSection.model_fields["parallelism"].default
    options = StackOptions(services={SERVICE: areas}, data_bytes=data_bytes,
                           min_uptime_s=MIN_UPTIME_S, parallelism=parallelism)
    async with Stack(root, options) as stack:
        await stack.wait_settled(expect={SERVICE: "local"}, timeout_s=60 + areas)
        floor = await _measure_floor(stack, parallelism=parallelism)
        since = len(stack.log_lines)
        clock = time.perf_counter()
        await stack.place(SERVICE, "remote")
        await _all_done(stack, timeout_s=120 + 10 * areas)
        wall_s = time.perf_counter() - clock
        started = _count(stack, since, "transaction_started")
        rollbacks = _count(stack, since, "transaction_phase", phase="ROLLED_BACK")
        step_retries = _count(stack, since, "step_retry")
        overlaps = len(stack.detector.overlaps())
    total_bytes = floor["bytes"]
    return {
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
    }


async def measure(
    tmp: Path, *, sizes: tuple[int, ...] = SIZES, data_bytes: int = DATA_BYTES
) -> list[dict[str, Any]]:
    """One figure per number of areas, each on its own fresh stack."""
    return [await _one_size(tmp / f"m{size}", areas=size, data_bytes=data_bytes)
            for size in sizes]


def run() -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="bench-migration-") as tmp:
        return asyncio.run(measure(Path(tmp)))


if __name__ == "__main__":
    if sys.argv[1:2] != ["--floor"] or len(sys.argv) != 3:
        sys.exit("usage: python -m benchmarks.bench_migration --floor SPEC_JSON")
    print(json.dumps(asyncio.run(_floor(json.loads(sys.argv[2])))))
    sys.stdout.flush()
    os._exit(0)

"""Status API latency figures: `GET /v1/status` latency under concurrent load while
areas migrate, against the same load on the same daemon while it is idle (same run).

On a whole installation (`monitord.testing.stack.Stack`, `AREAS` areas of one service):
`CLIENTS` concurrent clients each issue `REQUESTS_PER_CLIENT` requests back to back (keep-alive,
the whole body read). The load runs in a SEPARATE process, because the stack's SSH VPS lives
in this one and serves the migrations' SFTP traffic: a client sharing its event loop would
measure that loop, not monitord.
1. idle: every area settled local, nothing to do — the reference;
2. under migration: the load process is started and ready, then
   `PUT /v1/services/tg/placement {"location": "remote"}` and, at once, the load begins.
   Only requests that began before the last area was committed remote count (usually all of
   them; the figure says how many did).
p50/p95/p99 of each, and the ratio of each percentile to the idle one. Every answer must be
a 200 (the figure counts any other). Run as `python -m benchmarks.bench_status_api --load URL
CLIENTS REQUESTS` it is that load process: it prints `ready`, waits for a line on stdin, runs
the load and prints its samples as JSON. Called by `python -m benchmarks`; the unit smoke test
calls `measure()` with small sizes. Not a test: nothing here is pass/fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from monitord.testing.stack import Stack

AREAS = 20
CLIENTS = 8
REQUESTS_PER_CLIENT = 50
SERVICE = "tg"
POLL_S = 0.02
MIN_UPTIME_S = 0.5
PROJECT_ROOT = Path(__file__).resolve().parent.parent


# -- the load process -----------------------------------------------------------------------


async def _load(url: str, *, clients: int, requests: int) -> list[tuple[float, float, int]]:
    """(monotonic start, latency s, HTTP status) of every request."""
    import aiohttp

    samples: list[tuple[float, float, int]] = []
    connector = aiohttp.TCPConnector(limit=clients)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def client() -> None:
            for _ in range(requests):
                started = time.monotonic()
                try:
                    async with session.get(url) as resp:
                        await resp.read()
                        status = resp.status
                except (aiohttp.ClientError, OSError, TimeoutError):
                    status = 0
                samples.append((started, time.monotonic() - started, status))

        await asyncio.gather(*(client() for _ in range(clients)))
    return samples


async def _load_process(url: str, clients: int, requests: int) -> None:
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    samples = await _load(url, clients=clients, requests=requests)
    print(json.dumps(samples), flush=True)


# -- the benchmark process --------------------------------------------------------------------


class _LoadRun:
    """A started, ready load process; `go()` starts the load, `result()` collects it."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self._proc = proc

    @classmethod
    async def start(cls, url: str, *, clients: int, requests: int) -> _LoadRun:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "benchmarks.bench_status_api", "--load", url, str(clients),
            str(requests), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            cwd=str(PROJECT_ROOT),
        )
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        if line.strip() != b"ready":
            proc.kill()
            await proc.wait()
            raise RuntimeError(f"load process did not get ready: {line!r}")
        return cls(proc)

    def go(self) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.write(b"go\n")

    async def result(self, *, timeout_s: float) -> list[tuple[float, float, int]]:
        try:
            out, _ = await asyncio.wait_for(self._proc.communicate(), timeout_s)
        finally:
            if self._proc.returncode is None:
                self._proc.kill()
                await self._proc.wait()
        return [(float(start), float(latency), int(status))
                for start, latency, status in json.loads(out)]


def _percentiles(latencies: list[float]) -> dict[str, float]:
    cuts = statistics.quantiles(latencies, n=100, method="inclusive")
    return {"p50": cuts[49], "p95": cuts[94], "p99": cuts[98]}


async def _committed_remote_at(stack: Stack, *, timeout_s: float) -> float:
    """Monotonic time at which every area was seen committed remote (file polled)."""
    areas = stack.areas[SERVICE]
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(OSError, ValueError):
            placed = stack.committed()
            if all(placed[a].get("location") == "remote" for a in areas):
                return time.monotonic()
        if time.monotonic() > deadline:
            raise TimeoutError(f"areas not committed remote within {timeout_s} s")
        await asyncio.sleep(POLL_S)  # poll interval of a deadline loop


async def measure(
    tmp: Path,
    *,
    areas: int = AREAS,
    clients: int = CLIENTS,
    requests_per_client: int = REQUESTS_PER_CLIENT,
) -> list[dict[str, Any]]:
    from monitord.base.config import ServiceSection
    from monitord.testing.stack import Stack, StackOptions

    parallelism = ServiceSection.model_fields["parallelism"].default
    options = StackOptions(services={SERVICE: areas}, min_uptime_s=MIN_UPTIME_S,
                           parallelism=parallelism)
    async with Stack(tmp / "stack", options) as stack:
        url = f"http://127.0.0.1:{stack.http_port}/v1/status"
        await stack.wait_settled(expect={SERVICE: "local"}, timeout_s=60 + areas)

        idle_run = await _LoadRun.start(url, clients=clients, requests=requests_per_client)
        idle_run.go()
        idle = await idle_run.result(timeout_s=300)

        busy_run = await _LoadRun.start(url, clients=clients, requests=requests_per_client)
        await stack.place(SERVICE, "remote")
        busy_run.go()
        committed_at, busy = await asyncio.gather(
            _committed_remote_at(stack, timeout_s=120 + 10 * areas),
            busy_run.result(timeout_s=300),
        )
        await stack.wait_settled(expect={SERVICE: "remote"}, timeout_s=120)
        overlaps = len(stack.detector.overlaps())

    during = [s for s in busy if s[0] < committed_at]
    if len(during) < 2:
        raise RuntimeError("the migrations finished before the load began")
    reference = _percentiles([s[1] for s in idle])
    loaded = _percentiles([s[1] for s in during])
    figure: dict[str, Any] = {
        "benchmark": "status_api_latency_during_migration",
        "areas_migrating": areas,
        "parallelism": parallelism,
        "clients": clients,
        "requests": len(busy),
        "requests_during_migration": len(during),
        "non_200": sum(1 for s in (*idle, *busy) if s[2] != 200),
        "reference": "same load on the idle daemon (all areas settled local)",
        "split_brain_overlaps": overlaps,
    }
    for name in ("p50", "p95", "p99"):
        figure[f"{name}_ms"] = round(loaded[name] * 1000, 2)
        figure[f"reference_{name}_ms"] = round(reference[name] * 1000, 2)
        figure[f"ratio_{name}"] = round(loaded[name] / reference[name], 2)
    figure["ratio"] = figure["ratio_p95"]
    return [figure]


def run() -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="bench-status-") as tmp:
        return asyncio.run(measure(Path(tmp)))


if __name__ == "__main__":
    if sys.argv[1:2] != ["--load"] or len(sys.argv) != 5:
        sys.exit("usage: python -m benchmarks.bench_status_api --load URL CLIENTS REQUESTS")
    asyncio.run(_load_process(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))

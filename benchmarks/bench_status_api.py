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
the load and prints its samples as JSON.

A second figure, on a second fresh stack, is OPEN-LOOP (`status_api_open_loop_during_migration`):
requests are sent at a fixed rate (`OPEN_RATE_PER_S`) whatever the answers do — each at its
scheduled time, on as many connections as are outstanding — and each latency counts from its
SCHEDULED send time, so a stalled server (or a late load process) shows in the figures instead
of silently sending fewer requests (no coordinated omission). First `OPEN_IDLE_S` on the idle
daemon, then from the placement request until every area is committed remote. p50/p99/max and
the non-200 count of each; the ratios are to the idle p99. `send_late_*` says how late the load
process itself sent (its own share of the latency). Run as `python -m
benchmarks.bench_status_api --open URL RATE MAX_S` it is that load process: `ready`, then
`go` starts the sending and `stop` (or MAX_S) ends it; it prints its samples as JSON.

The open-loop figure has a FLOOR (`floor_*`): the same idle and busy load, during a second
identical migration on a third fresh stack, sent not to monitord but to a server in its own
process that answers every `GET /v1/status` with the bytes monitord's status had when the
areas settled, and does nothing else (same HTTP framework). It is the best any design could
do that serves the status apart from the moving areas (a thread, a process, a snapshot) on
this machine, with the VPS, the load process and the areas' daemons on the same cores:
`floor_ratio` is its busy p99 over its own idle p99, `ratio_to_floor` monitord's busy p99 over
the floor's. Run as `python -m benchmarks.bench_status_api --serve PORT FILE` it is that
server: it prints `ready` once listening and stops at a line on stdin (or its end).

Called by `python -m benchmarks`; the unit smoke test calls `measure()` with small sizes. Not a
test: nothing here is pass/fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
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
OPEN_RATE_PER_S = 200.0
OPEN_IDLE_S = 5.0
OPEN_MAX_S = 300.0  # the open-loop load stops by itself after this, whatever happens
OPEN_REQUEST_TIMEOUT_S = 10.0
GOAL_P99_MS = 20.0  # the target p99 at OPEN_RATE_PER_S while AREAS migrate (2 cores)
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


# (scheduled monotonic send time, latency from it, HTTP status, how late it was sent)
OpenSample = tuple[float, float, int, float]


async def _open_loop(url: str, *, rate: float, stop: asyncio.Event, max_s: float
                     ) -> list[OpenSample]:
    """Send at `rate` per second until `stop` (or `max_s`), never waiting for answers."""
    import aiohttp

    samples: list[OpenSample] = []
    # No pool limit: a slow answer must not hold back the next send (that would be closed-loop).
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=OPEN_REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one(scheduled: float) -> None:
            late = time.monotonic() - scheduled
            try:
                async with session.get(url) as resp:
                    await resp.read()
                    status = resp.status
            except (aiohttp.ClientError, OSError, TimeoutError):
                status = 0
            samples.append((scheduled, time.monotonic() - scheduled, status, late))

        in_flight: set[asyncio.Task[None]] = set()
        start = time.monotonic()
        sent = 0
        while not stop.is_set():
            scheduled = start + sent / rate
            if scheduled - start > max_s:
                break
            delay = scheduled - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)  # the schedule's own clock; late sends go at once
            task = asyncio.create_task(one(scheduled))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
            sent += 1
        await asyncio.gather(*in_flight)
    return samples


async def _constant_server(port: int, body: bytes) -> None:
    """The floor's server: `GET /v1/status` answers `body`, and nothing else runs here."""
    from aiohttp import web

    async def status(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json")

    app = web.Application()
    app.router.add_get("/v1/status", status)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    print("ready", flush=True)
    try:
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    finally:
        await runner.cleanup()


async def _open_load_process(url: str, rate: float, max_s: float) -> None:
    loop = asyncio.get_running_loop()
    print("ready", flush=True)
    await loop.run_in_executor(None, sys.stdin.readline)  # "go"
    stop = asyncio.Event()
    stopped = loop.run_in_executor(None, sys.stdin.readline)  # "stop" (or EOF)
    stopped.add_done_callback(lambda _: loop.call_soon_threadsafe(stop.set))
    samples = await _open_loop(url, rate=rate, stop=stop, max_s=max_s)
    print(json.dumps(samples), flush=True)


# -- the benchmark process --------------------------------------------------------------------


class _LoadRun:
    """A started, ready load process (`--load URL CLIENTS REQUESTS` or `--open URL RATE
    MAX_S`): `go()`, for the open loop `stop()`, then `rows()` — its samples as it printed
    them (each caller knows their shape). The floor's server (`--serve PORT FILE`) is started
    the same way and ended with `close()`."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self._proc = proc

    @classmethod
    async def start(cls, *args: str) -> _LoadRun:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "benchmarks.bench_status_api", *args,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            cwd=str(PROJECT_ROOT),
        )
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        if line.strip() != b"ready":
            proc.kill()
            await proc.wait()
            raise RuntimeError(f"load process {args[0]} did not get ready: {line!r}")
        return cls(proc)

    def go(self) -> None:
        self._say(b"go\n")

    def stop(self) -> None:
        self._say(b"stop\n")

    def _say(self, line: bytes) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.write(line)

    async def close(self) -> None:
        """Tell it to stop (a line on stdin) and wait for it; killed if it does not."""
        try:
            await asyncio.wait_for(self._proc.communicate(b"stop\n"), 10)
        finally:
            if self._proc.returncode is None:
                self._proc.kill()
                await self._proc.wait()

    async def rows(self, *, timeout_s: float) -> list[list[Any]]:
        try:
            out, _ = await asyncio.wait_for(self._proc.communicate(), timeout_s)
        finally:
            if self._proc.returncode is None:
                self._proc.kill()
                await self._proc.wait()
        rows: list[list[Any]] = json.loads(out)
        return rows


async def _open_samples(run: _LoadRun, *, timeout_s: float) -> list[OpenSample]:
    return [(float(a), float(b), int(c), float(d))
            for a, b, c, d in await run.rows(timeout_s=timeout_s)]


async def _closed_samples(run: _LoadRun, *, timeout_s: float) -> list[tuple[float, float, int]]:
    return [(float(a), float(b), int(c)) for a, b, c in await run.rows(timeout_s=timeout_s)]


def _open_summary(samples: list[OpenSample]) -> dict[str, float]:
    latencies = sorted(s[1] for s in samples)
    late = sorted(s[3] for s in samples)
    cuts = statistics.quantiles(latencies, n=100, method="inclusive")
    late_cuts = statistics.quantiles(late, n=100, method="inclusive")
    return {"p50": cuts[49], "p99": cuts[98], "max": latencies[-1],
            "late_p99": late_cuts[98], "late_max": late[-1]}


class _OpenRun:
    """One open-loop run on a fresh stack: its idle and busy samples, the busy ones sent
    before every area was committed remote (`during`), their summaries, and the overlaps."""

    def __init__(self, idle: list[OpenSample], busy: list[OpenSample], *, committed_at: float,
                 overlaps: int) -> None:
        self.idle_samples, self.busy_samples = idle, busy
        self.during = [s for s in busy if s[0] < committed_at]
        if len(self.during) < 2:
            raise RuntimeError("the migrations finished before the open-loop load began")
        self.idle = _open_summary(idle)
        self.busy = _open_summary(self.during)
        self.overlaps = overlaps

    @property
    def ratio(self) -> float:
        return self.busy["p99"] / self.idle["p99"]


async def _open_run(tmp: Path, *, areas: int, rate: float, idle_s: float,
                    floor: bool) -> _OpenRun:
    """Idle for `idle_s`, then while `areas` migrate, the load sent to monitord's status or,
    with `floor`, to the constant server holding the same bytes (module docstring)."""
    from monitord.testing.ports import free_port
    from monitord.testing.stack import Stack, StackOptions

    options = StackOptions(services={SERVICE: areas}, min_uptime_s=MIN_UPTIME_S,
                           parallelism=_parallelism())
    async with contextlib.AsyncExitStack() as exits:
        stack = await exits.enter_async_context(Stack(tmp, options))
        url = f"http://127.0.0.1:{stack.http_port}/v1/status"
        await stack.wait_settled(expect={SERVICE: "local"}, timeout_s=60 + areas)
        if floor:
            body = tmp / "status.json"
            body.write_bytes(await _body_of(url))
            port = free_port()
            server = await _LoadRun.start("--serve", str(port), str(body))
            exits.push_async_callback(server.close)
            url = f"http://127.0.0.1:{port}/v1/status"

        idle_run = await _LoadRun.start("--open", url, str(rate), str(OPEN_MAX_S))
        idle_run.go()
        await asyncio.sleep(idle_s)
        idle_run.stop()
        idle = await _open_samples(idle_run, timeout_s=60)

        busy_run = await _LoadRun.start("--open", url, str(rate), str(OPEN_MAX_S))
        await stack.place(SERVICE, "remote")
        busy_run.go()
        committed_at = await _committed_remote_at(stack, timeout_s=120 + 10 * areas)
        busy_run.stop()
        busy = await _open_samples(busy_run, timeout_s=60)
        await stack.wait_settled(expect={SERVICE: "remote"}, timeout_s=120)
        overlaps = len(stack.detector.overlaps())
    return _OpenRun(idle, busy, committed_at=committed_at, overlaps=overlaps)


async def _body_of(url: str) -> bytes:
    """The bytes one GET answers (the floor serves monitord's own status document)."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=OPEN_REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url) as resp:
        resp.raise_for_status()
        return await resp.read()


def _parallelism() -> int:
    from monitord.base.config import ServiceSection

    parallelism: int = ServiceSection.model_fields["parallelism"].default
    return parallelism


async def measure_open_loop(
    tmp: Path, *, areas: int = AREAS, rate: float = OPEN_RATE_PER_S,
    idle_s: float = OPEN_IDLE_S,
) -> dict[str, Any]:
    """The open-loop figure on a fresh stack, then its floor on another (module docstring)."""
    daemon = await _open_run(tmp / "open", areas=areas, rate=rate, idle_s=idle_s, floor=False)
    floor = await _open_run(tmp / "floor", areas=areas, rate=rate, idle_s=idle_s, floor=True)
    idle, busy, during = daemon.idle_samples, daemon.busy_samples, daemon.during
    loaded, reference = daemon.busy, daemon.idle
    idle_p99 = reference["p99"]
    return {
        "benchmark": "status_api_open_loop_during_migration",
        "areas_migrating": areas,
        "parallelism": _parallelism(),
        "rate_per_s": rate,
        "cpus": os.cpu_count(),
        "requests": len(busy),
        "requests_during_migration": len(during),
        "migration_s": round(max(s[0] for s in during) - min(s[0] for s in during), 2),
        "non_200": sum(1 for s in during if s[2] != 200),
        "reference_non_200": sum(1 for s in idle if s[2] != 200),
        "reference": "idle p99: the same open-loop rate on the idle daemon (all areas settled"
                     " local), same run",
        **{f"{name}_ms": round(loaded[name] * 1000, 2) for name in ("p50", "p99", "max")},
        **{f"reference_{name}_ms": round(reference[name] * 1000, 2)
           for name in ("p50", "p99", "max")},
        "ratio_p50_to_idle_p99": round(loaded["p50"] / idle_p99, 2),
        "ratio_max_to_idle_p99": round(loaded["max"] / idle_p99, 2),
        "ratio": round(daemon.ratio, 2),
        "goal_p99_ms": GOAL_P99_MS,
        "send_late_p99_ms": round(loaded["late_p99"] * 1000, 2),
        "send_late_max_ms": round(loaded["late_max"] * 1000, 2),
        "floor": "the same load, during a second identical migration, against a server in its"
                 " own process answering the same status bytes and doing nothing else",
        "floor_p99_ms": round(floor.busy["p99"] * 1000, 2),
        "floor_reference_p99_ms": round(floor.idle["p99"] * 1000, 2),
        "floor_ratio": round(floor.ratio, 2),
        "floor_send_late_p99_ms": round(floor.busy["late_p99"] * 1000, 2),
        "ratio_to_floor": round(loaded["p99"] / floor.busy["p99"], 2),
        "split_brain_overlaps": daemon.overlaps + floor.overlaps,
    }


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
    open_rate: float = OPEN_RATE_PER_S,
    open_idle_s: float = OPEN_IDLE_S,
) -> list[dict[str, Any]]:
    """The closed-loop figure, then the open-loop one on a second fresh stack (directory names
    kept short: the VPS side's Unix socket path must fit 107 bytes)."""
    closed = await _measure_closed_loop(tmp, areas=areas, clients=clients,
                                        requests_per_client=requests_per_client)
    opened = await measure_open_loop(tmp, areas=areas, rate=open_rate, idle_s=open_idle_s)
    return [closed, opened]


async def _measure_closed_loop(
    tmp: Path, *, areas: int, clients: int, requests_per_client: int
) -> dict[str, Any]:
    from monitord.testing.stack import Stack, StackOptions

    parallelism = _parallelism()
    options = StackOptions(services={SERVICE: areas}, min_uptime_s=MIN_UPTIME_S,
                           parallelism=parallelism)
    async with Stack(tmp / "stack", options) as stack:
        url = f"http://127.0.0.1:{stack.http_port}/v1/status"
        await stack.wait_settled(expect={SERVICE: "local"}, timeout_s=60 + areas)

        idle_run = await _LoadRun.start("--load", url, str(clients), str(requests_per_client))
        idle_run.go()
        idle = await _closed_samples(idle_run, timeout_s=300)

        busy_run = await _LoadRun.start("--load", url, str(clients), str(requests_per_client))
        await stack.place(SERVICE, "remote")
        busy_run.go()
        committed_at, busy = await asyncio.gather(
            _committed_remote_at(stack, timeout_s=120 + 10 * areas),
            _closed_samples(busy_run, timeout_s=300),
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
    return figure


def run() -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="bench-status-") as tmp:
        return asyncio.run(measure(Path(tmp)))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--open"] and len(sys.argv) == 5:
        asyncio.run(_open_load_process(sys.argv[2], float(sys.argv[3]), float(sys.argv[4])))
    elif sys.argv[1:2] == ["--load"] and len(sys.argv) == 5:
        asyncio.run(_load_process(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
    elif sys.argv[1:2] == ["--serve"] and len(sys.argv) == 4:
        asyncio.run(_constant_server(int(sys.argv[2]), Path(sys.argv[3]).read_bytes()))
    elif len(sys.argv) == 1:
        import logging

        from monitord.base import logs

        logs.configure("json", level=logging.WARNING)  # stdout is figures only
        for figure in run():
            print(json.dumps(figure, sort_keys=True), flush=True)
    else:
        sys.exit("usage: python -m benchmarks.bench_status_api [--load URL CLIENTS REQUESTS"
                 " | --open URL RATE MAX_S | --serve PORT FILE]")

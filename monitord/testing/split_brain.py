"""The split-brain detector: proves (or disproves) that no two processes served one area at once.

Fake daemons (monitord.testing.fake_daemon) send heartbeat JSON lines over TCP. For each
process — keyed by (area, side, generation, pid) — the detector keeps an interval of life:
from its first heartbeat until its goodbye, or, without a goodbye, until its last heartbeat
plus a staleness allowance (a process killed with SIGKILL may have lived that long after
its last word). Two intervals of different processes for one area that intersect are an
overlap: a split brain, reported with both processes and the times. Times are taken on the
detector's own clock when a line arrives, so the two sides' clocks never matter.

It is also the lineage checker: a heartbeat carries how many session records the sender's
DB holds (`records`) and how many it found at its start (`start_records`). A process that
starts with fewer records than another process of its area had already written started on
data older than the newest: a data regression (`regressions()`), the other half of the
promise — the newest data, one runner at a time.

`LifeLog` is the pure bookkeeping (unit-tested with synthetic heartbeats); `Detector` is the
asyncio TCP server around it, used by tests and the demo:

    async with Detector() as detector:
        ... start daemons with --heartbeat 127.0.0.1:{detector.port} ...
        assert detector.overlaps() == [] and detector.regressions() == []
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

DEFAULT_STALENESS_S = 0.35


@dataclass(frozen=True, order=True)
class LifeKey:
    """One process serving one area."""

    area: str
    side: str
    generation: int
    pid: int


@dataclass
class Life:
    """When one process was seen alive."""

    key: LifeKey
    first_seen: float
    last_seen: float
    goodbye_at: float | None = None
    heartbeats: int = 1
    start_records: int | None = None  # session records found at start (None: not reported)
    records: int = 0  # the most records it reported holding
    def end(self, *, staleness_s: float, now: float) -> float:
        """The last instant this process may have been alive (now, if it may still be)."""
        if self.goodbye_at is not None:
            return self.goodbye_at
        return min(now, self.last_seen + staleness_s)

    def alive(self, *, staleness_s: float, now: float) -> bool:
        return self.goodbye_at is None and now <= self.last_seen + staleness_s


@dataclass(frozen=True)
class Overlap:
    """Two processes that served one area during [start, end]."""

    area: str
    first: LifeKey
    second: LifeKey
    start: float
    end: float

    def describe(self) -> str:
        return (
            f"area {self.area}: {self.first.side}/gen{self.first.generation}/pid{self.first.pid}"
            f" and {self.second.side}/gen{self.second.generation}/pid{self.second.pid}"
            f" both alive for {self.end - self.start:.3f}s from {self.start:.3f}"
        )


@dataclass(frozen=True)
class Regression:
    """A process that started on older data than another process of its area had written."""

    area: str
    started: LifeKey
    found: int  # records its data held at its start
    newest: int  # records the newest data held, written by `writer`
    writer: LifeKey

    def describe(self) -> str:
        return (
            f"area {self.area}: {self.started.side}/gen{self.started.generation}"
            f"/pid{self.started.pid} started on {self.found} session records, but"
            f" {self.writer.side}/gen{self.writer.generation}/pid{self.writer.pid} had written"
            f" {self.newest}: {self.newest - self.found} update(s) lost"
        )


class MalformedHeartbeat(ValueError):
    """A line that is not a heartbeat."""


def parse_heartbeat(message: Mapping[str, Any]) -> tuple[LifeKey, bool]:
    """(who sent it, whether it is a goodbye) from one decoded heartbeat line."""
    try:
        key = LifeKey(
            area=str(message["area"]),
            side=str(message["side"]),
            generation=int(message["generation"]),
            pid=int(message["pid"]),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise MalformedHeartbeat(f"not a heartbeat: {message!r}") from e
    return key, message.get("event") == "goodbye"


class LifeLog:
    """Intervals of life per process, and the overlaps between them. No I/O, no clock."""

    def __init__(self, *, staleness_s: float = DEFAULT_STALENESS_S) -> None:
        self.staleness_s = staleness_s
        self._lives: dict[LifeKey, Life] = {}
        self._regressions: list[Regression] = []

    def record(self, message: Mapping[str, Any], *, at: float) -> LifeKey:
        key, goodbye = parse_heartbeat(message)
        life = self._lives.get(key)
        if life is None:
            life = self._lives[key] = Life(key=key, first_seen=at, last_seen=at, heartbeats=0)
            start = message.get("start_records")
            if isinstance(start, int):
                life.start_records = start
                self._check_start(life)
        life.last_seen = max(life.last_seen, at)
        life.heartbeats += 1
        records = message.get("records")
        if isinstance(records, int) and records > life.records:
            life.records = records
        if goodbye:
            life.goodbye_at = at
        return key

    def _check_start(self, life: Life) -> None:
        """A start on fewer records than the newest any other process of the area reported."""
        assert life.start_records is not None
        others = [
            other for other in self._lives.values()
            if other.key.area == life.key.area and other.key != life.key
        ]
        newest = max(others, key=lambda other: other.records, default=None)
        if newest is not None and newest.records > life.start_records:
            self._regressions.append(
                Regression(
                    area=life.key.area, started=life.key, found=life.start_records,
                    newest=newest.records, writer=newest.key,
                )
            )

    def regressions(self) -> list[Regression]:
        return list(self._regressions)

    def lives(self, area: str | None = None) -> list[Life]:
        found = [life for life in self._lives.values() if area is None or life.key.area == area]
        return sorted(found, key=lambda life: (life.first_seen, life.key))

    def alive(self, *, now: float) -> list[LifeKey]:
        return sorted(
            life.key for life in self._lives.values()
            if life.alive(staleness_s=self.staleness_s, now=now)
        )

    def overlaps(self, *, now: float) -> list[Overlap]:
        by_area: dict[str, list[Life]] = {}
        for life in self.lives():
            by_area.setdefault(life.key.area, []).append(life)
        found: list[Overlap] = []
        for area, lives in by_area.items():
            for i, first in enumerate(lives):
                first_end = first.end(staleness_s=self.staleness_s, now=now)
                for second in lives[i + 1 :]:
                    start = max(first.first_seen, second.first_seen)
                    end = min(first_end, second.end(staleness_s=self.staleness_s, now=now))
                    if start < end:
                        found.append(Overlap(area, first.key, second.key, start, end))
        return found


class Detector:
    """The asyncio TCP server that feeds a LifeLog; `port` is bound on 127.0.0.1 by default."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        staleness_s: float = DEFAULT_STALENESS_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.log = LifeLog(staleness_s=staleness_s)
        self.malformed = 0
        self._host = host
        self._requested_port = port
        self._clock = clock
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._changed = asyncio.Event()
        self._closing = False
        self.port = 0

    async def __aenter__(self) -> Detector:
        self._server = await asyncio.start_server(
            self._on_connection, self._host, self._requested_port
        )
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        if self._server is not None:
            self._closing = True
            self._server.close()
            # End each handler by closing its connection (its readline then returns), so
            # no handler task is cancelled mid-read; cancel only what does not end in time.
            for writer in list(self._writers):
                writer.close()
            pending = list(self._connections)
            if pending:
                _, stuck = await asyncio.wait(pending, timeout=2.0)
                for task in stuck:
                    task.cancel()
                await asyncio.gather(*stuck, return_exceptions=True)
            await self._server.wait_closed()
            self._server = None

    @property
    def address(self) -> str:
        return f"{self._host}:{self.port}"

    async def _on_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        self._writers.add(writer)
        try:
            # a connection accepted just before close() gets its handler after close() has
            # looked at the handlers: it ends on its own
            while not self._closing and (line := await reader.readline()):
                try:
                    self.log.record(json.loads(line), at=self._clock())
                except (ValueError, MalformedHeartbeat):
                    self.malformed += 1
                self._changed.set()
        except ConnectionError:
            pass
        finally:
            self._connections.discard(task)
            self._writers.discard(writer)
            writer.close()

    def overlaps(self) -> list[Overlap]:
        return self.log.overlaps(now=self._clock())

    def regressions(self) -> list[Regression]:
        """Processes that started on data older than the newest of their area."""
        return self.log.regressions()

    def alive(self, area: str | None = None) -> list[LifeKey]:
        keys = self.log.alive(now=self._clock())
        return [key for key in keys if area is None or key.area == area]

    def lives(self, area: str | None = None) -> list[Life]:
        return self.log.lives(area)

    async def wait_for(self, predicate: Callable[[Detector], bool], *, timeout_s: float) -> bool:
        """Wait until `predicate(self)` holds (re-checked on each heartbeat and every 50 ms);
        False on timeout."""
        deadline = time.monotonic() + timeout_s
        while not predicate(self):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout=min(remaining, 0.05))
        return True

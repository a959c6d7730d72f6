"""Per-area downtime of every transaction: `AreaDowntime` (one record, `state.db` table
`area_downtime`) and `DowntimeLog`, the book the migration engine keeps of them.

Called by monitord/engine/migration_engine.py only; docs/design.md, "Observability".
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from monitord.base import logs
from monitord.base.metrics import Metrics
from monitord.base.round_trips import RoundTrips
from monitord.store.state_db import Store
from orchestrator.models import Phase, Side, Transaction

log = logs.get_logger(__name__)

OUTCOMES = ("done", "rolled_back", "parked")


@dataclass(frozen=True, slots=True, kw_only=True)
class AreaDowntime:
    """One transaction's downtime record (`state.db` table `area_downtime`).

    `stopped_at` (wall) is when the source lost the permission to run; `healthy_at` and
    `healthy_side` when, and on which side, the area was first healthy again (the destination's
    health check, or the source's after a rollback); `downtime_s` the time between, on the
    monotonic clock when both ends happened in this process. `move_id` groups the transactions
    opened together for one service (one placement request or one tick)."""

    transaction_id: str
    service: str
    area: str
    direction: str
    move_id: str
    stopped_at: float | None = None
    healthy_at: float | None = None
    healthy_side: str | None = None
    downtime_s: float | None = None
    outcome: str | None = None  # done, rolled_back or parked, once the transaction ended
    finished_at: float | None = None

    @classmethod
    def first(cls, txn: Transaction, *, move_id: str) -> AreaDowntime:
        return cls(transaction_id=txn.transaction_id, service=txn.service, area=txn.area,
                   direction=txn.direction.value, move_id=move_id)

    @classmethod
    def from_storage(cls, row: Mapping[str, Any]) -> AreaDowntime:
        fields: dict[str, Any] = {f.name: row.get(f.name) for f in dataclasses.fields(cls)}
        return cls(**fields)

    def to_storage(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class DowntimeLog:
    """Per-area downtime of every transaction: written to `state.db` at each mark, observed
    once in `monitord_area_downtime_seconds` when final, logged as `area_downtime`; and, for
    the status, the ended records of each service's last move.

    The engine tells it: `opened` (transaction stored), `source_stopped` (SUPPRESS_SOURCE
    stored), `healthy` (a health check passed), `rollback_started`, `resumed`, `ended`; and
    it counts the round trips to the VPS the steps made while the area was down
    (`trips_for`, monitord/base/round_trips.py), in this process: the event's `round_trips`,
    None when the stop happened before a restart."""

    def __init__(
        self,
        *,
        store: Store,
        metrics: Metrics,
        on_change: Callable[[], None],
        wall: Callable[[], float],
        clock: Callable[[], float],
    ) -> None:
        self.store = store
        self.metrics = metrics
        self._on_change = on_change
        self._wall = wall
        self._clock = clock
        self._records: dict[str, AreaDowntime] = {}  # transactions still in PlacementState
        self._stopped: dict[str, float] = {}  # transaction_id -> monotonic stop (this process)
        self._moves: dict[str, tuple[str, dict[str, AreaDowntime]]] = {}  # service -> last move
        self._trips: dict[str, RoundTrips] = {}  # transaction_id -> since the stop
        self._trips_when_healthy: dict[str, int] = {}

    async def load(self, active: list[Transaction]) -> None:
        """The records of the active transactions and each service's last move (start-up)."""
        for row in await self.store.downtimes([t.transaction_id for t in active]):
            record = AreaDowntime.from_storage(row)
            self._records[record.transaction_id] = record
        for service, rows in (await self.store.last_moves()).items():
            records = [AreaDowntime.from_storage(r) for r in rows]
            self._moves[service] = (records[-1].move_id,
                                    {r.transaction_id: r for r in records})
        self._on_change()

    def _get(self, txn: Transaction) -> AreaDowntime:
        found = self._records.get(txn.transaction_id)
        if found is None:  # a transaction from before downtime records: a move of its own
            found = AreaDowntime.first(txn, move_id=txn.transaction_id)
        return found

    async def _put(self, record: AreaDowntime, *, active: bool = True) -> None:
        await self.store.put_downtime(record.to_storage())
        if active:
            self._records[record.transaction_id] = record
        move = self._moves.get(record.service)
        if move is not None and record.transaction_id in move[1]:
            move[1][record.transaction_id] = record
        self._on_change()

    async def opened(self, txn: Transaction, *, move_id: str) -> None:
        await self._put(AreaDowntime.first(txn, move_id=move_id))

    async def source_stopped(self, txn: Transaction) -> None:
        """The source may no longer run: its supervisor or agent stops it from now on."""
        self._stopped[txn.transaction_id] = self._clock()
        self._trips[txn.transaction_id] = RoundTrips()
        self._trips_when_healthy.pop(txn.transaction_id, None)
        await self._put(dataclasses.replace(
            self._get(txn), stopped_at=self._wall(), healthy_at=None, healthy_side=None,
            downtime_s=None,
        ))

    async def _ended_record(self, txn: Transaction) -> AreaDowntime:
        """The record of a transaction that may have ended already (a watched rollback)."""
        if txn.transaction_id in self._records:
            return self._records[txn.transaction_id]
        move = self._moves.get(txn.service)
        if move is not None and txn.transaction_id in move[1]:
            return move[1][txn.transaction_id]
        rows = await self.store.downtimes([txn.transaction_id])
        return AreaDowntime.from_storage(rows[0]) if rows else self._get(txn)

    async def healthy(self, txn: Transaction, *, side: Side, at: float, now: float) -> None:
        """`side` passed its health check at wall `at` (monotonic `now`)."""
        record = await self._ended_record(txn)
        if record.stopped_at is None:
            return  # nothing was stopped by this transaction (or not recorded): no downtime
        stopped = self._stopped.get(txn.transaction_id)
        downtime = now - stopped if stopped is not None else at - record.stopped_at
        if (trips := self._trips.get(txn.transaction_id)) is not None:
            self._trips_when_healthy[txn.transaction_id] = trips.count
        record = dataclasses.replace(record, healthy_at=at, healthy_side=side.value,
                                     downtime_s=max(0.0, downtime))
        ended = record.outcome in ("rolled_back", "parked")  # a rollback's source, watched
        await self._put(record, active=txn.transaction_id in self._records)
        if ended:
            await self._final(record)

    async def rollback_started(self, txn: Transaction) -> None:
        """A destination that passed its health check is no end of the downtime any more:
        it now runs until the source is healthy again."""
        record = self._get(txn)
        if record.healthy_at is not None:
            await self._put(dataclasses.replace(record, healthy_at=None, healthy_side=None,
                                                downtime_s=None))

    async def resumed(self, txn: Transaction, *, fresh: bool) -> None:
        """A PARKED transaction goes on: a retry from PREFLIGHT (`fresh`: a new attempt with
        its own downtime) or a rollback resumed (its downtime goes on)."""
        record = dataclasses.replace(self._get(txn), outcome=None, finished_at=None)
        if fresh:
            self._forget_stop(txn.transaction_id)
            record = dataclasses.replace(record, stopped_at=None, healthy_at=None,
                                         healthy_side=None, downtime_s=None)
        await self._put(record)

    async def ended(self, txn: Transaction) -> None:
        """DONE, ROLLED_BACK or PARKED: the record joins its service's last move."""
        record = dataclasses.replace(self._get(txn), outcome=txn.phase.value.lower(),
                                     finished_at=txn.updated_at)
        await self._put(record, active=txn.is_active)
        if not txn.is_active:
            self._records.pop(txn.transaction_id, None)
        move = self._moves.get(record.service)
        if move is None or (move[0] != record.move_id):
            rows = await self.store.move_downtimes(record.move_id)
            move = (record.move_id,
                    {r.transaction_id: r for r in map(AreaDowntime.from_storage, rows)})
            self._moves[record.service] = move
        move[1][record.transaction_id] = record
        self._on_change()
        if txn.phase is Phase.DONE:
            if record.downtime_s is not None:
                await self._final(record)
            self._forget_stop(txn.transaction_id)

    def unmeasured(self, txn: Transaction) -> None:
        """A watched source was not seen healthy: its downtime stays open in its record."""
        self._forget_stop(txn.transaction_id)

    def trips_for(self, txn: Transaction) -> RoundTrips | None:
        """What counts the round trips of `txn`'s steps: from its source's stop on."""
        return self._trips.get(txn.transaction_id)

    def _forget_stop(self, transaction_id: str) -> None:
        self._stopped.pop(transaction_id, None)
        self._trips.pop(transaction_id, None)
        self._trips_when_healthy.pop(transaction_id, None)

    async def _final(self, record: AreaDowntime) -> None:
        assert record.downtime_s is not None
        trips = self._trips_when_healthy.get(record.transaction_id)
        self._forget_stop(record.transaction_id)
        self.metrics.area_downtime.labels(
            service=record.service, direction=record.direction
        ).observe(record.downtime_s)
        fields = {"transaction_id": record.transaction_id, "service": record.service,
                  "area": record.area, "direction": record.direction,
                  "outcome": record.outcome, "healthy_side": record.healthy_side,
                  "downtime_s": round(record.downtime_s, 4), "round_trips": trips}
        log.info("area_downtime", **fields)
        await self.store.record_event("area_downtime", fields)

    def last_move_downtimes(self, service: str) -> dict[str, float | None]:
        """Each area's downtime in the service's last move (None: not measured)."""
        move = self._moves.get(service)
        if move is None:
            return {}
        return {r.area: None if r.downtime_s is None else round(r.downtime_s, 3)
                for r in move[1].values() if r.outcome is not None}

    def last_move(self, service: str) -> dict[str, Any] | None:
        """The status's `last_move` of a service, or None before its first ended transaction."""
        move = self._moves.get(service)
        if move is None:
            return None
        move_id, records = move
        ended = [r for r in records.values() if r.outcome is not None]
        if not ended:
            return None
        return {**move_summary(move_id, ended),
                "in_flight": sum(1 for r in self._records.values()
                                 if r.move_id == move_id and r.outcome is None)}

    async def moves_since(self, since: float) -> list[dict[str, Any]]:
        """The moves whose transactions ended since `since` (wall clock), newest first, each
        as `last_move` shows one (without `in_flight`): the page's history."""
        by_move: dict[str, list[AreaDowntime]] = {}
        for row in await self.store.downtimes_since(since):
            record = AreaDowntime.from_storage(row)
            by_move.setdefault(record.move_id, []).append(record)
        moves = [{"service": records[0].service, **move_summary(move_id, records)}
                 for move_id, records in by_move.items()]
        return sorted(moves, key=lambda m: m["finished_at"] or 0.0, reverse=True)


def move_summary(move_id: str, ended: list[AreaDowntime]) -> dict[str, Any]:
    """One move's ended transactions as the status shows a move: its direction, when its last
    transaction ended, how many areas with which outcomes, their downtime's max and median."""
    ended = sorted(ended, key=lambda r: r.finished_at or 0.0)
    latest = ended[-1]
    downtimes = sorted(r.downtime_s for r in ended if r.downtime_s is not None)
    outcomes = dict.fromkeys(OUTCOMES, 0)
    for r in ended:
        outcomes[str(r.outcome)] = outcomes.get(str(r.outcome), 0) + 1
    return {
        "move_id": move_id,
        "transaction_id": latest.transaction_id,
        "direction": latest.direction,
        "finished_at": latest.finished_at,
        "areas": len(ended),
        "outcomes": outcomes,
        # each area's own, of those measured
        "area_downtime_s": {r.area: round(r.downtime_s, 3) for r in ended
                            if r.downtime_s is not None},
        "downtime_s": {
            "max": round(downtimes[-1], 3),
            "p50": round(statistics.median(downtimes), 3),
            "measured": len(downtimes),
        } if downtimes else None,
    }

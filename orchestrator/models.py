"""The frozen values the decision core works on: sides, phases, areas, transactions,
cleanup items, leases, inventories and desired placement.

Every record is a frozen pydantic model changed only with `model_copy(update=...)`.
Records that the durable store keeps (`Transaction`, `CleanupItem`, `DesiredPlacement`)
convert to and from plain dicts keyed by the contract field names with `to_storage()` /
`from_storage()`; enums become their string values, so the store never imports this
module's types. Every other module of `orchestrator/` and the
runtime's adapters (store, agent client, status API) use them.

Times: `*_at` wall-clock fields are seconds since the epoch (float) unless the field's
comment says monotonic; the core never reads a clock, callers pass `now` in.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field


class Side(StrEnum):
    """Where something runs: the PBX (`local`) or the VPS (`remote`)."""

    LOCAL = "local"
    REMOTE = "remote"

    @property
    def other(self) -> Side:
        return Side.REMOTE if self is Side.LOCAL else Side.LOCAL


class Phase(StrEnum):
    """Phases of one area's migration (contract names; the table: docs/phases.md)."""

    PREFLIGHT = "PREFLIGHT"
    SUPPRESS_SOURCE = "SUPPRESS_SOURCE"
    COPY = "COPY"
    CREATE_DESTINATION = "CREATE_DESTINATION"
    HEALTHCHECK_DESTINATION = "HEALTHCHECK_DESTINATION"
    COMMIT_LOCATION = "COMMIT_LOCATION"
    CLEANUP_SOURCE = "CLEANUP_SOURCE"
    DONE = "DONE"
    ROLLBACK = "ROLLBACK"
    ROLLED_BACK = "ROLLED_BACK"
    PARKED = "PARKED"

    @property
    def is_committed(self) -> bool:
        """The destination is authoritative (the commit write has happened)."""
        return self in (Phase.CLEANUP_SOURCE, Phase.DONE)


# Forward order of the happy path; used to ask "did the transaction get as far as X?".
FORWARD_PHASES: tuple[Phase, ...] = (
    Phase.PREFLIGHT,
    Phase.SUPPRESS_SOURCE,
    Phase.COPY,
    Phase.CREATE_DESTINATION,
    Phase.HEALTHCHECK_DESTINATION,
    Phase.COMMIT_LOCATION,
    Phase.CLEANUP_SOURCE,
    Phase.DONE,
)


def reached(phase: Phase, milestone: Phase) -> bool:
    """True when forward phase `phase` is `milestone` or later on the happy path."""
    return FORWARD_PHASES.index(phase) >= FORWARD_PHASES.index(milestone)


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class _Stored(_Frozen):
    """A record the durable store keeps as a plain dict keyed by field names."""

    def to_storage(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @classmethod
    def from_storage(cls, data: dict[str, Any]) -> Self:
        return cls.model_validate(data)


# Generations are SQLite INTEGERs in state.db and on the VPS: [0, 2^63). A committed area may
# hold the last one, but no move can follow it (a move issues the next generation).
MAX_GENERATION = 2**63 - 1


def can_move(area: Area) -> bool:
    """Whether a next generation exists for `area` (see MAX_GENERATION)."""
    return area.generation < MAX_GENERATION


class Direction(StrEnum):
    """Which way a transaction moves its area."""

    LOCAL_TO_REMOTE = "local_to_remote"
    REMOTE_TO_LOCAL = "remote_to_local"


class Route(StrEnum):
    """The phase table a transaction follows (orchestrator/phases.py): its direction, and
    for a move home whether its VPS was given up (its source is then never asked for
    anything: it is waited out by its lease, and the move cannot be rolled back onto it)."""

    LOCAL_TO_REMOTE = "local_to_remote"
    REMOTE_TO_LOCAL = "remote_to_local"
    GIVEN_UP_TO_LOCAL = "given_up_to_local"


class Area(_Frozen):
    """One account of a service as committed in custom_config.json."""

    uuid: str = Field(min_length=1)
    service: str = Field(min_length=1)
    location: Side = Side.LOCAL
    generation: int = Field(default=0, ge=0, le=MAX_GENERATION)


class Transaction(_Stored):
    """The durable record of one area's migration (the contract fields, plus four more).

    Added fields, each needed to decide the next step after a crash from the record alone:
    `source_generation` (the source's stop and cleanup are generation-checked),
    `rollback_from` (the phase that failed: a destination can only run if the rollback
    started at CREATE_DESTINATION or later, which decides whether its lease must lapse),
    `destination_fenced` (the destination is proven stopped or its lease provably lapsed),
    `data_wait_since` (a rollback waits for the destination's newer data to come back:
    since when, so that waiting is bounded by `rollback_data_wait_s`),
    `source_abandoned` (a move home from a VPS the operator gave up: its source is never
    asked for anything; it is waited out by its lease instead, orchestrator/give_up.py).
    """

    transaction_id: str = Field(min_length=1)
    service: str = Field(min_length=1)
    area: str = Field(min_length=1)
    source: Side
    destination: Side
    phase: Phase = Phase.PREFLIGHT
    attempt: int = Field(default=1, ge=1)
    generation: int = Field(ge=1, le=MAX_GENERATION)  # the destination's new generation
    started_at: float
    updated_at: float
    last_error_code: str | None = None
    last_error_detail: str | None = None
    cleanup_required: bool = False
    source_generation: int = Field(default=0, ge=0, le=MAX_GENERATION)
    rollback_from: Phase | None = None
    destination_fenced: bool = False
    data_wait_since: float | None = None  # wall time a copy-back first failed (rollback)
    source_abandoned: bool = False  # the VPS was given up: fence its source by the lease alone

    def to_storage(self) -> dict[str, Any]:
        # `source_abandoned` is stored only when set: the previous release reads these
        # records back (a rollback of an upgrade), and it refuses fields it does not know.
        record = super().to_storage()
        if not self.source_abandoned:
            del record["source_abandoned"]
        return record

    @property
    def direction(self) -> Direction:
        return Direction.LOCAL_TO_REMOTE if self.source is Side.LOCAL else Direction.REMOTE_TO_LOCAL

    @property
    def route(self) -> Route:
        """The table this record follows; `source_abandoned` is how it is stored."""
        if self.source_abandoned:
            return Route.GIVEN_UP_TO_LOCAL
        return Route(self.direction.value)

    @property
    def is_active(self) -> bool:
        """Still owns its area: the engine (or an operator for PARKED) must act on it."""
        return self.phase not in (Phase.DONE, Phase.ROLLED_BACK)


class CleanupAction(StrEnum):
    """What a cleanup item removes on its side (always at its generation)."""

    REMOVE_AREA = "remove_area"  # stop the process, delete entry and data dir
    STOP_PROCESS = "stop_process"  # stop the process, keep the entry
    REMOVE_LEFTOVERS = "remove_leftovers"  # a migrated-away source's data, staging dirs


class CleanupItem(_Stored):
    """A durable obligation to remove something on one side (contract fields)."""

    id: str = Field(min_length=1)
    service: str = Field(min_length=1)
    area: str = Field(min_length=1)
    side: Side
    generation: int = Field(ge=0)
    action: CleanupAction = CleanupAction.REMOVE_AREA
    attempts: int = Field(default=0, ge=0)
    next_attempt_at: float
    last_error: str | None = None
    created_at: float


class AreaLease(_Frozen):
    """The local owner's view of one remote area lease (see area_leases.py).

    `acknowledged_at` is the LOCAL MONOTONIC time at which the agent's acknowledgement of
    the latest grant arrived; it is volatile (lost on restart, see rules.lease_after_restart).
    """

    area: str = Field(min_length=1)
    generation: int = Field(ge=0)
    owner_id: str = Field(min_length=1)
    acknowledged_at: float
    ttl: float = Field(gt=0)


class ProcessInfo(_Frozen):
    """One running daemon as a side reports it."""

    area: str = Field(min_length=1)
    service: str = Field(min_length=1)
    generation: int = Field(ge=0)
    pid: int = Field(gt=0)
    started_at: float  # wall clock


class RemoteEntry(_Frozen):
    """One area entry in the agent's table (it may or may not have a running process)."""

    area: str = Field(min_length=1)
    service: str = Field(min_length=1)
    generation: int = Field(ge=0)
    owner_id: str = ""
    lease_expires_at: float | None = None  # agent's wall clock
    created_at: float  # agent's wall clock, when the entry first appeared


class LocalInventory(_Frozen):
    """What the local supervisor runs right now."""

    processes: tuple[ProcessInfo, ...] = ()


class RemoteInventory(_Frozen):
    """What the agent reports: its entries and its running processes."""

    entries: tuple[RemoteEntry, ...] = ()
    processes: tuple[ProcessInfo, ...] = ()


class DesiredPlacement(_Stored):
    """What the operator asked for: per service, or per area when `area` is set."""

    service: str = Field(min_length=1)
    area: str | None = None
    location: Side
    updated_at: float

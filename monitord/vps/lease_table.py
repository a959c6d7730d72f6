"""The agent's area lease table: frozen entries and the pure decisions over them.

No I/O and no clock reads here: every function takes `now` (the agent's monotonic clock)
and returns a verdict or a new entry; `monitord.vps.runtime` performs the effects. This
is where the agent's rules (docs/design.md, "The agent (VPS side)") live:

- an area is created only if nobody else holds it: another owner's entry blocks while its
  lease is current or its process may still run; a newer generation always blocks;
- the same (area, generation, owner) again is idempotent (a renewal of the grant); with a
  changed command, data dir or env the old process is stopped and the new spec started;
- an older generation of the same owner is superseded (its process is fenced first);
- stop and delete act only at the named generation;
- a renewal is the grant: it refreshes the lease of entries that match exactly.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from orchestrator.text_enum import TextEnum


class EntryState(TextEnum):
    """What the agent reports for an entry in its inventory."""

    AWAITING_GRANT = "awaiting_grant"  # loaded from the cache, or lease lapsed: starts nothing
    STARTING = "starting"  # granted and wanted, process not up yet (or restarting)
    RUNNING = "running"
    STOPPED = "stopped"  # stopped on request (SUPPRESS_SOURCE); entry kept


@dataclass(frozen=True)
class AreaSpec:
    """What the owner asked to run for an area (the body of PUT /v1/areas/{area})."""

    area: str
    service: str
    generation: int
    owner_id: str
    command: tuple[str, ...]
    data_dir: str
    env: Mapping[str, str] = field(default_factory=dict)
    user: str | None = None  # the daemon runs as this user / group (None: as the agent)
    group: str | None = None
    log_max_bytes: int = 0  # the area log's cap and rotations kept (0: the defaults)
    log_keep: int = -1


RENEWAL_REWRITE_FRACTION = 0.1  # of the TTL: a smaller extension is not written


@dataclass(frozen=True)
class AreaEntry:
    """One area in the table. `lease_expires` is on the agent's monotonic clock; None means
    no grant since this agent started (or the lease lapsed)."""

    spec: AreaSpec
    created_at: float = 0.0  # wall clock, when this generation's entry was created
    run_wanted: bool = True
    lease_expires: float | None = None
    restarts: int = 0
    next_start: float = 0.0

    @property
    def generation(self) -> int:
        return self.spec.generation

    @property
    def owner_id(self) -> str:
        return self.spec.owner_id

    def lease_current(self, now: float) -> bool:
        return self.lease_expires is not None and now < self.lease_expires

    def granted(self, *, now: float, ttl_s: float) -> AreaEntry:
        return replace(self, lease_expires=now + ttl_s)

    def worth_a_rewrite(self, *, now: float, ttl_s: float) -> bool:
        """Whether a renewal of `ttl_s` at `now` must rewrite the lease file. One that would
        extend a current lease by less than a tenth of its TTL need not: the lease then
        stays as the last rewrite set it — shorter than the renewal asked for, never
        longer, so fencing only comes sooner — and it is still at least 0.9 TTL ahead.
        (The owner renews every TTL/3 and at once on changes of placement; an owner that
        names areas it renewed a moment ago — an older one, or two renewals in flight —
        would otherwise have every such file rewritten each time, and a rename over a file
        costs ext4 a flush.) A renewal that would shorten the lease is always written."""
        if self.lease_expires is None or not self.lease_current(now):
            return True
        extension = now + ttl_s - self.lease_expires
        return extension < 0 or extension >= ttl_s * RENEWAL_REWRITE_FRACTION

    def lapsed(self) -> AreaEntry:
        return replace(self, lease_expires=None)

    def should_run(self, now: float) -> bool:
        return self.run_wanted and self.lease_current(now) and now >= self.next_start

    def state(self, *, now: float, process_running: bool) -> EntryState:
        if not self.lease_current(now):
            return EntryState.AWAITING_GRANT
        if not self.run_wanted:
            return EntryState.STOPPED
        return EntryState.RUNNING if process_running else EntryState.STARTING


class CreateVerdict(enum.Enum):
    NEW = "new"  # nothing there: create
    SAME = "same"  # identical (area, generation, owner): refresh the grant, start if stopped
    UPDATE = "update"  # same (area, generation, owner), new command/env: stop it, start anew
    SUPERSEDE = "supersede"  # same owner, older generation: fence the old one, then create
    TAKE_OVER = "take_over"  # another owner's lapsed entry with no process: replace it
    CONFLICT = "conflict"  # 409 DESTINATION_CONFLICT


@dataclass(frozen=True)
class CreateDecision:
    verdict: CreateVerdict
    detail: str = ""


def decide_create(
    existing: AreaEntry | None, spec: AreaSpec, *, now: float, process_alive: bool
) -> CreateDecision:
    """May `spec` be created over `existing`? Pure; see the module docstring for the rules."""
    if existing is None:
        return CreateDecision(CreateVerdict.NEW)
    held = f"held by owner {existing.owner_id!r} at generation {existing.generation}"
    if existing.owner_id != spec.owner_id:
        if existing.lease_current(now) or process_alive:
            return CreateDecision(CreateVerdict.CONFLICT, f"area {spec.area} is {held}")
        return CreateDecision(CreateVerdict.TAKE_OVER, f"replacing lapsed entry {held}")
    if existing.generation > spec.generation:
        return CreateDecision(
            CreateVerdict.CONFLICT,
            f"area {spec.area} is {held}, newer than requested generation {spec.generation}",
        )
    if existing.generation == spec.generation:
        if existing.spec != spec:
            return CreateDecision(CreateVerdict.UPDATE, "command, data dir or env changed")
        return CreateDecision(CreateVerdict.SAME)
    return CreateDecision(CreateVerdict.SUPERSEDE, f"superseding generation {existing.generation}")


class RenewOutcome(TextEnum):
    RENEWED = "renewed"
    ABSENT = "absent"  # no entry for that area
    OTHER_OWNER = "other_owner"
    GENERATION_MISMATCH = "generation_mismatch"
    INVALID = "invalid"  # not a name (orchestrator.names): refused on its own, never the batch


def decide_renew(existing: AreaEntry | None, *, owner_id: str, generation: int) -> RenewOutcome:
    if existing is None:
        return RenewOutcome.ABSENT
    if existing.owner_id != owner_id:
        return RenewOutcome.OTHER_OWNER
    if existing.generation != generation:
        return RenewOutcome.GENERATION_MISMATCH
    return RenewOutcome.RENEWED


class GenerationCheck(enum.Enum):
    ABSENT = "absent"
    MATCH = "match"
    MISMATCH = "mismatch"


def check_generation(existing: AreaEntry | None, generation: int) -> GenerationCheck:
    """Stop and delete act only at the named generation; an absent entry is not an error."""
    if existing is None:
        return GenerationCheck.ABSENT
    if existing.generation != generation:
        return GenerationCheck.MISMATCH
    return GenerationCheck.MATCH


def restart_delay_s(restarts: int, *, base_s: float = 0.5, cap_s: float = 10.0) -> float:
    """Capped exponential backoff before restart number `restarts` (1-based)."""
    return float(min(cap_s, base_s * 2 ** max(0, restarts - 1)))

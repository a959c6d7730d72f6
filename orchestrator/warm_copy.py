"""Warm copies: a recent, verified copy of a remote area's data on the PBX, and when it counts.

A VPS that dies takes with it everything its areas wrote since they moved out. For a
service that declares how its data can be copied while it runs (`warm_copy = "sqlite"`),
the PBX pulls a consistent snapshot of each remote area every `warm_copy_interval_s`
(monitord/engine/warm_copier.py). A warm copy is never a holder of the newest data: the
lineage is unchanged by it, no move and no rollback starts from it. It has one use:

- `usable_at_give_up`: a give-up (orchestrator/give_up.py) trades the VPS's data for the
  PBX's; with a warm copy taken from the very copy given up (same lineage epoch, the VPS
  alone holding the newest data then, a generation that ran there) and verified on arrival,
  it trades it for that copy instead, and the loss is the copy's age, not the time since the
  move out. It is chosen *before* the give-up is recorded, for the epoch the give-up opens
  (`restore_epoch`): a crash between the two leaves a choice no epoch matches.
- `restores`: the give-up's move home puts it in place only when that choice matches the
  lineage it runs under.

The rest says when to take one (`due`), which to keep (`kept`) and when one is too old
(`overdue_at`), for the status.

Called by monitord/engine/warm_copier.py, monitord/engine/phase_actions.py (give-up) and the
model checker's world (tests/unit/core/world.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Self

from orchestrator.lineage import Lineage
from orchestrator.models import Area, Side

# A copy older than this many intervals is worth a warning: two are the bound with one
# copy's own time, a third means copies have been failing or starved.
OVERDUE_INTERVALS = 3


@dataclass(frozen=True, slots=True, kw_only=True)
class WarmCopy:
    """The newest warm copy of one area the PBX holds, verified on arrival."""

    area: str
    service: str
    generation: int  # the remote generation it was taken from
    epoch: int  # the lineage epoch it was taken in
    taken_at: float  # wall clock, the VPS's snapshot began: the data's age counts from here
    received_at: float  # wall clock, verified and in place on the PBX
    files: int
    bytes: int
    sent_bytes: int  # what crossed the link for it (a delta against the previous copy)
    digest: str  # SHA-256 of its listing, checked again before it is started from
    restore_epoch: int | None = None  # a give-up chose it for this epoch

    def to_storage(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    @classmethod
    def from_storage(cls, data: dict[str, Any]) -> Self:
        return cls(**{name: data[name] for name in cls.__dataclass_fields__})


def copied_now(area: Area, lineage: Lineage) -> bool:
    """Whether `area` is in a state its warm copies are taken in: committed to the VPS,
    which alone holds its newest data (a copy in between moves would be of nothing
    settled)."""
    return area.location is Side.REMOTE and lineage.holders == {Side.REMOTE}


def due(area: Area, lineage: Lineage, *, moving: bool, last_try: float | None,
        now: float, interval_s: float) -> bool:
    """Whether to take a warm copy of `area` now: `copied_now`, no move of any area under
    way (moves own the link: a warm copy waits for them, never the other way round), and
    `interval_s` since the last try (`now` and `last_try` on one monotonic clock; None:
    never tried)."""
    if not copied_now(area, lineage) or moving:
        return False
    return last_try is None or now - last_try >= interval_s


def usable_at_give_up(copy: WarmCopy | None, lineage: Lineage, *,
                      generations: frozenset[int]) -> bool:
    """Whether a give-up of the VPS's copy — `lineage` as it stands before it, `generations`
    the ones that could run there (give_up.remote_generations) — may start the area on
    `copy` instead of the PBX's own: taken in this very epoch, while the VPS alone held the
    newest data, from a generation that could run there. A copy of an older epoch was taken
    before the area last moved: the PBX's own copy is at least as new."""
    return (copy is not None and copy.area == lineage.area and copy.epoch == lineage.epoch
            and lineage.holders == {Side.REMOTE} and copy.generation in generations)


def chosen(copy: WarmCopy, lineage: Lineage) -> WarmCopy:
    """`copy` chosen by the give-up about to be recorded on `lineage` (lineage.discarded
    opens the next epoch)."""
    return replace(copy, restore_epoch=lineage.epoch + 1)


def restores(copy: WarmCopy | None, lineage: Lineage) -> bool:
    """Whether the give-up's move home, under `lineage`, starts from `copy`: a give-up
    chose it for exactly this epoch, and the PBX alone holds the newest data (the give-up
    is recorded)."""
    return (copy is not None and copy.restore_epoch is not None
            and copy.restore_epoch == lineage.epoch and lineage.holders == {Side.LOCAL})


def kept(copy: WarmCopy, area: Area | None, lineage: Lineage, *, moving: bool) -> bool:
    """Whether the PBX keeps `copy` (else its dir and record go): while a give-up's move
    home may still start from it (`restores`), while it is of the area's current epoch and
    generation on the VPS, and while a move of the area is under way (a move home diffs
    against it: monitord/engine/local_side.py). A copy of an epoch that is over is never
    used again."""
    if restores(copy, lineage) or moving:
        return True
    return (area is not None and copied_now(area, lineage) and copy.epoch == lineage.epoch
            and copy.generation == area.generation)


def age_s(copy: WarmCopy, *, now: float) -> float:
    """How much of the area's life the copy lacks (wall clock): what a give-up loses."""
    return max(0.0, now - copy.taken_at)


def overdue_at(copy: WarmCopy | None, *, since: float, interval_s: float) -> float:
    """When (wall clock) the area's warm copy is `OVERDUE_INTERVALS` intervals old — none
    yet: counted from `since`, when its copies became due — unless a newer one arrives."""
    reference = since if copy is None else copy.taken_at
    return reference + OVERDUE_INTERVALS * interval_s

"""Data lineage: which sides hold an area's newest data, and the one rule every start asks.

An area's data is written by whichever process of it runs. To never start an area on data
older than the newest any of its processes wrote, monitord keeps per area a durable
`Lineage`: the set of sides whose copy of the data is the newest one (`holders`) and a data
epoch that grows every time a side takes the data over.

    a verified copy X -> Y, X a holder         holders ∪ {Y}        (identical bytes)
    a process is about to start on side S      holders = {S}, epoch + 1   (written first)
    the operator discards a side's newer data  holders = {S}, epoch + 1   (recorded as such)

The rules, all pure:

- `may_run(lineage, side)`: a process may run on `side` only when that side alone holds the
  newest data (it claimed it). The supervisor's wanted set and the lease grants both pass
  through `orchestrator.rules.desired_runs`, which applies this.
- `may_claim(lineage, side)`: a side may take the data over (be started) only when it holds
  the newest data; otherwise the data must be copied to it first from a holder.
- `copy_plan(lineage, source=, destination=)`: what a copy between two sides must do:
  nothing (the destination already holds it), copy (the source holds it) or refuse (neither).
- `may_discard_data(lineage, side)`: cleanup may delete a side's data only when that side is
  not a holder — the newest data is never deleted.

An area with no lineage record (state from before lineage existed) is assumed to hold its
newest data where custom_config.json commits it (`default_for`).

Called by orchestrator/phases.py (rollback copy-back), orchestrator/rules.py (what may run),
monitord/engine/phase_actions.py and monitord/engine/cleanup_worker.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Self

from orchestrator.models import Area, Side


@dataclass(frozen=True, slots=True, kw_only=True)
class Lineage:
    """Where an area's newest data is (`holders`, never empty) and its data epoch."""

    area: str
    holders: frozenset[Side]
    epoch: int = 0

    def to_storage(self) -> dict[str, Any]:
        return {
            "area": self.area,
            "holders": sorted(side.value for side in self.holders),
            "epoch": self.epoch,
        }

    @classmethod
    def from_storage(cls, data: dict[str, Any]) -> Self:
        return cls(
            area=str(data["area"]),
            holders=frozenset(Side(s) for s in data["holders"]),
            epoch=int(data["epoch"]),
        )


def default_for(area: Area) -> Lineage:
    """The lineage of an area never recorded: its newest data is where it is committed."""
    return Lineage(area=area.uuid, holders=frozenset({area.location}), epoch=0)


def may_run(lineage: Lineage, side: Side) -> bool:
    """A process of the area may run on `side`: that side alone holds the newest data."""
    return lineage.holders == {side}


def may_claim(lineage: Lineage, side: Side) -> bool:
    """`side` may take the data over (a process is about to start there)."""
    return side in lineage.holders


def claimed(lineage: Lineage, side: Side) -> Lineage:
    """The lineage once `side` took the data over: it alone holds it, in a new epoch.

    Idempotent: a side that already holds it alone keeps the same epoch (a restart of a
    crashed daemon on its own data is not a hand-over)."""
    if not may_claim(lineage, side):
        raise ValueError(f"{lineage.area}: {side} does not hold the newest data")
    if may_run(lineage, side):
        return lineage
    return Lineage(area=lineage.area, holders=frozenset({side}), epoch=lineage.epoch + 1)


def copied(lineage: Lineage, *, source: Side, destination: Side) -> Lineage:
    """The lineage after a verified copy from a holder: the destination holds it too."""
    if source not in lineage.holders:
        raise ValueError(f"{lineage.area}: a copy from {source}, which is not a holder")
    return Lineage(
        area=lineage.area, holders=lineage.holders | {destination}, epoch=lineage.epoch
    )


def discarded(lineage: Lineage, *, keep: Side) -> Lineage:
    """The operator's choice: `keep`'s data becomes the newest; the others' is given up."""
    return Lineage(area=lineage.area, holders=frozenset({keep}), epoch=lineage.epoch + 1)


class CopyPlan(StrEnum):
    """What a copy of an area's data from one side to the other must do."""

    COPY = "copy"  # the source holds the newest data; the destination gets it
    SKIP = "skip"  # the destination already holds the newest data: copying would regress
    REFUSE = "refuse"  # neither holds it (cannot happen by these rules; never guess)


def copy_plan(lineage: Lineage, *, source: Side, destination: Side) -> CopyPlan:
    if destination in lineage.holders:
        return CopyPlan.SKIP
    if source in lineage.holders:
        return CopyPlan.COPY
    return CopyPlan.REFUSE


def may_discard_data(lineage: Lineage, side: Side) -> bool:
    """Cleanup may delete `side`'s data dir: it is not (one of) the newest copies."""
    return side not in lineage.holders

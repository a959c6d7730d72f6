"""What monitord may start when its own state (state.db) is missing or older than the files.

state.db holds what custom_config.json cannot: the moves under way, each area's data lineage
(which side holds the newest data), the generations issued. Lost — or put back from a backup
— while an area moved, it would have monitord start the area where custom_config.json still
commits it, on the data that side had before the move, while the destination on the VPS held
newer data (and the reconciler would remove that destination as an orphan). So an area is
*held* — it runs on neither side, nothing removes it — from the start until the VPS has been
asked what it holds:

- every area, when state.db was made by this start although monitord had run in this
  work_dir before (its owner id is there): the state was lost;
- an area whose committed generation is above the highest state.db ever issued for it:
  state.db (not made now) is older than custom_config.json.

It is released (its lineage recorded: the committed side holds the newest data) once the
VPS's inventory shows no entry or process of it at a generation above the committed one — at
once with no VPS configured. Otherwise it stays held, and `Held.detail` names the one manual
step. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from orchestrator.models import Area, RemoteInventory


@dataclass(frozen=True)
class Held:
    """Why the area is held, with the step that ends it."""

    detail: str


def held_at_start(committed: Iterable[Area], *, highest_issued: Mapping[str, int],
                  state_lost: bool, state_new: bool = False) -> dict[str, Held]:
    """The areas to hold from this start (see the module docstring). `state_new`: state.db
    was made by this start — the first one in this work_dir unless `state_lost`, and then
    the file's generations are no one's to doubt (written by hand, or before monitord)."""
    held: dict[str, Held] = {}
    if state_new and not state_lost:
        return held
    for area in committed:
        issued = highest_issued.get(area.uuid, 0)
        if state_lost:
            held[area.uuid] = Held(
                "state.db was missing at this start although monitord ran here before: the"
                " area may have been moving; held on both sides until the VPS says what it"
                " holds")
        elif issued < area.generation:
            held[area.uuid] = Held(
                f"state.db issued generation {issued} at most, custom_config.json commits"
                f" {area.generation}: state.db is older than the file; held on both sides"
                " until the VPS says what it holds")
    return held


def verdict(area: Area, held: Held, *, remote: RemoteInventory | None,
            remote_configured: bool) -> Held | None:
    """None when the held area may be released now; else why it stays held."""
    if not remote_configured:
        return None
    if remote is None:
        return held  # (the VPS not asked yet: it is, at the next pass it answers)
    newer = sorted({e.generation for e in remote.entries if e.area == area.uuid}
                   | {p.generation for p in remote.processes if p.area == area.uuid})
    newer = [g for g in newer if g > area.generation]
    if not newer:
        return None
    return Held(
        f"the VPS holds generation {newer[-1]} of it, newer than the committed"
        f" {area.generation}: state.db was lost or put back while it moved, and the newest"
        " data may be on the VPS. Stop monitord and put back the state.db of that move;"
        " or, to start on the PBX's copy and lose what the VPS wrote, remove the VPS's copy"
        f" ({area.service}/{area.uuid} under remote_bin_dir/data) and its entry there first")

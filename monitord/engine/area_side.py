"""What a side can do to an area: the one protocol both sides implement.

The phase actions, the reconciler and the cleanup worker act on an area through
`sides[side]` and never ask which side it is; what differs lives in the two
implementations: monitord.engine.local_side (the supervisor, the PBX's files) and
monitord.engine.remote_side (the agent over the tunnel, the VPS's files). A copy always
runs between the two, so each side knows how to receive the other's data.

Every operation is generation-checked and idempotent: after a crash the engine performs
the stored record's next action again.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from monitord.base.config import ServiceSection
from monitord.remote import artifact
from orchestrator import disk_space, memory_room
from orchestrator.cleanup_policy import SideObservation
from orchestrator.errors import ErrorCode, MonitordError, error_for
from orchestrator.lineage import Lineage
from orchestrator.models import Side, Transaction

if TYPE_CHECKING:  # the SSH side loads after readiness (monitord/remote/ssh_side.py)
    from monitord.remote.copy import CopyReport, Progress, Staged
    from monitord.remote.remote_link import RemoteLink

T = TypeVar("T")

# How long a stopped daemon gets between SIGTERM and SIGKILL (local) before a stop fails.
STOP_GRACE_S = 10.0


async def copy_over(
    link: RemoteLink,
    transfer: Callable[..., Awaitable[T]],
    *,
    local_dir: Path,
    remote_dir: str,
    area: str,
    **options: Any,
) -> T:
    """One direction of a copy (monitord.remote.copy: pre_upload, upload, pre_download,
    download) over the tunnel's live connection, with the agent answering for the area's
    dirs on the VPS; what both sides' `pre_receive` and `receive` are made of."""
    from monitord.remote.copy import AreaCopy

    async with link.session() as conn:
        return await transfer(
            conn, local_dir=local_dir, remote_dir=remote_dir,
            vps_command=artifact.remote_command(link.section),
            agent=AreaCopy(link.agent, area, remote_dir), **options,
        )


def health_timeout(txn: Transaction, section: ServiceSection, side: Side) -> MonitordError:
    """The destination did not stay up long enough within its health check's time."""
    return error_for(
        ErrorCode.HEALTHCHECK_TIMEOUT,
        f"{txn.area} did not stay up {section.min_uptime_s:g} s on {side.value}"
        f" within {section.min_uptime_s + section.healthcheck_timeout_s:g} s",
    )


class AreaSide(Protocol):
    side: Side

    def reachable(self) -> bool:
        """Whether this side can be acted on now (the PBX always; the VPS with the tunnel)."""
        ...

    def data_dir(self, *, service: str, area: str, generation: int) -> str:
        """The area's data dir on this side, templates expanded."""
        ...

    async def usage(
        self, *, service: str, area: str, generation: int
    ) -> disk_space.Usage | None:
        """What the area's data here takes once copied (bytes and inodes, and the files'
        content where this side can tell), or None when this side cannot tell now."""
        ...

    def resident_bytes(self, *, area: str) -> int | None:
        """What the area's daemon holds in memory here now; None when it does not run here
        or this side cannot tell."""
        ...

    async def check_ready(
        self, txn: Transaction, *, incoming: disk_space.Usage | None = None,
        memory: memory_room.Need | None = None,
    ) -> None:
        """The preflight of a move to this side: raises the first failed check's error;
        `incoming`, the area's usage on the source, is what must fit here; `memory`, what
        its daemon will take of this side's memory (the VPS judges it)."""
        ...

    async def stop(self, *, area: str, generation: int) -> None:
        """Stop the area's process and verify it gone; its entry and data stay."""
        ...

    async def remove(self, *, service: str, area: str, generation: int) -> None:
        """Stop the area at `generation` and remove its entry and a copy's leftovers; verified."""
        ...

    async def verify_gone(self, *, area: str, generation: int, entry_gone: bool = True) -> None:
        """Raise DAEMON_STOP_FAILED while a process at (or below) `generation` runs there, or
        (`entry_gone`) its entry at `generation` is still there."""
        ...

    async def observe(self, areas: Collection[str]) -> dict[str, SideObservation] | None:
        """The entry and process generations of `areas` here; None while unobservable."""
        ...

    async def start(self, *, service: str, area: str, generation: int) -> None:
        """Start the area at `generation` now (CREATE_DESTINATION); verified started."""
        ...

    async def resume(self, *, service: str, area: str, generation: int) -> None:
        """Let the rolled-back source run again at `generation`."""
        ...

    async def uptime(self, *, area: str, generation: int) -> float | None:
        """Seconds the area has run at `generation`, None while it does not run."""
        ...

    async def healthy_by(
        self, txn: Transaction, *, generation: int, min_uptime_s: float, deadline: float
    ) -> bool:
        """Ask this side to answer the health window itself: True once healthy, False
        where it cannot (then the caller looks at `uptime`); raises a timeout error."""
        ...

    async def probe(self, txn: Transaction) -> bool:
        """The service's configured probe, where this side can run it."""
        ...

    async def retire(self, *, service: str, area: str, generation: int) -> None:
        """CLEANUP_SOURCE: the migrated-away source at `generation` gone for good."""
        ...

    async def stop_at(self, *, area: str, generation: int) -> None:
        """Stop the area only if it runs at exactly `generation` (never a newer one)."""
        ...

    async def remove_unless_newest(
        self, *, area: str, generation: int, lineage: Lineage
    ) -> bool:
        """Remove the area at `generation` — or, when this side holds its newest data, only
        stop it and keep entry and data. True if removed."""
        ...

    async def pre_receive(
        self, *, local_dir: Path, remote_dir: str, service: str, area: str,
        progress: Progress | None = None,
    ) -> Staged:
        """Stage the other side's data here while its area still runs (best effort)."""
        ...

    async def receive(
        self, *, local_dir: Path, remote_dir: str, service: str, area: str,
        staged: Staged | None, progress: Progress | None = None,
    ) -> CopyReport:
        """Copy the other side's (stopped) data here: staging, check, atomic swap (telling
        `progress` the bytes done of the total as they move, as the pre-copy does)."""
        ...

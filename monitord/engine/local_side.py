"""The PBX as a side (monitord.engine.area_side): the local supervisor runs the area, its
data is a directory here, and a copy to it comes down from the VPS.

Locally an area has no entry beyond the supervisor's wanted set (`PlacementState.runs`,
fed through `LocalRuns` on every change), so "suppressing" is the persisted phase plus a
verified stop, and "removing" is stopping: a migrated-away source's data is archived by
`retire()`, never deleted.
"""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import stat
from collections.abc import Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING

from monitord.base import area_paths, logs, tree_digest
from monitord.base.config import Config, ServiceSection
from monitord.engine.area_side import STOP_GRACE_S, copy_over
from monitord.engine.placement_state import PlacementState
from monitord.local.supervisor import AreaRun, LocalSupervisor, area_run
from orchestrator import disk_space, memory_room
from orchestrator.cleanup_policy import SideObservation
from orchestrator.errors import ErrorCode, error_for
from orchestrator.lineage import Lineage
from orchestrator.models import Side, Transaction
from orchestrator.warm_copy import WarmCopy

log = logs.get_logger(__name__)

if TYPE_CHECKING:  # the SSH side loads after readiness (monitord/remote/ssh_side.py)
    from monitord.remote import copy as area_copy
    from monitord.remote.remote_link import RemoteLink


class LocalSide:
    side = Side.LOCAL

    def __init__(
        self,
        *,
        config: Config,
        supervisor: LocalSupervisor,
        runs: Callable[[], dict[str, AreaRun]],
        link: RemoteLink | None,
    ) -> None:
        self.config = config
        self.supervisor = supervisor
        self._runs = runs  # what may run locally now: the supervisor's wanted set
        self._link_or_none = link
        self.archive_dir = config.monitord.work_dir / "archive"

    def _section(self, service: str) -> ServiceSection:
        return self.config.services[service]

    def reachable(self) -> bool:
        return True

    def data_dir(self, *, service: str, area: str, generation: int) -> str:
        return str(self._path(service=service, area=area, generation=generation))

    def _path(self, *, service: str, area: str, generation: int) -> Path:
        return area_paths.local_data_dir(self._section(service), area=area, generation=generation)

    async def usage(
        self, *, service: str, area: str, generation: int
    ) -> disk_space.Usage | None:
        path = self._path(service=service, area=area, generation=generation)
        return await asyncio.to_thread(_tree_usage, path)

    def resident_bytes(self, *, area: str) -> int | None:
        return self.supervisor.resident_bytes(area)

    async def check_ready(
        self, txn: Transaction, *, incoming: disk_space.Usage | None = None,
        memory: memory_room.Need | None = None,
    ) -> None:
        """A move home (or a copy back): the file system that will hold the area's data dir
        and its staging dir (their parent) has the area's footprint plus the margin free
        (orchestrator/disk_space.py); an unknown size is judged on the margin alone. (The
        PBX's memory is not judged: the area ran there before.)"""
        target = self._path(service=txn.service, area=txn.area, generation=txn.generation)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            free = await asyncio.to_thread(_free_space, target.parent)
        except OSError as e:
            from monitord.remote.copy.local_tree import local_file_error

            raise local_file_error(e, during=f"preflight of {target.parent}") from e
        usage = incoming or disk_space.Usage(bytes=0)
        short = disk_space.shortage(side="PBX", path=str(target.parent), usage=usage, free=free)
        if short is not None:
            raise error_for(ErrorCode.PREFLIGHT_DISK_SPACE, short.detail(), facts=short.facts())

    async def check_room_for_warm_copy(self, path: Path, *, bytes_: int, files: int) -> None:
        """A warm copy of `bytes_` in `files` into `path` leaves room for what a move home of
        the same area then needs (its staging dir: the same again) plus the margin: warm
        copies give way before a move's preflight would fail for their room
        (LOCAL_DISK_FULL, a warm copy's failure, never a move's)."""
        try:
            await asyncio.to_thread(path.mkdir, parents=True, exist_ok=True)
            free = await asyncio.to_thread(_free_space, path)
        except OSError as e:
            from monitord.remote.copy.local_tree import local_file_error

            raise local_file_error(e, during=f"warm copy into {path}") from e
        usage = disk_space.Usage(bytes=2 * bytes_, inodes=2 * files)
        short = disk_space.shortage(side="PBX", path=str(path), usage=usage, free=free)
        if short is not None:
            raise error_for(ErrorCode.LOCAL_DISK_FULL, f"no warm copy: {short.detail()}",
                            facts=short.facts())

    # -- stopping and removing -------------------------------------------------------------

    async def stop(self, *, area: str, generation: int) -> None:
        # The stored phase already took the area out of the wanted set (the placement
        # state's listener fed it to the supervisor): this stop is the one stop request.
        if not await self.supervisor.stop_area(area, grace_s=STOP_GRACE_S):
            raise error_for(ErrorCode.DAEMON_STOP_FAILED, f"{area} would not stop")

    async def remove(self, *, service: str, area: str, generation: int) -> None:
        await self.stop(area=area, generation=generation)
        target = self._path(service=service, area=area, generation=generation)
        await asyncio.to_thread(_remove_staging, target)

    async def verify_gone(self, *, area: str, generation: int, entry_gone: bool = True) -> None:
        if any(v.area == area and v.pid and v.generation <= generation
               for v in self.supervisor.inventory()):
            raise error_for(ErrorCode.DAEMON_STOP_FAILED,
                            f"{area} still runs locally at generation {generation}")

    async def observe(self, areas: Collection[str]) -> dict[str, SideObservation] | None:
        wanted = set(areas)
        running: dict[str, set[int]] = {area: set() for area in wanted}
        for view in self.supervisor.inventory():
            if view.area in wanted and view.pid:
                running[view.area].add(view.generation)
        return {
            area: SideObservation(side=Side.LOCAL, area=area,
                                  process_generations=frozenset(generations))
            for area, generations in running.items()
        }

    async def retire(self, *, service: str, area: str, generation: int) -> None:
        if not await self.supervisor.stop_area(area, grace_s=STOP_GRACE_S):
            raise error_for(ErrorCode.DAEMON_STOP_FAILED, f"{area} would not stop")
        source_dir = self._path(service=service, area=area, generation=generation)
        target = self.archive_dir / service / f"{area}-g{generation}"
        await asyncio.to_thread(_archive, source_dir, target)

    async def stop_at(self, *, area: str, generation: int) -> None:
        if not await self.supervisor.stop_area_at(area, generation):
            raise error_for(ErrorCode.DAEMON_STOP_FAILED, f"{area} would not stop")

    async def remove_unless_newest(
        self, *, area: str, generation: int, lineage: Lineage
    ) -> bool:
        # Removing a local area is stopping it: its data is never deleted here.
        await self.stop_at(area=area, generation=generation)
        return True

    # -- starting and health ---------------------------------------------------------------

    async def start(self, *, service: str, area: str, generation: int) -> None:
        run = area_run(service=service, section=self._section(service), area=area,
                       generation=generation)
        self.supervisor.set_desired(self._runs())
        view = await self.supervisor.start_area(run)
        if view.generation != generation:
            raise error_for(ErrorCode.DAEMON_START_FAILED, f"{area} did not start")

    async def resume(self, *, service: str, area: str, generation: int) -> None:
        # The persisted phase lets it run again; the supervisor's loop starts it.
        self.supervisor.set_desired(self._runs())

    async def uptime(self, *, area: str, generation: int) -> float | None:
        for view in self.supervisor.inventory():
            if view.area == area and view.generation == generation and view.pid:
                return view.uptime_s
        return None

    async def healthy_by(
        self, txn: Transaction, *, generation: int, min_uptime_s: float, deadline: float
    ) -> bool:
        return False  # the supervisor's inventory is local: looking at it costs nothing

    async def probe(self, txn: Transaction) -> bool:
        section = self._section(txn.service)
        if not section.probe:
            return True
        argv = [part.format(area=txn.area) for part in section.probe]
        proc = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
        )
        try:
            async with asyncio.timeout(section.healthcheck_timeout_s):
                return await proc.wait() == 0
        except TimeoutError:
            proc.kill()
            await proc.wait()
            return False

    # -- the PBX's own copy, when the VPS is given up ---------------------------------------

    def _archive_of(self, *, service: str, area: str) -> Path | None:
        """The newest archived copy of the area (a migrated-away source's data dir)."""
        newest: tuple[int, Path] | None = None
        for path in (self.archive_dir / service).glob(f"{area}-g*"):
            generation = path.name.removeprefix(f"{area}-g")
            if generation.isascii() and generation.isdigit() \
                    and (newest is None or int(generation) > newest[0]):
                newest = (int(generation), path)
        return newest[1] if newest else None

    async def own_copy(self, *, service: str, area: str, generation: int) -> dict[str, object]:
        """What the PBX holds of the area: its data dir at `generation`, else the newest
        archive; with the time it was last written (None: no copy at all)."""
        live = self._path(service=service, area=area, generation=generation)
        path = live if live.is_dir() else self._archive_of(service=service, area=area)
        if path is None:
            return {"path": None, "modified_at": None}
        modified = await asyncio.to_thread(_newest_mtime, path)
        return {"path": str(path), "modified_at": modified}

    async def warm_copy_whole(self, copy: WarmCopy) -> bool:
        """Whether `copy`'s files are still exactly the ones received (their listing's
        SHA-256): a give-up chooses it only then; else `warm_copy_unusable`."""
        if await self.warm_copy_dir_of(copy) is not None:
            return True
        log.warning("warm_copy_unusable", area=copy.area, service=copy.service,
                    detail="not the copy received (gone or changed since): the PBX's own"
                           " copy is used")
        return False

    async def warm_copy_dir_of(self, copy: WarmCopy) -> Path | None:
        """The dir holding exactly `copy` (its listing's SHA-256): its place, or the one it
        arrived in when its move into place was cut after it was recorded; None: neither."""
        placed = area_paths.warm_copy_dir(self.config.monitord.work_dir, service=copy.service,
                                          area=copy.area)
        for path in (placed, area_paths.arriving_warm_copy_dir(placed)):
            if await asyncio.to_thread(_still, path, copy.digest):
                return path
        return None

    async def restore_own_copy(self, *, service: str, area: str, generation: int,
                               warm: WarmCopy | None = None) -> str | None:
        """Put the PBX's newest copy in place as the data dir at `generation` (a given-up
        VPS's move home starts on it): kept if there, else the warm copy the give-up chose
        (`warm`) if it is still exactly the one received, else the newest archive moved
        back. The path it came from; None when the PBX has no copy (the area starts empty)."""
        target = self._path(service=service, area=area, generation=generation)
        if target.exists():
            return str(target)
        source = None if warm is None else await self.warm_copy_dir_of(warm)
        if source is not None:
            target.parent.mkdir(parents=True, exist_ok=True)
            await asyncio.to_thread(_archive, source, target)
            return str(source)
        if warm is not None:
            log.warning("warm_copy_unusable", area=area, service=service,
                        detail="not the copy received (gone or changed since): the PBX's"
                               " own copy is used")
        archive = self._archive_of(service=service, area=area)
        if archive is None:
            return None
        target.parent.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(_archive, archive, target)  # the same crash-safe move
        return str(archive)

    # -- receiving a copy from the VPS -----------------------------------------------------

    def _link(self) -> RemoteLink:
        if self._link_or_none is None:
            raise error_for(ErrorCode.PREFLIGHT_REMOTE_CONFIG, "no [remote] section configured")
        return self._link_or_none

    async def pre_receive(
        self, *, local_dir: Path, remote_dir: str, service: str, area: str,
        progress: area_copy.Progress | None = None,
    ) -> area_copy.Staged:
        from monitord.remote import copy as area_copy

        return await copy_over(self._link(), area_copy.pre_download, local_dir=local_dir,
                               remote_dir=remote_dir, area=area, progress=progress,
                               basis=self._basis(local_dir, service=service, area=area))

    async def receive(
        self, *, local_dir: Path, remote_dir: str, service: str, area: str,
        staged: area_copy.Staged | None, progress: area_copy.Progress | None = None,
    ) -> area_copy.CopyReport:
        from monitord.remote import copy as area_copy

        return await copy_over(self._link(), area_copy.download, local_dir=local_dir,
                               remote_dir=remote_dir, area=area, staged=staged,
                               progress=progress,
                               basis=self._basis(local_dir, service=service, area=area))

    def _basis(self, local_dir: Path, *, service: str, area: str) -> Path | None:
        """The PBX's own copy a download starts from, so that only the blocks it lacks
        cross the link: the data dir if it is there, else the area's warm copy (taken
        minutes ago, where the archive is as old as the move out), else the newest archive
        (the source of the move out). Only a seed: what starts is what the VPS listed, by
        SHA-256."""
        if local_dir.is_dir():
            return local_dir
        warm = area_paths.warm_copy_dir(self.config.monitord.work_dir, service=service,
                                        area=area)
        return warm if warm.is_dir() else self._archive_of(service=service, area=area)

    def basis_of(self, *, service: str, area: str, generation: int) -> Path | None:
        """`_basis` of the area's data dir at `generation`."""
        return self._basis(self._path(service=service, area=area, generation=generation),
                           service=service, area=area)


class LocalRuns:
    """The supervisor's wanted set: every area that may run locally, as AreaRuns. Asked on
    every change of the placement state (each phase of each area), so an AreaRun is built
    once per (area, service, generation) and reused while that stays what may run."""

    def __init__(self, config: Config) -> None:
        self._config = config
        self._built: dict[tuple[str, str, int], AreaRun] = {}

    def __call__(self, state: PlacementState) -> dict[str, AreaRun]:
        runs: dict[str, AreaRun] = {}
        built: dict[tuple[str, str, int], AreaRun] = {}
        for area, generation in state.runs(Side.LOCAL).items():
            committed = state.committed.get(area)
            txn = state.transactions.get(area)
            service = txn.service if txn else committed.service if committed else None
            if service is None or service not in self._config.services:
                continue
            key = (area, service, generation)
            run = self._built.get(key)
            if run is None:
                run = area_run(service=service, section=self._config.services[service],
                               area=area, generation=generation)
            runs[area] = built[key] = run
        self._built = built
        return runs


def _free_space(path: Path) -> disk_space.Free:
    """statvfs of `path`'s file system, as an unprivileged writer sees it."""
    st = os.statvfs(path)
    return disk_space.Free(bytes=st.f_bavail * st.f_frsize, inodes=st.f_favail,
                           total_inodes=st.f_files)


def _tree_usage(root: Path) -> disk_space.Usage:
    """What the area's tree will take once copied (orchestrator/disk_space.footprint)."""
    if not root.is_dir():
        return disk_space.Usage(bytes=0, content_bytes=0)
    sizes: list[int] = []
    dirs = 1
    for _, st in tree_digest.walk_inside(root):  # (a dir swapped for a link to / is not walked)
        if stat.S_ISDIR(st.st_mode):
            dirs += 1
        elif stat.S_ISREG(st.st_mode):
            sizes.append(st.st_size)
    return disk_space.footprint(sizes, dirs=dirs)


def _newest_mtime(root: Path) -> float:
    """When anything in the tree was last written (the dir itself when it is empty)."""
    newest = root.lstat().st_mtime
    for _, st in tree_digest.walk_inside(root):
        newest = max(newest, st.st_mtime)
    return newest


def _remove_staging(target: Path) -> None:
    """What a copy to `target` left: its staging dir and an old tree (the PBX keeps no digest
    cache on disk), in the data dir's own copy dir (monitord.base.tree_digest.copy_dir)."""
    shutil.rmtree(tree_digest.copy_dir(target), ignore_errors=True)


def _still(root: Path, digest: str) -> bool:
    from monitord.remote.copy import local_tree

    return root.is_dir() and local_tree.tree_sha256(root) == digest


def _archive(source: Path, target: Path) -> None:
    if not source.exists():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(target, ignore_errors=True)
    try:
        source.rename(target)
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
        _move_across_filesystems(source, target)


def _move_across_filesystems(source: Path, target: Path) -> None:
    """The data dir and work_dir are on different file systems (EXDEV): copy to a temporary
    name next to the target, fsync every file, rename it into place, then remove the source
    — a crash at any point leaves the source whole."""
    staging = target.with_name(target.name + ".moving")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(source, staging, symlinks=True)
    for path in staging.rglob("*"):
        if path.is_file() and not path.is_symlink():
            with path.open("rb") as f:
                os.fsync(f.fileno())
    staging.rename(target)
    shutil.rmtree(source)

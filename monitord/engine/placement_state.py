"""The daemon's in-memory view of placement: committed areas, active transactions, wishes.

One `PlacementState` per daemon, owned by the runtime and shared by the migration engine,
the lease renewer, the reconciler, the supervisor feed and the status API. It is a cache of
durable facts, never the other way round:

- committed areas come from `custom_config.json` (the authority; monitord is its only
  writer while running, and the commit write goes through `commit()` here);
- transactions are written to the store *before* the cache changes (`save()`);
- desired placements are the operator's wishes, recorded in the store by the intake.

Whoever changes it calls `notify()`: listeners (the supervisor feed, the renewer, the
status projection) recompute from `runs(side)`, which is `orchestrator.rules.desired_runs`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from monitord.base import logs
from monitord.store import abandoned_copies, spool_files
from monitord.store.state_db import Store
from orchestrator import lineage, rules, state_loss, warm_copy
from orchestrator.errors import ErrorCode, error_for
from orchestrator.lineage import Lineage
from orchestrator.models import Area, Phase, RemoteInventory, Side, Transaction
from orchestrator.warm_copy import WarmCopy

log = logs.get_logger(__name__)

Listener = Callable[[], None]


class PlacementState:
    def __init__(self, *, store: Store, custom_config_path: Path) -> None:
        self.store = store
        self.custom_config_path = custom_config_path
        self.committed: dict[str, Area] = {}
        self.titles: dict[str, str] = {}  # uuid -> the entry's title or name, shown only
        self.corrupt: spool_files.ConfigCorrupt | None = None
        # custom_config.json entries left out one by one (never started, never sent to the VPS)
        self.quarantined: tuple[spool_files.InvalidEntry, ...] = ()
        self.transactions: dict[str, Transaction] = {}  # active ones, by area
        self.desired_service: dict[str, Side] = {}
        self.desired_area: dict[str, Side] = {}
        self.last_finished: dict[str, Transaction] = {}  # newest final record per area
        self.lineages: dict[str, Lineage] = {}  # recorded data lineage per area (durable)
        self.warm: dict[str, WarmCopy] = {}  # each remote area's newest warm copy (durable)
        # VPS copies given up, by (area, generation): set aside there, never started (durable)
        self.abandoned: dict[tuple[str, int], abandoned_copies.Row] = {}
        self._abandoned_path = store.path.parent / abandoned_copies.FILE_NAME
        # Areas held on both sides after state.db was lost or found older than the files,
        # until the VPS has said what it holds (orchestrator/state_loss.py), with why.
        self.held: dict[str, state_loss.Held] = {}
        self._loaded = False  # (load done: areas that appear later are the UI's additions)
        self._listeners: list[Listener] = []
        self.changed = asyncio.Event()
        # custom_config.json is read-changed-written by commits and re-read by the
        # reconciler, each in a worker thread: one at a time, or a commit can be lost on
        # disk or undone in memory (and the supervisor would start a migrated area again).
        self._file_lock = asyncio.Lock()
        self._read_stamp: tuple[int, int, int] | None = None  # (inode, size, mtime_ns) read

    # -- loading ---------------------------------------------------------------------------

    async def load(self) -> None:
        """Read custom_config.json, active transactions and wishes (at start-up)."""
        await self.reload_committed()
        for record in await self.store.list_transactions(active_only=True, limit=1_000_000):
            txn = Transaction.from_storage(record)
            self.transactions[txn.area] = txn
        for record in await self.store.lineages():
            found = Lineage.from_storage(record)
            self.lineages[found.area] = found
        for record in await self.store.warm_copies():
            copy = WarmCopy.from_storage(record)
            self.warm[copy.area] = copy
        self.abandoned = await asyncio.to_thread(abandoned_copies.load, self._abandoned_path)
        # In the order they were made: a later service-wide wish overrides per-area ones.
        rows = sorted(await self.store.desired_placements(), key=lambda r: r["updated_at"])
        for row in rows:
            self._apply_desired(row["service"], row.get("area"), Side(row["location"]))
        self.held = state_loss.held_at_start(
            self.committed.values(), highest_issued=await self.store.highest_generations(),
            state_lost=self.store.state_lost, state_new=self.store.created)
        for area, why in self.held.items():
            log.critical("area_held_state_lost", area=area, detail=why.detail)
        # The file's generations of the areas not held are the truth from now on, issued
        # here or not (written before monitord, by hand): the next start compares with them.
        await self.store.raise_generations(
            {a.uuid: a.generation for a in self.committed.values() if a.uuid not in self.held})
        self._loaded = True

    async def settle_held(self, remote: RemoteInventory | None, *,
                          remote_configured: bool) -> None:
        """Release each held area the VPS's inventory (`remote`, None: not asked) clears:
        its lineage recorded as the committed side's, then it may run there again; the rest
        stay held, with why (state_loss.verdict)."""
        for uuid, why in list(self.held.items()):
            area = self.committed.get(uuid)
            if area is None:  # no longer in custom_config.json: nothing to hold
                del self.held[uuid]
                continue
            still = state_loss.verdict(area, why, remote=remote,
                                       remote_configured=remote_configured)
            if still is not None:
                if still != why:
                    log.critical("area_held_state_lost", area=uuid, detail=still.detail)
                    self.held[uuid] = still
                    self.notify()
                continue
            await self.record_lineage(lineage.default_for(area))
            await self.store.raise_generations({uuid: area.generation})
            del self.held[uuid]
            log.warning("area_released_state_lost", area=uuid, side=area.location.value,
                        generation=area.generation)
            self.notify()

    async def recheck(self) -> bool:
        """Re-read custom_config.json only if it changed on disk since it was last read
        (inode, size, mtime); False when it is (now) corrupt. Cheap enough for every request."""
        if _stamp(self.custom_config_path) != self._read_stamp:
            return await self.reload_committed()
        return self.corrupt is None

    async def usable(self) -> Mapping[str, Area]:
        """The one check of custom_config.json an operator's request makes (`recheck`): the
        committed areas by UUID, or the file's `ConfigCorrupt` (CONFIG_CORRUPT) when it
        cannot be used, so nothing is recorded and nothing stops."""
        if not await self.recheck():
            assert self.corrupt is not None
            raise spool_files.ConfigCorrupt(path=self.corrupt.path, detail=self.corrupt.reason)
        return self.committed

    async def reload_committed(self) -> bool:
        """Re-read custom_config.json; False (and `corrupt` set) when it cannot be parsed.

        A corrupt file changes nothing in memory: what runs keeps running, and placement
        changes are refused until the file is fixed (CONFIG_CORRUPT).
        """
        async with self._file_lock:
            stamp = _stamp(self.custom_config_path)
            try:
                document = await asyncio.to_thread(
                    spool_files.read_custom_config, self.custom_config_path
                )
            except spool_files.ConfigCorrupt as e:
                self.corrupt = e
                self._read_stamp = stamp
                return False
            self._read_stamp = stamp
            await self._adopt(document)
        return True

    async def _adopt(self, document: spool_files.CustomConfig) -> None:
        """Take the file's placement as committed — but never an entry some writer put back
        at an older generation than committed (rules.reverted): that is logged
        (`custom_config_reverted`), the committed location and generation are written back
        over it (the writer's other fields kept) and only then is the file taken. Caller
        holds the file lock."""
        found = [Area(uuid=e.uuid, service=e.service, location=Side(e.location),
                      generation=e.generation) for e in document.entries]
        if self._loaded:  # an entry new to this run (the UI added it): its generation is
            # taken as issued, as at a start (`load`)
            new = {a.uuid: a.generation for a in found
                   if a.uuid not in self.committed and a.uuid not in self.held}
            await self.store.raise_generations(new)
        stale = rules.reverted(self.committed, found)
        if stale:
            for was, committed in stale:
                log.error("custom_config_reverted", area=was.uuid, service=was.service,
                          location=was.location.value, generation=was.generation,
                          committed_location=committed.location.value,
                          committed_generation=committed.generation)
            try:
                document = await asyncio.to_thread(
                    spool_files.put_placements, self.custom_config_path,
                    {c.uuid: (c.location.value, c.generation) for _, c in stale})
            except (spool_files.ConfigCorrupt, KeyError) as e:
                # Not written back now (the next read tries again); never acted on either.
                log.error("custom_config_revert_not_repaired", error_code=ErrorCode.CONFIG_CORRUPT,
                          detail=str(e)[:300])
                keep = {c.uuid: c for _, c in stale}
                document = dataclasses.replace(document, entries=tuple(
                    dataclasses.replace(e, location=keep[e.uuid].location.value,
                                        generation=keep[e.uuid].generation)
                    if e.uuid in keep else e for e in document.entries))
            self._read_stamp = _stamp(self.custom_config_path)
        self._apply_committed(document)

    def _apply_committed(self, document: spool_files.CustomConfig) -> None:
        self.corrupt = None
        if document.invalid != self.quarantined:
            for entry in document.invalid:
                log.warning("area_entry_quarantined", position=entry.position,
                            error_code=entry.code, detail=entry.detail)
            self.quarantined = document.invalid
        committed = {
            e.uuid: Area(uuid=e.uuid, service=e.service, location=Side(e.location),
                         generation=e.generation)
            for e in document.entries
        }
        titles = document.titles()
        if committed != self.committed or titles != self.titles:
            self.committed = committed
            self.titles = titles
            self.notify()

    # -- reading ---------------------------------------------------------------------------

    def areas_of(self, service: str) -> list[Area]:
        return [a for a in self.committed.values() if a.service == service]

    def desired_location(self, area: Area) -> Side:
        """The operator's wish for one area: per-area, else per-service, else where it is."""
        return self.desired_area.get(
            area.uuid, self.desired_service.get(area.service, area.location)
        )

    def service_desired(self, service: str) -> Side | None:
        return self.desired_service.get(service)

    def runs(self, side: Side) -> Mapping[str, int]:
        """area -> generation of all that may run on `side` now (orchestrator.rules)."""
        return rules.desired_runs(
            side=side,
            authoritative=self.committed.values(),
            transactions=self.transactions.values(),
            lineages=self._lineages(),
        )

    def lineage(self, area: str) -> Lineage:
        """The area's data lineage (recorded, or the default for one never recorded); a
        held area's holds on no side (nothing runs or claims it)."""
        return rules.lineage_of(area, lineages=self._lineages(), committed=self.committed)

    def _lineages(self) -> Mapping[str, Lineage]:
        if not self.held:
            return self.lineages
        return {**self.lineages,
                **{area: Lineage(area=area, holders=frozenset()) for area in self.held}}

    def parked_services(self) -> set[str]:
        return {t.service for t in self.transactions.values() if t.phase is Phase.PARKED}

    def active(self) -> Iterable[Transaction]:
        return self.transactions.values()

    # -- changing --------------------------------------------------------------------------

    async def save(self, txn: Transaction) -> None:
        """Persist a transaction record, then update the cache and tell the listeners."""
        await self.store.put_transaction(txn.to_storage())
        if txn.is_active:
            self.transactions[txn.area] = txn
        else:
            self.transactions.pop(txn.area, None)
            self.last_finished[txn.area] = txn
        self.notify()

    async def abandon_remote(self, area: str, *, generations: Iterable[int],
                             warm_whole: bool = False) -> Lineage:
        """The VPS's copy of `area` is given up: `generations` on the VPS are to be set aside
        when it answers again, and the PBX holds the newest data from now on (a new epoch) —
        both durable before anything acts on them. A warm copy of the copy given up, its
        files found whole (`warm_whole`), is chosen for the new epoch first
        (orchestrator/warm_copy.py): the move home starts from it. Returns the lineage it
        replaced."""
        current = self.lineage(area)
        generations = frozenset(generations)
        copy = self.warm.get(area)
        if copy is not None and warm_whole and warm_copy.usable_at_give_up(
                copy, current, generations=generations):
            await self.record_warm_copy(warm_copy.chosen(copy, current))
        elif copy is not None and copy.restore_epoch is not None:
            # (a choice an earlier try left, cut before its give-up was recorded: not now)
            await self.record_warm_copy(dataclasses.replace(copy, restore_epoch=None))
        now = time.time()
        rows = dict(self.abandoned)
        for generation in generations:
            rows.setdefault((area, generation), {
                "area": area, "generation": generation, "abandoned_at": now,
                "set_aside_path": None, "set_aside_at": None})
        # First what is set aside, then the lineage that gives it up (abandoned_copies.py).
        await asyncio.to_thread(abandoned_copies.save, self._abandoned_path, rows)
        self.abandoned = rows
        await self.record_lineage(lineage.discarded(current, keep=Side.LOCAL))
        return current

    def is_abandoned(self, area: str, generation: int) -> bool:
        """A VPS copy at `generation` was given up (or an older one of a given-up area)."""
        return any(a == area and generation <= g for a, g in self.abandoned)

    async def record_set_aside(self, *, area: str, generation: int, path: str) -> None:
        now = time.time()
        rows = dict(self.abandoned)
        row = dict(rows.get((area, generation)) or {
            "area": area, "generation": generation, "abandoned_at": now})
        rows[(area, generation)] = {**row, "set_aside_path": path, "set_aside_at": now}
        await asyncio.to_thread(abandoned_copies.save, self._abandoned_path, rows)
        self.abandoned = rows
        self.notify()

    async def forget_abandoned(self, *, area: str, generation: int) -> None:
        """A set-aside copy was removed from the VPS: its record goes (the agent's entry of
        that generation went when it was set aside, so nothing is left to fence)."""
        rows = dict(self.abandoned)
        if rows.pop((area, generation), None) is None:
            return
        await asyncio.to_thread(abandoned_copies.save, self._abandoned_path, rows)
        self.abandoned = rows
        self.notify()

    async def reread(self, area: str) -> Transaction | None:
        """The area's active record as stored: a write cut short (its task cancelled while the
        store wrote) may have reached the disk but not this cache."""
        cached = self.transactions.get(area)
        if cached is None:
            return None
        row = await self.store.get_transaction(cached.transaction_id)
        stored = Transaction.from_storage(row) if row else cached
        if stored != cached:
            if stored.is_active:
                self.transactions[area] = stored
            else:
                self.transactions.pop(area, None)
                self.last_finished[area] = stored
            self.notify()
        return self.transactions.get(area)

    async def record_warm_copy(self, copy: WarmCopy) -> None:
        """Persist an area's newest warm copy (its dir already in place), then tell."""
        await self.store.put_warm_copy(copy.to_storage())
        self.warm[copy.area] = copy
        self.notify()

    async def forget_warm_copy(self, area: str) -> None:
        if self.warm.pop(area, None) is not None:
            await self.store.forget_warm_copy(area)
            self.notify()

    async def record_lineage(self, updated: Lineage) -> None:
        """Persist a new lineage before anything acts on it, then tell the listeners."""
        if self.lineages.get(updated.area) == updated:
            return
        await self.store.put_lineage(updated.to_storage(), now=time.time())
        self.lineages[updated.area] = updated
        self.notify()

    async def claim_data(self, area: str, side: Side) -> None:
        """`side` takes the area's data over: recorded durably BEFORE any process starts there.

        Raises DATA_NOT_NEWEST when the side does not hold the newest data (copy first)."""
        current = self.lineage(area)
        if not lineage.may_claim(current, side):
            raise error_for(
                ErrorCode.DATA_NOT_NEWEST,
                f"{area}: the newest data is on {', '.join(sorted(current.holders)) or 'no side'}"
                f", not {side.value}; it must be copied there before the area starts",
            )
        await self.record_lineage(lineage.claimed(current, side))

    async def commit(self, *, area: str, location: Side, generation: int) -> None:
        """The commit point of a migration: custom_config.json, atomically."""
        async with self._file_lock:
            try:
                document = await asyncio.to_thread(
                    spool_files.update_area_placement,
                    self.custom_config_path,
                    uuid=area,
                    location=location.value,
                    generation=generation,
                )
            except spool_files.ConfigCorrupt as e:
                self.corrupt = e
                raise error_for(ErrorCode.CONFIG_CORRUPT, e.detail) from e
            except KeyError as e:
                raise error_for(
                    ErrorCode.UNKNOWN_AREA, f"area {area} is no longer in custom_config.json"
                ) from e
            self._read_stamp = _stamp(self.custom_config_path)
            await self._adopt(document)

    async def record_desired(self, *, service: str, area: str | None, location: Side) -> None:
        await self.store.set_desired_placement(
            service=service, area=area, location=location.value, now=time.time()
        )
        self._apply_desired(service, area, location)
        self.notify()

    def _apply_desired(self, service: str, area: str | None, location: Side) -> None:
        if area is None:
            self.desired_service[service] = location
            # A service-wide wish replaces earlier per-area ones of that service.
            for uuid in [u for u in self.desired_area if self._service_of(u) == service]:
                del self.desired_area[uuid]
        else:
            self.desired_area[area] = location

    def _service_of(self, uuid: str) -> str | None:
        area = self.committed.get(uuid)
        return area.service if area else None

    def add_listener(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def notify(self) -> None:
        self.changed.set()
        for listener in self._listeners:
            listener()


def _stamp(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns

"""The VPS copies an operator gave up, after they were set aside: kept, fetched, removed.

A given-up copy is moved aside on the VPS when the VPS answers again (RemoteSide._delete,
the agent's `DELETE /v1/areas/{area}?aside=1`) and recorded in `abandoned_copies.json`
(PlacementState.abandoned). From then on:

- it is kept `[monitord] abandoned_data_keep_s` (default 7 days) from the moment it was set
  aside, then removed by the cleanup worker's pass (`expire`): the agent's
  `DELETE /v1/abandoned/{name}`, then the record is dropped and a `set_aside_removed` event
  stored. A copy being fetched is not removed; a VPS that does not answer is asked again at
  the next pass;
- an operator can fetch it to the PBX for forensics (`monitord fetch-abandoned`,
  `POST /v1/abandoned/{area}/fetch`): a verified download, as a move home makes, into
  `{work_dir}/abandoned/{name}`, which monitord never starts and never removes. The fetch
  runs in the background (a child of the cleanup worker's root task); its state and bytes
  so far are in the status row of that copy.

A record whose copy was never set aside (the VPS has not answered since) is never removed
here: it is what tells the next delete on the VPS to set that copy aside.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

from monitord.base import logs
from monitord.base.task_owner import TaskOwner
from monitord.engine.placement_state import PlacementState
from monitord.engine.remote_side import RemoteSide
from monitord.store import abandoned_copies
from monitord.store.state_db import Store
from orchestrator.errors import ErrorCode, MonitordError, error_for

log = logs.get_logger(__name__)

Key = tuple[str, int]  # (area, generation)


class AbandonedData:
    def __init__(
        self,
        *,
        state: PlacementState,
        store: Store,
        remote: RemoteSide,
        keep_s: float,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.state = state
        self.store = store
        self.remote = remote
        self.keep_s = keep_s
        self._wall = wall
        self.fetch_dir = store.path.parent / "abandoned"
        self._fetches: dict[Key, dict[str, Any]] = {}
        self._tasks = TaskOwner("abandoned data: fetches")
        self.version = 0  # for the status key: a fetch started, progressed or ended

    # -- removal -----------------------------------------------------------------------------

    def due(self) -> list[abandoned_copies.Row]:
        """The set-aside copies whose keep time has passed and which are not being fetched."""
        now = self._wall()
        return [
            row for key, row in sorted(self.state.abandoned.items())
            if row.get("set_aside_path") and isinstance(row.get("set_aside_at"), (int, float))
            and now >= row["set_aside_at"] + self.keep_s and not self._fetching(key)
        ]

    async def expire(self) -> int:
        """Remove every due copy the VPS answers for; how many were removed. A failure is
        logged and left for the next pass (the record stays, so does the copy)."""
        if not self.remote.reachable():
            return 0
        removed = 0
        for row in self.due():
            area, generation, path = row["area"], row["generation"], row["set_aside_path"]
            try:
                result = await self.remote.remove_set_aside(path)
            except MonitordError as e:
                log.warning("set_aside_remove_failed", area=area, generation=generation,
                            path=path, error_code=e.code, detail=e.detail)
                continue
            await self.state.forget_abandoned(area=area, generation=generation)
            fields = {"area": area, "generation": generation, "path": path, "result": result,
                      "kept_s": round(self._wall() - row["set_aside_at"])}
            await self.store.record_event("set_aside_removed", fields)
            log.info("set_aside_removed", **fields)
            removed += 1
        return removed

    # -- forensic fetch ----------------------------------------------------------------------

    def start_fetch(self, area: str, generation: int | None) -> dict[str, Any]:
        """Start fetching the set-aside copy of `area` (its newest given-up generation unless
        one is named) to the PBX; what is fetched where. NOT_FOUND without such a copy,
        TRANSACTION_CONFLICT while it is being fetched, SSH_UNREACHABLE without the VPS."""
        key, row = self._set_aside(area, generation)
        if self._fetching(key):
            raise error_for(ErrorCode.TRANSACTION_CONFLICT,
                            f"the copy of {area} at generation {key[1]} is being fetched")
        if not self.remote.reachable():
            raise error_for(ErrorCode.SSH_UNREACHABLE,
                            "the VPS is not reachable now: its copy cannot be fetched")
        path = str(row["set_aside_path"])
        local_dir = self.fetch_dir / PurePosixPath(path).name
        view: dict[str, Any] = {"state": "running", "to": str(local_dir), "bytes": 0,
                                "started_at": self._wall()}
        self._fetches[key] = view
        self._tasks.spawn(f"fetch {area} g{key[1]}", self._fetch(key, path, local_dir, view))
        self._changed()
        return {"area": area, "generation": key[1], "from": path, "to": str(local_dir)}

    async def _fetch(self, key: Key, path: str, local_dir: Path, view: dict[str, Any]) -> None:
        def progress(done: int, _total: int) -> None:
            view["bytes"] = done
            self.version += 1

        try:
            await asyncio.to_thread(self.fetch_dir.mkdir, mode=0o700, exist_ok=True)
            report = await self.remote.fetch_set_aside(path=path, local_dir=local_dir,
                                                       progress=progress)
        except MonitordError as e:
            view.update(state="failed", error={"code": str(e.code), "detail": e.detail})
            log.warning("set_aside_fetch_failed", area=key[0], generation=key[1], path=path,
                        error_code=e.code, detail=e.detail)
        except OSError as e:  # the PBX's side of the download (its fetch dir)
            view.update(state="failed", error={"code": str(ErrorCode.COPY_INCOMPLETE),
                                               "detail": f"{local_dir}: {e.strerror or e}"})
        else:
            view.update(state="done", files=report.files, bytes=report.bytes)
            fields = {"area": key[0], "generation": key[1], "from": path,
                      "to": str(local_dir), "files": report.files, "bytes": report.bytes}
            await self.store.record_event("set_aside_fetched", fields)
            log.info("set_aside_fetched", **fields)
        finally:
            if view["state"] == "running":  # cancelled, or a bug the task owner reports
                view.update(state="failed", error={"code": str(ErrorCode.INTERNAL),
                                                   "detail": "the fetch ended unfinished"})
            view["ended_at"] = self._wall()
            self._changed()

    def _set_aside(self, area: str, generation: int | None) -> tuple[Key, abandoned_copies.Row]:
        rows = {key: row for key, row in self.state.abandoned.items()
                if key[0] == area and row.get("set_aside_path")
                and (generation is None or key[1] == generation)}
        if not rows:
            which = "" if generation is None else f" at generation {generation}"
            raise error_for(ErrorCode.NOT_FOUND,
                            f"no copy of {area}{which} given up and set aside on the VPS")
        key = max(rows)
        return key, rows[key]

    def _fetching(self, key: Key) -> bool:
        view = self._fetches.get(key)
        return view is not None and view["state"] == "running"

    def _changed(self) -> None:
        self.version += 1
        self.state.notify()

    # -- status and shutdown -----------------------------------------------------------------

    def rows(self) -> list[dict[str, Any]]:
        """The status document's `abandoned_data`: each record, when its copy will be removed
        (once set aside) and its fetch, if one was asked for."""
        shown = []
        for key, row in sorted(self.state.abandoned.items()):
            view = dict(row)
            at = row.get("set_aside_at")
            view["remove_after"] = at + self.keep_s if isinstance(at, (int, float)) else None
            if key in self._fetches:
                view["fetch"] = dict(self._fetches[key])
            shown.append(view)
        return shown

    async def close(self) -> None:
        await self._tasks.close()

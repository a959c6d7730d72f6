"""monitord's own durable state: one SQLite database `state.db` in work_dir.

Holds migration transactions, the highest generation issued per area (never reused), the
cleanup queue, a capped ring of recent events, the operator's desired placement, the data
lineage per area and the downtime of each transaction's area.

Durability: WAL journal with `synchronous=FULL`, so a write whose coroutine has returned is on
disk and survives `kill -9` or power loss. Every statement runs on ONE dedicated thread that
owns the connection (a single-worker executor): the event loop never blocks on SQLite and there
is exactly one writer, so no write ever waits on another connection's lock.

Records cross this boundary as plain dicts keyed by the contract field names; the
orchestrator's models convert with `to_storage()` / `from_storage()`. Fields of a transaction
beyond the contract columns are kept in a JSON column and returned as they were given. An
error's detail UTF-8 cannot encode (a lone surrogate) is stored with U+FFFD in its place
rather than failing the write (monitord.base.outside_text.encodable); any other value that
does not encode is a StoreError, and nothing of that write is done.

Cost: taking due cleanup items walks the `next_attempt_at` index and finishing one is a primary
key delete, both O(log n); enqueue is idempotent through a unique index on
(service, area, side, generation, action). Schema changes are forward migrations numbered in
`MIGRATIONS`, applied once at open and recorded in `schema_version`.

Callers: monitord.surface.daemon (opens/closes it), the HTTP API, the migration engine, the cleanup
worker, the status and bundle code.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from monitord.base import outside_text
from monitord.store import owner_id
from orchestrator.errors import ErrorCode, PermanentError, TransientError
from orchestrator.models import MAX_GENERATION

DB_NAME = "state.db"
DEFAULT_EVENTS_CAP = 1000
DEFAULT_CLAIM_S = 60.0
FINAL_PHASES = ("DONE", "ROLLED_BACK")
_OPTIONAL_TX = ("last_error_code", "last_error_detail", "cleanup_required")

T = TypeVar("T")

TRANSACTION_COLUMNS = (
    "transaction_id",
    "service",
    "area",
    "source",
    "destination",
    "phase",
    "attempt",
    "generation",
    "started_at",
    "updated_at",
    "last_error_code",
    "last_error_detail",
    "cleanup_required",
)
CLEANUP_COLUMNS = (
    "id",
    "service",
    "area",
    "side",
    "generation",
    "action",
    "attempts",
    "next_attempt_at",
    "last_error",
    "created_at",
)

WARM_COPY_COLUMNS = ("area", "service", "generation", "epoch", "taken_at", "received_at",
                     "files", "bytes", "sent_bytes", "digest", "restore_epoch")
DOWNTIME_COLUMNS = (
    "transaction_id",
    "service",
    "area",
    "direction",
    "move_id",
    "stopped_at",
    "healthy_at",
    "healthy_side",
    "downtime_s",
    "outcome",
    "finished_at",
)

# Forward-only schema migrations: entry i (a tuple of statements, applied in one transaction)
# brings the schema from version i to i + 1. Never edit a released entry; append a new one.
MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        """
        CREATE TABLE transactions (
            transaction_id TEXT PRIMARY KEY,
            service TEXT NOT NULL,
            area TEXT NOT NULL,
            source TEXT NOT NULL,
            destination TEXT NOT NULL,
            phase TEXT NOT NULL,
            attempt INTEGER NOT NULL,
            generation INTEGER NOT NULL,
            started_at REAL NOT NULL,
            updated_at REAL NOT NULL,
            last_error_code TEXT,
            last_error_detail TEXT,
            cleanup_required INTEGER NOT NULL DEFAULT 0,
            extra TEXT NOT NULL DEFAULT '{}'
        )
        """,
        "CREATE INDEX transactions_by_area ON transactions (area)",
        "CREATE INDEX transactions_by_service ON transactions (service)",
        """
        CREATE TABLE generations (
            area TEXT PRIMARY KEY,
            highest_issued INTEGER NOT NULL
        )
        """,
        """
        CREATE TABLE cleanup_items (
            id TEXT PRIMARY KEY,
            service TEXT NOT NULL,
            area TEXT NOT NULL,
            side TEXT NOT NULL,
            generation INTEGER NOT NULL,
            action TEXT NOT NULL,
            attempts INTEGER NOT NULL DEFAULT 0,
            next_attempt_at REAL NOT NULL,
            last_error TEXT,
            created_at REAL NOT NULL,
            UNIQUE (service, area, side, generation, action)
        )
        """,
        "CREATE INDEX cleanup_items_due ON cleanup_items (next_attempt_at)",
        """
        CREATE TABLE events (
            seq INTEGER PRIMARY KEY AUTOINCREMENT,
            at REAL NOT NULL,
            event TEXT NOT NULL,
            fields TEXT NOT NULL
        )
        """,
        """
        CREATE TABLE desired_placement (
            service TEXT NOT NULL,
            area TEXT,
            location TEXT NOT NULL,
            updated_at REAL NOT NULL
        )
        """,
        "CREATE UNIQUE INDEX desired_placement_key "
        "ON desired_placement (service, IFNULL(area, ''))",
    ),
    # v2: the cleanup backlog as a counter kept by triggers, so reading it is O(1).
    (
        "CREATE TABLE counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL)",
        "INSERT INTO counters (name, value) SELECT 'cleanup_items', COUNT(*) FROM cleanup_items",
        """
        CREATE TRIGGER cleanup_items_counted_in AFTER INSERT ON cleanup_items BEGIN
            UPDATE counters SET value = value + 1 WHERE name = 'cleanup_items';
        END
        """,
        """
        CREATE TRIGGER cleanup_items_counted_out AFTER DELETE ON cleanup_items BEGIN
            UPDATE counters SET value = value - 1 WHERE name = 'cleanup_items';
        END
        """,
    ),
    # v3: data lineage per area (orchestrator/lineage.py): which sides hold the newest data.
    (
        """
        CREATE TABLE lineage (
            area TEXT PRIMARY KEY,
            holders TEXT NOT NULL,
            epoch INTEGER NOT NULL,
            updated_at REAL NOT NULL
        )
        """,
    ),
    # v4: per-area downtime of every transaction (source stopped -> a side healthy again),
    # in a table of its own: the transaction rows and what older versions read stay as they
    # were. `move_id` groups the transactions one placement request (or tick) opened.
    (
        """
        CREATE TABLE area_downtime (
            transaction_id TEXT PRIMARY KEY,
            service TEXT NOT NULL,
            area TEXT NOT NULL,
            direction TEXT NOT NULL,
            move_id TEXT NOT NULL,
            stopped_at REAL,
            healthy_at REAL,
            healthy_side TEXT,
            downtime_s REAL,
            outcome TEXT,
            finished_at REAL
        )
        """,
        "CREATE INDEX area_downtime_by_move ON area_downtime (move_id)",
        "CREATE INDEX area_downtime_by_end ON area_downtime (service, finished_at)",
    ),
)


# Tables a release adds that the release before it never reads: created at every open (IF NOT
# EXISTS) instead of by a migration, so that the schema version stays and a rollback to the
# previous release still opens state.db (it refuses a newer version). The newest warm copy of
# each remote area (orchestrator/warm_copy.py), one row an area: the copy itself is a dir
# under work_dir/warm, swapped in whole.
ADDITIVE_TABLES = (
    """
    CREATE TABLE IF NOT EXISTS warm_copies (
        area TEXT PRIMARY KEY,
        service TEXT NOT NULL,
        generation INTEGER NOT NULL,
        epoch INTEGER NOT NULL,
        taken_at REAL NOT NULL,
        received_at REAL NOT NULL,
        files INTEGER NOT NULL,
        bytes INTEGER NOT NULL,
        sent_bytes INTEGER NOT NULL,
        digest TEXT NOT NULL,
        restore_epoch INTEGER
    )
    """,
)

class StoreError(TransientError):
    """A store operation failed; the write did not happen (code STORE_WRITE_FAILED)."""

    def __init__(self, detail: str) -> None:
        super().__init__(ErrorCode.STORE_WRITE_FAILED, detail)


class StoreClosed(StoreError):
    """The store was used after `close()`."""


def _connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=True)
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("PRAGMA foreign_keys=ON")
    conn.execute("PRAGMA busy_timeout=5000")
    # Keep the hot B-tree pages of a large cleanup queue in memory (16 MiB; default is 2 MiB).
    conn.execute("PRAGMA cache_size=-16384")
    return conn


def _migrate(conn: sqlite3.Connection, *, target: int = len(MIGRATIONS)) -> int:
    conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
    row = conn.execute("SELECT version FROM schema_version").fetchone()
    current = row[0] if row else 0
    if current > len(MIGRATIONS):
        raise StoreError(
            f"state.db schema version {current} is newer than this monitord "
            f"({len(MIGRATIONS)}); refusing to downgrade"
        )
    for version in range(current, target):
        conn.execute("BEGIN IMMEDIATE")
        try:
            for statement in MIGRATIONS[version]:
                conn.execute(statement)
            conn.execute("DELETE FROM schema_version")
            conn.execute("INSERT INTO schema_version (version) VALUES (?)", (version + 1,))
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
    return max(current, target)


class _Tx:
    """`with _Tx(conn):` one IMMEDIATE transaction, committed on success, rolled back on error."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def __enter__(self) -> sqlite3.Connection:
        self._conn.execute("BEGIN IMMEDIATE")
        return self._conn

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self._conn.execute("COMMIT")
        else:
            self._conn.execute("ROLLBACK")


def _transaction_row(record: Mapping[str, Any]) -> dict[str, Any]:
    missing = [c for c in TRANSACTION_COLUMNS if c not in record and c not in _OPTIONAL_TX]
    if missing:
        raise ValueError(f"transaction record lacks {', '.join(missing)}")
    row = {c: record.get(c) for c in TRANSACTION_COLUMNS}
    row["cleanup_required"] = int(bool(row["cleanup_required"]))
    # A detail may quote the VPS: what UTF-8 cannot encode is kept as U+FFFD, so the record
    # of a failed step is written whole (a write that raised would leave the step to be
    # redone for ever, never failed). `extra` is JSON with ASCII escapes: kept exactly.
    if isinstance(row["last_error_detail"], str):
        row["last_error_detail"] = outside_text.encodable(row["last_error_detail"])
    row["extra"] = json.dumps({k: v for k, v in record.items() if k not in TRANSACTION_COLUMNS})
    return row


def _transaction_from_row(row: sqlite3.Row) -> dict[str, Any]:
    record = {c: row[c] for c in TRANSACTION_COLUMNS}
    record["cleanup_required"] = bool(record["cleanup_required"])
    record.update(json.loads(row["extra"]))
    return record


def _cleanup_from_row(row: sqlite3.Row) -> dict[str, Any]:
    return {c: row[c] for c in CLEANUP_COLUMNS}


def read_only_sections(path: Path, *, transactions: int = 5000, cleanup: int = 100_000,
                       events: int = 1000) -> dict[str, Any]:
    """The bundle's state.db sections (`transactions.json`, `cleanup.json`, `events.json`,
    `lineage.json`), read with the database opened read-only (`mode=ro`): nothing is written,
    migrated or checkpointed, so it is safe whether or not a monitord runs on it
    (`monitord bundle --offline`). Without a `-wal` file beside it (monitord stopped cleanly)
    it is opened `immutable` too, so that not even the empty `-wal` and `-shm` files a WAL
    reader needs are created (as whoever runs the bundle, in monitord's work_dir); with one,
    SQLite reads the committed writes that are still in it. StoreError when it cannot be
    opened or read."""
    wal = path.with_name(path.name + "-wal")
    mode = "mode=ro" if wal.exists() else "mode=ro&immutable=1"
    if not path.exists():
        raise StoreError(f"{path} does not exist")
    try:
        conn = sqlite3.connect(f"{path.resolve().as_uri()}?{mode}", uri=True,
                               isolation_level=None)
    except sqlite3.Error as e:
        raise StoreError(f"cannot open {path} read-only: {e}") from e
    try:
        conn.row_factory = sqlite3.Row
        conn.execute("PRAGMA busy_timeout=5000")
        return {
            "transactions.json": [_transaction_from_row(r) for r in conn.execute(
                "SELECT * FROM transactions ORDER BY updated_at DESC LIMIT ?", (transactions,))],
            "cleanup.json": [_cleanup_from_row(r) for r in conn.execute(
                "SELECT * FROM cleanup_items ORDER BY next_attempt_at LIMIT ?", (cleanup,))],
            "events.json": list(reversed([
                {"at": r["at"], "event": r["event"], **json.loads(r["fields"])}
                for r in conn.execute(
                    "SELECT at, event, fields FROM events ORDER BY seq DESC LIMIT ?", (events,))
            ])),
            "lineage.json": [
                {"area": r["area"], "holders": json.loads(r["holders"]), "epoch": r["epoch"]}
                for r in conn.execute("SELECT area, holders, epoch FROM lineage ORDER BY area")
            ],
        }
    except (sqlite3.Error, ValueError) as e:
        raise StoreError(f"cannot read {path}: {e}") from e
    finally:
        conn.close()


class Store:
    """The async face of `state.db`; open with `await Store.open(work_dir)`."""

    def __init__(self, *, path: Path, executor: ThreadPoolExecutor, events_cap: int) -> None:
        self.path = path
        self._executor: ThreadPoolExecutor | None = executor
        self._events_cap = events_cap
        self._conn: sqlite3.Connection | None = None  # touched only on the executor thread
        self.created = False  # (both set by open)
        self.state_lost = False

    # --- lifecycle ------------------------------------------------------------------------

    @classmethod
    async def open(cls, work_dir: Path, *, events_cap: int = DEFAULT_EVENTS_CAP) -> Store:
        """Open (creating and migrating if needed) `{work_dir}/state.db`."""
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="monitord-store")
        store = cls(path=work_dir / DB_NAME, executor=executor, events_cap=events_cap)
        try:
            await store._run(store._open_on_thread)
        except BaseException:
            executor.shutdown(wait=True)
            raise
        return store

    def _open_on_thread(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Made now although monitord ran in this work_dir before (its owner id, written at
        # the first start, is there): what it held is lost (orchestrator/state_loss.py).
        self.created = not self.path.exists()
        self.state_lost = self.created and (self.path.parent / owner_id.OWNER_ID_FILE).exists()
        conn = _connect(self.path)
        try:
            _migrate(conn)
            for statement in ADDITIVE_TABLES:
                conn.execute(statement)
        except BaseException:
            conn.close()
            raise
        self._conn = conn

    async def close(self) -> None:
        """Close the connection and stop the writer thread (waits for queued work)."""
        executor, self._executor = self._executor, None
        if executor is None:
            return
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(executor, self._close_on_thread)
        finally:
            executor.shutdown(wait=True)

    def _close_on_thread(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    async def __aenter__(self) -> Store:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def _run(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the writer thread; sqlite errors become StoreError, and so does a
        value sqlite3 cannot encode as UTF-8 (the statement's transaction rolled back, so
        nothing of it is written)."""
        executor = self._executor
        if executor is None:
            raise StoreClosed(f"{self.path}: store is closed")
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(executor, fn)
        except (sqlite3.Error, UnicodeError) as e:
            raise StoreError(f"{self.path}: {e}") from e

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            raise StoreClosed(f"{self.path}: store is closed")
        return self._conn

    async def schema_version(self) -> int:
        def read() -> int:
            return int(self._db().execute("SELECT version FROM schema_version").fetchone()[0])

        return await self._run(read)

    # --- transactions ---------------------------------------------------------------------

    async def put_transaction(self, record: Mapping[str, Any]) -> None:
        """Insert or replace a transaction record (keyed by transaction_id)."""
        row = _transaction_row(record)

        def write() -> None:
            columns = ", ".join(row)
            marks = ", ".join(f":{c}" for c in row)
            with _Tx(self._db()) as db:
                db.execute(f"INSERT OR REPLACE INTO transactions ({columns}) VALUES ({marks})", row)

        await self._run(write)

    async def get_transaction(self, transaction_id: str) -> dict[str, Any] | None:
        def read() -> dict[str, Any] | None:
            row = (
                self._db()
                .execute("SELECT * FROM transactions WHERE transaction_id = ?", (transaction_id,))
                .fetchone()
            )
            return _transaction_from_row(row) if row else None

        return await self._run(read)

    async def list_transactions(
        self, *, active_only: bool = False, service: str | None = None, limit: int = 1000
    ) -> list[dict[str, Any]]:
        """Newest first; `active_only` leaves out DONE and ROLLED_BACK."""
        clauses: list[str] = []
        params: list[Any] = []
        if active_only:
            clauses.append(f"phase NOT IN ({', '.join('?' * len(FINAL_PHASES))})")
            params.extend(FINAL_PHASES)
        if service is not None:
            clauses.append("service = ?")
            params.append(service)
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""

        def read() -> list[dict[str, Any]]:
            rows = self._db().execute(
                f"SELECT * FROM transactions {where} ORDER BY updated_at DESC LIMIT ?",
                (*params, limit),
            )
            return [_transaction_from_row(r) for r in rows]

        return await self._run(read)

    # --- generations ----------------------------------------------------------------------

    async def issue_generation(self, area: str, *, floor: int = 0) -> int:
        """Durably issue max(highest issued, floor) + 1 for `area`; never returns a value twice.

        Past MAX_GENERATION (SQLite's INTEGER ends at 2^63 - 1) nothing is issued:
        PermanentError AREA_ENTRY_INVALID, the area cannot move any more."""

        def write() -> int:
            with _Tx(self._db()) as db:
                row = db.execute(
                    "SELECT highest_issued FROM generations WHERE area = ?", (area,)
                ).fetchone()
                issued = max(row[0] if row else 0, floor) + 1
                if issued > MAX_GENERATION:
                    raise PermanentError(
                        ErrorCode.AREA_ENTRY_INVALID,
                        f"area {area}: no generation after {issued - 1} fits state.db"
                        f" (2^63 - 1 is the last), so it cannot move",
                    )
                db.execute(
                    "INSERT INTO generations (area, highest_issued) VALUES (?, ?) "
                    "ON CONFLICT (area) DO UPDATE SET highest_issued = excluded.highest_issued",
                    (area, issued),
                )
            return issued

        return await self._run(write)

    async def raise_generations(self, floors: Mapping[str, int]) -> None:
        """Record each area's generation (area -> generation) as issued if it is higher than
        the highest issued: the generations custom_config.json holds that this state.db did
        not issue (a file written before monitord, an entry the UI added), taken as they are
        once, so that a later start tells a state.db older than the file
        (orchestrator/state_loss.py)."""

        def write() -> None:
            with _Tx(self._db()) as db:
                db.executemany(
                    "INSERT INTO generations (area, highest_issued) VALUES (?, ?) "
                    "ON CONFLICT (area) DO UPDATE SET highest_issued = "
                    "MAX(highest_issued, excluded.highest_issued)",
                    [(area, generation) for area, generation in floors.items()],
                )

        if floors:
            await self._run(write)

    async def highest_generations(self) -> dict[str, int]:
        """The highest generation ever issued, of every area one was issued for."""

        def read() -> dict[str, int]:
            rows = self._db().execute("SELECT area, highest_issued FROM generations")
            return {str(area): int(issued) for area, issued in rows.fetchall()}

        return await self._run(read)

    async def highest_generation(self, area: str) -> int:
        """The highest generation ever issued for `area` (0 if none)."""

        def read() -> int:
            row = (
                self._db()
                .execute("SELECT highest_issued FROM generations WHERE area = ?", (area,))
                .fetchone()
            )
            return int(row[0]) if row else 0

        return await self._run(read)

    # --- cleanup queue --------------------------------------------------------------------

    async def enqueue_cleanup(
        self,
        *,
        service: str,
        area: str,
        side: str,
        generation: int,
        action: str,
        now: float,
        item_id: str | None = None,
    ) -> dict[str, Any]:
        """Add an item due at `now`; an identical obligation already queued is returned as is."""
        new_id = item_id or uuid.uuid4().hex
        key = (service, area, side, generation, action)

        def write() -> dict[str, Any]:
            with _Tx(self._db()) as db:
                db.execute(
                    "INSERT INTO cleanup_items (id, service, area, side, generation, action, "
                    "attempts, next_attempt_at, last_error, created_at) "
                    "VALUES (?, ?, ?, ?, ?, ?, 0, ?, NULL, ?) "
                    "ON CONFLICT (service, area, side, generation, action) DO NOTHING",
                    (new_id, *key, now, now),
                )
                row = db.execute(
                    "SELECT * FROM cleanup_items WHERE service = ? AND area = ? AND side = ? "
                    "AND generation = ? AND action = ?",
                    key,
                ).fetchone()
            return _cleanup_from_row(row)

        return await self._run(write)

    async def take_due(
        self, now: float, limit: int, *, claim_for_s: float = DEFAULT_CLAIM_S
    ) -> list[dict[str, Any]]:
        """Claim up to `limit` items due at `now`, oldest due first.

        Claiming counts an attempt and moves `next_attempt_at` to `now + claim_for_s`, so a second
        call does not hand out the same item again; if the worker dies, the claim lapses and the
        item comes back. Finish with `complete()` or `reschedule()`.
        """

        def write() -> list[dict[str, Any]]:
            with _Tx(self._db()) as db:
                rows = db.execute(
                    "SELECT * FROM cleanup_items WHERE next_attempt_at <= ? "
                    "ORDER BY next_attempt_at LIMIT ?",
                    (now, limit),
                ).fetchall()
                items = []
                for row in rows:
                    item = _cleanup_from_row(row)
                    item["attempts"] += 1
                    item["next_attempt_at"] = now + claim_for_s
                    db.execute(
                        "UPDATE cleanup_items SET attempts = ?, next_attempt_at = ? WHERE id = ?",
                        (item["attempts"], item["next_attempt_at"], item["id"]),
                    )
                    items.append(item)
            return items

        return await self._run(write)

    async def complete(self, item_id: str) -> bool:
        """Remove a finished item; False if it was not there (already completed)."""

        def write() -> bool:
            with _Tx(self._db()) as db:
                return db.execute("DELETE FROM cleanup_items WHERE id = ?", (item_id,)).rowcount > 0

        return await self._run(write)

    async def reschedule(self, item_id: str, *, next_attempt_at: float, last_error: str) -> bool:
        """Record a failed attempt and when to try again; False if the item is gone."""
        last_error = outside_text.encodable(last_error)  # as a transaction's detail

        def write() -> bool:
            with _Tx(self._db()) as db:
                cursor = db.execute(
                    "UPDATE cleanup_items SET next_attempt_at = ?, last_error = ? WHERE id = ?",
                    (next_attempt_at, last_error, item_id),
                )
                return cursor.rowcount > 0

        return await self._run(write)

    async def list_cleanup(self, *, limit: int = 1000) -> list[dict[str, Any]]:
        """Queued items, soonest due first (for the API and the bundle)."""

        def read() -> list[dict[str, Any]]:
            rows = self._db().execute(
                "SELECT * FROM cleanup_items ORDER BY next_attempt_at LIMIT ?", (limit,)
            )
            return [_cleanup_from_row(r) for r in rows]

        return await self._run(read)

    async def cleanup_backlog(self) -> int:
        """How many items are queued (a trigger-kept counter: O(1), not a scan)."""

        def read() -> int:
            row = (
                self._db()
                .execute("SELECT value FROM counters WHERE name = 'cleanup_items'")
                .fetchone()
            )
            return int(row[0])

        return await self._run(read)

    # --- events ---------------------------------------------------------------------------

    async def record_event(
        self, event: str, fields: Mapping[str, Any] | None = None, *, at: float | None = None
    ) -> None:
        """Append to the recent-events ring; the oldest beyond the cap are dropped."""
        when = time.time() if at is None else at
        payload = json.dumps(dict(fields or {}), default=str)

        def write() -> None:
            with _Tx(self._db()) as db:
                seq = db.execute(
                    "INSERT INTO events (at, event, fields) VALUES (?, ?, ?)",
                    (when, event, payload),
                ).lastrowid or 0
                db.execute("DELETE FROM events WHERE seq <= ?", (seq - self._events_cap,))

        await self._run(write)

    async def recent_events(self, *, limit: int = 100) -> list[dict[str, Any]]:
        """Newest last, as `{"at", "event", **fields}`."""

        def read() -> list[dict[str, Any]]:
            rows = self._db().execute(
                "SELECT at, event, fields FROM events ORDER BY seq DESC LIMIT ?", (limit,)
            )
            return [{"at": r["at"], "event": r["event"], **json.loads(r["fields"])} for r in rows]

        return list(reversed(await self._run(read)))

    # --- data lineage ---------------------------------------------------------------------

    async def put_lineage(self, record: Mapping[str, Any], *, now: float) -> None:
        """Durably record an area's lineage (`Lineage.to_storage()`); returns once on disk."""

        def write() -> None:
            with _Tx(self._db()) as db:
                db.execute(
                    "INSERT INTO lineage (area, holders, epoch, updated_at) VALUES (?, ?, ?, ?)"
                    " ON CONFLICT (area) DO UPDATE SET holders = excluded.holders,"
                    " epoch = excluded.epoch, updated_at = excluded.updated_at",
                    (record["area"], json.dumps(list(record["holders"])), int(record["epoch"]),
                     now),
                )

        await self._run(write)

    async def lineages(self) -> list[dict[str, Any]]:
        """Every recorded lineage, as `Lineage.from_storage()` takes it."""

        def read() -> list[dict[str, Any]]:
            rows = self._db().execute("SELECT area, holders, epoch FROM lineage ORDER BY area")
            return [
                {"area": r["area"], "holders": json.loads(r["holders"]), "epoch": r["epoch"]}
                for r in rows
            ]

        return await self._run(read)

    # --- warm copies ----------------------------------------------------------------------

    async def put_warm_copy(self, record: Mapping[str, Any]) -> None:
        """Record an area's newest warm copy (`WarmCopy.to_storage()`), replacing the last."""
        row = {c: record[c] for c in WARM_COPY_COLUMNS}

        def write() -> None:
            with _Tx(self._db()) as db:
                db.execute(
                    f"INSERT OR REPLACE INTO warm_copies ({', '.join(row)})"
                    f" VALUES ({', '.join(f':{c}' for c in row)})", row,
                )

        await self._run(write)

    async def forget_warm_copy(self, area: str) -> None:
        def write() -> None:
            with _Tx(self._db()) as db:
                db.execute("DELETE FROM warm_copies WHERE area = ?", (area,))

        await self._run(write)

    async def warm_copies(self) -> list[dict[str, Any]]:
        """Every recorded warm copy, as `WarmCopy.from_storage()` takes it."""

        def read() -> list[dict[str, Any]]:
            return [dict(r) for r in self._db().execute(
                "SELECT * FROM warm_copies ORDER BY area")]

        return await self._run(read)

    # --- per-area downtime ----------------------------------------------------------------

    async def put_downtime(self, record: Mapping[str, Any]) -> None:
        """Insert or replace one transaction's downtime record (keyed by transaction_id)."""
        row = {c: record.get(c) for c in DOWNTIME_COLUMNS}

        def write() -> None:
            columns = ", ".join(row)
            marks = ", ".join(f":{c}" for c in row)
            with _Tx(self._db()) as db:
                db.execute(
                    f"INSERT OR REPLACE INTO area_downtime ({columns}) VALUES ({marks})", row
                )

        await self._run(write)

    async def downtimes(self, transaction_ids: list[str]) -> list[dict[str, Any]]:
        """The downtime records of these transactions (those that have one)."""

        def read() -> list[dict[str, Any]]:
            found: list[dict[str, Any]] = []
            for start in range(0, len(transaction_ids), 500):  # SQLite's parameter limit
                chunk = transaction_ids[start:start + 500]
                rows = self._db().execute(
                    "SELECT * FROM area_downtime WHERE transaction_id IN"
                    f" ({', '.join('?' * len(chunk))})",
                    chunk,
                )
                found.extend(dict(r) for r in rows)
            return found

        return await self._run(read)

    async def move_downtimes(self, move_id: str) -> list[dict[str, Any]]:
        """The records of one move's transactions that have ended (an index look-up)."""

        def read() -> list[dict[str, Any]]:
            rows = self._db().execute(
                "SELECT * FROM area_downtime WHERE move_id = ? AND finished_at IS NOT NULL"
                " ORDER BY finished_at",
                (move_id,),
            )
            return [dict(r) for r in rows]

        return await self._run(read)

    async def downtimes_since(self, since: float, *, limit: int = 20_000
                              ) -> list[dict[str, Any]]:
        """The ended records whose transaction ended at or after `since`, at most `limit`
        of the newest."""

        def read() -> list[dict[str, Any]]:
            rows = self._db().execute(
                "SELECT * FROM area_downtime WHERE finished_at >= ?"
                " ORDER BY finished_at DESC LIMIT ?",
                (since, limit),
            )
            return [dict(r) for r in rows]

        return await self._run(read)

    async def last_moves(self) -> dict[str, list[dict[str, Any]]]:
        """Per service, the ended records of the move whose transaction ended last."""

        def read() -> dict[str, list[dict[str, Any]]]:
            db = self._db()
            services = [r[0] for r in db.execute("SELECT DISTINCT service FROM area_downtime")]
            moves: dict[str, list[dict[str, Any]]] = {}
            for service in services:
                latest = db.execute(
                    "SELECT move_id FROM area_downtime WHERE service = ?"
                    " AND finished_at IS NOT NULL ORDER BY finished_at DESC LIMIT 1",
                    (service,),
                ).fetchone()
                if latest is None:
                    continue
                rows = db.execute(
                    "SELECT * FROM area_downtime WHERE move_id = ? AND finished_at IS NOT NULL"
                    " ORDER BY finished_at",
                    (latest[0],),
                )
                moves[service] = [dict(r) for r in rows]
            return moves

        return await self._run(read)

    # --- desired placement ----------------------------------------------------------------

    async def set_desired_placement(
        self, *, service: str, area: str | None, location: str, now: float
    ) -> None:
        """Record what the operator asked for (per service, or per area when `area` is set)."""

        def write() -> None:
            with _Tx(self._db()) as db:
                db.execute(
                    "DELETE FROM desired_placement WHERE service = ? AND IFNULL(area, '') = ?",
                    (service, area or ""),
                )
                db.execute(
                    "INSERT INTO desired_placement (service, area, location, updated_at) "
                    "VALUES (?, ?, ?, ?)",
                    (service, area, location, now),
                )

        await self._run(write)

    async def desired_placements(self) -> list[dict[str, Any]]:
        """Every recorded wish: service-wide rows (area None) and per-area overrides."""

        def read() -> list[dict[str, Any]]:
            rows = self._db().execute(
                "SELECT service, area, location, updated_at FROM desired_placement "
                "ORDER BY service, IFNULL(area, '')"
            )
            return [dict(r) for r in rows]

        return await self._run(read)


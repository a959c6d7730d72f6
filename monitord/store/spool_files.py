"""Crash-safe files in the spool: `custom_config.json` and `remote_state.json`.

Every write goes through `monitord.base.atomic_file.atomic_write_bytes`.

`custom_config.json` is the authoritative placement. It is read into a `CustomConfig`: typed
`AreaEntry` values (uuid, service, location, generation) plus the raw entry dicts, so that a
write keeps unknown fields and entry order exactly as found — numbers too: one a Python int
or float would not write back as the same text (5000 digits, 1e400, 1.10) is read as its
text (bounded_json.NumberText) and written back as it was. A malformed or truncated file
raises `ConfigCorrupt` (code CONFIG_CORRUPT, with the parse position) and is never overwritten:
every update re-reads and re-validates the file first. So does one that is not a regular file,
is larger than 16 MiB, nests deeper than 64 levels or holds NaN/Infinity (not JSON;
monitord.base.bounded_json): nothing but ConfigCorrupt leaves the loader. An entry whose
generation is not an integer in [0, 2^63) — a 5000-digit one included — is quarantined on
its own.

`remote_state.json` is the per-service compatibility projection the PHP UI reads; it is never a
source of truth, so reading it is lenient about missing keys but not about broken JSON.

Callers: monitord.engine.placement_state (load, and the COMMIT_LOCATION write),
monitord.surface.http_api (area lookup), monitord.store.remote_state (the projection and the
legacy-state import), monitord.engine.operator_facade (the projection's rows).
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import math
import os
import stat
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

from monitord.base import bounded_json, outside_text
from monitord.base.atomic_file import atomic_write_bytes
from orchestrator import models, names
from orchestrator.errors import ErrorCode, PermanentError

CUSTOM_CONFIG_NAME = "custom_config.json"
REMOTE_STATE_NAME = "remote_state.json"
LOCATIONS = ("local", "remote")
# Thousands of areas take a few hundred KiB; anything this large is not a placement.
MAX_CUSTOM_CONFIG_BYTES = 16 * 1024 * 1024
TITLE_MAX_CHARS = 200

Side = Literal["local", "remote"]


class ConfigCorrupt(PermanentError):
    """A spool file that cannot be trusted; monitord refuses to act on it and never rewrites it.

    `detail` names the file and the parse position; `reason` is the position alone."""

    def __init__(self, *, path: Path, detail: str) -> None:
        super().__init__(ErrorCode.CONFIG_CORRUPT, f"{path}: {detail}")
        self.path = path
        self.reason = detail


def _dump_json(document: Any) -> bytes:
    # As json.dumps(indent=2) writes it, each NumberText as the text it was read with. A
    # lone surrogate (the UI's title cut mid-emoji, read from the escape "\ud83d") cannot be
    # encoded as UTF-8: it is written back as that same escape, so a commit keeps the UI's
    # fields exactly instead of failing. The writer leaves such a code point raw, and only
    # inside a string, where `backslashreplace`'s \udXXX is the JSON escape for it.
    return (bounded_json.dumps(document) + "\n").encode("utf-8", "backslashreplace")


def _read_bounded(path: Path) -> bytes | None:
    """The bytes of `path`, None if it does not exist. Opened without blocking and read only
    if it is a regular file of at most MAX_CUSTOM_CONFIG_BYTES: the file is writable by
    the PBX's web UI, and a FIFO put in its place would block the reader (and, with it, the
    file lock every commit takes) for ever, a huge file exhaust memory."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ConfigCorrupt(path=path, detail=f"cannot read: {e.strerror or e}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigCorrupt(path=path, detail="not a regular file")
        chunks: list[bytes] = []
        size = 0
        while chunk := os.read(fd, 1024 * 1024):
            chunks.append(chunk)
            size += len(chunk)
            if size > MAX_CUSTOM_CONFIG_BYTES:
                raise ConfigCorrupt(
                    path=path, detail=f"larger than {MAX_CUSTOM_CONFIG_BYTES} bytes, not read"
                )
        return b"".join(chunks)
    except OSError as e:
        raise ConfigCorrupt(path=path, detail=f"cannot read: {e.strerror or e}") from e
    finally:
        os.close(fd)


def _load_json(path: Path) -> Any | None:
    """Parsed JSON of `path`, None if it does not exist (or holds `null`: `_parse_json` tells
    them apart); ConfigCorrupt with the reason and the parse position."""
    raw = _read_bounded(path)
    return None if raw is None else _parse_json(raw, path=path)


def _parse_json(raw: bytes, *, path: Path) -> Any:
    """`raw` parsed within bounded_json's bounds (nesting, RFC 8259), so nothing but
    ConfigCorrupt leaves here, and what comes back is safe to walk and copy. A number a
    Python value would not write back the same is a NumberText: the file is the UI's, and
    one odd number in it must neither refuse the whole file nor change when it is written."""
    try:
        return bounded_json.loads(raw, exact_numbers=True)
    except bounded_json.JsonRefused as e:
        raise ConfigCorrupt(path=path, detail=str(e)) from e


# --- custom_config.json ------------------------------------------------------------------------


@dataclass(frozen=True)
class AreaEntry:
    """One area's committed placement as the typed view of a `custom_daemons` entry."""

    uuid: str
    service: str
    location: Side = "local"
    generation: int = 0
    # What an operator calls the account (the entry's `title`, else its `name`): shown, never
    # used for anything else; None when the entry has neither as a string.
    title: str | None = None


@dataclass(frozen=True)
class InvalidEntry:
    """A `custom_daemons` entry monitord will not act on: left untouched in the file, never
    started, never sent to the VPS. `position` is its index in the list."""

    position: int
    code: str  # AREA_ID_INVALID (a uuid/service that is not a name, or a duplicate uuid)
    #            or AREA_ENTRY_INVALID (another field)
    detail: str


@dataclass(frozen=True)
class CustomConfig:
    """The whole `custom_config.json`: typed entries plus the raw document for round-trips.

    `invalid` lists the entries quarantined one by one: a bad entry never stops the others."""

    entries: tuple[AreaEntry, ...] = ()
    document: Mapping[str, Any] = field(default_factory=lambda: {"custom_daemons": []})
    invalid: tuple[InvalidEntry, ...] = ()

    def entry(self, uuid: str) -> AreaEntry | None:
        for entry in self.entries:
            if entry.uuid == uuid:
                return entry
        return None

    def titles(self) -> dict[str, str]:
        """uuid -> the entry's `title` (else its `name`) for the valid entries that carry one
        as text: what an operator calls the account (the status, `monitord areas`, the page).
        Never used to decide anything."""
        return {e.uuid: e.title for e in self.entries if e.title}

    def raw_entries(self) -> list[dict[str, Any]]:
        """Deep copies of the raw entry dicts, unknown fields included, in file order."""
        return copy.deepcopy(list(self.document.get("custom_daemons", [])))


class _EntryInvalid(ValueError):
    def __init__(self, code: ErrorCode, detail: str) -> None:
        super().__init__(detail)
        self.code = code


def _entry_from_raw(raw: Any, *, where: str) -> AreaEntry:
    if not isinstance(raw, dict):
        raise _EntryInvalid(
            ErrorCode.AREA_ENTRY_INVALID, f"{where}: expected an object, got {type(raw).__name__}"
        )
    for key in ("uuid", "service"):
        reason = names.why_invalid(raw.get(key))
        if reason is not None:
            raise _EntryInvalid(ErrorCode.AREA_ID_INVALID, f"{where}.{key}: {reason}")
    location = raw.get("location", "local")
    if location not in LOCATIONS:
        raise _EntryInvalid(
            ErrorCode.AREA_ENTRY_INVALID,
            f"{where}.location: expected 'local' or 'remote', got {location!r:.40}",
        )
    generation = raw.get("generation", 0)
    if (isinstance(generation, bool) or not isinstance(generation, int)
            or not 0 <= generation <= models.MAX_GENERATION):
        raise _EntryInvalid(
            ErrorCode.AREA_ENTRY_INVALID,
            f"{where}.generation: {'out of range: ' if _out_of_range(generation) else ''}"
            f"expected an integer in [0, 2^63), got {generation!r:.40}",
        )
    return AreaEntry(
        uuid=raw["uuid"],
        service=raw["service"],
        location=cast(Side, location),
        generation=generation,
        title=_title(raw),
    )


def _out_of_range(value: Any) -> bool:
    """Whether a refused generation was refused for its size: an int (refused, so outside
    [0, 2^63)), or a number too large for a Python value at all (5000 digits, 1e400: a
    NumberText, of which the reason shows the first 40 characters)."""
    if isinstance(value, bounded_json.NumberText):
        return not math.isfinite(float(value.text))
    return isinstance(value, int) and not isinstance(value, bool)


def _title(raw: Mapping[str, Any]) -> str | None:
    """The entry's display title: printable characters only, at most TITLE_MAX_CHARS."""
    for key in ("title", "name"):
        value = raw.get(key)
        if isinstance(value, str):
            shown = "".join(c for c in value if c.isprintable()).strip()[:TITLE_MAX_CHARS]
            if shown:
                return shown
    return None


def parse_custom_config(document: Any, *, path: Path) -> CustomConfig:
    """Validate a parsed `custom_config.json` document.

    A document whose shape is wrong (not an object, `custom_daemons` not a list) is
    ConfigCorrupt. A bad entry is quarantined on its own (`CustomConfig.invalid`, naming its
    position): the other areas go on. A uuid that appears twice quarantines every entry
    that carries it — which one is meant cannot be known."""
    if not isinstance(document, dict):
        raise ConfigCorrupt(
            path=path, detail=f"top level: expected an object, got {type(document).__name__}"
        )
    daemons = document.get("custom_daemons", [])
    if not isinstance(daemons, list):
        raise ConfigCorrupt(path=path, detail="custom_daemons: expected a list")
    parsed: list[tuple[int, AreaEntry]] = []
    invalid: list[InvalidEntry] = []
    for i, raw in enumerate(daemons):
        try:
            parsed.append((i, _entry_from_raw(raw, where=f"custom_daemons[{i}]")))
        except _EntryInvalid as e:
            invalid.append(InvalidEntry(position=i, code=e.code, detail=str(e)))
    # Count every object entry that carries the uuid, valid or not: a commit matches the raw
    # entries by uuid, so an invalid twin would otherwise take a valid area's commit.
    counts: dict[str, int] = {}
    for raw in daemons:
        uuid = raw.get("uuid") if isinstance(raw, dict) else None
        if isinstance(uuid, str):
            counts[uuid] = counts.get(uuid, 0) + 1
    entries = []
    for i, entry in parsed:
        if counts[entry.uuid] > 1:
            invalid.append(InvalidEntry(
                position=i, code=ErrorCode.AREA_ID_INVALID,
                detail=f"custom_daemons[{i}].uuid: area {entry.uuid} appears"
                       f" {counts[entry.uuid]} times",
            ))
        else:
            entries.append(entry)
    return CustomConfig(
        entries=tuple(entries),
        document=copy.deepcopy(document),
        invalid=tuple(sorted(invalid, key=lambda e: e.position)),
    )


def read_custom_config(path: Path) -> CustomConfig:
    """Read `custom_config.json`; a missing file is an empty placement (no areas), a file
    of `null` a broken one (ConfigCorrupt: never every area stopped for it)."""
    raw = _read_bounded(path)
    if raw is None:
        return CustomConfig()
    return parse_custom_config(_parse_json(raw, path=path), path=path)


def write_custom_config(path: Path, config: CustomConfig) -> None:
    """Write the document back atomically (the typed view is derived from it, not written).

    The file belongs to the PBX's web UI as much as to monitord: a rewrite keeps the existing
    file's mode and owner (uid, gid), set on the temp file before the rename; a new file is
    0644 and ours. Not being allowed to give it its owner back (not root) is an error unless
    the owner is already ours: the commit fails rather than leave a file the UI can not read.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        atomic_write_bytes(path, _dump_json(config.document))
        return
    atomic_write_bytes(
        path,
        _dump_json(config.document),
        mode=stat.S_IMODE(st.st_mode),
        owner=(st.st_uid, st.st_gid),
    )


def with_area_placement(
    config: CustomConfig, *, uuid: str, location: Side, generation: int
) -> CustomConfig:
    """A copy with one area's location and generation changed; other fields and order kept."""
    if location not in LOCATIONS:
        raise ValueError(f"location must be 'local' or 'remote', got {location!r}")
    if not 0 <= generation <= models.MAX_GENERATION:
        raise ValueError(f"generation must be in [0, 2^63), got {generation}")
    document = copy.deepcopy(dict(config.document))
    daemons = document.setdefault("custom_daemons", [])
    for raw in daemons:
        if isinstance(raw, dict) and raw.get("uuid") == uuid:
            raw["location"] = location
            raw["generation"] = generation
            break
    else:
        raise KeyError(f"area {uuid} is not in custom_config.json")
    entries = tuple(
        AreaEntry(uuid=e.uuid, service=e.service, location=location, generation=generation)
        if e.uuid == uuid
        else e
        for e in config.entries
    )
    return CustomConfig(entries=entries, document=document, invalid=config.invalid)


def update_area_placement(
    path: Path, *, uuid: str, location: Side, generation: int
) -> CustomConfig:
    """Re-read, change one area, write atomically, under the writers' lock (`writers_lock`):
    the commit point of a migration.

    Raises ConfigCorrupt (file untouched) if the current file is malformed or the lock stays
    held, KeyError if the area is not in it.
    """
    return put_placements(path, {uuid: (location, generation)})


def put_placements(path: Path, placements: Mapping[str, tuple[Side, int]]) -> CustomConfig:
    """`update_area_placement` for several areas at once (uuid -> (location, generation)),
    one read and one write under the lock; a KeyError names the first area not there."""
    with writers_lock(path):
        updated = read_custom_config(path)
        for uuid, (location, generation) in placements.items():
            updated = with_area_placement(updated, uuid=uuid, location=location,
                                          generation=generation)
        write_custom_config(path, updated)
        return updated


# The lock every writer of custom_config.json takes around its read-modify-write (the PBX's
# UI as well: docs/operations.md): an exclusive flock on this sibling file. Not on the file
# itself, which each write replaces by rename: a lock on it would hold an inode no longer
# there. A writer holding it longer than LOCK_WAIT_S fails the commit (CONFIG_CORRUPT).
LOCK_SUFFIX = ".lock"
LOCK_WAIT_S = 10.0
_LOCK_POLL_S = 0.02


def lock_path(path: Path) -> Path:
    return path.with_name(path.name + LOCK_SUFFIX)


@contextlib.contextmanager
def writers_lock(path: Path, *, wait_s: float = LOCK_WAIT_S) -> Iterator[None]:
    """Hold the writers' lock of custom_config.json `path` (blocking, up to `wait_s`). The
    lock file is made 0660 with the config file's owner, so the UI can take it too; one that
    is there is only opened — never through a symlink, never a FIFO — and left as it is."""
    fd = _open_lock(path)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise ConfigCorrupt(path=path, detail=(
                        f"another writer has held {lock_path(path).name} for more than"
                        f" {wait_s:g} s")) from None
                time.sleep(_LOCK_POLL_S)
        yield  # (the lock goes with the fd)
    finally:
        os.close(fd)


def _open_lock(path: Path) -> int:
    where = lock_path(path)
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(where, flags | os.O_CREAT | os.O_EXCL, 0o660)
    except FileExistsError:
        pass
    except OSError as e:
        raise ConfigCorrupt(path=path, detail=f"cannot make {where.name}: {e.strerror}") from e
    else:
        with contextlib.suppress(OSError):  # (the config file's owner: the UI's user)
            st = os.stat(path)
            os.fchown(fd, st.st_uid, st.st_gid)
        os.fchmod(fd, 0o660)
        return fd
    try:
        fd = os.open(where, flags)
    except OSError as e:
        raise ConfigCorrupt(path=path, detail=f"cannot open {where.name}: {e.strerror}") from e
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ConfigCorrupt(path=path, detail=f"{where.name} is not a regular file")
    return fd


# --- remote_state.json -------------------------------------------------------------------------


@dataclass(frozen=True)
class ServiceCompatState:
    """One service's row of the legacy `remote_state.json` projection."""

    migrating: bool = False
    resuming: bool = False
    parked: bool = False
    fail_count: int = 0
    last_error: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "migrating": self.migrating,
            "resuming": self.resuming,
            "parked": self.parked,
            "fail_count": self.fail_count,
            "last_error": self.last_error,
        }


def _compat_from_raw(raw: Any, *, where: str) -> ServiceCompatState:
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected an object, got {type(raw).__name__}")
    fail_count = raw.get("fail_count", 0)
    last_error = raw.get("last_error", "")
    return ServiceCompatState(
        migrating=bool(raw.get("migrating", False)),
        resuming=bool(raw.get("resuming", False)),
        parked=bool(raw.get("parked", False)),
        fail_count=fail_count if isinstance(fail_count, int) and fail_count >= 0 else 0,
        last_error=last_error if isinstance(last_error, str) else str(last_error),
    )


def read_remote_state(path: Path) -> dict[str, ServiceCompatState]:
    """Read `remote_state.json` (missing file: no services). Lenient about legacy fields."""
    document = _load_json(path)
    if document is None:
        return {}
    try:
        if not isinstance(document, dict):
            raise ValueError(f"top level: expected an object, got {type(document).__name__}")
        return {
            str(service): _compat_from_raw(raw, where=str(service))
            for service, raw in document.items()
        }
    except ValueError as e:
        raise ConfigCorrupt(path=path, detail=str(e)) from e


def write_remote_state(path: Path, states: Mapping[str, ServiceCompatState]) -> None:
    """Write the projection atomically, services in the order given.

    A last_error UTF-8 cannot encode (a legacy file's lone surrogate) is written as U+FFFD:
    the write must not raise out of every placement listener, and the UI's JSON decoder
    refuses an unpaired surrogate's escape."""
    document = {name: {**s.to_json(), "last_error": outside_text.encodable(s.last_error)}
                for name, s in states.items()}
    atomic_write_bytes(path, _dump_json(document))


def spool_paths(spool_dir: Path) -> tuple[Path, Path]:
    """(custom_config.json, remote_state.json) inside `spool_dir`."""
    return spool_dir / CUSTOM_CONFIG_NAME, spool_dir / REMOTE_STATE_NAME


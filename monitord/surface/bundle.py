"""The diagnostic bundle: one .tar.gz a support engineer can read without access.

Called by monitord.surface.status_api (`GET /v1/diagnostics/bundle`) and
monitord.surface.client_commands. The caller
(`OperatorFacade.bundle_sections`) collects the sections (status, transactions, cleanup
queue, recent events, inventories, tunnel, configuration, and `custom_config.json` and
`remote_state.json` as raw bytes); this module redacts and packs them.

Redaction is by allow-list, per section name: inside a JSON section only keys known to be
safe for that section keep their values (identifiers, paths, intervals, counts, states,
codes, phases, timestamps); every other value — anything under `env`, commands, unknown
keys, and any key that looks like a secret even if listed — becomes `"<redacted>"`. A few
keys hold maps keyed by names (`services`, `counts`, …): the names are kept and their values
redacted by the same rules. Known JSON sections handed in as bytes (the spool files) are
parsed and redacted too, within monitord.base.bounded_json's bounds (nesting, integer
digits: another user may have written them); one that is not such JSON is replaced by a
note. Text sections of
other names are packed as they are. Finally, a member that still looks like key material is
replaced, so a private key can not leave through the bundle even if a caller hands one in
by mistake. Every bundle opens with `version.json`: the monitord and Python versions that
wrote it (support reads it before anything else).
"""

from __future__ import annotations

import io
import json
import os
import platform
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from monitord import __version__
from monitord.base import bounded_json

REDACTED = "<redacted>"
# A key that looks like a secret is redacted even where it is allow-listed.
_SECRET_KEY = re.compile(
    r"secret|passw|passphrase|pass$|pass_|_pass|pwd|token|private|bearer|cred|auth|cookie"
    r"|session_?id|(api|access|secret|signing|private|encryption|license)[_-]?key|^key$"
    r"|signature|salt",
    re.IGNORECASE,
)
_KEY_MATERIAL = re.compile(rb"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----|PuTTY-User-Key-File")
# Interval (`*_s`) and timestamp (`*_at`) keys are safe in every section.
_SAFE_SUFFIX = re.compile(r"[a-z][a-z0-9_]*_(s|at)")


@dataclass(frozen=True, slots=True)
class SectionRules:
    """What a section may show: `keys` keep their values (scalars as they are, containers
    redacted by these rules again); `name_maps` hold `{name: value}` maps whose names are
    kept; `top_is_name_map` says the section itself is such a map."""

    keys: frozenset[str]
    name_maps: frozenset[str] = frozenset()
    top_is_name_map: bool = False


_IDENTITY = frozenset({
    "service", "area", "uuid", "transaction_id", "owner_id", "owner_label", "name", "id",
    "pid", "guard_pid", "event",
})
_PLACEMENT = frozenset({
    "location", "desired", "source", "destination", "side", "generation",
    "source_generation", "phase", "previous", "outcome", "state", "action", "kept",
    "reason", "epoch", "rollback_from",
})
_ERRORS = frozenset({
    "code", "error_code", "last_error", "last_error_code", "last_error_detail", "detail",
    "config_error", "last_exit_status",
})
_COUNTS = frozenset({
    "attempt", "attempts", "restarts", "reconnects", "fail_count", "backlog", "stuck",
    "before", "after", "actions", "fenced_sessions", "sshd_pid", "sshd_start_ticks", "ttl",
    "at", "now", "data_wait_since",
})
_FLAGS = frozenset({
    "accepting", "connected", "adopted", "alive", "ready", "run_wanted", "remote_observed",
    "cleanup_required", "destination_fenced", "migrating", "resuming", "parked",
})
_TUNNEL = frozenset({
    "tunnel", "lease", "lease_holder", "session", "ssh_connection", "forwards", "direction",
    "listen", "target",
})
_RUNTIME = _IDENTITY | _PLACEMENT | _ERRORS | _COUNTS | _FLAGS
_KIND_MAPS = frozenset({"counts", "before_by_kind", "after_by_kind"})

VERSION_SECTION = "version.json"

SECTIONS: dict[str, SectionRules] = {
    VERSION_SECTION: SectionRules(frozenset({"monitord", "python", "implementation"})),
    "status.json": SectionRules(
        _RUNTIME | _TUNNEL | {"services", "areas", "transactions", "cleanup", "drift"}
        # each area's process view and each service's last move (an area's `title` is the
        # operator's name for an account: redacted like any text)
        | {"process", "health", "restarts_1h", "failures", "as_of", "last_move", "move_id",
           "in_flight", "outcomes", "max", "p50", "measured"},
        name_maps=_KIND_MAPS | {"services", "area_downtime_s", "outcomes"},
    ),
    "transactions.json": SectionRules(_RUNTIME),
    "cleanup.json": SectionRules(_RUNTIME),
    "events.json": SectionRules(_RUNTIME, name_maps=_KIND_MAPS),
    "lineage.json": SectionRules(_RUNTIME | {"holders"}),
    "local_inventory.json": SectionRules(_RUNTIME),
    "remote_inventory.json": SectionRules(
        _RUNTIME | {"agent", "dir", "now", "entries", "processes", "data_dir"}
    ),
    "tunnel.json": SectionRules(_RUNTIME | _TUNNEL),
    "config.json": SectionRules(
        frozenset({
            # [monitord]
            "monitord", "work_dir", "spool_dir", "owner_label", "log_format",
            "park_after_failures", "rollback_data",
            # [http]
            "http", "listen", "allow_remote_api",
            # [remote]: the key's path, never its content
            "remote", "host", "port", "user", "key_file", "known_hosts",
            "accept_any_host_key", "remote_bin_dir", "remote_python", "keepalive_count_max",
            "reconnect_max_per_minute", "lease_clock_margin",
            "reverse_forwards", "local_forwards", "name", "target", "artifacts",
            # [services.NAME]: data dirs and limits; command, probe and env are redacted
            "services", "local_data_dir", "remote_data_dir", "parallelism",
        }),
        name_maps=frozenset({"services"}),
    ),
    # The authoritative placement: what is where, nothing else of an entry.
    "custom_config.json": SectionRules(
        frozenset({"custom_daemons", "uuid", "service", "location", "generation"})
    ),
    "remote_state.json": SectionRules(
        frozenset({"migrating", "resuming", "parked", "fail_count", "last_error"}),
        top_is_name_map=True,
    ),
}
# Structured sections of other names: the union of what the known ones may show.
DEFAULT_RULES = SectionRules(
    frozenset().union(*(r.keys for r in SECTIONS.values())),
    name_maps=frozenset().union(*(r.name_maps for r in SECTIONS.values())),
)


def looks_secret(key: str) -> bool:
    return _SECRET_KEY.search(key) is not None


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, str | int | float | bool)


def _allowed(key: str, rules: SectionRules) -> bool:
    if looks_secret(key):
        return False
    return key in rules.keys or key in rules.name_maps or _SAFE_SUFFIX.fullmatch(key) is not None


def _name_map(value: Any, rules: SectionRules) -> Any:
    """`{name: value}`: names kept (unless secret-looking), values redacted by `rules`;
    a bare string under a name is redacted (only numbers, flags and null are kept)."""
    if not isinstance(value, Mapping):
        return _value(value, rules)
    out: dict[str, Any] = {}
    for k, v in value.items():
        if looks_secret(str(k)) or isinstance(v, str):
            out[str(k)] = REDACTED
        else:
            out[str(k)] = _value(v, rules)
    return out


def _value(value: Any, rules: SectionRules) -> Any:
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for k, v in value.items():
            key = str(k)
            if not _allowed(key, rules):
                out[key] = REDACTED
            elif key in rules.name_maps:
                out[key] = _name_map(v, rules)
            else:
                out[key] = _value(v, rules)
        return out
    if isinstance(value, list | tuple):
        return [_value(v, rules) for v in value]
    return value if _scalar(value) else REDACTED


def redact(value: Any, section: str | None = None) -> Any:
    """A copy of a JSON-like value keeping only the values of keys known to be safe for
    `section` (see the module docstring); other values are `"<redacted>"`."""
    rules = SECTIONS.get(section or "", DEFAULT_RULES)
    if rules.top_is_name_map:
        return _name_map(value, rules)
    return _value(value, rules)


def contains_key_material(data: bytes) -> bool:
    return _KEY_MATERIAL.search(data) is not None


def _dump(value: Any) -> bytes:
    return json.dumps(value, indent=2, sort_keys=True, default=str).encode() + b"\n"


def _member_bytes(name: str, value: Any) -> bytes:
    if isinstance(value, bytes | str):
        if name not in SECTIONS:
            return value.encode() if isinstance(value, str) else value
        text = value.decode(errors="replace") if isinstance(value, bytes) else value
        if isinstance(value, str) and text.startswith("unreadable: ") and "\n" not in text[:-1]:
            return text.encode()  # the caller's note that the file could not be read
        try:
            document = bounded_json.loads(text)
        except bounded_json.JsonRefused as e:
            return (
                f"{REDACTED}: {name} is not valid JSON ({e}; {len(value)} bytes),"
                " so none of it is shown\n"
            ).encode()
        return _dump(redact(document, name))
    return _dump(redact(value, name))


def version_section() -> dict[str, str]:
    """What wrote the bundle: monitord's version and the Python running it."""
    return {
        "monitord": __version__,
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
    }


def build(sections: Mapping[str, Any], *, now: float | None = None) -> bytes:
    """Pack `name -> value` (bytes, str or JSON-able) into a .tar.gz under `monitord-bundle/`,
    each value redacted by its section's rules; `version.json` comes first."""
    import tarfile  # here: tarfile costs every daemon start about 19 ms, a bundle is rare

    mtime = time.time() if now is None else now
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, value in {VERSION_SECTION: version_section(), **sections}.items():
            data = _member_bytes(name, value)
            if contains_key_material(data):
                data = f"{REDACTED}: this section looked like private key material\n".encode()
            info = tarfile.TarInfo(f"monitord-bundle/{name}")
            info.size, info.mtime, info.mode = len(data), int(mtime), 0o600
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()

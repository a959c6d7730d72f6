"""The one pattern for the names monitord turns into paths, URLs, argv and agent requests:
service names and area ids, and the names of the copies the VPS sets aside.

A name is 1..128 characters of ASCII letters, digits, `_`, `.` and `-`, starting with a
letter or digit: nothing that can leave a directory (`/`, a leading `.`), end a URL path
(`#`, `?`, `%`), hide in a log line (whitespace, control characters, NUL) or be read as an
option (a leading `-`). UUIDs in any usual spelling match; `{…}`, padded or path-like
values do not.

Checked at every edge: when custom_config.json is loaded (a bad entry is quarantined, the
others go on), at every API path parameter, and by the agent on the VPS. Pure: no I/O.
"""

from __future__ import annotations

import re

MAX_LENGTH = 128
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def is_valid(value: object) -> bool:
    """True for a string that is a name by the pattern above (matched whole)."""
    return isinstance(value, str) and _NAME.fullmatch(value) is not None


def why_invalid(value: object) -> str | None:
    """A short reason `value` is not a name, or None when it is one."""
    if not isinstance(value, str):
        return f"expected a string, got {type(value).__name__}"
    if not value:
        return "empty"
    if len(value) > MAX_LENGTH:
        return f"{len(value)} characters (at most {MAX_LENGTH})"
    if _NAME.fullmatch(value) is None:
        return (
            f"{value[:40]!r} is not a name (letters, digits, '_', '.', '-', starting with a"
            " letter or digit)"
        )
    return None


# Where the agent moves a given-up area's data dir: `{dir}/abandoned/{area}-g{generation}-{t}`
# (t: the wall clock's seconds when it was set aside).
ABANDONED_DIR = "abandoned"
_SET_ASIDE = re.compile(r"(?P<area>[A-Za-z0-9][A-Za-z0-9_.-]{0,127})-g(?P<generation>[0-9]{1,19})"
                        r"-[0-9]{1,19}")


def set_aside_name(area: str, generation: int, at: int) -> str:
    """The name a copy of `area` at `generation` set aside at `at` gets in ABANDONED_DIR."""
    return f"{area}-g{generation}-{at}"


def is_set_aside_name(value: object, *, area: str | None = None,
                      generation: int | None = None) -> bool:
    """True for a name `set_aside_name` makes (of that area and generation, if given): one
    path component, nothing a removal or a download of it could take out of ABANDONED_DIR."""
    if not isinstance(value, str):
        return False
    found = _SET_ASIDE.fullmatch(value)
    return found is not None and (area is None or found["area"] == area) and (
        generation is None or int(found["generation"]) == generation)


def set_aside_problem(path: object, *, base_dir: str, area: str, generation: int) -> str | None:
    """Why `path`, the VPS's answer for where it set `area` at `generation` aside, is not
    `{base_dir}/abandoned/<set_aside_name>` of that very area; None when it is. The PBX
    later removes and downloads what it names: a VPS answering `/` must not make it so."""
    if not isinstance(path, str):
        return f"expected a path, got {type(path).__name__}"
    parent, _, name = path.rpartition("/")
    if parent != f"{base_dir.rstrip('/')}/{ABANDONED_DIR}" or not is_set_aside_name(
            name, area=area, generation=generation):
        return (f"{path[:200]!r} is not {base_dir.rstrip('/')}/{ABANDONED_DIR}/"
                f"{set_aside_name(area, generation, 0)[:-1]}<time>")
    return None

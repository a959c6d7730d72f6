"""The one pattern for the names monitord turns into paths, URLs, argv and agent requests:
service names and area ids.

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

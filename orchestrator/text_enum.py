"""`TextEnum`: an enum whose members are their own string values, on Python 3.9 too.

The same behaviour as the standard library's `enum.StrEnum` (3.11+): a member compares equal
to, formats as and prints as its value. It exists because the modules the VPS runs (the error
catalogue, the name pattern, the tunnel lease decisions, the agent's lease table) must run on
the oldest Python a supported VPS ships (docs/vps-setup.md).
"""

from __future__ import annotations

import enum


class TextEnum(str, enum.Enum):
    """A `str` enum whose `str()` and `format()` are the value, as `enum.StrEnum`'s are."""

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, format_spec: str) -> str:
        return str.__format__(self, format_spec)

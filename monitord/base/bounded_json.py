"""JSON from someone else, read within bounds: nesting depth, integer length, RFC 8259 only.

`json.loads` trusts its input in three ways that a file another user can write, or a VPS
that may be compromised, can exploit:

- nesting: the decoder recurses per level, so `[[[[…` a few thousand deep raises
  `RecursionError` — not a `ValueError`, so the caller's handler misses it — and a document
  a little under that limit still breaks whoever walks it next (`copy.deepcopy`, a
  redaction, `json.dumps`);
- integers: an integer literal of more than 4300 digits raises `ValueError` from `int()`
  (Python's int-string limit), and below that limit the conversion costs time quadratic in
  the digits;
- `NaN` and `Infinity` are accepted although they are not JSON, and `1e999` reads as an
  infinite float.

`loads()` checks the nesting first with one linear scan (strings skipped whole, so a
bracket inside a string never counts), converts integers itself with a bound on their
digits, refuses the three constants and numbers out of a float's range, and raises only
`JsonRefused` (a `ValueError`) with a short reason and, where known, the line and column.
Standard library only: the VPS agent parses its request bodies with it too
(monitord/remote/artifact.py PORTABLE_MODULES).

Callers: monitord.store.spool_files (custom_config.json), monitord.surface.bundle,
monitord.remote.tunnel.lease_client and preflight (the VPS's answers), monitord.vps.server
(request bodies).
"""

from __future__ import annotations

import json
import re
from typing import Any

# Far deeper than any document monitord reads or writes (custom_config.json is three levels
# deep), far shallower than the interpreter's recursion limit.
MAX_DEPTH = 64
# Far more than any 64-bit value (19 digits), far fewer than Python's 4300-digit limit.
MAX_INT_DIGITS = 100

# A whole string (escapes included), or one bracket. An unterminated string runs to the end
# of the text (the decoder refuses it anyway): every match attempt at a quote succeeds, so
# the scan stays linear whatever the quotes and backslashes.
_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)|[\[\]{}]', re.DOTALL)
_OPENERS = frozenset("[{")
_INF = float("inf")


class JsonRefused(ValueError):
    """The text is not JSON within the bounds; `str()` says why (and where, when known)."""


def _position(text: str, index: int) -> str:
    line = text.count("\n", 0, index) + 1
    column = index - (text.rfind("\n", 0, index) + 1) + 1
    return f"line {line} column {column}"


def check_depth(text: str, *, max_depth: int = MAX_DEPTH) -> None:
    """JsonRefused if arrays and objects nest deeper than `max_depth` (linear time)."""
    depth = 0
    for match in _TOKEN.finditer(text):
        token = match.group()
        if token in _OPENERS:
            depth += 1
            if depth > max_depth:
                raise JsonRefused(
                    f"nested deeper than {max_depth} levels at {_position(text, match.start())}"
                )
        elif token in ("]", "}"):
            depth = max(0, depth - 1)


def _bounded_int(max_digits: int) -> Any:
    def parse_int(literal: str) -> int:
        digits = len(literal.lstrip("-"))
        if digits > max_digits:
            raise JsonRefused(f"an integer of {digits} digits (at most {max_digits} are read)")
        return int(literal)

    return parse_int


def _finite_float(literal: str) -> float:
    value = float(literal)
    if value in (_INF, -_INF):
        raise JsonRefused(f"a number out of range ({literal[:20]}...)")
    return value


def _no_constant(name: str) -> Any:
    raise JsonRefused(f"{name} is not JSON")


def loads(
    data: str | bytes,
    *,
    max_depth: int = MAX_DEPTH,
    max_int_digits: int = MAX_INT_DIGITS,
) -> Any:
    """The JSON value of `data` (bytes must be UTF-8); JsonRefused for anything else."""
    if isinstance(data, (bytes, bytearray)):
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError as e:
            raise JsonRefused(f"not UTF-8 at byte {e.start}") from e
    else:
        text = data
    check_depth(text, max_depth=max_depth)
    try:
        return json.loads(
            text, parse_int=_bounded_int(max_int_digits), parse_float=_finite_float,
            parse_constant=_no_constant,
        )
    except JsonRefused:
        raise
    except json.JSONDecodeError as e:
        raise JsonRefused(f"invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from e
    except (ValueError, RecursionError) as e:  # neither can happen within the bounds above
        raise JsonRefused(f"unreadable JSON: {type(e).__name__}: {str(e)[:120]}") from e

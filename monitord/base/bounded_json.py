"""JSON from someone else, read within bounds: nesting depth, integer length, RFC 8259 only.

`json.loads` trusts its input in three ways that a file another user can write, or a VPS
that may be compromised, can exploit:

- nesting: the decoder recurses per level, so `[[[[…` a few thousand deep raises
  `RecursionError` — not a `ValueError`, so the caller's handler misses it — and a document
  a little under that limit still breaks whoever walks it next (`copy.deepcopy`, a
  redaction, `json.dumps`);
- integers: an integer literal of more than 4300 digits raises `ValueError` from `int()`
  (Python's int-string limit; below it a conversion costs at most about a millisecond);
- `NaN` and `Infinity` are accepted although they are not JSON, and `1e999` reads as an
  infinite float.

`loads()` lets the C decoder parse (it guards its own recursion with the interpreter's
limit, so `[[[[…` thousands deep is a `RecursionError` caught here, as is the `ValueError`
of a too long integer), refuses the three constants, then checks what it parsed with an
iterative walk, linear in the number of values: nesting at most MAX_DEPTH, no infinite
float, and raises only `JsonRefused` (a `ValueError`) with a short reason
and, for a syntax error, the line and column.
Standard library only: the VPS agent parses its request bodies with it too
(monitord/remote/artifact.py PORTABLE_MODULES).

`loads(..., exact_numbers=True)` is for a file someone else owns and monitord writes back
(custom_config.json): a number literal that a Python int or float would not write back as
the same text — more digits than the int-string limit, `1e400` (no float holds it), `1.10`
— is kept as that text, a `NumberText`, instead of refusing the whole document (or changing
it); it is no int, float or str, so a field checked for a number refuses it, and `dumps()`
writes it back unchanged. (`-0` alone reads as the int 0: the same number.)

`count()` reads a number from text someone else sent (a query parameter, a header) within
the same bounds. `number()` and `integer()` read one from a parsed document (a VPS's
answer): every reader of such a number goes through them, so none meets an OverflowError
(`float()` of a 400-digit integer), NaN, an infinity or a bool where it wanted a number.

Callers: monitord.store.spool_files (custom_config.json), monitord.surface.bundle,
monitord.remote.tunnel.lease_client, agent_client and preflight (the VPS's answers),
monitord.vps.server (request bodies, query parameters, headers), monitord.surface.status_api
(query parameters).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# Far deeper than any document monitord reads or writes (custom_config.json is three levels
# deep), far shallower than the interpreter's recursion limit.
MAX_DEPTH = 64

_INF = float("inf")

# The largest integer `count()` returns at most: a signed 64-bit value, as SQLite stores it.
MAX_COUNT = 2**63 - 1
# The largest magnitude `number()` returns: a float holds every integer up to it exactly, no
# time, duration or size a VPS reports comes near it, and a sum of two stays finite.
MAX_NUMBER = float(2**53)


class JsonRefused(ValueError):
    """The text is not JSON within the bounds; `str()` says why (and where, when known)."""


@dataclass(frozen=True)
class NumberText:
    """A JSON number kept as the text it was written with (`loads(exact_numbers=True)`):
    one a Python int or float would not write back the same. Shown as that text."""

    text: str

    def __repr__(self) -> str:
        return self.text


def _int_or_text(text: str) -> int | NumberText:
    # (`-0` is the one integer literal int() reads but writes back otherwise, as 0: the same
    # number, and a generation written so was always read as 0.)
    try:
        return int(text)
    except ValueError:  # more digits than the int-string limit: int() refuses
        return NumberText(text)


def _float_or_text(text: str) -> float | NumberText:
    value = float(text)  # never raises for a JSON literal: 1e400 is inf, 1e-400 is 0.0
    return value if repr(value) == text else NumberText(text)


def check_depth(value: Any, *, max_depth: int = MAX_DEPTH) -> None:
    """JsonRefused if arrays and objects in a parsed value nest deeper than `max_depth`, or
    a number in it is infinite (`1e999`). Iterative (a walk that recursed would meet the
    very limit it guards against) and linear in the number of values; strings are leaves, so
    their length costs nothing here."""
    if max_depth < 1:
        raise JsonRefused(f"nested deeper than {max_depth} levels")
    stack: list[tuple[Any, int]] = [(value, 0)]  # (a container, its depth: the root's is 0)
    while stack:
        item, depth = stack.pop()
        for child in item.values() if isinstance(item, dict) else item:
            kind = type(child)
            if kind is dict or kind is list:
                if depth + 1 >= max_depth:
                    raise JsonRefused(f"nested deeper than {max_depth} levels")
                if child:  # an empty one has nothing to look at
                    stack.append((child, depth + 1))
            elif kind is float and child in (_INF, -_INF):
                raise JsonRefused("a number out of a float's range")


def _no_constant(name: str) -> Any:
    raise JsonRefused(f"{name} is not JSON")


def loads(
    data: str | bytes,
    *,
    max_depth: int = MAX_DEPTH,
    exact_numbers: bool = False,
) -> Any:
    """The JSON value of `data` (bytes must be UTF-8); JsonRefused for anything else.

    With `exact_numbers`, a number a Python int or float would not write back as the same
    text is a NumberText (see the module docstring) rather than refused or changed."""
    if isinstance(data, (bytes, bytearray)):
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError as e:
            raise JsonRefused(f"not UTF-8 at byte {e.start}") from e
    else:
        text = data
    try:
        if exact_numbers:
            value = json.loads(text, parse_constant=_no_constant, parse_int=_int_or_text,
                               parse_float=_float_or_text)
        else:
            value = json.loads(text, parse_constant=_no_constant)
    except JsonRefused:
        raise
    except json.JSONDecodeError as e:
        raise JsonRefused(f"invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from e
    except RecursionError as e:  # the C decoder guards its own recursion with the limit
        raise JsonRefused(f"nested deeper than {max_depth} levels") from e
    except ValueError as e:  # int() refusing a literal over the int-string limit
        raise JsonRefused(f"unreadable JSON: {str(e)[:120]}") from e
    if isinstance(value, (dict, list)):
        check_depth(value, max_depth=max_depth)
    elif isinstance(value, float) and value in (_INF, -_INF):
        raise JsonRefused("a number out of a float's range")
    return value


# One encoder for every scalar: json.dumps would build a new one per call.
_SCALAR = json.JSONEncoder(ensure_ascii=False).encode


def dumps(value: Any) -> str:
    """`json.dumps(value, indent=2, ensure_ascii=False)`, each NumberText written as its text
    (json.dumps cannot be told to write a literal of ours). Keys must be strings, as they are
    in anything `loads` returned; recursive, so `value` nests no deeper than `loads` allows."""
    return "".join(_encoded(value, "\n"))


def _encoded(value: Any, newline: str) -> Iterator[str]:
    """The pieces of `value` written at the indentation that `newline` ends with."""
    if isinstance(value, NumberText):
        yield value.text
    elif isinstance(value, dict) and value:
        inner = newline + "  "
        separator = "{"
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"keys must be str, not {type(key).__name__}")
            yield separator + inner + _SCALAR(key) + ": "
            yield from _encoded(item, inner)
            separator = ","
        yield newline + "}"
    elif isinstance(value, (list, tuple)) and value:
        inner = newline + "  "
        separator = "["
        for item in value:
            yield separator + inner
            yield from _encoded(item, inner)
            separator = ","
        yield newline + "]"
    else:  # a scalar, {} or []
        yield _SCALAR(value)


def number(value: Any, *, minimum: float = -MAX_NUMBER,
           maximum: float = MAX_NUMBER) -> float | None:
    """`value`, a number of a parsed document, as a float in [minimum, maximum] (and within
    ±MAX_NUMBER); None for anything else: a bool, a string, NaN, an infinity, an integer
    no float holds. The caller raises its own malformed-answer error for None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    # Compared before float(): an int compares with a float exactly, float(10**400) raises;
    # NaN fails every comparison.
    if not (minimum <= value <= maximum and -MAX_NUMBER <= value <= MAX_NUMBER):
        return None
    return float(value)


def integer(value: Any, *, minimum: int = 0, maximum: int = MAX_COUNT) -> int | None:
    """`value`, a number of a parsed document, as an int in [minimum, maximum]; None for
    anything else: a bool, a float (1.0 too), a string."""
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value if minimum <= value <= maximum else None


def count(raw: str, *, maximum: int = MAX_COUNT) -> int | None:
    """`raw` as a non-negative integer of ASCII digits no larger than `maximum`; else None.

    `str.isdigit` alone takes `²` (which int() refuses) and Arabic-Indic digits (which it
    reads), and int() of thousands of digits raises: either would cost the sender its answer.
    """
    if not raw.isascii() or not raw.isdigit() or len(raw) > len(str(MAX_COUNT)):
        return None
    value = int(raw)
    return value if value <= maximum else None

"""monitord.base.bounded_json: JSON from someone else is read within bounds, and anything
outside them is JsonRefused (a ValueError) with a reason — never a RecursionError, and
never a document that breaks whoever walks it next."""

from __future__ import annotations

import copy
import json

import pytest

from monitord.base import bounded_json
from monitord.base.bounded_json import JsonRefused


def _nested(levels: int, *, kind: str = "list") -> str:
    if kind == "list":
        return "[" * levels + "]" * levels
    return '{"a": ' * levels + "1" + "}" * levels


class TestBounds:
    """Depth 64, Python's integer limit, RFC 8259 numbers."""

    @pytest.mark.parametrize("kind", ["list", "object"])
    def test_64_levels_are_read_and_65_refused(self, kind: str) -> None:
        value = bounded_json.loads(_nested(64, kind=kind))
        copy.deepcopy(value)  # what the next walker does: fine at this depth
        with pytest.raises(JsonRefused, match="deeper than 64"):
            bounded_json.loads(_nested(65, kind=kind))

    @pytest.mark.parametrize("text", [
        _nested(900), _nested(100_000), '{"a": ' + _nested(5000) + "}",
        "9" * 5000, "[NaN]", '{"a": -Infinity}', "[1e999]", "-1e400", b"\xff{}",
        "[1, 2", "",
    ])
    def test_anything_outside_is_json_refused(self, text: str | bytes) -> None:
        with pytest.raises(JsonRefused):
            bounded_json.loads(text)

    def test_brackets_inside_strings_do_not_count(self) -> None:
        text = json.dumps({"a": "[" * 10_000, "b": ["]" * 10_000]})
        assert bounded_json.loads(text)["a"] == "[" * 10_000

    def test_a_document_is_read_as_json_reads_it(self) -> None:
        document = {"custom_daemons": [{"uuid": "a", "generation": 2**63 - 1, "x": 1.5,
                                        "y": [None, True, "é"]}]}
        assert bounded_json.loads(json.dumps(document).encode()) == document


class TestCount:
    """A number someone else sent as text: ASCII digits within a bound, or None."""

    @pytest.mark.parametrize(("raw", "maximum", "value"), [
        ("0", 10, 0), ("10", 10, 10), ("007", 10, 7),
        (str(2**63 - 1), bounded_json.MAX_COUNT, 2**63 - 1),
    ])
    def test_digits_within_the_bound_are_read(self, raw: str, maximum: int, value: int) -> None:
        assert bounded_json.count(raw, maximum=maximum) == value

    @pytest.mark.parametrize("raw", [
        "", "11", "-1", "+1", " 1", "1 ", "1.0", "1e3", "0x1", "²", "١٢", "9" * 5000,
        str(2**63),
    ])
    def test_anything_else_is_none(self, raw: str) -> None:
        maximum = 10 if raw == "11" else bounded_json.MAX_COUNT
        assert bounded_json.count(raw, maximum=maximum) is None

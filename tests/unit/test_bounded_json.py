"""monitord.base.bounded_json: JSON from someone else is read within bounds, and anything
outside them is JsonRefused (a ValueError) with a reason — never a RecursionError, and
never a document that breaks whoever walks it next."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from monitord.base import bounded_json
from monitord.base.bounded_json import JsonRefused, NumberText


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


# Number literals as a JSON writer might put them: plain, and ones Python would hold otherwise.
NUMBER_LITERALS = st.one_of(
    st.integers().map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.integers(min_value=4290, max_value=4400).map(lambda n: "9" * n),
    st.sampled_from(["1e400", "-1e999", "1E-400", "1.10", "2.5E3", "1e5", "-0.0",
                     "0.30000000000000001", "123456789012345678901234567890"]),
)
PLAIN_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                max_size=3),
    max_leaves=8,
)


def _as_written(text: str) -> Any:
    """The JSON document of `text` with every number as the text it is written with."""
    return json.loads(text, parse_int=lambda n: ("n", n), parse_float=lambda n: ("n", n))


class TestExactNumbers:
    """With exact_numbers, a number Python would not write back as the same text is kept as
    that text (NumberText), and `dumps` writes it back unchanged; within the other bounds."""

    @pytest.mark.parametrize(("text", "value"), [
        ("7", 7), ("-3", -3), (str(2**63), 2**63), ("1.5", 1.5), ("-0.5", -0.5), ("0.0", 0.0),
        ("-0", 0), ("1.10", NumberText("1.10")), ("1e5", NumberText("1e5")),
        ("1e400", NumberText("1e400")), ("-1e999", NumberText("-1e999")),
        ("1E-400", NumberText("1E-400")),
        pytest.param("9" * 5000, NumberText("9" * 5000), id="5000 digits"),
    ])
    def test_a_number_is_a_python_number_only_when_it_writes_back_the_same(
        self, text: str, value: Any
    ) -> None:
        assert bounded_json.loads(f"[{text}]", exact_numbers=True) == [value]

    def test_a_kept_number_is_no_int_float_or_string_and_shows_its_text(self) -> None:
        kept = bounded_json.loads("9" * 5000, exact_numbers=True)
        assert not isinstance(kept, int | float | str)
        assert repr(kept) == str(kept) == "9" * 5000

    @pytest.mark.parametrize("text", [_nested(65), "[NaN]", '{"a": -Infinity}', "[1, 2"])
    def test_the_other_bounds_still_hold(self, text: str) -> None:
        with pytest.raises(JsonRefused):
            bounded_json.loads(text, exact_numbers=True)

    @settings(max_examples=200, deadline=None)
    @given(document=PLAIN_VALUES, literals=st.lists(NUMBER_LITERALS, min_size=1, max_size=4))
    def test_dumps_writes_every_number_back_as_it_was_read(
        self, document: Any, literals: list[str]
    ) -> None:
        text = json.dumps({"doc": document, "numbers": [{"n": None}] * len(literals)})
        for literal in literals:
            text = text.replace('{"n": null}', '{"n": ' + literal + "}", 1)
        written = bounded_json.dumps(bounded_json.loads(text, exact_numbers=True))
        assert _as_written(written) == _as_written(text)

    @settings(max_examples=200, deadline=None)
    @given(document=PLAIN_VALUES)
    def test_dumps_writes_as_json_dumps_does_with_indent_2(self, document: Any) -> None:
        assert bounded_json.dumps(document) == json.dumps(document, indent=2,
                                                          ensure_ascii=False)


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

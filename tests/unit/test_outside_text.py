"""The one sanitising edge for text from outside (monitord/base/outside_text.py): whatever
`str` it is given, what `clean` returns encodes as UTF-8, holds no control character but
newline and tab, and is no longer than its bound; what `encodable` returns differs only
where UTF-8 could not encode it; text that needs nothing is kept as it is."""

from __future__ import annotations

import unicodedata

from hypothesis import given, settings
from hypothesis import strategies as st

from monitord.base import outside_text

# Every code point, lone surrogates included (hypothesis leaves those out unless asked).
any_text = st.text(st.characters(blacklist_categories=()), max_size=300)


class TestClean:
    """`clean` makes any text safe to store, log and show, replacing one for one."""

    @settings(max_examples=300, deadline=None)
    @given(text=any_text, limit=st.integers(min_value=0, max_value=400), tail=st.booleans())
    def test_any_text_comes_out_encodable_bounded_and_without_controls(
        self, text: str, limit: int, tail: bool
    ) -> None:
        safe = outside_text.clean(text, limit=limit, tail=tail)
        safe.encode("utf-8")
        assert len(safe) == min(len(text), limit)
        assert all(c in "\n\t" or unicodedata.category(c) not in ("Cc", "Cs") for c in safe)

    def test_a_lone_surrogate_and_an_escape_sequence_become_replacement_characters(self) -> None:
        assert outside_text.clean("a\udc80b\x1b[2Jc\x9b1m", limit=100) == (
            "a\ufffdb\ufffd[2Jc\ufffd1m")

    def test_printable_text_newlines_and_tabs_are_kept(self) -> None:
        text = "line 1\n\tfailed: café ☃ 😀 — \u200d"
        assert outside_text.clean(text, limit=100) == text

    def test_the_bound_keeps_the_head_or_with_tail_the_end(self) -> None:
        assert outside_text.clean("abcdef", limit=3) == "abc"
        assert outside_text.clean("abcdef", limit=3, tail=True) == "def"
        assert outside_text.clean("abcdef", limit=0, tail=True) == ""



class TestEncodable:
    """`encodable` replaces only what UTF-8 cannot encode: lone surrogates."""

    @given(text=any_text)
    def test_any_text_comes_out_encodable_and_otherwise_unchanged(self, text: str) -> None:
        kept = outside_text.encodable(text)
        kept.encode("utf-8")
        assert all(a == b or unicodedata.category(a) == "Cs"
                   for a, b in zip(text, kept, strict=True))

    def test_control_characters_are_left_to_the_writer(self) -> None:
        assert outside_text.encodable("\x1b[2J\udc80") == "\x1b[2J\ufffd"

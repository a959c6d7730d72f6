"""A VPS listing is parsed in time and memory linear in its size, whatever the shape of its
names: the deepest and longest names the limits allow cost no more, per byte, than a flat
listing of short names; names over the limits (255 bytes a component, 4096 a path, 128
components) are refused, in both directions."""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import Callable

import pytest

from monitord.remote.copy import listing
from orchestrator.errors import ErrorCode, MonitordError

DIGEST = b"0" * 64
SIZE = 2 << 20  # bytes of each listing compared


def _listing(names: list[bytes]) -> bytes:
    return b"".join(DIGEST + b"  ./" + name + b"\n" for name in names)


def _filled(make: Callable[[int], bytes]) -> bytes:
    """Lines of `make(i)`, i = 0, 1, …, until the listing holds SIZE bytes."""
    names, size, i = [], 0, 0
    while size < SIZE:
        names.append(make(i))
        size += len(DIGEST) + 5 + len(names[-1])
        i += 1
    return _listing(names)


def _deepest(i: int) -> bytes:
    """A name at every limit: 128 components of 31 bytes (4095 bytes), each line's
    components its own, so that no two lines share a parent directory."""
    component = b"%031d" % i
    return b"/".join([component] * 128)


def _nested(i: int) -> bytes:
    """A name of the most directories the limits allow, each line under a parent of its own
    (before the limits, every parent of every name was built as a string of its own)."""
    return b"/".join([b"%d" % i] + [b"c"] * 127)


def _flat(i: int) -> bytes:
    return b"f%08d" % i


def _peak_bytes(raw: bytes) -> int:
    tracemalloc.start()
    try:
        listing.parse(raw)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _seconds(raw: bytes) -> float:
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        listing.parse(raw)
        best = min(best, time.perf_counter() - started)
    return best


def _refused(raw: bytes) -> str:
    with pytest.raises(MonitordError) as err:
        listing.parse(raw)
    assert err.value.code == ErrorCode.COPY_INCOMPLETE
    return err.value.detail


class TestLinearCost:
    """The most hostile listing within the limits costs about what a flat one of the same
    size does (ratios, generous: the machine may be busy)."""

    @pytest.mark.parametrize("make", [_deepest, _nested])
    def test_deep_names_cost_no_more_memory_than_flat_ones(
        self, make: Callable[[int], bytes]
    ) -> None:
        hostile, flat = _filled(make), _filled(_flat)
        assert len(listing.parse(hostile)) > 400 and len(listing.parse(flat)) > 20_000
        ratio = _peak_bytes(hostile) / _peak_bytes(flat)
        assert ratio < 2.0, f"peak memory {ratio:.1f} x a flat listing's"

    @pytest.mark.parametrize("make", [_deepest, _nested])
    def test_deep_names_cost_no_more_time_than_flat_ones(
        self, make: Callable[[int], bytes]
    ) -> None:
        hostile, flat = _filled(make), _filled(_flat)
        ratio = _seconds(hostile) / _seconds(flat)
        assert ratio < 4.0, f"parsing took {ratio:.1f} x a flat listing's time"


class TestLimits:
    """Names over the limits are refused, names at them accepted."""

    def test_a_component_of_255_bytes_is_accepted_and_of_256_refused(self) -> None:
        assert listing.parse(_listing([b"d/" + b"x" * 255])) == {"d/" + "x" * 255: "0" * 64}
        assert "255" in _refused(_listing([b"d/" + b"x" * 256]))

    def test_a_component_is_counted_in_utf8_bytes(self) -> None:
        assert "255" in _refused(_listing(["é".encode() * 128]))  # 256 bytes, 128 chars

    def test_a_path_of_4096_bytes_is_accepted_and_of_4097_refused(self) -> None:
        at_limit = b"/".join([b"y" * 240] * 16) + b"/" + b"z" * 240
        assert len(at_limit) == 4096
        assert len(listing.parse(_listing([at_limit]))) == 1
        assert "4096" in _refused(_listing([at_limit + b"z"]))

    def test_128_components_are_accepted_and_129_refused(self) -> None:
        assert len(listing.parse(_listing([b"/".join([b"c"] * 128)]))) == 1
        assert "128" in _refused(_listing([b"/".join([b"c"] * 129)]))

    def test_a_16_kib_line_of_nested_dirs_is_refused(self) -> None:
        """(Before the limits, one such line cost 65 MB and half a second to parse.)"""
        assert "4096" in _refused(_listing([b"a/" * 8191 + b"a"]))

    def test_the_limits_hold_for_names_going_up_as_well(self) -> None:
        assert listing.name_problem("x" * 255) is None
        assert listing.name_problem("x" * 256) is not None
        assert listing.name_problem("/".join(["c"] * 129)) is not None


class TestEscapedNames:
    """sha256sum's escaped form: `\\\\` is a backslash, `\\n` a newline, anything else refused."""

    @pytest.mark.parametrize(("escaped", "plain"), [
        (b"a\\nb", "a\nb"),
        (b"a\\\\nb", "a\\nb"),
        (b"\\\\\\n", "\\\n"),
        (b"\\n\\\\", "\n\\"),
        (b"x\\\\\\\\y", "x\\\\y"),
    ])
    def test_an_escaped_name_is_read_as_sha256sum_wrote_it(
        self, escaped: bytes, plain: str
    ) -> None:
        assert listing.parse(b"\\" + DIGEST + b"  ./" + escaped + b"\n") == {plain: "0" * 64}

    @pytest.mark.parametrize("escaped", [b"a\\tb", b"a\\", b"\\\\\\", b"a\\\\\\x"])
    def test_any_other_escape_is_refused(self, escaped: bytes) -> None:
        assert "bad escape" in _refused(b"\\" + DIGEST + b"  ./" + escaped + b"\n")


class TestFileAndDirectory:
    """A name listed both as a file and as a directory is refused, however far apart the
    two lines are and whatever sorts between them."""

    @pytest.mark.parametrize("names", [
        [b"a", b"a/b"],
        [b"a/b", b"a"],
        [b"a", b"a-x", b"a.y", b"a/b/c"],
        [b"p/q", b"p/q-r/s", b"p/q/t"],
        [b"x/y/z", b"x/y"],
    ])
    def test_a_file_that_is_also_a_directory_is_refused(self, names: list[bytes]) -> None:
        assert "both as a file and as a directory" in _refused(_listing(names))

    def test_names_sharing_a_prefix_are_not_a_conflict(self) -> None:
        names = [b"a", b"a-x/b", b"ab/c", b"a.d"]
        assert len(listing.parse(_listing(names))) == 4

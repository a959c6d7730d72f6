"""Fuzz: custom_config.json entries (monitord.store.spool_files).

Promise: `parse_custom_config` never raises for a list of entries (ConfigCorrupt only for a
wrong top-level shape); `read_custom_config` of any text (huge numbers, deep nesting, odd
constants) returns or raises ConfigCorrupt, nothing else; every entry it returns has a uuid
and service that are names; every valid entry with a unique uuid is kept, every other entry
is in `invalid` at its position;
`update_area_placement` of a kept entry changes that entry's location and generation and
leaves every other raw entry (and top-level key) equal in JSON terms — and every number in
them written as the very text it was read with (5000 digits, 1e400, 1.10): a number Python
cannot hold quarantines the entry whose generation it is, and no other; and every string,
lone surrogates and control characters included, comes back as it was.
"""

from __future__ import annotations

import copy
import json
import re
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from monitord.store import spool_files
from orchestrator import names
from orchestrator.errors import ErrorCode

from .profiles import demo, profile

# An independent reading of docs: 1..128 ASCII letters/digits/_/./-, starting alphanumeric.
_REFERENCE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}", re.ASCII)

# Text as a UI may leave it: lone surrogates (a title cut mid-emoji: JSON "\ud83d"), control
# characters, NUL — every code point, not only the ones UTF-8 can encode.
# (joined by hand: st.text leaves surrogates out whatever its alphabet)
any_text = st.lists(st.one_of(st.characters(categories=["Cs", "Cc"]), st.characters()),
                    max_size=20).map("".join)
json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20), any_text,
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)

good_names = st.one_of(
    st.uuids().map(str),
    st.uuids().map(lambda u: str(u).upper()),
    st.uuids().map(lambda u: u.hex),
    st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,15}", fullmatch=True),
    st.just("a" * 128),
)
odd_names: st.SearchStrategy[Any] = st.one_of(
    st.text(max_size=40),
    st.text(alphabet=st.characters(min_codepoint=0x80), min_size=1, max_size=10),  # unicode
    st.sampled_from([
        "", " ", "a" * 129, "x" * 5000, "-rf", ".hidden", "..", "a/b", "../etc", "a\n", "a\x00",
        "{5b1d0000-0000-4000-8000-000000000001}", " 5b1d0000 ", "a%2Fb", "a?b", "a#b",
        "\u0663abc", "abc\u0301", "ａｂｃ", "İ", "ß", "a b",
    ]),
    st.uuids().map(lambda u: "{" + str(u) + "}"),
    json_scalars.filter(lambda v: not isinstance(v, str)),
    st.lists(json_scalars, max_size=2),
    st.dictionaries(st.text(max_size=4), json_scalars, max_size=2),
)
locations: st.SearchStrategy[Any] = st.one_of(
    st.sampled_from(["local", "remote"]),
    st.sampled_from(["LOCAL", "Remote", "", "vps", " local"]),
    json_scalars,
)
generations: st.SearchStrategy[Any] = st.one_of(
    st.integers(min_value=0, max_value=2**63), st.integers(max_value=-1), st.booleans(),
    st.sampled_from([2**63 - 1, 2**63, 2**64, 10**99]),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=5), st.none(),
)
extra_fields = st.dictionaries(
    st.text(max_size=10).filter(lambda k: k not in ("uuid", "service", "location", "generation")),
    json_values, max_size=3,
)
UUID_POOL = [f"5b1d0000-0000-4000-8000-00000000000{i}" for i in range(4)]


@st.composite
def entries(draw: st.DrawFn) -> Any:
    """One raw custom_daemons entry: mostly objects, valid or with fields of any kind."""
    kind = draw(st.sampled_from(["valid", "valid", "valid", "odd", "odd", "not-an-object"]))
    if kind == "not-an-object":
        return draw(json_values)
    entry: dict[str, Any] = draw(extra_fields)
    # A small pool of uuids makes duplicates (valid and invalid ones) common.
    uuid = draw(st.one_of(st.sampled_from(UUID_POOL), good_names))
    service = draw(good_names)
    if kind == "odd":
        field = draw(st.sampled_from(["uuid", "service", "location", "generation", "missing"]))
        if field == "uuid":
            uuid = draw(odd_names)
        elif field == "service":
            service = draw(odd_names)
        elif field == "location":
            entry["location"] = draw(locations)
        elif field == "generation":
            entry["generation"] = draw(generations)
        else:
            missing = draw(st.sampled_from(["uuid", "service"]))
            uuid, service = (None, service) if missing == "uuid" else (uuid, None)
    if uuid is not None:
        entry["uuid"] = uuid
    if service is not None:
        entry["service"] = service
    if kind == "valid" and draw(st.booleans()):
        entry["location"] = draw(st.sampled_from(["local", "remote"]))
        entry["generation"] = draw(st.integers(min_value=0, max_value=2**40))
    return entry


entry_lists = st.lists(entries(), max_size=12)


def _reference_valid(raw: Any) -> bool:
    def name(v: Any) -> bool:
        return isinstance(v, str) and _REFERENCE_NAME.fullmatch(v) is not None

    if not isinstance(raw, dict) or not name(raw.get("uuid")) or not name(raw.get("service")):
        return False
    if raw.get("location", "local") not in ("local", "remote"):
        return False
    generation = raw.get("generation", 0)
    return (isinstance(generation, int) and not isinstance(generation, bool)
            and 0 <= generation < 2**63)


Parser = Callable[..., spool_files.CustomConfig]


def check_entries(
    daemons: list[Any], *, workdir: Path, parse: Parser = spool_files.parse_custom_config,
    update: Callable[..., Any] = spool_files.update_area_placement, extra: Any = None,
) -> None:
    """The property; raises AssertionError (or whatever the code under test raises)."""
    document: dict[str, Any] = {"custom_daemons": daemons}
    if extra is not None:
        document["other"] = extra
    original = copy.deepcopy(document)
    path = workdir / "custom_config.json"
    config = parse(document, path=path)  # must not raise
    assert document == original, "parse_custom_config changed its input"

    valid = [i for i, raw in enumerate(daemons) if _reference_valid(raw)]
    # A uuid carried by more than one object entry (valid or not) is ambiguous: all go.
    counts = Counter(
        raw["uuid"] for raw in daemons
        if isinstance(raw, dict) and isinstance(raw.get("uuid"), str)
    )
    kept = [i for i in valid if counts[daemons[i]["uuid"]] == 1]
    assert [e.uuid for e in config.entries] == [daemons[i]["uuid"] for i in kept]
    for entry, i in zip(config.entries, kept, strict=True):
        assert names.is_valid(entry.uuid) and names.is_valid(entry.service)
        raw = daemons[i]
        assert (entry.service, entry.location, entry.generation) == (
            raw["service"], raw.get("location", "local"), raw.get("generation", 0)
        )
    positions = [bad.position for bad in config.invalid]
    assert positions == sorted(set(range(len(daemons))) - set(kept)), positions
    for bad in config.invalid:
        assert bad.code in (ErrorCode.AREA_ID_INVALID, ErrorCode.AREA_ENTRY_INVALID)
        assert f"custom_daemons[{bad.position}]" in bad.detail
    assert config.raw_entries() == daemons

    if not kept:
        return
    target = kept[len(kept) // 2]
    uuid = daemons[target]["uuid"]
    # (escaped: a lone surrogate is only writable as its JSON escape, as the UI writes it;
    # what the file then says is the document — two escaped surrogates of a pair are one
    # code point to any JSON reader)
    path.write_text(json.dumps(document), encoding="utf-8")
    document = json.loads(path.read_text(encoding="utf-8"))
    daemons = document["custom_daemons"]
    update(path, uuid=uuid, location="remote", generation=7)
    after = json.loads(path.read_text(encoding="utf-8"))
    assert set(after) == set(document)
    assert after.get("other") == document.get("other")
    assert len(after["custom_daemons"]) == len(daemons)
    for i, (before_raw, after_raw) in enumerate(zip(daemons, after["custom_daemons"], strict=True)):
        if i == target:
            assert after_raw == {**before_raw, "location": "remote", "generation": 7}
        else:
            assert after_raw == before_raw, f"entry {i} changed by updating entry {target}"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield tmp_path_factory.mktemp("custom_config")


@profile("config")
@given(daemons=entry_lists, extra=st.one_of(st.none(), json_values))
def test_entries_are_kept_or_quarantined_and_updates_touch_one_entry(
    workdir: Path, daemons: list[Any], extra: Any
) -> None:
    check_entries(daemons, workdir=workdir, extra=extra)


@profile("config")
@given(document=json_values)
def test_only_a_wrong_top_level_shape_is_config_corrupt(document: Any) -> None:
    wrong = not isinstance(document, dict) or not isinstance(
        document.get("custom_daemons", []), list
    )
    if wrong:
        with pytest.raises(spool_files.ConfigCorrupt):
            spool_files.parse_custom_config(document, path=Path("custom_config.json"))
    else:
        spool_files.parse_custom_config(document, path=Path("custom_config.json"))


# -- the property can fail ----------------------------------------------------------------------


def _parse_without_dedup(document: Any, *, path: Path) -> spool_files.CustomConfig:
    """Broken on purpose: keeps every copy of a duplicated uuid."""
    config = spool_files.parse_custom_config(document, path=path)
    daemons = document["custom_daemons"]
    entries = tuple(
        spool_files.AreaEntry(uuid=raw["uuid"], service=raw["service"])
        for raw in daemons if isinstance(raw, dict) and names.is_valid(raw.get("uuid"))
        and names.is_valid(raw.get("service"))
    )
    return spool_files.CustomConfig(entries=entries, document=config.document)


def _update_rewriting_everything(path: Path, *, uuid: str, location: str, generation: int) -> None:
    """Broken on purpose: sets the location of every entry, not only the one asked for."""
    document = json.loads(path.read_text())
    for raw in document["custom_daemons"]:
        if isinstance(raw, dict):
            raw["location"], raw["generation"] = location, generation
    path.write_text(json.dumps(document))


@pytest.mark.parametrize(
    "broken", ["parser keeps duplicates", "update rewrites every entry"]
)
def test_the_property_catches_a_broken_implementation(workdir: Path, broken: str) -> None:
    kwargs: dict[str, Any] = (
        {"parse": _parse_without_dedup} if broken == "parser keeps duplicates"
        else {"update": _update_rewriting_everything}
    )

    @demo()
    @given(daemons=entry_lists)
    def search(daemons: list[Any]) -> None:
        check_entries(daemons, workdir=workdir, **kwargs)

    with pytest.raises(AssertionError):
        search()


def test_an_invalid_twin_quarantines_the_valid_entry_so_no_commit_can_hit_it(
    workdir: Path,
) -> None:
    """Found by this fuzzing: an invalid entry sharing a valid one's uuid used to take that
    area's commit (the raw entries are matched by uuid)."""
    uuid = UUID_POOL[0]
    daemons: list[Any] = [{"uuid": uuid, "service": ""}, {"uuid": uuid, "service": "tg"}]
    check_entries(daemons, workdir=workdir)
    config = spool_files.parse_custom_config({"custom_daemons": daemons}, path=workdir / "c")
    assert config.entries == () and [e.position for e in config.invalid] == [0, 1]


# -- hostile text: the loader itself ---------------------------------------------------------

hostile_pieces = st.one_of(
    st.sampled_from(["[", "]", "{", "}", '"', "\\", ",", ":", "NaN", "-Infinity", "1e999",
                     "-1e400", "1.10", "-", "true", "null", " ", "\n"]),
    st.integers(min_value=1, max_value=6000).map(lambda n: "9" * n),
    st.integers(min_value=1, max_value=3000).map(lambda n: "[" * n),
    st.integers(min_value=1, max_value=3000).map(lambda n: '{"a":' * n),
    st.text(max_size=10),
)


@st.composite
def hostile_texts(draw: st.DrawFn) -> str:
    """A valid file with hostile pieces spliced in, or hostile pieces alone."""
    valid = json.dumps({"custom_daemons": [{"uuid": UUID_POOL[0], "service": "tg",
                                            "generation": 1}]})
    pieces = draw(st.lists(hostile_pieces, max_size=8))
    if draw(st.booleans()):
        at = draw(st.integers(min_value=0, max_value=len(valid)))
        return valid[:at] + "".join(pieces) + valid[at:]
    return "".join(pieces)


@profile("config")
@given(text=hostile_texts())
def test_any_text_is_read_or_config_corrupt_and_nothing_else(workdir: Path, text: str) -> None:
    path = workdir / "hostile.json"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    try:
        config = spool_files.read_custom_config(path)
    except spool_files.ConfigCorrupt as e:
        assert e.code == ErrorCode.CONFIG_CORRUPT
        return
    for entry in config.entries:
        assert 0 <= entry.generation < 2**63
    copy.deepcopy(config.document)  # what a commit does with it: within the bounds
    # ... and what it writes: read back the same, every number as the text it was.
    written = workdir / "hostile-written.json"
    spool_files.write_custom_config(written, config)
    again = spool_files.read_custom_config(written)
    assert (again.entries, again.invalid) == (config.entries, config.invalid)
    assert _as_written(written.read_text()) == _as_written(text)  # (`null` is corrupt)


def _as_written(text: str) -> Any:
    """The JSON document of `text` with every number as the text it is written with."""
    return json.loads(text, parse_int=lambda n: ("n", n), parse_float=lambda n: ("n", n))


# -- numbers Python would not write back the same ------------------------------------------------

number_literals = st.one_of(
    st.integers().map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.integers(min_value=4295, max_value=6000).map(lambda n: "9" * n),  # the int-string limit
    st.integers(min_value=4295, max_value=4400).map(lambda n: "-" + "1" * n),
    st.sampled_from(["0", str(2**63 - 1), str(2**63), "9" * 30, "1e400", "-1e999", "1E-400",
                     "1.10", "2.5E3", "0.30000000000000001", "7.0"]),
)
_GENERATION_LITERAL = re.compile(r"0|[1-9][0-9]{0,18}", re.ASCII)


@profile("config")
@given(generation=number_literals, field=number_literals)
def test_every_number_is_written_back_as_it_was_read(
    workdir: Path, generation: str, field: str
) -> None:
    """Only an integer in [0, 2^63) is a generation; any other number quarantines its own
    entry; a commit of another area writes every number back as the text it was."""
    path = workdir / "numbers.json"
    text = ('{"custom_daemons": [{"uuid": "a1", "service": "tg", "generation": ' + generation
            + ', "x": ' + field + '}, {"uuid": "a2", "service": "tg", "y": [' + field
            + ']}], "z": ' + field + "}")
    path.write_text(text)
    config = spool_files.read_custom_config(path)  # never ConfigCorrupt: the file is JSON
    valid = _GENERATION_LITERAL.fullmatch(generation) is not None and int(generation) < 2**63
    assert [e.uuid for e in config.entries] == (["a1", "a2"] if valid else ["a2"])
    assert [(q.position, q.code) for q in config.invalid] == (
        [] if valid else [(0, ErrorCode.AREA_ENTRY_INVALID)])
    spool_files.update_area_placement(path, uuid="a2", location="remote", generation=9)
    before, after = _as_written(text), _as_written(path.read_text())
    assert after["custom_daemons"][0] == before["custom_daemons"][0]
    assert after["custom_daemons"][1] == {**before["custom_daemons"][1], "location": "remote",
                                          "generation": ("n", "9")}
    assert after["z"] == before["z"]


@profile("config")
@given(title=any_text, key=any_text)
def test_text_of_any_code_points_survives_a_commit(workdir: Path, title: str, key: str) -> None:
    """A field the UI owns — a lone surrogate, a control character, NUL in it or in its key
    — is written back as it was read, and the commit succeeds."""
    document = {"custom_daemons": [
        {"uuid": "a1", "service": "tg", "title": title, key or "k": title},
        {"uuid": "a2", "service": "tg"}]}
    path = workdir / "custom_config.json"
    path.write_text(json.dumps(document), encoding="utf-8")
    written = json.loads(path.read_text(encoding="utf-8"))  # (a pair's escapes: one point)
    spool_files.update_area_placement(path, uuid="a2", location="remote", generation=1)
    after = json.loads(path.read_text(encoding="utf-8"))
    assert after["custom_daemons"][0] == written["custom_daemons"][0]
